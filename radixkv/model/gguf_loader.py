"""Loader for llama.cpp GGUF files of architecture ``llama`` (e.g. the embedded SmolLM2) or
``gemma3`` (e.g. Gemma 3 270M; its names, config and norm weights in
:mod:`radixkv.model.gguf_gemma`).

Tensors are read with :class:`gguf.GGUFReader`, dequantized to fp32 with
:func:`gguf.quants.dequantize`, renamed to Hugging Face names, and for ``llama`` the q/k projection
rows are put back in HF order: llama.cpp's converter interleaves the two RoPE halves of every head
(its RoPE rotates adjacent pairs, HF's rotates ``(i, i + D/2)``), so each head's rows are
stored as ``[h0, h_{D/2}, h1, h_{D/2+1}, …]``. Undoing it: view a head's rows as
``[2, D/2]``-transposed, i.e. ``reshape(H, D/2, 2, in).swapaxes(1, 2)``.

Speed (the first start of ``radixkv serve`` converts the embedded GGUF): ``gguf.GGUFReader``
builds a numpy memmap view per metadata element, ~5 s for SmolLM2's 98k vocabulary strings,
so the header is parsed here with :mod:`struct` over the file's bytes (spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). Q4_0 / Q4_1 / Q8_0 / F16 / F32 are
dequantized a whole tensor at a time with numpy, with the same fp32 operations in the same order
as :mod:`gguf.quants` (so bit-identical; a test checks it); other types go through
:func:`gguf.quants.dequantize`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import structlog
import torch

from .config import ModelShape
from .gguf_gemma import GEMMA3_ARCH, gemma3_hf_name, gemma3_hf_tensor, gemma3_shape

__all__ = ["read_gguf", "read_gguf_header", "gguf_shape", "dequantize", "unpermute_qk", "GgufHeader",
           "GgufTensorInfo", "SUPPORTED_GGUF_ARCHITECTURES"]

log = structlog.get_logger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
#: ``general.architecture`` values :func:`read_gguf` converts.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", GEMMA3_ARCH)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Args:
        weight: ``[num_heads * D, in]`` rows in llama.cpp order.
        num_heads: heads of this projection (Hq for q, Hkv for k).

    Returns:
        ``[num_heads * D, in]`` rows in Hugging Face order.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"weight: {rows} rows not divisible by 2 * {num_heads} heads")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _field(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key)
    return default if value is None else value


def gguf_shape(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> ModelShape:
    """The :class:`ModelShape` a GGUF's metadata describes (no tensor data is read).

    Args:
        metadata: ``read_gguf_header(path).metadata``.
        tensor_names: every tensor name in the file.
        path: the file, for messages.

    Raises:
        ValueError: naming ``model`` and the architecture when ``general.architecture`` is
            not in :data:`SUPPORTED_GGUF_ARCHITECTURES`, or the metadata key that is missing
            or unsupported.
    """
    arch = _field(metadata, "general.architecture")
    if arch == GEMMA3_ARCH:
        return gemma3_shape(metadata, tensor_names, path)
    if arch != "llama":
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}: {path}")
    scaling_type = _field(metadata, "llama.rope.scaling.type", "none")
    if scaling_type not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"model: GGUF RoPE scaling ({scaling_type!r}, rope_freqs) is not supported: {path}")

    def need(key: str) -> Any:
        value = _field(metadata, key)
        if value is None:
            raise ValueError(f"model: GGUF metadata lacks {key!r}: {path}")
        return value

    hidden = int(need("llama.embedding_length"))
    num_q_heads = int(need("llama.attention.head_count"))
    head_dim = int(_field(metadata, "llama.attention.key_length", hidden // num_q_heads))
    rope_dims = int(_field(metadata, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"model: partial RoPE ({rope_dims} of {head_dim} dims) is not supported: {path}")
    vocab = _field(metadata, "llama.vocab_size")
    if vocab is None:
        vocab = len(need("tokenizer.ggml.tokens"))
    try:
        return ModelShape(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("llama.feed_forward_length")),
            num_layers=int(need("llama.block_count")),
            num_q_heads=num_q_heads,
            num_kv_heads=int(_field(metadata, "llama.attention.head_count_kv", num_q_heads)),
            head_dim=head_dim,
            rope_theta=float(_field(metadata, "llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(need("llama.context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
        )
    except ValueError as exc:
        raise ValueError(f"model: {exc}") from exc


class GgufTensorInfo(NamedTuple):
    """One tensor of a GGUF file: name, torch-order shape (ggml's dims reversed), ggml type id,
    absolute byte offset of its data in the file and its size in bytes."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset_bytes: int
    num_bytes: int


class GgufHeader(NamedTuple):
    """A GGUF file's metadata (key -> int / float / bool / str / list) and tensor table."""

    metadata: dict[str, Any]
    tensors: tuple[GgufTensorInfo, ...]


# GGUF metadata value types (gguf.md "gguf_metadata_value_type"): fixed-size scalars; 8 is a
# string (u64 length + UTF-8 bytes), 9 an array (u32 element type, u64 count, elements).
_SCALARS = {0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
            4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
            10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d")}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_U32, _U64 = _SCALARS[4], _SCALARS[10]
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT_BYTES = 32


class _Cursor:
    """Sequential little-endian reads over a bytes-like object."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: struct.Struct) -> Any:
        value = fmt.unpack_from(self.buf, self.pos)[0]
        self.pos += fmt.size
        return value

    def string(self) -> str:
        length = self.scalar(_U64)
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar(_U32), self.scalar(_U64)
            if item_type in _NUMPY_DTYPES:  # numeric arrays in one read, not one struct call each
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += count * dtype.itemsize
                return items
            return [self.value(item_type) for _ in range(count)]
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self.scalar(fmt)


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Parse a GGUF (version 2 or 3) file's metadata and tensor table without reading tensor data.

    Raises:
        ValueError: naming ``model`` for a file that is not GGUF, an unsupported version, an
            unknown ggml type, or a truncated / corrupt header.
    """
    import mmap

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"model: not a GGUF file (bad magic {bytes(buf[:4])!r}): {path}")
        cur = _Cursor(buf)
        cur.pos = 4
        try:
            version = cur.scalar(_U32)
            if version not in (2, 3):  # version 1 counted in u32; llama.cpp dropped it long ago
                raise ValueError(f"unsupported GGUF version {version}")
            num_tensors, num_kv = cur.scalar(_U64), cur.scalar(_U64)
            metadata: dict[str, Any] = {}
            for _ in range(num_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.scalar(_U32))
            table = []
            for _ in range(num_tensors):
                name = cur.string()
                dims = [cur.scalar(_U64) for _ in range(cur.scalar(_U32))]
                table.append((name, tuple(reversed(dims)), cur.scalar(_U32), cur.scalar(_U64)))
        except (struct.error, IndexError, ValueError) as exc:
            raise ValueError(f"model: GGUF header is truncated or corrupt ({exc}): {path}") from exc
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT_BYTES))
        data_start = -(-cur.pos // alignment) * alignment
        file_bytes = len(buf)
    tensors = []
    for name, shape, ggml_type, offset in table:
        try:
            block_size, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"model: GGUF tensor {name!r} has unknown ggml type {ggml_type}: {path}"
                             ) from exc
        num_elements = int(np.prod(shape, dtype=np.int64))
        num_bytes = num_elements // block_size * type_bytes
        if shape[-1] % block_size or data_start + offset + num_bytes > file_bytes:
            raise ValueError(f"model: GGUF tensor {name!r} is truncated or misshapen: {path}")
        tensors.append(GgufTensorInfo(name, shape, ggml_type, data_start + offset, num_bytes))
    return GgufHeader(metadata, tuple(tensors))


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """``blocks[:, start:start+2]`` read as one fp16 per block, widened to fp32 (exact)."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[n, 16]`` bytes -> fp32 ``[n, 32]``: all low nibbles, then all high (ggml's Q4 layout)."""
    half = packed.shape[1]
    out = np.empty((packed.shape[0], 2 * half), dtype=np.float32)
    np.bitwise_and(packed, np.uint8(0x0F), out=out[:, :half], casting="unsafe")
    np.right_shift(packed, np.uint8(4), out=out[:, half:], casting="unsafe")
    return out


# Same fp32 operations in the same order as gguf.quants' dequantize_blocks (each op rounds once,
# nothing is fused; in place only to skip temporaries and gguf's per-16-row split), so the
# results are bit-identical to it. numpy, not torch: single-threaded, so a busy machine does
# not make OpenMP threads spin against each other (torch on 2 threads took 10x longer there).
def _q4_0(blocks: np.ndarray) -> np.ndarray:
    out = _nibbles(blocks[:, 2:])
    out -= np.float32(8)
    out *= _f16_column(blocks, 0)
    return out


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    out = _nibbles(blocks[:, 4:])
    out *= _f16_column(blocks, 0)
    out += _f16_column(blocks, 2)
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    out *= _f16_column(blocks, 0)
    return out


_FAST_BLOCKS: dict[int, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    2: (18, _q4_0), 3: (20, _q4_1), 8: (34, _q8_0)}  # ggml type id: (bytes per 32-value block, fn)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of one GGUF tensor.

    Args:
        raw: the tensor's bytes, writable ``uint8 [num_bytes]`` (the result may share its
            memory, for F32).
        ggml_type: ggml type id (``gguf.GGMLQuantizationType``).
        shape: torch-order shape of the result.

    Returns:
        ``float32`` tensor of ``shape``, bit-identical to :func:`gguf.quants.dequantize`.

    Raises:
        NotImplementedError: for a type that :mod:`gguf.quants` cannot dequantize either.
    """
    if ggml_type == 0:
        values = raw.view(np.float32)
    elif ggml_type == 1:
        values = raw.view(np.float16).astype(np.float32)
    elif ggml_type in _FAST_BLOCKS:
        block_bytes, fn = _FAST_BLOCKS[ggml_type]
        values = fn(raw.reshape(-1, block_bytes))
    else:
        import gguf  # deferred: only other types need it

        rows = raw.reshape(*shape[:-1], -1)
        values = np.ascontiguousarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(ggml_type)),
                                      dtype=np.float32)
    return torch.from_numpy(values).reshape(shape)


def _hf_name(gguf_name: str, path: Path) -> str:
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    raise ValueError(f"model: unexpected GGUF tensor {gguf_name!r} in {path}")


def read_gguf(path: Path, *, progress: Callable[[int, int], None] | None = None
              ) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """Shape and fp32 HF-named state dict of a ``llama`` or ``gemma3`` GGUF file.

    Args:
        path: the ``.gguf`` file.
        progress: called as ``progress(done_bytes, total_bytes)`` after each tensor (file bytes).

    Raises:
        ValueError: naming ``model`` for another architecture (before any tensor is read),
            unsupported RoPE scaling, missing metadata, an unknown tensor name or a corrupt
            file.
    """
    path = Path(path)
    header = read_gguf_header(path)
    shape = gguf_shape(header.metadata, {t.name for t in header.tensors}, path)
    gemma = header.metadata.get("general.architecture") == GEMMA3_ARCH
    total_bytes = sum(t.num_bytes for t in header.tensors)
    done_bytes = 0
    state: dict[str, torch.Tensor] = {}
    with open(path, "rb") as handle:
        for info in header.tensors:
            hf_name = gemma3_hf_name(info.name, path) if gemma else _hf_name(info.name, path)
            # A fresh writable buffer per tensor: the state dict owns its memory (F32 tensors are
            # views of it), and no read-only mmap reaches torch.
            raw = np.empty(info.num_bytes, dtype=np.uint8)
            handle.seek(info.offset_bytes)
            if handle.readinto(raw.data) != info.num_bytes:
                raise ValueError(f"model: GGUF tensor {info.name!r} is truncated: {path}")
            weight = dequantize(raw, info.ggml_type, info.shape)
            if gemma:
                weight = gemma3_hf_tensor(hf_name, weight)
            elif hf_name.endswith("q_proj.weight"):
                weight = unpermute_qk(weight, shape.num_q_heads)
            elif hf_name.endswith("k_proj.weight"):
                weight = unpermute_qk(weight, shape.num_kv_heads)
            state[hf_name] = weight.contiguous()
            done_bytes += info.num_bytes
            if progress is not None:
                progress(done_bytes, total_bytes)
    log.debug("gguf_dequantized", path=str(path), num_tensors=len(state))
    return shape, state

"""Triton attention backend: the three kernels under the same names as ``reference``.

``radixkv.kernels.reference`` and this module are interchangeable: same functions, same
signatures, same results within dtype tolerance. Importing this module imports triton and
decorates the kernels, so on a CPU-only machine set ``TRITON_INTERPRET=1`` *before* importing
it (the interpreter flag is read at decoration time) or use the reference backend.

Quantized KV (int8 / fp8_e4m3, ``kv_quant.py``): all three functions take keyword-only
``k_scale_pool`` / ``v_scale_pool`` (``[M, B, Hkv]`` fp32, one scale per token slot and KV head)
beside int8 or float8_e4m3fn pools. ``paged_kv_write`` quantizes exactly as
``kv_quant.quantize_kv`` (same bytes, same scales); ``extend_attention`` and
``decode_attention`` read every key and value, the extend suffix included, dequantized from the
pool (so the suffix must be written first and the block tables must cover it).
"""

from __future__ import annotations

from ._triton_common import interpreting
from .decode import decode_attention, default_num_kv_splits
from .extend import extend_attention, extend_block_sizes
from .kv_write import paged_kv_write

__all__ = ["paged_kv_write", "extend_attention", "decode_attention", "extend_block_sizes",
           "default_num_kv_splits", "interpreting", "KV_QUANT_FORMATS"]

#: Quantized KV formats (``kv_quant`` names) the three kernels take with scale pools; fp8_e4m3
#: compiles only for GPUs with native fp8 conversions (sm_89+), and runs under the interpreter.
KV_QUANT_FORMATS = ("int8", "fp8_e4m3")

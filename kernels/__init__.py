"""Attention kernels (installed as ``radixkv.kernels``).

Only the torch reference backend lives here for now; Triton kernels arrive in a later issue
and must stay optional so this package imports without triton.
"""

from .reference import decode_attention, extend_attention, paged_kv_write

__all__ = ["paged_kv_write", "extend_attention", "decode_attention"]

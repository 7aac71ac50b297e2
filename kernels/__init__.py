"""Attention kernels (installed as ``radixkv.kernels``).

Two interchangeable backends with the same three functions and signatures:

| module | backend | imports |
|---|---|---|
| ``reference`` | pure torch (CPU default, correctness oracle) | torch |
| ``triton_backend`` | Triton kernels ``kv_write``, ``extend``, ``decode`` (GPU default) | torch, triton |

The CPU default is ``paged_sdpa`` (torch only): ``plan_attention`` prepares a step once
(slots, block gathers, masks, groups), then ``AttentionPlan.attend`` writes and attends per
layer with batched SDPA; it is checked against ``reference``. With fp32 weights on x86-64
(AVX2), ``native`` adds C kernels built at first use from ``csrc/cpu_decode.c`` with the system
compiler (ctypes, no torch headers): a few-row linear, decode attention read in place from the
pool (decode rows of any step), and a whole decoder layer per call for pure decode steps; where
they cannot build or run, everything stays on torch.

- ``paged_kv_write(k, v, k_pool, v_pool, slot_mapping, *, k_scale_pool=None,
  v_scale_pool=None)``
- ``extend_attention(q, k, v, k_pool, v_pool, block_tables, prefix_lens, qo_indptr, *,
  max_q_len, sm_scale=None, window_left=-1, logits_soft_cap=0.0, out=None, return_lse=False,
  k_scale_pool=None, v_scale_pool=None)``
- ``decode_attention(q, k_pool, v_pool, block_tables, kv_lens, *, sm_scale=None,
  window_left=-1, logits_soft_cap=0.0, out=None, return_lse=False, num_kv_splits=None,
  k_scale_pool=None, v_scale_pool=None)``

``k_scale_pool`` / ``v_scale_pool``: ``[M, B, Hkv]`` fp32 scales beside int8 or float8_e4m3fn
value pools (``kv_quant``: one scale per token slot and KV head); the write quantizes exactly as
``kv_quant.quantize_kv``, the attention functions dequantize what they read.

This package exports the reference functions and never imports triton itself, so it imports
where triton is missing, and ``TRITON_INTERPRET=1`` can still be set before
``radixkv.kernels.triton_backend`` is first imported (triton reads it when kernels are
decorated). Modules here import only torch and triton, with relative imports, so
``bench/kernels.py`` can load this folder by path without radixkv installed.
"""

import sys as _sys

if __name__ == "kernels":
    # Imported as a top-level ``kernels``, not as ``radixkv.kernels``: the repository root is on
    # sys.path (``python -m pytest`` from it, pytest's rootdir insertion) and this source folder
    # shadows the ``kernels`` distribution (Hugging Face hub kernels, which transformers >= 5.25
    # requires and imports). Load that distribution in this module's place; the import system
    # hands the importer whatever sys.modules["kernels"] holds once this body has run.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
    # Not installed: this module stays empty, with no __version__. transformers (< 5.25, where
    # the distribution is optional) imports a ``kernels`` it finds without distribution metadata
    # and reads its version: none means not available. Raising ImportError here made every
    # process started from the repository root (servers, vLLM beside them) fail at that check.
else:
    from .reference import decode_attention, extend_attention, paged_kv_write

    __all__ = ["paged_kv_write", "extend_attention", "decode_attention"]

"""Triton ``paged_kv_write`` against the reference scatter, on NaN-poisoned pools."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from radixkv.kernels import triton_backend as triton_ops
from tests.kernels.paged import DEVICE, dtype_id


def _pools(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("block_size,heads,head_dim,dtype", [
    (1, 2, 64, torch.float32), (4, 2, 80, torch.bfloat16), (16, 3, 80, torch.float16)],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v))
def test_kv_write_matches_reference(block_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_tokens = 37
    num_blocks = -(-2 * num_tokens // block_size)
    # Distinct random slots (a permutation prefix), a few of them padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    fused = torch.randn(num_tokens, 2 * heads + 1, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = fused[:, :heads], fused[:, heads + 1:]  # strided views, as the runner passes them
    k_pool, v_pool = _pools((num_blocks, block_size, heads, head_dim), dtype)
    triton_ops.paged_kv_write(k, v, k_pool, v_pool, slots.to(DEVICE))
    want_k, want_v = _pools((num_blocks, block_size, heads, head_dim), dtype)
    reference.paged_kv_write(k, v, want_k, want_v, slots.to(DEVICE))
    # Same bits, NaN included: untouched slots stay poisoned.
    assert torch.equal(k_pool.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want_k.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(v_pool.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want_v.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_kv_write_casts_to_the_pool_dtype_and_skips_out_of_range() -> None:
    k = torch.randn(4, 1, 16, device=DEVICE)
    k_pool, v_pool = _pools((2, 4, 1, 16), torch.bfloat16)
    triton_ops.paged_kv_write(k, -k, k_pool, v_pool, torch.tensor([0, 7, 8, -3], dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_pool[0, 0], k[0].to(torch.bfloat16))
    assert torch.equal(v_pool[1, 3], (-k[1]).to(torch.bfloat16))
    assert int((~k_pool.isnan()).any(-1).sum()) == 2  # slot 8 is past the pool: dropped


def test_kv_write_validates_shapes() -> None:
    k_pool, v_pool = _pools((2, 4, 1, 16), torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_ops.paged_kv_write(torch.zeros(3, 1, 16, device=DEVICE), torch.zeros(3, 1, 16, device=DEVICE),
                                  k_pool, v_pool, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="k: shape"):
        triton_ops.paged_kv_write(torch.zeros(3, 2, 16, device=DEVICE), torch.zeros(3, 2, 16, device=DEVICE),
                                  k_pool, v_pool, torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("name", ["paged_kv_write", "extend_attention", "decode_attention"])
def test_backends_share_signatures(name: str) -> None:
    import inspect

    assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(reference, name))

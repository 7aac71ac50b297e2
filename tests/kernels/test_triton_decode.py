"""Triton ``decode_attention`` (split-KV + LSE merge) against the torch reference.

Each launch packs one sequence per KV length ``{1, B-1, B, B+1, 2B, 37, 70}`` (0 dropped);
the four launches rotate block size, dtype, GQA group (4 = 8:2, 3 = 6:2, padded to the
16-row tile), head dim and split count, including more splits than key tiles (empty splits).
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from radixkv.kernels import triton_backend as triton_ops
from tests.kernels.paged import DEVICE, LSE_TOL, dtype_id, make_paged_batch, nan_like, tolerance

KV_LENS = ("1", "B-1", "B", "B+1", "2B", "37", "70")
_SYMBOLS = {"1": lambda b: 1, "B-1": lambda b: b - 1, "B": lambda b: b, "B+1": lambda b: b + 1,
            "2B": lambda b: 2 * b, "37": lambda b: 37, "70": lambda b: 70}

CASES = [  # (block_size, dtype, heads, head_dim, num_kv_splits)
    (1, torch.float32, (8, 2), 64, 1),
    (4, torch.float16, (6, 2), 80, 3),
    (16, torch.bfloat16, (8, 2), 80, 5),
    (16, torch.float32, (6, 2), 64, 16),  # more splits than key tiles: empty splits
    (4, torch.float16, (32, 1), 64, 2),   # group of 32 > the 16-row minimum tile
]


def _decode_batch(block_size: int, dtype: torch.dtype, heads: tuple[int, int], head_dim: int, seed: int):
    kv_lens = sorted({s(block_size) for s in _SYMBOLS.values()} - {0})
    # The whole KV is "prefix" in the pool; the batch's q rows (L = 1) are the decode queries.
    batch = make_paged_batch([(n, 1) for n in kv_lens], block_size=block_size, heads=heads,
                             head_dim=head_dim, dtype=dtype, seed=seed)
    return batch, torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)


def _reference_decode(batch, kv_lens: torch.Tensor, **kwargs):
    return reference.decode_attention(batch.q.float(), batch.k_pool.float(), batch.v_pool.float(),
                                      batch.block_tables, kv_lens, **kwargs)


@pytest.mark.parametrize("block_size,dtype,heads,head_dim,num_kv_splits", CASES,
                         ids=[f"B{c[0]}-{dtype_id(c[1])}-gqa{c[2][0]}:{c[2][1]}-D{c[3]}-S{c[4]}" for c in CASES])
def test_decode_matches_reference(block_size: int, dtype: torch.dtype, heads: tuple[int, int],
                                  head_dim: int, num_kv_splits: int) -> None:
    batch, kv_lens = _decode_batch(block_size, dtype, heads, head_dim, seed=block_size + num_kv_splits)
    out = nan_like(batch.q)
    got, lse = triton_ops.decode_attention(batch.q, batch.k_pool, batch.v_pool, batch.block_tables, kv_lens,
                                           out=out, return_lse=True, num_kv_splits=num_kv_splits)
    assert got is out and not got.isnan().any()
    want, want_lse = _reference_decode(batch, kv_lens, return_lse=True)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("window_left,soft_cap", [(7, 0.0), (40, 5.0)], ids=["window7", "window40-cap5"])
def test_decode_window_and_soft_cap(window_left: int, soft_cap: float) -> None:
    batch, kv_lens = _decode_batch(4, torch.float32, (4, 2), 64, seed=9)
    got, lse = triton_ops.decode_attention(batch.q, batch.k_pool, batch.v_pool, batch.block_tables, kv_lens,
                                           window_left=window_left, logits_soft_cap=soft_cap,
                                           return_lse=True, num_kv_splits=3)
    want, want_lse = _reference_decode(batch, kv_lens, window_left=window_left, logits_soft_cap=soft_cap,
                                       return_lse=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=0)


def test_decode_split_count_does_not_change_the_result() -> None:
    batch, kv_lens = _decode_batch(4, torch.float32, (2, 1), 64, seed=2)
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables, kv_lens)
    one = triton_ops.decode_attention(*args, num_kv_splits=1)
    many = triton_ops.decode_attention(*args, num_kv_splits=7)
    torch.testing.assert_close(one, many, atol=2e-6, rtol=2e-6)


def test_decode_validates_arguments() -> None:
    batch, kv_lens = _decode_batch(4, torch.float32, (2, 1), 64, seed=2)
    args = (batch.q, batch.k_pool, batch.v_pool, batch.block_tables)
    with pytest.raises(ValueError, match="kv_lens"):
        triton_ops.decode_attention(*args, kv_lens.long())
    with pytest.raises(ValueError, match="num_kv_splits"):
        triton_ops.decode_attention(*args, kv_lens, num_kv_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_llama_shapes_on_gpu(block_size: int) -> None:
    kv = [1, 17, 1000, 8191, 33000]
    batch = make_paged_batch([(n, 1) for n in kv], block_size=block_size, heads=(32, 8), head_dim=128,
                             dtype=torch.bfloat16, seed=block_size)
    kv_lens = torch.tensor(kv, dtype=torch.int32, device=DEVICE)
    got, lse = triton_ops.decode_attention(batch.q, batch.k_pool, batch.v_pool, batch.block_tables, kv_lens,
                                           out=nan_like(batch.q), return_lse=True)
    want, want_lse = _reference_decode(batch, kv_lens, return_lse=True)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=0)

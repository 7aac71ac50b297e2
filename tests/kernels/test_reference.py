"""Reference attention backend: paged K/V write and extend attention vs dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv.kernels import decode_attention, extend_attention, paged_kv_write


def _pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    # NaN everywhere: any read of a slot that was not written poisons the output.
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))


def test_paged_kv_write_places_rows_and_skips_negative_slots() -> None:
    k_pool, v_pool = _pool(3, 4, 2, 2), _pool(3, 4, 2, 2)
    k = torch.arange(3 * 2 * 2, dtype=torch.float32).reshape(3, 2, 2)
    v = -k
    slots = torch.tensor([9, -1, 0])  # block 2 offset 1; padding; block 0 offset 0
    paged_kv_write(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool[2, 1], k[0])
    assert torch.equal(v_pool[2, 1], v[0])
    assert torch.equal(k_pool[0, 0], k[2])
    assert torch.equal(v_pool[0, 0], v[2])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert bool(k_pool[~written].isnan().all()) and bool(v_pool[~written].isnan().all())


def test_paged_kv_write_rejects_out_of_range_slot() -> None:
    k_pool, v_pool = _pool(2, 4, 1, 2), _pool(2, 4, 1, 2)
    k = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_kv_write(k, k, k_pool, v_pool, torch.tensor([8]))


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int = -1) -> torch.Tensor:
    """Naive attention of the last L queries over S keys; q [L, Hq, D], k/v [S, Hkv, D]."""
    num_q, num_q_heads, head_dim = q.shape
    num_k = k.shape[0]
    group = num_q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(head_dim)
    q_pos = torch.arange(num_k - num_q, num_k)[:, None]
    k_pos = torch.arange(num_k)[None, :]
    allowed = k_pos <= q_pos
    if window_left >= 0:
        allowed &= k_pos >= q_pos - window_left
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


CASES = [  # (prefix_len, suffix_len) per sequence
    [(0, 1)],
    [(0, 7)],
    [(5, 1)],
    [(16, 3), (0, 5), (33, 1)],
    [(1, 17), (31, 9)],
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seqs", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window_left", [-1, 5])
def test_extend_attention_matches_dense(block_size: int, seqs: list[tuple[int, int]],
                                        heads: tuple[int, int], window_left: int) -> None:
    num_q_heads, num_kv_heads = heads
    head_dim = 8
    gen = torch.Generator().manual_seed(block_size * 100 + len(seqs))
    max_blocks = max(-(-(p + s) // block_size) for p, s in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    k_pool, v_pool = _pool(num_blocks, block_size, num_kv_heads, head_dim), _pool(num_blocks, block_size, num_kv_heads, head_dim)
    # Scatter each sequence over a shuffled set of blocks.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    for i, (p, s) in enumerate(seqs):
        table = perm[i * max_blocks:(i + 1) * max_blocks]
        tables.append(table)
        kk = torch.randn(p + s, num_kv_heads, head_dim, generator=gen)
        vv = torch.randn(p + s, num_kv_heads, head_dim, generator=gen)
        full_k.append(kk)
        full_v.append(vv)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(p)], dtype=torch.int64)
        if p:
            paged_kv_write(kk[:p], vv[:p], k_pool, v_pool, slots)
    q = torch.randn(sum(s for _, s in seqs), num_q_heads, head_dim, generator=gen)
    k = torch.cat([kk[p:] for kk, (p, _) in zip(full_k, seqs)])
    v = torch.cat([vv[p:] for vv, (p, _) in zip(full_v, seqs)])
    indptr = [0]
    for _, s in seqs:
        indptr.append(indptr[-1] + s)
    out = extend_attention(
        q, k, v, k_pool, v_pool,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor([p for p, _ in seqs], dtype=torch.int32),
        torch.tensor(indptr, dtype=torch.int32),
        max_q_len=max(s for _, s in seqs), window_left=window_left)
    assert out.shape == q.shape
    for i, (p, s) in enumerate(seqs):
        expected = _dense_attention(q[indptr[i]:indptr[i + 1]], full_k[i], full_v[i], window_left)
        torch.testing.assert_close(out[indptr[i]:indptr[i + 1]], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_attention_matches_dense(block_size: int) -> None:
    gen = torch.Generator().manual_seed(7)
    kv_lens = [1, 6, 21]
    num_kv_heads, num_q_heads, head_dim = 2, 6, 8
    max_blocks = -(-max(kv_lens) // block_size)
    num_blocks = len(kv_lens) * max_blocks
    k_pool, v_pool = _pool(num_blocks, block_size, num_kv_heads, head_dim), _pool(num_blocks, block_size, num_kv_heads, head_dim)
    tables, ks, vs = [], [], []
    for i, n in enumerate(kv_lens):
        table = list(range(i * max_blocks, (i + 1) * max_blocks))[::-1]
        tables.append(table)
        kk, vv = torch.randn(n, num_kv_heads, head_dim, generator=gen), torch.randn(n, num_kv_heads, head_dim, generator=gen)
        ks.append(kk)
        vs.append(vv)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
        paged_kv_write(kk, vv, k_pool, v_pool, slots)
    q = torch.randn(len(kv_lens), num_q_heads, head_dim, generator=gen)
    out = decode_attention(q, k_pool, v_pool, torch.tensor(tables, dtype=torch.int32),
                           torch.tensor(kv_lens, dtype=torch.int32))
    for i in range(len(kv_lens)):
        torch.testing.assert_close(out[i:i + 1], _dense_attention(q[i:i + 1], ks[i], vs[i]), atol=1e-5, rtol=0)


def test_extend_attention_rejects_bad_indptr() -> None:
    q = torch.zeros(3, 2, 4)
    k = torch.zeros(3, 2, 4)
    pool = torch.zeros(2, 4, 2, 4)
    with pytest.raises(ValueError, match="qo_indptr"):
        extend_attention(q, k, k, pool, pool, torch.zeros(1, 2, dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), max_q_len=3)

"""Triton ``extend_attention`` against the torch reference, plus its invariances.

The case table is a pairwise covering design, not a product: every pair of values of the axes
block size B, prefix P, suffix L, dtype, GQA heads and head dim D occurs in some launch (the
first test checks that). P and L values are symbolic in B and BLOCK_M (16 on the
interpreter). Each launch packs several sequences, so 9 launches cover 56 (P, L) pairs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from radixkv.kernels import reference
from radixkv.kernels import triton_backend as triton_ops
from tests.kernels.paged import (
    DEVICE,
    LSE_TOL,
    dtype_id,
    make_paged_batch,
    nan_like,
    reference_extend,
    tolerance,
)

BLOCK_M = triton_ops.extend_block_sizes(64, torch.float32, DEVICE)[0]

P_VALUES = ("0", "1", "B-1", "B", "B+1", "2B", "37")
L_VALUES = ("1", "B-1", "B", "B+1", "BM-1", "BM", "BM+1", "70")
BLOCK_SIZES = (1, 4, 16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS = ((8, 2), (6, 2))
HEAD_DIMS = (64, 80)


_SYMBOLS = {"0": lambda b: 0, "1": lambda b: 1, "B-1": lambda b: b - 1, "B": lambda b: b,
            "B+1": lambda b: b + 1, "2B": lambda b: 2 * b, "37": lambda b: 37, "70": lambda b: 70,
            "BM-1": lambda b: BLOCK_M - 1, "BM": lambda b: BLOCK_M, "BM+1": lambda b: BLOCK_M + 1}


def _value(sym: str, block_size: int) -> int:
    return _SYMBOLS[sym](block_size)


def _launches() -> list[dict]:
    """Nine launches: an OA(9; 3, 3, 2, 2) over (B, dtype, heads, D); (P_i, L_j) -> row (i + 2j) % 9.

    For a fixed P the 8 L values land in 8 distinct rows and for a fixed L the 7 P values in 7
    rows; every level of every launch axis sits in >= 3 of the 9 rows, so each (P or L value,
    launch-axis value) pair is covered, and the array covers every launch-axis pair.
    """
    rows = []
    for i, j in itertools.product(range(3), range(3)):
        rows.append({"block_size": BLOCK_SIZES[i], "dtype": DTYPES[j], "heads": HEADS[((i + j) % 3) % 2],
                     "head_dim": HEAD_DIMS[((i + 2 * j) % 3) % 2], "seqs": [], "syms": []})
    for (pi, p), (li, l) in itertools.product(enumerate(P_VALUES), enumerate(L_VALUES)):
        row = rows[(pi + 2 * li) % 9]
        b = row["block_size"]
        row["syms"].append((p, l))
        row["seqs"].append((_value(p, b), max(1, _value(l, b))))  # L = B-1 = 0 at B = 1 -> 1
    return rows


LAUNCHES = _launches()


def _launch_id(row: dict) -> str:
    return f"B{row['block_size']}-{dtype_id(row['dtype'])}-gqa{row['heads'][0]}:{row['heads'][1]}-D{row['head_dim']}"


def test_case_table_covers_every_pair() -> None:
    # Each sequence is a point on six axes; collect every pair of (axis, value) it touches.
    points = [{"B": r["block_size"], "dtype": r["dtype"], "heads": r["heads"], "D": r["head_dim"], "P": p, "L": l}
              for r in LAUNCHES for p, l in r["syms"]]
    axes = {"B": BLOCK_SIZES, "dtype": DTYPES, "heads": HEADS, "D": HEAD_DIMS, "P": P_VALUES, "L": L_VALUES}
    missing = [(a, va, b, vb) for a, b in itertools.combinations(axes, 2)
               for va in axes[a] for vb in axes[b]
               if not any(pt[a] == va and pt[b] == vb for pt in points)]
    assert missing == []
    assert sum(len(r["seqs"]) for r in LAUNCHES) == len(P_VALUES) * len(L_VALUES)


@pytest.mark.parametrize("row", LAUNCHES, ids=_launch_id)
def test_extend_matches_reference(row: dict) -> None:
    batch = make_paged_batch(row["seqs"], block_size=row["block_size"], heads=row["heads"],
                             head_dim=row["head_dim"], dtype=row["dtype"], seed=row["block_size"])
    out = nan_like(batch.q)
    got, lse = triton_ops.extend_attention(*batch.args(), max_q_len=batch.max_q_len, out=out, return_lse=True)
    assert got is out and got.dtype == row["dtype"]
    assert not got.isnan().any(), "a row was not written or read a poisoned slot"
    want, want_lse = reference_extend(batch, return_lse=True)
    atol, rtol = tolerance(row["dtype"])
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL[row["dtype"]], rtol=0)


@pytest.mark.parametrize("window_left,soft_cap,dtype", [(5, 0.0, torch.float32), (20, 4.0, torch.bfloat16),
                                                        (0, 30.0, torch.float16)],
                         ids=["window5", "window20-cap4-bf16", "window0-cap30-fp16"])
def test_extend_window_and_soft_cap(window_left: int, soft_cap: float, dtype: torch.dtype) -> None:
    batch = make_paged_batch([(37, 21), (3, 40), (0, 18)], block_size=4, heads=(4, 2), dtype=dtype, seed=5)
    got, lse = triton_ops.extend_attention(*batch.args(), max_q_len=batch.max_q_len, out=nan_like(batch.q),
                                           window_left=window_left, logits_soft_cap=soft_cap, return_lse=True)
    want, want_lse = reference_extend(batch, window_left=window_left, logits_soft_cap=soft_cap, return_lse=True)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_extend_with_prefix_equals_tail_of_full_prefill(dtype: torch.dtype) -> None:
    # extend(P, L) == last L rows of extend(0, P + L): the same keys, once from the pool.
    seqs = [(37, 21), (16, 5)]
    full = make_paged_batch([(0, p + l) for p, l in seqs], block_size=4, dtype=dtype, seed=11)
    full_out = triton_ops.extend_attention(*full.args(), max_q_len=full.max_q_len, out=nan_like(full.q))
    # Cache the first P tokens of each sequence through the kernel, then prefill only the rest.
    starts = full.qo_indptr.tolist()
    cached = torch.cat([torch.arange(starts[i], starts[i] + p) for i, (p, _) in enumerate(seqs)]).to(DEVICE)
    slots = torch.cat([full.slots(i, range(p)) for i, (p, _) in enumerate(seqs)])
    triton_ops.paged_kv_write(full.k[cached], full.v[cached], full.k_pool, full.v_pool, slots)
    rest = torch.cat([torch.arange(starts[i] + p, starts[i + 1]) for i, (p, _) in enumerate(seqs)]).to(DEVICE)
    indptr = torch.tensor([0, seqs[0][1], seqs[0][1] + seqs[1][1]], dtype=torch.int32, device=DEVICE)
    prefix_lens = torch.tensor([p for p, _ in seqs], dtype=torch.int32, device=DEVICE)
    q = full.q[rest]
    suffix_out = triton_ops.extend_attention(q, full.k[rest], full.v[rest], full.k_pool, full.v_pool,
                                             full.block_tables, prefix_lens, indptr,
                                             max_q_len=max(l for _, l in seqs), out=nan_like(q))
    atol, rtol = tolerance(dtype) if dtype != torch.float32 else (1e-5, 1e-5)
    torch.testing.assert_close(suffix_out.float(), full_out[rest].float(), atol=atol, rtol=rtol)


def test_extend_is_batch_invariant() -> None:
    # Each program reads only its own sequence: alone or packed, the bits are the same,
    # whatever the neighbours' lengths (including an empty suffix) and the grid size.
    seqs = [(9, 33), (37, 0), (2, 5)]
    batch = make_paged_batch(seqs, block_size=4, seed=3)
    packed = triton_ops.extend_attention(*batch.args(), max_q_len=batch.max_q_len)
    indptr = batch.qo_indptr.tolist()
    for i, (p, l) in enumerate(seqs):
        if l == 0:
            continue
        rows = slice(indptr[i], indptr[i + 1])
        alone = triton_ops.extend_attention(
            batch.q[rows], batch.k[rows], batch.v[rows], batch.k_pool, batch.v_pool,
            batch.block_tables[i:i + 1], batch.prefix_lens[i:i + 1],
            torch.tensor([0, l], dtype=torch.int32, device=DEVICE), max_q_len=l)
        assert torch.equal(alone, packed[rows])


def test_extend_is_invariant_to_physical_page_permutation() -> None:
    batch = make_paged_batch([(37, 20), (5, 9)], block_size=4, heads=(6, 2), seed=8)
    before = triton_ops.extend_attention(*batch.args(), max_q_len=batch.max_q_len)
    # Move physical block b to perm[b] and rename every table entry accordingly.
    num_blocks = batch.k_pool.shape[0]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    k_pool, v_pool = torch.empty_like(batch.k_pool), torch.empty_like(batch.v_pool)
    k_pool[perm.to(DEVICE)] = batch.k_pool
    v_pool[perm.to(DEVICE)] = batch.v_pool
    tables = batch.block_tables.cpu()
    tables = torch.where(tables >= 0, perm[tables.clamp(min=0).long()].to(torch.int32), tables).to(DEVICE)
    after = triton_ops.extend_attention(batch.q, batch.k, batch.v, k_pool, v_pool, tables,
                                        batch.prefix_lens, batch.qo_indptr, max_q_len=batch.max_q_len)
    assert torch.equal(before, after)


def test_extend_full_hit_matches_decode() -> None:
    # Full hit: the whole 3-block prompt is cached and only its last token is recomputed
    # (P = 3B - 1, L = 1); decode over all 3B keys must agree with it and the reference.
    block_size = 16
    batch = make_paged_batch([(3 * block_size - 1, 1), (2 * block_size - 1, 1)], block_size=block_size,
                             heads=(8, 2), seed=21)
    ext = triton_ops.extend_attention(*batch.args(), max_q_len=1, out=nan_like(batch.q))
    torch.testing.assert_close(ext, reference_extend(batch), atol=2e-5, rtol=2e-5)
    last = torch.cat([batch.slots(i, range(p, p + 1)) for i, (p, _) in enumerate(batch.seqs)])
    triton_ops.paged_kv_write(batch.k, batch.v, batch.k_pool, batch.v_pool, last)
    kv_lens = (batch.prefix_lens + 1).to(torch.int32)
    dec = triton_ops.decode_attention(batch.q, batch.k_pool, batch.v_pool, batch.block_tables, kv_lens,
                                      out=nan_like(batch.q), num_kv_splits=2)
    torch.testing.assert_close(dec, ext, atol=2e-5, rtol=2e-5)


def test_extend_reads_strided_views_of_a_fused_qkv() -> None:
    # The runner's q/k/v may be views of one [T, (Hq + 2 Hkv) * D] projection.
    batch = make_paged_batch([(6, 17)], block_size=4, heads=(4, 2), seed=4)
    fused = torch.cat([batch.q, batch.k, batch.v], dim=1)  # [T, Hq + 2 Hkv, D]
    q, k, v = fused[:, :4], fused[:, 4:6], fused[:, 6:]
    assert not q.is_contiguous()
    got = triton_ops.extend_attention(q, k, v, *batch.args()[3:], max_q_len=17, sm_scale=0.3)
    torch.testing.assert_close(got, reference_extend(batch, sm_scale=0.3), atol=2e-5, rtol=2e-5)


def test_extend_validates_metadata() -> None:
    batch = make_paged_batch([(4, 3)], block_size=4, seed=0)
    args = list(batch.args())
    args[6] = batch.prefix_lens.long()
    with pytest.raises(ValueError, match="prefix_lens"):
        triton_ops.extend_attention(*args, max_q_len=3)
    with pytest.raises(ValueError, match="out"):
        triton_ops.extend_attention(*batch.args(), max_q_len=3, out=torch.empty(1, device=DEVICE))
    with pytest.raises(ValueError, match="q/k/v"):
        triton_ops.extend_attention(batch.q.half(), *batch.args()[1:], max_q_len=3)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.kernels import _triton_common

    monkeypatch.setattr(_triton_common, "_INTERPRETER_AT_IMPORT", False)
    batch = make_paged_batch([(4, 3)], block_size=4, seed=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_ops.extend_attention(*batch.args(), max_q_len=3)


def test_reference_soft_cap_and_lse_match_dense_math() -> None:
    # The reference's own explicit path, checked once against a direct formula.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 8, generator=gen) for _ in range(3))
    pool = torch.zeros(1, 4, 2, 8)
    out, lse = reference.extend_attention(
        q, k, v, pool, pool, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32), max_q_len=5, logits_soft_cap=2.0, return_lse=True)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(8)
    s = 2.0 * torch.tanh(s / 2.0)
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).T, atol=1e-6, rtol=0)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", s.softmax(-1), v), atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_extend_llama_shapes_on_gpu(block_size: int) -> None:
    batch = make_paged_batch([(1000, 300), (0, 129), (4096, 1), (77, 513)], block_size=block_size,
                             heads=(32, 8), head_dim=128, dtype=torch.bfloat16, seed=block_size)
    got, lse = triton_ops.extend_attention(*batch.args(), max_q_len=batch.max_q_len,
                                           out=nan_like(batch.q), return_lse=True)
    want, want_lse = reference_extend(batch, return_lse=True)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=0)


@pytest.mark.gpu
def test_int64_addressing_past_2_pow_31_elements_on_gpu() -> None:
    # Pools of > 2^31 elements with the sequence in the highest blocks: an int32 offset
    # (block * stride) would wrap and read the wrong (NaN) slots.
    block_size, heads, head_dim, dtype = 16, (32, 8), 128, torch.bfloat16
    per_block = block_size * heads[1] * head_dim
    num_blocks = (1 << 31) // per_block + 64
    k_pool = torch.full((num_blocks, block_size, heads[1], head_dim), float("nan"), dtype=dtype, device="cuda")
    v_pool = torch.full_like(k_pool, float("nan"))
    prefix_len, suffix_len = 300, 50
    count = -(-(prefix_len + suffix_len) // block_size)
    table = torch.arange(num_blocks - 1, num_blocks - 1 - 2 * count, -2, dtype=torch.int32, device="cuda")[None]
    pos = torch.arange(prefix_len, device="cuda")
    slots = table[0].long()[pos // block_size] * block_size + pos % block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    pk, pv = (torch.randn(prefix_len, heads[1], head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    reference.paged_kv_write(pk, pv, k_pool, v_pool, slots)
    q = torch.randn(suffix_len, heads[0], head_dim, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(suffix_len, heads[1], head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    meta = (table, torch.tensor([prefix_len], dtype=torch.int32, device="cuda"),
            torch.tensor([0, suffix_len], dtype=torch.int32, device="cuda"))
    got = triton_ops.extend_attention(q, k, v, k_pool, v_pool, *meta, max_q_len=suffix_len)
    want = reference.extend_attention(q.float(), k.float(), v.float(), k_pool[table[0].long()].float(),
                                      v_pool[table[0].long()].float(),
                                      torch.arange(count, dtype=torch.int32, device="cuda")[None], *meta[1:],
                                      max_q_len=suffix_len)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    kv_lens = torch.tensor([prefix_len], dtype=torch.int32, device="cuda")
    dec = triton_ops.decode_attention(q[:1], k_pool, v_pool, table, kv_lens)
    used = table[0].long()
    want_dec = reference.decode_attention(q[:1].float(), k_pool[used].float(), v_pool[used].float(),
                                          torch.arange(count, dtype=torch.int32, device="cuda")[None], kv_lens)
    torch.testing.assert_close(dec.float(), want_dec, atol=3e-2, rtol=3e-2)

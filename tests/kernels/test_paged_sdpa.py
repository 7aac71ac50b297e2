"""The torch fast path (``paged_sdpa``: one plan per step) against the per-sequence reference.

Pools are NaN outside each sequence's prefix (``make_paged_batch``): a read of a slot the plan
should not touch, or a padding key that is not masked out, turns the output into NaN.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from radixkv.kernels.paged_sdpa import plan_attention

from .paged import make_paged_batch

# fp32 SDPA against the reference's fp32 SDPA on the same inputs: only summation order differs.
ATOL = RTOL = 2e-5

CASES = {  # id: ((P, L) per sequence, block size)
    "decode-1": ([(37, 1)], 16),
    "decode-equal-lengths": ([(32, 1), (32, 1), (32, 1)], 16),
    "decode-17-ragged": ([(p, 1) for p in (0, 1, 5, 15, 16, 17, 31, 33, 40, 63, 64, 65, 97, 3, 8, 120, 2)], 16),
    "prefill-no-prefix": ([(0, 97)], 16),
    "extend-unaligned-prefix": ([(13, 6)], 4),
    "extend-ragged": ([(0, 5), (9, 3), (16, 11)], 8),
    "mixed-decode-and-extend": ([(20, 1), (0, 33), (7, 1), (5, 9), (64, 1)], 16),
    "page-size-1": ([(6, 1), (3, 4), (0, 2)], 1),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("window_left", [-1, 4], ids=["no-window", "window-4"])
def test_plan_matches_reference(case: str, window_left: int) -> None:
    seqs, block_size = CASES[case]
    batch = make_paged_batch(seqs, block_size=block_size, heads=(6, 2), head_dim=32,
                             device=torch.device("cpu"))
    slot_mapping = torch.cat([batch.slots(i, range(p, p + l)) for i, (p, l) in enumerate(seqs)])
    want = reference.extend_attention(*batch.args(), max_q_len=batch.max_q_len, window_left=window_left)
    k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
    plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                          block_size=block_size, num_pool_blocks=k_pool.shape[0],
                          head_dim=32, window_left=window_left)
    got = plan.attend(batch.q, batch.k, batch.v, k_pool, v_pool)
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # The step's own K/V landed in the pool at exactly the mapped slots.
    flat = k_pool.view(-1, *k_pool.shape[2:])
    assert torch.equal(flat[slot_mapping], batch.k)


def test_plan_groups_decode_apart_from_extend() -> None:
    seqs = [(20, 1), (0, 33), (7, 1), (5, 9)]
    batch = make_paged_batch(seqs, block_size=16, heads=(2, 1), head_dim=8, device=torch.device("cpu"))
    slot_mapping = torch.cat([batch.slots(i, range(p, p + l)) for i, (p, l) in enumerate(seqs)])
    plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                          block_size=16, num_pool_blocks=batch.k_pool.shape[0], head_dim=8)
    decode, extend = plan.groups
    # Decode rows 0 and 34 (sequences 0 and 2) in one batch: 21 and 8 keys, padded to 2 blocks;
    # sequence 2's one block is followed by a repeat of it, whose rows are zeroed.
    assert decode.rows.tolist() == [0, 34]
    assert (decode.num_seqs, decode.max_q_len, decode.max_kv_len) == (2, 1, 32)
    table = batch.block_tables.tolist()
    assert decode.kv_blocks.tolist() == [table[0][0], table[0][1], table[2][0], table[2][0]]
    assert decode.pad_rows.tolist() == list(range(21, 32)) + list(range(32 + 8, 64))
    # Extend sequences 1 and 3 padded to 33 query rows and 3 blocks of keys; the 24 padding
    # rows of sequence 3 repeat its first row (35) and are not written back.
    assert (extend.num_seqs, extend.max_q_len, extend.max_kv_len) == (2, 33, 48)
    assert extend.rows.tolist()[:33] == list(range(1, 34))
    assert extend.rows.tolist()[33:] == list(range(35, 44)) + [35] * 24
    assert int(extend.valid.sum()) == 33 + 9


def test_groups_are_cut_to_the_kv_budget_and_still_match() -> None:
    # 4 bytes of K+V per token. Decode lengths 17, 33, 9, 40, 2 pad to 32, 48, 16, 48, 16 keys;
    # a group costs (members x its longest padded length x 4) bytes. Budget 256: every pair
    # costs 384, so each sequence is alone. Budget 400: [0, 1] and [2, 3] cost 384, a third
    # member 576.
    seqs = [(16, 1), (32, 1), (8, 1), (39, 1), (1, 1)]
    batch = make_paged_batch(seqs, block_size=16, heads=(4, 2), head_dim=16, device=torch.device("cpu"))
    slot_mapping = torch.cat([batch.slots(i, range(p, p + l)) for i, (p, l) in enumerate(seqs)])
    want = reference.extend_attention(*batch.args(), max_q_len=1)
    k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
    plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                          block_size=16, num_pool_blocks=k_pool.shape[0], head_dim=16,
                          kv_bytes_per_token=4, chunk_kv_bytes=256)
    assert [g.rows.tolist() for g in plan.groups] == [[0], [1], [2], [3], [4]]
    plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                          block_size=16, num_pool_blocks=k_pool.shape[0], head_dim=16,
                          kv_bytes_per_token=4, chunk_kv_bytes=400)
    assert [g.rows.tolist() for g in plan.groups] == [[0, 1], [2, 3], [4]]
    got = plan.attend(batch.q, batch.k, batch.v, k_pool, v_pool)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_single_prefill_without_prefix_reads_no_pool() -> None:
    batch = make_paged_batch([(0, 10)], block_size=4, heads=(2, 1), head_dim=8, device=torch.device("cpu"))
    slot_mapping = batch.slots(0, range(10))
    plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                          block_size=4, num_pool_blocks=batch.k_pool.shape[0], head_dim=8)
    (group,) = plan.groups
    assert group.causal_own and group.kv_blocks is None and group.mask is None


@pytest.mark.parametrize("field, kwargs, message", [
    ("slot_mapping", {"slot_mapping": torch.tensor([999])}, "slot_mapping"),
    ("qo_indptr", {"qo_indptr": torch.tensor([0, 2], dtype=torch.int32)}, "qo_indptr"),
    ("block_tables", {"block_tables": torch.tensor([[-1, -1]], dtype=torch.int32)}, "block_tables"),
])
def test_bad_metadata_names_the_field(field: str, kwargs: dict, message: str) -> None:
    args = {"block_tables": torch.tensor([[0, 1]], dtype=torch.int32),
            "prefix_lens": torch.tensor([5], dtype=torch.int32),
            "qo_indptr": torch.tensor([0, 1], dtype=torch.int32),
            "slot_mapping": torch.tensor([5])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_attention(args["block_tables"], args["prefix_lens"], args["qo_indptr"], args["slot_mapping"],
                       block_size=4, num_pool_blocks=2, head_dim=8)

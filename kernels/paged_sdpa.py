"""Torch fast path of paged attention: a per-step plan, then one batched SDPA per layer.

The reference backend (``reference.py``) loops over sequences in every layer and gathers each
sequence's prefix with ``index_select`` + ``cat``: on a CPU at batch 4 and 2k context that was
about 60 % of a decode step. Here everything that depends only on the step's metadata (which
pool slots each sequence reads, the masks, which packed rows form which padded batch) is built
once by :func:`plan_attention`; each layer then does one ``index_copy_`` into the pool, one
``index_select`` of the keys and values its sequences read, and one
``scaled_dot_product_attention`` call per group, with no Python loop over sequences.

Shapes (one set of letters, as in ``reference``): N sequences, T packed query rows, Hq / Hkv
heads, D head dim, B block size, M pool blocks, P cached prefix length, L suffix length,
S = P + L keys of a sequence. Pools are ``[M, B, Hkv, D]`` (NHD).

Groups. Decode rows (L = 1) and extend rows (L > 1) go into separate padded batches, so a
long prefill chunk in the same step never pads every decode row to its length:

- a group of G sequences gathers ``[G, S_max]`` pool slots (padding repeats the sequence's
  key 0 and is masked out) and pads its queries to ``[G, L_max]`` rows;
- the mask is bottom-right aligned (suffix query j sits at position P + j and sees keys
  ``0 … P + j``), also masks padding keys and the sliding window, and is omitted when it
  would allow everything (equal lengths, decode, no window);
- a group of one sequence with no prefix and no window uses SDPA's own causal masking on the
  step's K/V (top-left and bottom-right alignment coincide when P = 0).

Every sequence's keys, its own suffix included, are read back from the pool after the write,
so the pool is the only source of K/V and the result equals the reference's within SDPA's
floating-point reordering (tests: ``tests/kernels/test_paged_sdpa.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["AttentionPlan", "plan_attention"]


@dataclass(frozen=True)
class _Group:
    """One padded batch of sequences that share a kind (decode or extend).

    Attributes:
        rows: ``[G * L_max]`` int64 packed query row of each padded query position (padding
            repeats a valid row of the group and is never written back).
        valid: ``[G * L_max]`` bool, False at padding; None when nothing is padded.
        kv_slots: ``[G * S_max]`` int64 flat pool slots (``block * B + offset``) each
            sequence reads (padding repeats its key 0); None when the group reads the step's
            own K/V (``causal_own``).
        mask: ``[G, 1, L_max, S_max]`` bool, True = may attend; None = attend to everything.
        num_seqs / max_q_len / max_kv_len: G, L_max, S_max.
        causal_own: one sequence with no prefix and no window: SDPA ``is_causal`` on the
            step's K/V rows, no pool read.
    """

    rows: torch.Tensor
    valid: torch.Tensor | None
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None
    num_seqs: int
    max_q_len: int
    max_kv_len: int
    causal_own: bool


class AttentionPlan:
    """Pool writes and attention of one forward step, prepared once and run per layer.

    Valid for the step it was built for: it holds the step's slot mapping and the block ids of
    its block tables; the pools may change between layers (that is the point), the metadata
    may not.
    """

    def __init__(self, slot_mapping: torch.Tensor, groups: list[_Group], num_tokens: int,
                 sm_scale: float, whole: bool) -> None:
        self.slot_mapping = slot_mapping
        self.groups = groups
        self.num_tokens = num_tokens
        self.sm_scale = sm_scale
        self._whole = whole

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> None:
        """Write the step's ``[T, Hkv, D]`` K/V rows into their pool slots, in place."""
        # 2-D row views ([M*B, Hkv*D]): torch's row copy is several times faster than on 3-D.
        flat, row = k_pool.shape[0] * k_pool.shape[1], k_pool.shape[2] * k_pool.shape[3]
        k_pool.view(flat, row).index_copy_(0, self.slot_mapping, k.reshape(-1, row).to(k_pool.dtype))
        v_pool.view(flat, row).index_copy_(0, self.slot_mapping, v.reshape(-1, row).to(v_pool.dtype))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor) -> torch.Tensor:
        """Write K/V, then attend every query row over its sequence's keys.

        Args:
            q: ``[T, Hq, D]`` queries; k / v: ``[T, Hkv, D]`` the same rows' keys and values.
            k_pool / v_pool: ``[M, B, Hkv, D]`` this layer's pools (written in place).

        Returns:
            ``[T, Hq, D]`` in q's dtype.
        """
        self.write_kv(k, v, k_pool, v_pool)
        if self._whole:
            return self._run(self.groups[0], q, k, v, k_pool, v_pool)
        out = torch.empty_like(q)
        for group in self.groups:
            rows_out = self._run(group, q, k, v, k_pool, v_pool)
            rows = group.rows if group.valid is None else group.rows[group.valid]
            out.index_copy_(0, rows, rows_out)
        return out

    def _run(self, group: _Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """``[rows of the group, Hq, D]`` outputs in packed order of ``group.rows[valid]``."""
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        g, lq, skv = group.num_seqs, group.max_q_len, group.max_kv_len
        if group.causal_own:
            rows = group.rows
            out = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None], is_causal=True, scale=self.sm_scale,
                enable_gqa=True)
            return out[0].transpose(0, 1)
        flat, row = k_pool.shape[0] * k_pool.shape[1], num_kv_heads * head_dim
        keys = k_pool.view(flat, row).index_select(0, group.kv_slots)
        values = v_pool.view(flat, row).index_select(0, group.kv_slots)
        # [G, S, Hkv, D] -> [G, Hkv, S, D] as a strided view: SDPA's CPU kernel takes strides.
        keys = keys.view(g, skv, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        values = values.view(g, skv, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        queries = q if self._whole else q.index_select(0, group.rows)
        queries = queries.view(g, lq, num_q_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                             scale=self.sm_scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(g * lq, num_q_heads, head_dim)
        return out if group.valid is None else out[group.valid]


def plan_attention(block_tables: torch.Tensor, prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                   slot_mapping: torch.Tensor, *, block_size: int, num_pool_slots: int,
                   head_dim: int, window_left: int = -1,
                   sm_scale: float | None = None) -> AttentionPlan:
    """Build a step's :class:`AttentionPlan` from its metadata (host tensors, checked here).

    Args:
        block_tables: ``[N, max_blocks]`` int block ids (-1 padding past a sequence's blocks).
        prefix_lens: ``[N]`` int P of each sequence, tokens already in the pool.
        qo_indptr: ``[N+1]`` int, sequence i owns query rows ``qo_indptr[i]:qo_indptr[i+1]``.
        slot_mapping: ``[T]`` int flat pool slot of each new row's K/V.
        block_size: B, tokens per block.
        num_pool_slots: ``M * B``.
        head_dim: D (default scale ``1 / sqrt(D)``).
        window_left: keys more than this many positions left of a query are masked; -1: none.
        sm_scale: softmax scale; None = ``1 / sqrt(D)``.

    Returns:
        The plan, its tensors on ``block_tables``' device.

    Raises:
        ValueError: naming the field, when ``qo_indptr`` does not run from 0 to T or
            decreases, a sequence has no rows, a slot is outside ``[0, num_pool_slots)``, or a
            block table misses a block its sequence reads.
    """
    device = block_tables.device
    num_tokens = int(slot_mapping.shape[0])
    indptr = [int(x) for x in qo_indptr.tolist()]
    prefix = [int(x) for x in prefix_lens.tolist()]
    if len(indptr) != len(prefix) + 1 or indptr[0] != 0 or indptr[-1] != num_tokens:
        raise ValueError(f"qo_indptr: must have N+1 = {len(prefix) + 1} entries from 0 to {num_tokens}")
    q_lens = [indptr[i + 1] - indptr[i] for i in range(len(prefix))]
    if min(q_lens) < 1:
        raise ValueError("qo_indptr: every sequence needs at least one query row")
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    if num_tokens and (int(slots.min()) < 0 or int(slots.max()) >= num_pool_slots):
        raise ValueError(f"slot_mapping: a slot is outside [0, {num_pool_slots})")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    extend = [i for i, n in enumerate(q_lens) if n > 1]
    groups = [_build_group(members, indptr, prefix, q_lens, block_tables, block_size,
                           num_pool_slots, window_left)
              for members in (decode, extend) if members]
    # A single unpadded group lists every row in packed order: its output is the layer's.
    whole = len(groups) == 1 and groups[0].valid is None
    return AttentionPlan(slots, groups, num_tokens, scale, whole)


def _build_group(members: list[int], indptr: list[int], prefix: list[int], q_lens: list[int],
                 block_tables: torch.Tensor, block_size: int, num_pool_slots: int,
                 window_left: int) -> _Group:
    """Padded rows, pool slots and mask of the sequences ``members`` (see module docstring)."""
    device = block_tables.device
    g = len(members)
    lq = max(q_lens[i] for i in members)
    kv_lens = [prefix[i] + q_lens[i] for i in members]
    skv = max(kv_lens)
    if g == 1 and prefix[members[0]] == 0 and window_left < 0:
        i = members[0]
        rows = torch.arange(indptr[i], indptr[i + 1], dtype=torch.int64, device=device)
        return _Group(rows, None, None, None, 1, lq, skv, causal_own=True)
    member_idx = torch.tensor(members, dtype=torch.int64, device=device)
    starts = torch.tensor([indptr[i] for i in members], dtype=torch.int64, device=device)
    q_len_t = torch.tensor([q_lens[i] for i in members], dtype=torch.int64, device=device)
    kv_len_t = torch.tensor(kv_lens, dtype=torch.int64, device=device)
    j = torch.arange(lq, dtype=torch.int64, device=device)
    valid = j[None, :] < q_len_t[:, None]                                   # [G, L_max]
    rows = starts[:, None] + torch.where(valid, j[None, :], torch.zeros_like(j)[None, :])
    positions = torch.arange(skv, dtype=torch.int64, device=device)
    num_blocks = -(-skv // block_size)
    if block_tables.shape[1] < num_blocks:
        # Shorter tables are fine as long as no member needs the missing columns.
        tables = torch.full((block_tables.shape[0], num_blocks), -1, dtype=torch.int64, device=device)
        tables[:, :block_tables.shape[1]] = block_tables.to(torch.int64)
    else:
        tables = block_tables[:, :num_blocks].to(torch.int64)
    blocks = tables.index_select(0, member_idx)[:, positions // block_size]  # [G, S_max]
    key_ok = positions[None, :] < kv_len_t[:, None]
    read = blocks[key_ok]
    if bool((read < 0).any()) or bool((read * block_size >= num_pool_slots).any()):
        raise ValueError("block_tables: a sequence reads a block its table does not hold")
    slots = blocks * block_size + positions % block_size
    # Padding keys repeat the sequence's own key 0: masked, but SDPA still multiplies their
    # values by a zero weight, and a never-written slot could hold a NaN.
    kv_slots = torch.where(key_ok, slots, slots[:, :1]).reshape(-1)
    mask = None
    uniform = all(n == kv_lens[0] for n in kv_lens) and lq == 1
    if not (uniform and window_left < 0):
        q_pos = torch.tensor([prefix[i] for i in members], dtype=torch.int64,
                             device=device)[:, None] + j[None, :]           # [G, L_max]
        allowed = (positions[None, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :]
        if window_left >= 0:
            allowed &= positions[None, None, :] >= q_pos[:, :, None] - window_left
        # A padding query row sees key 0 only: a row with no allowed key would be NaN.
        allowed[:, :, 0] |= ~valid
        mask = allowed[:, None]
    flat_valid = valid.reshape(-1)
    all_valid = bool(flat_valid.all())
    return _Group(rows.reshape(-1), None if all_valid else flat_valid, kv_slots, mask, g, lq, skv,
                  causal_own=False)

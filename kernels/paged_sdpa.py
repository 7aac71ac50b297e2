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

- a group of G sequences gathers whole pool blocks, ``[G, S_max / B]`` of them (S_max rounded
  up to whole blocks; a sequence with fewer blocks repeats its block 0), and pads its queries
  to ``[G, L_max]`` rows; gathered rows past a sequence's S are zeroed, since a masked key
  still meets a zero weight in ``P @ V`` and a stale NaN there would leak into the output;
- the mask is bottom-right aligned (suffix query j sits at position P + j and sees keys
  ``0 … P + j``), also masks padding keys and the sliding window, and is omitted when it
  would allow everything;
- a group of one sequence with no prefix and no window uses SDPA's own causal masking on the
  step's K/V (top-left and bottom-right alignment coincide when P = 0).

Cache-sized groups. A group's gathered K/V is written, then read back by SDPA: when it fits
in the last-level cache the read is nearly free; when it does not (batch 16 at 2k context is
50 MB per layer) the batch reads DRAM twice and loses to the per-sequence loop. So sequences
of one kind are cut, in order, into groups of at most ``chunk_kv_bytes`` of padded K/V
(:data:`DEFAULT_CHUNK_KV_BYTES`): one group for short contexts, about one sequence per
group for long ones, and the Python loop runs over groups, never over short sequences.

Native kernels. With ``native_kernels``, decode rows run the C decode kernel
(``native.paged_decode``); with ``native_extend``, every extend row runs the C extend kernel
(``native_attention.paged_extend``, FlashAttention-2 over the pool in place, fp32 or bf16
pools): no gather, no padding, no mask, and no SDPA group is left for those rows.

Every sequence's keys, its own suffix included, are read back from the pool after the write,
so the pool is the only source of K/V and the result equals the reference's within SDPA's
floating-point reordering (tests: ``tests/kernels/test_paged_sdpa.py``).

Quantized pools (``radixkv.kernels.kv_quant``: int8 / float8_e4m3fn values with ``[M, B, Hkv]``
fp32 scale pools, passed to :meth:`AttentionPlan.attend`): the write quantizes
(``kv_quant.quantize_kv``); a group gathers whole blocks of values and their scale rows and
dequantizes them to the queries' dtype; a ``causal_own`` group attends over the step's K/V as
stored (quantized, then dequantized), so every path reads what the pool holds. The C kernels
take quantized pools only where they say so (``native.KV_QUANT_FORMATS``; the caller decides:
:func:`native_quant_formats`), and are then passed the scale pools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native, native_attention
from .kv_quant import dequantize_kv, quantize_kv
from .reference import pool_kv_format, stored_kv

__all__ = ["AttentionPlan", "plan_attention", "DEFAULT_CHUNK_KV_BYTES", "native_quant_formats"]


def native_quant_formats() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(decode, extend)``: the quantized KV formats (``kv_quant`` names) the C decode and
    extend kernels read, from their modules' ``KV_QUANT_FORMATS`` (missing: none). A runner
    hands a quantized pool to a C kernel only when its format is listed here."""
    decode = tuple(getattr(native, "KV_QUANT_FORMATS", ()))
    extend = tuple(getattr(native_attention, "KV_QUANT_FORMATS", decode))
    return decode, extend

# Gathered K+V per group: half a 32 MiB L3. On 2 cores 2, 4, 16 and 64 MiB were within noise
# of each other at batch 4-16 and 512-8k context; the budget only matters on larger batches.
DEFAULT_CHUNK_KV_BYTES = 16 << 20


@dataclass(frozen=True)
class _Group:
    """One padded batch of sequences that share a kind (decode or extend).

    Attributes:
        rows: ``[G * L_max]`` int64 packed query row of each padded query position (padding
            repeats a valid row of the group and is never written back).
        valid: ``[G * L_max]`` bool, False at padding; None when nothing is padded.
        kv_blocks: ``[G * S_max / B]`` int64 pool blocks each sequence reads, in order
            (padding repeats its block 0); None when the group reads the step's own K/V
            (``causal_own``).
        pad_rows: ``[R]`` int64 rows of the gathered ``[G * S_max]`` keys past each
            sequence's length, zeroed after the gather; None when there are none.
        mask: ``[G, 1, L_max, S_max]`` bool, True = may attend; None = attend to everything.
        num_seqs / max_q_len / max_kv_len: G, L_max, S_max (a multiple of B, except for
            ``causal_own``).
        causal_own: one sequence with no prefix and no window: SDPA ``is_causal`` on the
            step's K/V rows, no pool read.
    """

    rows: torch.Tensor
    valid: torch.Tensor | None
    kv_blocks: torch.Tensor | None
    pad_rows: torch.Tensor | None
    mask: torch.Tensor | None
    num_seqs: int
    max_q_len: int
    max_kv_len: int
    causal_own: bool


@dataclass(frozen=True)
class _NativeDecode:
    """Decode rows (L = 1) for the C kernel (:func:`kernels.native.paged_decode`).

    Attributes:
        kernels: the loaded library.
        rows: ``[G]`` int64 packed query row of each decode sequence.
        block_tables: ``[G, max_blocks]`` int32 their block tables (checked by the plan).
        kv_lens: ``[G]`` int32 keys of each (P + 1).
        window_left: as :func:`plan_attention`'s.
    """

    kernels: native.NativeKernels
    rows: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    window_left: int


@dataclass(frozen=True)
class _NativeExtend:
    """Extend rows (L > 1) for the C kernel (:func:`kernels.native_attention.paged_extend`),
    read in place from the pool: no gather, no padding, no mask.

    Attributes:
        kernels: the loaded library.
        rows: ``[R]`` int64 packed query rows of the extend sequences, in their order; None
            when they are all the step's rows (0 … T-1).
        qo_indptr: ``[G+1]`` int64 offsets of each extend sequence within ``rows``.
        prefix_lens: ``[G]`` int32 P of each.
        block_tables: ``[G, blocks]`` int32 their block tables (checked by the plan).
        window_left: as :func:`plan_attention`'s.
    """

    kernels: native.NativeKernels
    rows: torch.Tensor | None
    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    block_tables: torch.Tensor
    window_left: int


class AttentionPlan:
    """Pool writes and attention of one forward step, prepared once and run per layer.

    Valid for the step it was built for: it holds the step's slot mapping and the block ids of
    its block tables; the pools may change between layers (that is the point), the metadata
    may not.
    """

    def __init__(self, slot_mapping: torch.Tensor, groups: list[_Group], num_tokens: int,
                 sm_scale: float, whole: bool, native: _NativeDecode | None = None,
                 native_extend: _NativeExtend | None = None,
                 native_write: native.NativeKernels | None = None) -> None:
        self.slot_mapping = slot_mapping
        self.groups = groups
        self.native_write = native_write
        # Only a causal_own group reads the step's own K/V rows (every other path reads the pool).
        self._own_rows = any(g.causal_own for g in groups)
        self.native = native
        self.native_extend = native_extend
        self.num_tokens = num_tokens
        self.sm_scale = sm_scale
        self._whole = whole
        self._out_rows = [g.rows if g.valid is None else g.rows[g.valid] for g in groups]
        # Gather buffers per group, allocated at the first layer and reused by the others: a
        # fresh multi-MB tensor per layer costs page faults that took longer than the copy.
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's ``[T, Hkv, D]`` K/V rows into their pool slots, in place.

        A quantized pool (int8 / float8_e4m3fn, with its ``[M, B, Hkv]`` fp32 ``k_scales`` /
        ``v_scales``) stores ``kv_quant.quantize_kv`` of the rows and their scales (through the
        C write, ``native.paged_kv_write``, when the plan has ``native_write``: the same bytes).

        Returns:
            ``(k, v)`` as a ``causal_own`` group must read the step's own rows: the rows
            themselves for an unquantized pool, else their dequantized values in k's dtype
            (computed only when the plan has such a group; nothing else reads them).

        Raises:
            ValueError: naming ``k_scales`` when a quantized pool comes without scale pools.
        """
        # 2-D row views ([M*B, Hkv*D]): torch's row copy is several times faster than on 3-D.
        flat, row = k_pool.shape[0] * k_pool.shape[1], k_pool.shape[2] * k_pool.shape[3]
        fmt = pool_kv_format(k_pool)
        if fmt is None:
            k_pool.view(flat, row).index_copy_(0, self.slot_mapping, k.reshape(-1, row).to(k_pool.dtype))
            v_pool.view(flat, row).index_copy_(0, self.slot_mapping, v.reshape(-1, row).to(v_pool.dtype))
            return k, v
        if k_scales is None or v_scales is None:
            raise ValueError(f"k_scales: a {k_pool.dtype} pool needs its [M, B, Hkv] fp32 scale pools")
        if self.native_write is not None:  # quantize + scatter in C, tokens in parallel
            native.paged_kv_write(self.native_write, k, v, k_pool, v_pool, self.slot_mapping,
                                  k_scales=k_scales, v_scales=v_scales)
            if not self._own_rows:
                return k, v
            return stored_kv(k, fmt, k.dtype), stored_kv(v, fmt, v.dtype)
        stored = []
        for x, pool, scales in ((k, k_pool, k_scales), (v, v_pool, v_scales)):
            values, scale = quantize_kv(x, fmt)
            raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool  # no fp8 index_copy_
            raw.view(flat, row).index_copy_(0, self.slot_mapping,
                                            values.reshape(-1, row).view(raw.dtype))
            scales.view(flat, scales.shape[2]).index_copy_(0, self.slot_mapping, scale)
            if self._own_rows:
                stored.append(dequantize_kv(values, scale, x.dtype))
        return (stored[0], stored[1]) if stored else (k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Write K/V, then attend every query row over its sequence's keys.

        Args:
            q: ``[T, Hq, D]`` queries; k / v: ``[T, Hkv, D]`` the same rows' keys and values.
            k_pool / v_pool: ``[M, B, Hkv, D]`` this layer's pools (written in place).
            k_scales / v_scales: ``[M, B, Hkv]`` fp32 scale pools of a quantized (int8 /
                float8_e4m3fn) pool, written in place; None for an unquantized pool.

        Returns:
            ``[T, Hq, D]`` in q's dtype.
        """
        k, v = self.write_kv(k, v, k_pool, v_pool, k_scales, v_scales)
        if self._whole:
            return self._run(self.groups[0], q, k, v, k_pool, v_pool, k_scales, v_scales)
        ne = self.native_extend
        if ne is not None and ne.rows is None and q.dtype == torch.float32:
            # Every row is an extend row: the kernel writes the layer's output directly, reading
            # q in place when it is a row-strided view (the fused qkv projection's output).
            return self._run_native_extend(ne, q if native_attention.rows_packed(q) else q.contiguous(),
                                           k_pool, v_pool, k_scales, v_scales)
        out = torch.empty_like(q)
        if ne is not None:
            queries = q if ne.rows is None else q.index_select(0, ne.rows)
            result = self._run_native_extend(ne, queries.float().contiguous(), k_pool, v_pool,
                                             k_scales, v_scales)
            if ne.rows is None:
                out.copy_(result)
            else:
                out.index_copy_(0, ne.rows, result.to(out.dtype))
        nd = self.native
        if nd is not None:  # decode rows: read in place from the pool, written straight to out
            native.paged_decode(nd.kernels, q.contiguous(), nd.rows, k_pool, v_pool, nd.block_tables,
                                nd.kv_lens, sm_scale=self.sm_scale, window_left=nd.window_left,
                                out=out, k_scales=k_scales, v_scales=v_scales)
        for group, rows in zip(self.groups, self._out_rows):
            out.index_copy_(0, rows, self._run(group, q, k, v, k_pool, v_pool, k_scales, v_scales))
        return out

    def _run_native_extend(self, ne: _NativeExtend, q: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, k_scales: torch.Tensor | None,
                           v_scales: torch.Tensor | None) -> torch.Tensor:
        """``[R, Hq, D]`` fp32 outputs of the extend rows (``q``: those rows, fp32, each
        token's ``[Hq, D]`` contiguous; ``k_scales`` / ``v_scales``: the scale pools of a
        quantized pool, else None)."""
        out = torch.empty(q.shape, dtype=torch.float32)
        native_attention.launch(ne.kernels, q, ne.qo_indptr, ne.prefix_lens, k_pool, v_pool,
                                ne.block_tables, sm_scale=self.sm_scale, window_left=ne.window_left,
                                out=out, k_scales=k_scales, v_scales=v_scales)
        return out

    def _run(self, group: _Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_pool: torch.Tensor, v_pool: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows of the group, Hq, D]`` outputs in packed order of ``group.rows[valid]``
        (``k`` / ``v``: the step's rows as the pool holds them, dequantized for a quantized
        pool; ``k_scales`` / ``v_scales``: its scale pools)."""
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
        num_blocks, block_row = k_pool.shape[0], k_pool.shape[1] * num_kv_heads * head_dim
        kv_blocks = group.kv_blocks
        assert kv_blocks is not None  # set unless causal_own (returned above)
        buffers = self._buffers.get(id(group))
        if buffers is None or buffers[0].dtype != k_pool.dtype:
            buffers = (torch.empty(kv_blocks.shape[0], block_row, dtype=k_pool.dtype, device=k_pool.device),
                       torch.empty(kv_blocks.shape[0], block_row, dtype=k_pool.dtype, device=k_pool.device))
            self._buffers[id(group)] = buffers
        # Whole blocks (B * Hkv * D contiguous values each): far faster than per-token rows.
        keys = torch.index_select(k_pool.view(num_blocks, block_row), 0, kv_blocks, out=buffers[0])
        values = torch.index_select(v_pool.view(num_blocks, block_row), 0, kv_blocks, out=buffers[1])
        if k_scales is not None and v_scales is not None:
            # Each gathered block dequantized with its own scale rows ([B, Hkv] per block).
            scale_row = k_scales.shape[1] * num_kv_heads
            keys = dequantize_kv(keys.view(g * skv, num_kv_heads, head_dim),
                                 k_scales.view(num_blocks, scale_row).index_select(0, kv_blocks)
                                 .view(g * skv, num_kv_heads), q.dtype)
            values = dequantize_kv(values.view(g * skv, num_kv_heads, head_dim),
                                   v_scales.view(num_blocks, scale_row).index_select(0, kv_blocks)
                                   .view(g * skv, num_kv_heads), q.dtype)
        keys, values = keys.view(g * skv, -1), values.view(g * skv, -1)
        if group.pad_rows is not None:
            # Masked keys still meet a zero weight in P @ V: a stale NaN there would leak.
            keys.index_fill_(0, group.pad_rows, 0)
            values.index_fill_(0, group.pad_rows, 0)
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
                   slot_mapping: torch.Tensor, *, block_size: int, num_pool_blocks: int,
                   head_dim: int, window_left: int = -1, sm_scale: float | None = None,
                   kv_bytes_per_token: int = 0,
                   chunk_kv_bytes: int = DEFAULT_CHUNK_KV_BYTES,
                   native_kernels: native.NativeKernels | None = None,
                   native_extend: native.NativeKernels | None = None,
                   native_write: native.NativeKernels | None = None) -> AttentionPlan:
    """Build a step's :class:`AttentionPlan` from its metadata (host tensors, checked here).

    Args:
        block_tables: ``[N, max_blocks]`` int block ids (-1 padding past a sequence's blocks).
        prefix_lens: ``[N]`` int P of each sequence, tokens already in the pool.
        qo_indptr: ``[N+1]`` int, sequence i owns query rows ``qo_indptr[i]:qo_indptr[i+1]``.
        slot_mapping: ``[T]`` int flat pool slot of each new row's K/V.
        block_size: B, tokens per block.
        num_pool_blocks: M.
        head_dim: D (default scale ``1 / sqrt(D)``).
        window_left: keys more than this many positions left of a query are masked; -1: none.
        sm_scale: softmax scale; None = ``1 / sqrt(D)``.
        kv_bytes_per_token: K+V bytes of one token in one layer (``2 * Hkv * D * itemsize``);
            0 puts every sequence of a kind in one group.
        chunk_kv_bytes: most gathered K+V bytes per group (a lone longer sequence is a group
            of its own); see the module docstring.
        native_kernels: when given (fp32 or bf16 pools and queries; heads as
            :func:`kernels.native.decode_supported` allows), decode rows run the C kernel over
            the pool in place instead of a gather and SDPA.
        native_extend: when given (fp32 or bf16 pools; heads as
            :func:`kernels.native_attention.extend_supported` allows, the caller's check),
            every extend row (L > 1: prefills, suffixes after a prefix hit, prefill chunks)
            runs the C extend kernel over the pool in place instead of a gather and SDPA.
        native_write: when given, a quantized pool's K/V write runs in C
            (``native.paged_kv_write``: ``kv_quant.quantize_kv``'s bytes, tokens in parallel)
            instead of torch's quantize and scatter; unquantized writes are unchanged.

    Returns:
        The plan, its tensors on ``block_tables``' device.

    Raises:
        ValueError: naming the field, when ``qo_indptr`` does not run from 0 to T or
            decreases, a sequence has no rows, a slot is outside the pool, or a block table
            misses a block its sequence reads.
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
    if num_tokens and (int(slots.min()) < 0 or int(slots.max()) >= num_pool_blocks * block_size):
        raise ValueError(f"slot_mapping: a slot is outside [0, {num_pool_blocks * block_size})")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    tables = block_tables.to(torch.int64)
    groups = []
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    extend = [i for i, n in enumerate(q_lens) if n > 1]
    native_decode = None
    if native_kernels is not None and decode:
        native_decode = _native_decode(native_kernels, decode, indptr, prefix, tables, block_size,
                                       num_pool_blocks, window_left)
        decode = []
    native_ext = None
    if native_extend is not None and extend:
        native_ext = _native_extend(native_extend, extend, indptr, prefix, q_lens, tables, block_size,
                                    num_pool_blocks, window_left, num_tokens)
        extend = []
    for kind in (decode, extend):
        for members in _chunks(kind, prefix, q_lens, block_size, kv_bytes_per_token, chunk_kv_bytes):
            groups.append(_build_group(members, indptr, prefix, q_lens, tables, block_size,
                                       num_pool_blocks, window_left))
    # A single unpadded group lists every row in packed order: its output is the layer's.
    whole = native_decode is None and native_ext is None and len(groups) == 1 and groups[0].valid is None
    return AttentionPlan(slots, groups, num_tokens, scale, whole, native_decode, native_ext,
                         native_write)


def _native_decode(kernels: native.NativeKernels, members: list[int], indptr: list[int],
                   prefix: list[int], tables: torch.Tensor, block_size: int, num_pool_blocks: int,
                   window_left: int) -> _NativeDecode:
    """The decode rows' metadata for the C kernel, block ids checked here once per step (the
    kernel trusts them)."""
    kv_lens = [prefix[i] + 1 for i in members]
    num_blocks = -(-max(kv_lens) // block_size)
    if tables.shape[1] < num_blocks:
        raise ValueError("block_tables: a sequence reads a block its table does not hold")
    member_idx = torch.tensor(members, dtype=torch.int64)
    sub = tables.index_select(0, member_idx)[:, :num_blocks]
    lens_t = torch.tensor(kv_lens, dtype=torch.int64)
    read = sub[torch.arange(num_blocks)[None, :] * block_size < lens_t[:, None]]
    if bool((read < 0).any()) or bool((read >= num_pool_blocks).any()):
        raise ValueError("block_tables: a sequence reads a block its table does not hold")
    rows = torch.tensor([indptr[i] for i in members], dtype=torch.int64)
    return _NativeDecode(kernels, rows, sub.to(torch.int32).contiguous(),
                         lens_t.to(torch.int32), window_left)


def _checked_tables(members: list[int], kv_lens: list[int], tables: torch.Tensor, block_size: int,
                    num_pool_blocks: int) -> torch.Tensor:
    """``[G, blocks]`` int32 contiguous tables of ``members``, cut to the blocks the longest
    reads; every block a member reads checked to be a pool block (the C kernels trust them)."""
    num_blocks = -(-max(kv_lens) // block_size)
    if tables.shape[1] < num_blocks:
        raise ValueError("block_tables: a sequence reads a block its table does not hold")
    sub = tables.index_select(0, torch.tensor(members, dtype=torch.int64))[:, :num_blocks]
    lens_t = torch.tensor(kv_lens, dtype=torch.int64)
    read = sub[torch.arange(num_blocks)[None, :] * block_size < lens_t[:, None]]
    if bool((read < 0).any()) or bool((read >= num_pool_blocks).any()):
        raise ValueError("block_tables: a sequence reads a block its table does not hold")
    return sub.to(torch.int32).contiguous()


def _native_extend(kernels: native.NativeKernels, members: list[int], indptr: list[int],
                   prefix: list[int], q_lens: list[int], tables: torch.Tensor, block_size: int,
                   num_pool_blocks: int, window_left: int, num_tokens: int) -> _NativeExtend:
    """The extend rows' metadata for the C kernel, block ids checked here once per step."""
    sub = _checked_tables(members, [prefix[i] + q_lens[i] for i in members], tables, block_size,
                          num_pool_blocks)
    offsets = [0]
    for i in members:
        offsets.append(offsets[-1] + q_lens[i])
    rows = None
    if offsets[-1] != num_tokens:  # members' rows are in packed order; all rows: no index
        rows = torch.cat([torch.arange(indptr[i], indptr[i + 1], dtype=torch.int64) for i in members])
    return _NativeExtend(kernels, rows, torch.tensor(offsets, dtype=torch.int64),
                         torch.tensor([prefix[i] for i in members], dtype=torch.int32), sub, window_left)


def _chunks(members: list[int], prefix: list[int], q_lens: list[int], block_size: int,
            kv_bytes_per_token: int, chunk_kv_bytes: int) -> list[list[int]]:
    """``members`` cut in order into runs whose padded K+V fits ``chunk_kv_bytes``."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in members:
        padded = -(-(prefix[i] + q_lens[i]) // block_size) * block_size
        longest_if = max(longest, padded)
        group_bytes = (len(current) + 1) * longest_if * kv_bytes_per_token
        if current and group_bytes > chunk_kv_bytes:
            chunks.append(current)
            current, longest_if = [], padded
        current.append(i)
        longest = longest_if
    if current:
        chunks.append(current)
    return chunks


def _build_group(members: list[int], indptr: list[int], prefix: list[int], q_lens: list[int],
                 tables: torch.Tensor, block_size: int, num_pool_blocks: int,
                 window_left: int) -> _Group:
    """Padded rows, pool blocks, padding rows and mask of ``members`` (module docstring)."""
    device = tables.device
    g = len(members)
    lq = max(q_lens[i] for i in members)
    kv_lens = [prefix[i] + q_lens[i] for i in members]
    if g == 1 and prefix[members[0]] == 0 and window_left < 0:
        i = members[0]
        rows = torch.arange(indptr[i], indptr[i + 1], dtype=torch.int64, device=device)
        return _Group(rows, None, None, None, None, 1, lq, kv_lens[0], causal_own=True)
    num_blocks = -(-max(kv_lens) // block_size)
    skv = num_blocks * block_size
    member_idx = torch.tensor(members, dtype=torch.int64, device=device)
    starts = torch.tensor([indptr[i] for i in members], dtype=torch.int64, device=device)
    q_len_t = torch.tensor([q_lens[i] for i in members], dtype=torch.int64, device=device)
    kv_len_t = torch.tensor(kv_lens, dtype=torch.int64, device=device)
    j = torch.arange(lq, dtype=torch.int64, device=device)
    valid = j[None, :] < q_len_t[:, None]                                   # [G, L_max]
    rows = starts[:, None] + torch.where(valid, j[None, :], torch.zeros_like(j)[None, :])
    if tables.shape[1] < num_blocks:
        # Shorter tables are fine as long as no member needs the missing columns.
        tables = torch.cat([tables, tables.new_full((tables.shape[0], num_blocks - tables.shape[1]), -1)], 1)
    blocks = tables.index_select(0, member_idx)[:, :num_blocks]             # [G, blocks]
    block_ok = torch.arange(num_blocks, device=device)[None, :] * block_size < kv_len_t[:, None]
    read = blocks[block_ok]
    if bool((read < 0).any()) or bool((read >= num_pool_blocks).any()):
        raise ValueError("block_tables: a sequence reads a block its table does not hold")
    # Padding blocks repeat the sequence's block 0 (a valid id); their rows are zeroed below.
    gather_blocks = torch.where(block_ok, blocks, blocks[:, :1]).reshape(-1)
    positions = torch.arange(skv, dtype=torch.int64, device=device)
    key_ok = positions[None, :] < kv_len_t[:, None]                         # [G, S_pad]
    pad_rows = (~key_ok).reshape(-1).nonzero().reshape(-1)
    mask = None
    if not (lq == 1 and window_left < 0 and pad_rows.numel() == 0):
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
    return _Group(rows.reshape(-1), None if all_valid else flat_valid, gather_blocks,
                  pad_rows if pad_rows.numel() else None, mask, g, lq, skv, causal_own=False)

"""KV bytes per token and what a memory budget holds, from a :class:`KVLayout` (no torch).

Formulas (per tensor-parallel rank; ``bytes`` is the KV dtype's element size):

- MHA / GQA / MQA layer: ``2 × Hkv_rank × D × bytes`` (K and V), plus for int8 / fp8_e4m3
  ``2 × Hkv_rank × 4`` (one fp32 scale per token and KV head for K and for V:
  ``kernels/kv_quant.py``, ``KVFormat.bytes_per_token``). ``Hkv_rank = max(1, Hkv / TP)``: with
  fewer KV heads than ranks each rank keeps a replica of one head (Megatron-style attention
  sharding splits heads, never a head's dims).
- MLA layer: ``(kv_lora_rank + qk_rope_head_dim) × bytes``, ONE latent (it is both K and V
  before the up-projections; DeepSeek-V2, arXiv:2405.04434, sec. 2.1), plus 4 bytes of scale
  for int8 / fp8 (the latent as one head). Every rank keeps the whole latent.
- A sequence of ``L`` tokens holds ``ceil(L / B)`` blocks in a full or MLA layer, and at most
  ``ceil((W - 1) / B) + 1`` in a sliding-window layer (the last W tokens, unaligned, span one
  more block than ``W / B``), fewer when ``L`` is shorter.

radixkv's own pool keeps every layer's K/V of every token in one block
(``ModelRunner.bytes_per_block_for``: ``B × kv_bytes_per_token``), so ``num_blocks`` counts
those blocks; ``concurrent_seqs_all_tokens_kept`` is what that pool holds, and
``concurrent_seqs_at_max_model_len`` what an engine that frees out-of-window blocks holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import FLOAT_DTYPE_BYTES, MLA, SLIDING, KVLayout, LayerGroup

__all__ = ["GIB", "KV_DTYPE_BYTES", "QUANTIZED_KV_DTYPES", "PLAN_KV_CACHE_DTYPES",
           "MemoryBudget", "GroupCost", "CapacityPlan", "resolve_kv_cache_dtype",
           "kv_heads_per_rank", "group_cost", "memory_budget", "plan_capacity"]

GIB = 1 << 30
#: Element bytes of each KV dtype ``radixkv plan`` prices.
KV_DTYPE_BYTES = {**FLOAT_DTYPE_BYTES, "int8": 1, "fp8_e4m3": 1}
#: Dtypes stored with one fp32 scale per token and KV head (``kernels/kv_quant.py``).
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
SCALE_BYTES = 4
#: ``--kv-cache-dtype`` choices of ``radixkv plan`` (serve's, plus float16 for GPU configs).
PLAN_KV_CACHE_DTYPES = ("auto", *KV_DTYPE_BYTES)


def resolve_kv_cache_dtype(kv_cache_dtype: str, layout: KVLayout) -> str:
    """``auto`` -> the layout's ``torch_dtype``; any other value of :data:`PLAN_KV_CACHE_DTYPES`
    as given.

    Raises:
        ValueError: naming ``kv_cache_dtype`` for a value outside the choices.
    """
    if kv_cache_dtype not in PLAN_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {', '.join(PLAN_KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return layout.torch_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one of ``tp`` ranks stores: ``Hkv / tp``, or 1 (a replica) when ``Hkv < tp``.

    Raises:
        ValueError: naming ``tp`` when neither divides the other (heads cannot be split evenly).
    """
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"tp: {tp} does not divide the {num_kv_heads} KV heads")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"tp: {tp} is not a multiple of the {num_kv_heads} KV heads "
                         f"(each head would be replicated unevenly)")
    return 1


@dataclass(frozen=True)
class GroupCost:
    """One layer group's KV cost per rank.

    Attributes:
        group: the layers.
        kv_heads_per_rank: Hkv on one rank (MLA: 1, the latent).
        bytes_per_token_per_layer: K+V (or latent) bytes of one token in one layer, scales
            included.
        bytes_per_token: ``bytes_per_token_per_layer × num_layers``.
        formula: the per-layer product written out, e.g. ``2 × 8 × 128 × 2``.
        blocks_per_seq: blocks one sequence of ``max_model_len`` tokens holds in these layers
            (window-bounded for a sliding group); None without a ``max_model_len``.
    """

    group: LayerGroup
    kv_heads_per_rank: int
    bytes_per_token_per_layer: int
    bytes_per_token: int
    formula: str
    blocks_per_seq: int | None


def group_cost(group: LayerGroup, kv_dtype: str, *, tp: int = 1, block_size: int = 16,
               max_model_len: int | None = None) -> GroupCost:
    """The module docstring's formulas for one group (``kv_dtype`` already resolved).

    Raises:
        ValueError: naming ``tp`` (:func:`kv_heads_per_rank`) or ``kv_dtype``.
    """
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype: must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    itemsize = KV_DTYPE_BYTES[kv_dtype]
    quantized = kv_dtype in QUANTIZED_KV_DTYPES
    if group.kind == MLA:
        heads = 1
        width = group.kv_lora_rank + group.qk_rope_head_dim
        per_layer = width * itemsize + (SCALE_BYTES if quantized else 0)
        formula = f"({group.kv_lora_rank} + {group.qk_rope_head_dim}) × {itemsize}"
        if quantized:
            formula += f" + {SCALE_BYTES}"
    else:
        heads = kv_heads_per_rank(group.num_kv_heads, tp)
        per_layer = 2 * heads * group.head_dim * itemsize + (2 * heads * SCALE_BYTES if quantized else 0)
        formula = f"2 × {heads} × {group.head_dim} × {itemsize}"
        if quantized:
            formula += f" + 2 × {heads} × {SCALE_BYTES}"
    blocks = None
    if max_model_len is not None:
        blocks = -(-max_model_len // block_size)
        if group.kind == SLIDING and group.window_tokens is not None:
            blocks = min(blocks, -(-(group.window_tokens - 1) // block_size) + 1)
    return GroupCost(group, heads, per_layer, per_layer * group.num_layers, formula, blocks)


@dataclass(frozen=True)
class MemoryBudget:
    """KV memory of one rank and how it was derived.

    Attributes:
        kv_memory_bytes: bytes for the KV pool on one rank.
        device_memory_bytes: the device's memory (None when the KV memory was given directly).
        memory_utilization: share of it radixkv may use, in (0, 1].
        weights_bytes: the model's weights over all ranks (one rank holds ``/ tp``).
        workspace_bytes: activations and other non-KV memory of one rank.
    """

    kv_memory_bytes: int
    device_memory_bytes: int | None = None
    memory_utilization: float | None = None
    weights_bytes: int | None = None
    workspace_bytes: int | None = None


def memory_budget(*, device_memory_gib: float, memory_utilization: float, weights_bytes: int,
                  workspace_gib: float, tp: int = 1) -> MemoryBudget:
    """``device × utilization − weights / tp − workspace`` for one rank.

    Raises:
        ValueError: naming ``device_memory_gib`` when nothing is left for the KV cache, or the
            field that is out of range.
    """
    if not device_memory_gib > 0:
        raise ValueError(f"device_memory_gib: must be > 0, got {device_memory_gib!r}")
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization: must be in (0, 1], got {memory_utilization!r}")
    if weights_bytes < 0 or not workspace_gib >= 0:
        raise ValueError(f"weights_bytes / workspace_gib: must be >= 0, got {weights_bytes!r}, "
                         f"{workspace_gib!r}")
    device = int(device_memory_gib * GIB)
    workspace = int(workspace_gib * GIB)
    kv_bytes = int(device * memory_utilization) - -(-weights_bytes // tp) - workspace
    if kv_bytes <= 0:
        raise ValueError(f"device_memory_gib: {device_memory_gib} GiB × {memory_utilization} leaves "
                         f"nothing for the KV cache after {weights_bytes / tp / GIB:.2f} GiB of "
                         f"weights per rank and {workspace_gib} GiB of workspace")
    return MemoryBudget(kv_bytes, device, memory_utilization, weights_bytes, workspace)


@dataclass(frozen=True)
class CapacityPlan:
    """What one rank's KV memory holds.

    Attributes:
        layout: the model.
        kv_cache_dtype: the resolved KV dtype.
        tp, block_size: tensor-parallel ranks; tokens per block (B).
        max_model_len: tokens of the worst-case sequence; None if neither given nor in the config.
        groups: per layer group costs.
        bytes_per_token: K+V bytes of one token over all layers on one rank (radixkv's
            ``kv_bytes_per_token`` at ``tp = 1``).
        bytes_per_block: ``block_size × bytes_per_token`` (radixkv's ``bytes_per_block``).
        bytes_per_seq: one ``max_model_len`` sequence, sliding groups bounded by their window.
        bytes_per_seq_all_tokens_kept: the same with every layer keeping every token.
        budget: the memory budget, or None (bytes only).
        num_blocks: blocks of ``bytes_per_block`` in the budget; num_tokens: ``× B``.
        concurrent_seqs_at_max_model_len: ``kv_memory // bytes_per_seq``.
        concurrent_seqs_all_tokens_kept: ``num_blocks // ceil(max_model_len / B)`` (radixkv's
            pool, which keeps every layer of every token).
    """

    layout: KVLayout
    kv_cache_dtype: str
    tp: int
    block_size: int
    max_model_len: int | None
    groups: tuple[GroupCost, ...]
    bytes_per_token: int
    bytes_per_block: int
    bytes_per_seq: int | None
    bytes_per_seq_all_tokens_kept: int | None
    budget: MemoryBudget | None = None
    num_blocks: int | None = None
    num_tokens: int | None = None
    concurrent_seqs_at_max_model_len: int | None = None
    concurrent_seqs_all_tokens_kept: int | None = None


def plan_capacity(layout: KVLayout, *, kv_cache_dtype: str = "auto", tp: int = 1,
                  block_size: int = 16, max_model_len: int | None = None,
                  budget: MemoryBudget | None = None) -> CapacityPlan:
    """Bytes per token per layer group and, with a budget, blocks, tokens and worst-case
    concurrency (module docstring).

    Args:
        layout: the model's KV layout.
        kv_cache_dtype: one of :data:`PLAN_KV_CACHE_DTYPES`.
        tp: tensor-parallel ranks (>= 1).
        block_size: tokens per block (B, >= 1).
        max_model_len: worst-case sequence tokens; None = the config's
            ``max_position_embeddings``.
        budget: one rank's KV memory; None for bytes only.

    Raises:
        ValueError: naming ``kv_cache_dtype``, ``tp``, ``block_size`` or ``max_model_len``.
    """
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, layout)
    for name, value in (("tp", tp), ("block_size", block_size)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
    if max_model_len is None:
        max_model_len = layout.max_position_embeddings
    elif type(max_model_len) is not int or max_model_len < 1:
        raise ValueError(f"max_model_len: must be an int >= 1, got {max_model_len!r}")
    costs = tuple(group_cost(g, dtype, tp=tp, block_size=block_size, max_model_len=max_model_len)
                  for g in layout.groups)
    per_token = sum(c.bytes_per_token for c in costs)
    per_block = block_size * per_token
    per_seq = per_seq_all = None
    if max_model_len is not None:
        blocks_all = -(-max_model_len // block_size)
        per_seq = sum(block_size * c.bytes_per_token * (c.blocks_per_seq or 0) for c in costs)
        per_seq_all = blocks_all * per_block
    plan = CapacityPlan(layout, dtype, tp, block_size, max_model_len, costs, per_token, per_block,
                        per_seq, per_seq_all)
    if budget is None:
        return plan
    num_blocks = budget.kv_memory_bytes // per_block
    seqs = seqs_all = None
    if per_seq is not None and per_seq_all is not None:
        seqs = budget.kv_memory_bytes // per_seq
        seqs_all = num_blocks // -(-max_model_len // block_size) if max_model_len else None
    return CapacityPlan(layout, dtype, tp, block_size, max_model_len, costs, per_token, per_block,
                        per_seq, per_seq_all, budget, num_blocks, num_blocks * block_size, seqs,
                        seqs_all)

"""What a prefix hit can reuse on a model with sliding-window layers: its layer groups.

Layers group by attention kind: full attention, or a sliding window of W tokens (a query at
position p attends to keys ``[p - W + 1, p]``). The K/V of a cached position depends on every
token before it whatever the window (the layers below carry it forward), so a block computed
for a prefix is the right K/V for that prefix under any layer kind; what differs per group is
which blocks a later suffix *reads*: a full layer every block of ``[0, m)``, a window layer
only those overlapping ``[m - W + 1, m)``.

Two residency rules (``--sliding-window-kv``): ``keep-all`` keeps every block of every layer
for the whole sequence (one block table indexes all layers), so a hit ends at any multiple of
the block size, as on a full-attention model; ``window`` gives the window layers a pool of
their own in which a request holds only the blocks of its window (KV groups;
``radixkv.cache.window_cache``), so a hit also needs the window's blocks before it cached.
``docs/sliding-window.md`` describes both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixkv.cache.window_rules import window_blocks_needed
from radixkv.config import GIB, CacheConfig, EngineConfig
from radixkv.log import get_logger
from radixkv.model.config import ModelShape

log = get_logger(__name__)

__all__ = ["WINDOW_KV_KEEP_ALL", "WINDOW_KV_WINDOW", "grouped_pool_sizes", "hit_granularity",
           "concurrent_windows", "layer_groups", "max_window_chunk_tokens", "plan_window_pools",
           "window_kv_mode"]

#: Every block of every layer stays for the whole sequence and while cached (window layers'
#: out-of-window blocks included).
WINDOW_KV_KEEP_ALL = "keep-all"
#: KV groups: window layers hold only each request's window (and cached resume points).
WINDOW_KV_WINDOW = "window"


def window_kv_mode(requested: str, shape: ModelShape) -> str:
    """The residency rule in force: ``window`` only for a model with window layers (a
    full-attention model has nothing to bound: ``keep-all``)."""
    if requested == WINDOW_KV_WINDOW and any(w >= 0 for w in shape.layer_window_lefts):
        return WINDOW_KV_WINDOW
    return WINDOW_KV_KEEP_ALL


def grouped_pool_sizes(cache: CacheConfig, shape: ModelShape, bytes_per_block: int,
                       budget_bytes: int) -> tuple[int, int]:
    """``(num_blocks, window_num_blocks)``: the full-attention and window pools' sizes in
    blocks under KV groups.

    With ``cache.num_blocks`` given, the full pool has that many and the window pool
    ``cache.window_num_blocks`` (default ``num_blocks + 1``: never shorter than the full one).
    Otherwise ``budget_bytes`` is split: ``window_kv_fraction`` of it to the window layers,
    the rest to the full-attention layers, each at its layers' share of ``bytes_per_block``
    (every layer's K/V has the same size).

    Args:
        bytes_per_block: K+V bytes of one block over all layers (the keep-all block).
        budget_bytes: KV memory for both pools.

    Raises:
        ValueError: naming ``window_kv_fraction`` (or ``window_num_blocks``) when the window
            pool cannot hold one request's window, a block of slack and a one-block chunk
            (``ceil((W - 1) / B) + 5`` blocks), or ``kv_cache_memory_bytes`` when the full
            pool gets no block.
    """
    lefts = shape.layer_window_lefts
    num_window_layers = sum(1 for w in lefts if w >= 0)
    per_layer = bytes_per_block // len(lefts)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
        window_num_blocks = cache.window_num_blocks or num_blocks + 1
        field = "window_num_blocks"
    elif cache.window_num_blocks is not None:
        window_num_blocks = cache.window_num_blocks
        num_blocks = (budget_bytes - window_num_blocks * per_layer * num_window_layers) // (
            per_layer * (len(lefts) - num_window_layers) or 1)
        field = "window_num_blocks"
    else:
        window_bytes = int(budget_bytes * cache.window_kv_fraction)
        window_num_blocks = window_bytes // (per_layer * num_window_layers)
        full_layers = len(lefts) - num_window_layers
        # A model whose every layer is windowed (Mistral) has no full-attention pool: the
        # tree's block ids then index no memory; as many as one layer's share would hold.
        num_blocks = (budget_bytes - window_bytes) // (per_layer * (full_layers or 1))
        field = "window_kv_fraction"
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes: {budget_bytes} bytes leave no block for the "
                         f"full-attention layers")
    window_tokens = max(lefts) + 1
    least = window_blocks_needed(window_tokens, cache.block_size) + 5
    if window_num_blocks < least:
        fix = (f"at least {least} blocks (--window-num-blocks)" if field == "window_num_blocks"
               else f"at least {least * per_layer * num_window_layers / GIB:.3f} GiB "
                    f"(--kv-cache-memory x --window-kv-fraction)")
        raise ValueError(f"{field}: the window layers' pool gets {window_num_blocks} blocks; one "
                         f"request's window ({window_tokens} tokens) needs {fix}")
    return num_blocks, window_num_blocks


def layer_groups(shape: ModelShape) -> list[dict[str, Any]]:
    """The model's layers grouped by attention kind, full attention first, then windows by size.

    Returns:
        One dict per group: ``attention`` (``"full"`` or ``"sliding"``), ``window_tokens``
        (W, tokens a query sees including itself; None for full attention) and ``num_layers``.
        E.g. Gemma 3 270M (18 layers, window 512, five sliding layers to one full):
        ``[{"attention": "full", "window_tokens": None, "num_layers": 3},
        {"attention": "sliding", "window_tokens": 512, "num_layers": 15}]``.
    """
    counts: dict[int, int] = {}
    for window_left in shape.layer_window_lefts:  # -1 = full; else W - 1
        counts[window_left] = counts.get(window_left, 0) + 1
    return [{"attention": "full" if left < 0 else "sliding",
             "window_tokens": None if left < 0 else left + 1, "num_layers": counts[left]}
            for left in sorted(counts)]


def concurrent_windows(window_num_blocks: int, window_tokens: int, block_size: int) -> int:
    """How many requests' windows (``ceil((W - 1) / B) + 2`` blocks each: the window, slack and
    the block being written) the window pool holds at once, cached resume points aside; fewer
    than ``max_num_seqs`` and running requests preempt one another in decode."""
    return (window_num_blocks - 1) // (window_blocks_needed(window_tokens, block_size) + 2)


def max_window_chunk_tokens(window_num_blocks: int, window_tokens: int, block_size: int) -> int:
    """The longest prefill chunk one request can compute alone in a window pool of
    ``window_num_blocks`` blocks: its window's ``ceil((W - 1) / B)`` blocks, a block of slack,
    a partial block at each end of the chunk and the null block stay out; the engine caps
    ``prefill_chunk_tokens`` at this so a long prompt never waits for room that cannot come."""
    need = window_blocks_needed(window_tokens, block_size)
    return (window_num_blocks - need - 4) * block_size


def plan_window_pools(config: EngineConfig, shape: ModelShape, bytes_per_block: int,
                      budget_bytes: int) -> tuple[EngineConfig, int, int]:
    """``(config, num_blocks, window_num_blocks)`` for an engine under KV groups: the pools'
    sizes (:func:`grouped_pool_sizes`) and the config with ``prefill_chunk_tokens`` capped at
    :func:`max_window_chunk_tokens` (every window block a chunk writes is held during its step:
    one request must always fit, or it would wait forever). Logs ``window_pool_small`` when
    the pool holds fewer :func:`concurrent_windows` than ``max_num_seqs``.

    Raises:
        ValueError: as :func:`grouped_pool_sizes`.
    """
    num_blocks, window_num_blocks = grouped_pool_sizes(config.cache, shape, bytes_per_block,
                                                       budget_bytes)
    window_tokens = max(shape.layer_window_lefts) + 1
    block_size = config.cache.block_size
    windows = concurrent_windows(window_num_blocks, window_tokens, block_size)
    if windows < config.scheduler.max_num_seqs:
        log.warning("window_pool_small", window_num_blocks=window_num_blocks,
                    concurrent_windows=windows, max_num_seqs=config.scheduler.max_num_seqs,
                    hint="running requests will preempt one another and cached window blocks "
                         "will not last: raise --window-kv-fraction, --kv-cache-memory or "
                         "lower --max-num-seqs")
    chunk = max_window_chunk_tokens(window_num_blocks, window_tokens, block_size)
    if chunk < (config.scheduler.prefill_chunk_tokens or chunk + 1):
        config = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, prefill_chunk_tokens=chunk))
    return config, num_blocks, window_num_blocks


def hit_granularity(shape: ModelShape, block_size: int, window_kv: str = WINDOW_KV_KEEP_ALL
                    ) -> dict[str, Any]:
    """Where a prefix hit can end and what it needs resident, for the startup log and ``/stats``.

    Args:
        shape: the served model's shape.
        block_size: tokens per KV block (B).
        window_kv: the residency rule in force (:func:`window_kv_mode`).

    Returns:
        ``block_size_tokens`` (a hit covers whole blocks: it ends at a multiple of B, below the
        prompt's last token), ``window_kv`` (the residency rule: :data:`WINDOW_KV_KEEP_ALL`,
        or :data:`WINDOW_KV_WINDOW`, where a hit also needs the ``ceil((W - 1) / B)`` window
        blocks before it cached) and ``layer_groups`` (:func:`layer_groups`).
    """
    return {"block_size_tokens": block_size, "window_kv": window_kv,
            "layer_groups": layer_groups(shape)}

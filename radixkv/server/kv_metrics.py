"""``/metrics`` families of the KV pool's state and the engine's per-step KV work.

Read at scrape time from the ``/stats`` snapshot the engine thread took after its latest step
(``pool``, ``fork``, ``kv_activity``, ``leak_check``) and from the live histograms of
``EngineStats.activity`` (their own lock): the event loop never reads cache state. Units are in
the names; counters end in ``_total``. What each measures and its formula: the docstrings of
``radixkv.engine.kv_activity``, ``radixkv.engine.stats`` (``_occupancy``) and
``radixkv.cache.gauges``; the operator's view: docs/operations.md "Metrics".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

# (name, /stats pool key, help)
_POOL_GAUGES = (
    ("radixkv_kv_capacity_tokens", "total_token_slots",
     "Token slots in the pool (blocks x block size)."),
    ("radixkv_kv_occupied_tokens", "used_token_slots",
     "Token slots holding a token's K/V: blocks not free x block size, less the live tail "
     "waste (token occupancy, beside block occupancy)."),
    ("radixkv_kv_live_tail_waste_tokens", "live_tail_waste_tokens",
     "Token slots allocated to running requests and empty: the unfilled rest of each "
     "sequence's last block (cached blocks are always full)."),
    ("radixkv_kv_live_blocks", "live_blocks",
     "KV blocks held by running requests (in use, less blocks only a retention pins)."),
)
_POOL_COUNTERS = (
    ("radixkv_kv_allocated_blocks", "allocated_blocks_total",
     "KV blocks taken off the free list."),
    ("radixkv_kv_freed_blocks", "freed_blocks_total",
     "KV blocks returned to the free list (released private blocks, evicted cached blocks)."),
)
_FORK_COUNTERS = (
    ("radixkv_kv_forked_sequences", "forks_total",
     "Sequences started as a fork of a running one (n > 1 sampling)."),
    ("radixkv_kv_fork_shared_blocks", "shared_blocks_total",
     "KV blocks forked sequences share with their parent instead of copying."),
    ("radixkv_kv_cow_copied_blocks", "copied_blocks_total",
     "Partial tail blocks copied at a fork (copy-on-write)."),
    ("radixkv_kv_cow_copied_bytes", "copied_bytes_total",
     "Bytes of the copy-on-write block copies (blocks x bytes per block)."),
)
_ACTIVITY_COUNTERS = (
    ("radixkv_engine_steps", "steps_total", "Engine steps that ran a forward."),
    ("radixkv_decode_kv_read_bytes", "decode_kv_read_bytes_total",
     "K/V bytes decode attention read: sum over decode chunks of context tokens x KV bytes "
     "per token (all layers)."),
    ("radixkv_prefill_kv_written_bytes", "prefill_kv_written_bytes_total",
     "K/V bytes prefill wrote: prefill, suffix and recompute chunk tokens x KV bytes per "
     "token."),
    ("radixkv_preempted_kv_tokens", "preempted_kv_tokens_total",
     "Tokens whose K/V preempted requests held when they were preempted."),
    ("radixkv_recomputed_tokens", "recomputed_tokens_total",
     "Tokens computed again after a preemption (past what the resume found cached)."),
)
# (name, KVActivity.histograms key, help)
_ACTIVITY_HISTOGRAMS = (
    ("radixkv_prefix_cache_lookup_seconds", "lookup",
     "Time of one prefix-cache lookup (tree match, hit cap, lock, miss causes)."),
    ("radixkv_scheduler_step_seconds", "schedule",
     "Scheduler time of one step on the engine thread (admission, lookups, allocation)."),
    ("radixkv_block_table_prepare_seconds", "block_table",
     "Time to build one step's batch: block tables, slot mapping, positions."),
    ("radixkv_cancel_release_seconds", "cancel_release",
     "From an abort being asked to the request's KV blocks being back in the pool."),
    ("radixkv_engine_step_seconds", "step",
     "Wall time of one engine step that ran a forward: schedule, batch, forward, sampling."),
)


def kv_families(stats: dict, engine_stats: Any) -> Iterator[Any]:
    """The families above from a ``/stats`` snapshot and ``EngineStats`` (``activity``)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.utils import floatToGoString

    pool = stats["pool"]
    for name, key, doc in _POOL_GAUGES:
        if key in pool:
            yield GaugeMetricFamily(name, doc, value=pool[key])
    for name, key, doc in _POOL_COUNTERS:
        if key in pool:
            yield CounterMetricFamily(name, doc, value=pool[key])
    for families, section in ((_FORK_COUNTERS, stats.get("fork") or {}),
                              (_ACTIVITY_COUNTERS, stats.get("kv_activity") or {})):
        for name, key, doc in families:
            if key in section:
                yield CounterMetricFamily(name, doc, value=section[key])
    if "missed_reuse_flops_total" in stats:
        yield CounterMetricFamily(
            "radixkv_missed_reuse_flops",
            "Prefill FLOPs spent on prompt tokens whose blocks had been evicted (the evicted "
            "miss cause, cost model): what eviction cost.",
            value=stats["missed_reuse_flops_total"])
    store = stats.get("store")
    if store is not None and "num_blocks" in store:
        yield GaugeMetricFamily("radixkv_kv_store_blocks", "KV block values in the store tier.",
                                value=store["num_blocks"])
    leak = stats.get("leak_check")
    if leak is not None:
        yield CounterMetricFamily("radixkv_kv_leak_checks",
                                  "Idle self-checks of the KV pool run (conservation, no "
                                  "block held for a finished request).",
                                  value=leak["checks_total"])
        yield CounterMetricFamily("radixkv_kv_leak_check_failures",
                                  "Idle self-checks that found a leak or a broken invariant "
                                  "(each logged as kv_leak_check_failed).",
                                  value=leak["failures_total"])
    histograms = engine_stats.activity.histograms()
    for name, key, doc in _ACTIVITY_HISTOGRAMS:
        cumulative, sum_s = histograms[key]
        buckets = [("+Inf" if math.isinf(le) else floatToGoString(le), count)
                   for le, count in cumulative]
        yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum_s)
    attention = HistogramMetricFamily(
        "radixkv_attention_seconds",
        "Wall time of one step's attention over all layers (the new rows' K/V pool writes "
        "included, except in the fused C decode layer), by phase (decode: every row a "
        "generated token; prefill otherwise) and by the step's longest context in tokens "
        "(context_tokens_le). Measured on the CPU only.",
        labels=["phase", "context_tokens_le"])
    for (phase, label), (cumulative, sum_s) in engine_stats.activity.attention_histograms().items():
        attention.add_metric([phase, label],
                             [("+Inf" if math.isinf(le) else floatToGoString(le), count)
                              for le, count in cumulative], sum_value=sum_s)
    yield attention

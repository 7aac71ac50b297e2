"""Engine counters (cumulative since start) and the ``/stats`` snapshot (docs/design.md §7).

Rates are derived per token from counters, never averaged per request: a token hit rate is
``cached_prompt_tokens_total / prompt_tokens_total``. Each request's lookup is recorded once,
at its first admission; a preempted request's resume is not a second lookup.

``requests_*`` count requests and ``sequences_*`` their choices: an ``n = 3`` request admitted
and then aborted adds 1 to ``requests_total`` and ``requests_aborted_total`` and 3 to
``sequences_total`` and ``sequences_aborted_total``.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Protocol

from radixkv.engine.histogram import LATENCY_BUCKETS_S, LatencyHistogram, percentile_ms
from radixkv.engine.kv_activity import KVActivity
from radixkv.eviction.cost_model import CostShape, prefill_flops, saved_prefill_flops

__all__ = ["LATENCY_BUCKETS_S", "Counters", "EngineStats", "KVActivity", "LatencyHistogram"]


class _CacheGauges(Protocol):
    """What ``EngineStats.snapshot`` reads of the cache (``CacheManager``): read-only gauges."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def eviction_policy(self) -> str: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_evictable_blocks(self) -> int: ...
    @property
    def num_in_use_blocks(self) -> int: ...
    @property
    def num_tree_nodes(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def evicted_blocks_total(self) -> int: ...
    @property
    def miss_tokens(self) -> Mapping[str, int]: ...
    @property
    def num_live_tail_waste_tokens(self) -> int: ...
    @property
    def num_retained_blocks(self) -> int: ...
    @property
    def allocated_blocks_total(self) -> int: ...
    @property
    def freed_blocks_total(self) -> int: ...
    @property
    def forks_total(self) -> int: ...
    @property
    def fork_shared_blocks_total(self) -> int: ...
    @property
    def cow_copied_blocks_total(self) -> int: ...
    def num_obtainable_blocks(self) -> int: ...


class Counters:
    """Request and token counters and latencies of one view of the traffic.

    ``requests_total`` / ``sequences_total``: requests admitted (one prefix-cache lookup each)
    and their choices (``n`` each). ``*_aborted_total``: aborted by the client or at shutdown,
    in any phase (waiting included), counting the choices that had not finished.
    ``*_failed_total``: ended by a fault of their own in the engine (sampling, detokenizing,
    forking, a failed forward; the client got a 500 ``internal_error``).
    ``server_errors_total``: requests the server answered 500 ``internal_error`` for a fault in
    its own per-request code (templating, tool parsing, output memory), recorded by the server.

    The global view and each tenant's share are both a ``Counters``, written by the same
    ``EngineStats.record_*`` call (the tenant's only when the request carries one). Not locked
    itself: ``EngineStats`` holds its lock.
    """

    def __init__(self) -> None:
        self.requests_total = 0
        self.sequences_total = 0
        self.requests_with_hit_total = 0
        self.requests_aborted_total = 0
        self.sequences_aborted_total = 0
        self.requests_failed_total = 0
        self.sequences_failed_total = 0
        self.server_errors_total = 0
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.ttft = LatencyHistogram()
        self.itl = LatencyHistogram()

    def counts(self) -> dict[str, Any]:
        """The counters and the per-token rates derived from them (docs/design.md §7 keys)."""
        prompt, cached, requests = (self.prompt_tokens_total, self.cached_prompt_tokens_total,
                                    self.requests_total)
        return {
            "requests_total": requests,
            "sequences_total": self.sequences_total,
            "requests_with_hit_total": self.requests_with_hit_total,
            "requests_aborted_total": self.requests_aborted_total,
            "sequences_aborted_total": self.sequences_aborted_total,
            "requests_failed_total": self.requests_failed_total,
            "sequences_failed_total": self.sequences_failed_total,
            "server_errors_total": self.server_errors_total,
            "prompt_tokens_total": prompt,
            "cached_prompt_tokens_total": cached,
            "computed_prompt_tokens_total": prompt - cached,
            "generated_tokens_total": self.generated_tokens_total,
            "token_hit_rate": cached / prompt if prompt else 0.0,
            "request_hit_rate": self.requests_with_hit_total / requests if requests else 0.0,
        }


class EngineStats:
    """Counters written by the engine thread; ``snapshot`` may be called from any thread.

    ``totals`` counts every request; ``tenants`` holds the share of each tenant seen so far
    (requests that carry a tenant: the server's authenticated one). Each ``record_*`` call
    updates both views at once, so a tenant's counters always sum into the global ones.

    Args:
        cost_shape: the served model's ``eviction.cost_model`` shape; with it, each hit adds
            the prefill FLOPs it saved to ``saved_prefill_flops_total``.
    """

    def __init__(self, cost_shape: CostShape | None = None) -> None:
        self._lock = threading.Lock()
        self.totals = Counters()
        self.tenants: dict[str, Counters] = {}
        # Global only: engine-internal events, not a tenant's traffic.
        self.preemptions_total = 0
        self.resumed_cached_tokens_total = 0
        self.saved_prefill_flops_total = 0.0  # FLOPs, from eviction.cost_model
        self.cost_shape = cost_shape
        self.store_cached_prompt_tokens_total = 0  # part of cached_prompt_tokens_total
        self.store_fetch_latency = LatencyHistogram()  # store tier loads: backend seconds
        # Prefill FLOPs of the prompt tokens that missed because their blocks were evicted
        # (the ``evicted`` miss cause): what eviction cost, from eviction.cost_model.
        self.missed_reuse_flops_total = 0.0
        #: Per-step engine counters and histograms (lookup, schedule, KV bytes, cancels).
        self.activity = KVActivity()

    def observe_store_fetch(self, seconds: float) -> None:
        """One store load's backend time (exists + get), from the tier's loader thread."""
        with self._lock:
            self.store_fetch_latency.observe(seconds)

    def _views(self, tenant: str | None) -> tuple[Counters, ...]:
        """The global counters, and the tenant's (created on first use) when there is one."""
        if tenant is None:
            return (self.totals,)
        counters = self.tenants.get(tenant)
        if counters is None:
            counters = self.tenants[tenant] = Counters()
        return (self.totals, counters)

    def record_admission(self, num_prompt_tokens: int, num_cached_tokens: int, *,
                         num_sequences: int = 1, tenant: str | None = None,
                         num_store_tokens: int = 0, num_evicted_tokens: int = 0) -> None:
        """A request's one prefix-cache lookup, at its first admission (``num_sequences``:
        its choices, ``n``; ``num_store_tokens``: the part of ``num_cached_tokens`` the store
        tier loaded; ``num_evicted_tokens``: its ``evicted`` miss tokens, which follow the hit
        directly, so their prefill costs ``prefill_flops(shape, m, num_evicted_tokens)``,
        added to ``missed_reuse_flops_total``)."""
        with self._lock:
            self.store_cached_prompt_tokens_total += num_store_tokens
            for view in self._views(tenant):
                view.requests_total += 1
                view.sequences_total += num_sequences
                view.prompt_tokens_total += num_prompt_tokens
                view.cached_prompt_tokens_total += num_cached_tokens
                view.requests_with_hit_total += int(num_cached_tokens > 0)
            if num_cached_tokens > 0 and self.cost_shape is not None:
                self.saved_prefill_flops_total += saved_prefill_flops(self.cost_shape,
                                                                      num_cached_tokens)
            if num_evicted_tokens > 0 and self.cost_shape is not None:
                self.missed_reuse_flops_total += prefill_flops(
                    self.cost_shape, num_cached_tokens, num_evicted_tokens)

    def record_generated(self, num_tokens: int, *, tenant: str | None = None) -> None:
        """Tokens sampled for a request of ``tenant`` (None: no tenant)."""
        with self._lock:
            for view in self._views(tenant):
                view.generated_tokens_total += num_tokens

    def record_abort(self, *, num_sequences: int = 1, tenant: str | None = None) -> None:
        """One request aborted, with ``num_sequences`` of its choices still unfinished."""
        with self._lock:
            for view in self._views(tenant):
                view.requests_aborted_total += 1
                view.sequences_aborted_total += num_sequences

    def record_failure(self, *, num_sequences: int = 1, tenant: str | None = None) -> None:
        """One request ended by an engine-side fault, ``num_sequences`` choices unfinished."""
        with self._lock:
            for view in self._views(tenant):
                view.requests_failed_total += 1
                view.sequences_failed_total += num_sequences

    def record_server_error(self, *, tenant: str | None = None) -> None:
        """One request the server answered 500 for a fault in its own code (any thread)."""
        with self._lock:
            for view in self._views(tenant):
                view.server_errors_total += 1

    def record_latency(self, tenant: str | None, *, ttft_s: float | None = None,
                       itl_s: float | None = None) -> None:
        """Time to first token / inter-token latency of a delivery to a request of ``tenant``."""
        with self._lock:
            for view in self._views(tenant):
                if ttft_s is not None:
                    view.ttft.observe(ttft_s)
                if itl_s is not None:
                    view.itl.observe(itl_s)

    def record_preemption(self) -> None:
        with self._lock:
            self.preemptions_total += 1

    def record_resume(self, num_cached_tokens: int) -> None:
        """A preempted request re-admitted: its hit is not a new lookup, so it is kept apart."""
        with self._lock:
            self.resumed_cached_tokens_total += num_cached_tokens

    def latency_ms(self, tenant: str | None = None) -> dict[str, float | None]:
        """``{"ttft_p50", "ttft_p99", "itl_p50", "itl_p99"}`` in ms over the recent window
        (None before the first sample), globally or for one tenant."""
        with self._lock:
            view = self.totals if tenant is None else self.tenants.get(tenant)
            ttft = list(view.ttft.recent) if view is not None else []
            itl = list(view.itl.recent) if view is not None else []
        return {"ttft_p50": percentile_ms(ttft, 0.5), "ttft_p99": percentile_ms(ttft, 0.99),
                "itl_p50": percentile_ms(itl, 0.5), "itl_p99": percentile_ms(itl, 0.99)}

    def latency_histograms(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """Global ``{"ttft"|"itl": (cumulative buckets, sum in seconds)}`` for Prometheus."""
        with self._lock:
            return {"ttft": (self.totals.ttft.cumulative(), self.totals.ttft.sum_s),
                    "itl": (self.totals.itl.cumulative(), self.totals.itl.sum_s)}

    def tenant_snapshot(self, tenant: str) -> dict[str, Any]:
        """One tenant's counters and rates (zeros for a tenant never seen), plus latency_ms."""
        with self._lock:
            out = (self.tenants.get(tenant) or Counters()).counts()
        out["latency_ms"] = self.latency_ms(tenant)
        return out

    def tenant_names(self) -> list[str]:
        with self._lock:
            return sorted(self.tenants)

    def counts(self) -> dict[str, Any]:
        """The global counters and rates now (``Counters.counts``); any thread."""
        with self._lock:
            return self.totals.counts()

    def snapshot(self, cache: _CacheGauges, bytes_per_block: int, *,
                 kv_cache_dtype: str | None = None,
                 kv_bytes_per_token: int | None = None) -> dict[str, Any]:
        """The ``/stats`` JSON object: counters plus pool and tree gauges; ``kv_cache_dtype``
        (the KV pool dtype actually allocated: float32, bfloat16, int8, fp8_e4m3) and
        ``kv_bytes_per_token`` (K+V bytes of one token over all layers, scales included)
        are reported at the top level when given."""
        with self._lock:
            out = self.totals.counts()
            out["preemptions_total"] = self.preemptions_total
            out["resumed_cached_tokens_total"] = self.resumed_cached_tokens_total
            out["saved_prefill_flops_total"] = self.saved_prefill_flops_total
            out["missed_reuse_flops_total"] = self.missed_reuse_flops_total
            store_tokens = self.store_cached_prompt_tokens_total
            fetch = list(self.store_fetch_latency.recent), self.store_fetch_latency.count
        out["cached_prompt_tokens_by_tier"] = {
            "device": out["cached_prompt_tokens_total"] - store_tokens, "store": store_tokens}
        store = getattr(cache, "store", None)
        if store is not None:
            out["store"] = store.snapshot()
            out["store"]["fetches_total"] = fetch[1]
            out["store"]["fetch_ms_p50"] = percentile_ms(fetch[0], 0.5)
            out["store"]["fetch_ms_p90"] = percentile_ms(fetch[0], 0.9)
        out["evicted_blocks_total"] = cache.evicted_blocks_total
        out["miss_tokens"] = dict(cache.miss_tokens)
        out["pool"] = {
            "block_size_tokens": cache.block_size,
            "bytes_per_block": bytes_per_block,
            "total_blocks": cache.num_blocks,
            "free_blocks": cache.num_free_blocks,
            "cached_evictable_blocks": cache.num_cached_evictable_blocks,
            "in_use_blocks": cache.num_in_use_blocks,
        }
        out["pool"].update(_occupancy(cache))
        out["fork"] = {
            "forks_total": cache.forks_total,
            "shared_blocks_total": cache.fork_shared_blocks_total,
            "copied_blocks_total": cache.cow_copied_blocks_total,
            "copied_bytes_total": cache.cow_copied_blocks_total * bytes_per_block,
        }
        out["kv_activity"] = self.activity.snapshot(kv_bytes_per_token)
        out["tree"] = {"nodes": cache.num_tree_nodes, "cached_blocks": cache.num_cached_blocks}
        retention = getattr(cache, "retention_snapshot", None)
        if retention is not None:  # retained blocks are part of in_use_blocks (pinned)
            out["retention"] = retention()
            out["pool"]["retained_blocks"] = out["retention"]["retained_blocks"]
        out["eviction_policy"] = cache.eviction_policy
        out["prefix_caching"] = cache.enable_prefix_caching
        if kv_cache_dtype is not None:
            out["kv_cache_dtype"] = kv_cache_dtype
        if kv_bytes_per_token is not None:
            out["kv_bytes_per_token"] = kv_bytes_per_token
        return out


def _occupancy(cache: _CacheGauges) -> dict[str, int]:
    """Token occupancy beside block occupancy, and the allocation counters (``/stats``
    ``pool``): ``used_token_slots`` = (blocks not free) × B − ``live_tail_waste_tokens`` (the
    empty rest of each active request's last block; cached blocks are always full), out of
    ``total_token_slots`` = blocks × B; ``live_blocks`` = blocks held by requests (in use
    less retained blocks only a retention pins)."""
    bs = cache.block_size
    waste = cache.num_live_tail_waste_tokens
    free, evictable = cache.num_free_blocks, cache.num_cached_evictable_blocks
    # Retained blocks no request holds are pinned (in use) but not live: an allocation would
    # unpin them (num_obtainable_blocks counts them; the walk runs only while any is retained).
    pinned_only = (cache.num_obtainable_blocks() - free - evictable
                   if cache.num_retained_blocks else 0)
    return {
        "total_token_slots": cache.num_blocks * bs,
        "used_token_slots": (cache.num_blocks - free) * bs - waste,
        "live_tail_waste_tokens": waste,
        "live_blocks": cache.num_in_use_blocks - pinned_only,
        "allocated_blocks_total": cache.allocated_blocks_total,
        "freed_blocks_total": cache.freed_blocks_total,
    }

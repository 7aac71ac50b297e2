"""Engine counters (cumulative since start) and the ``/stats`` snapshot (docs/design.md §7).

Rates are derived per token from counters, never averaged per request: a token hit rate is
``cached_prompt_tokens_total / prompt_tokens_total``. Each request's lookup is recorded once,
at its first admission; a preempted request's resume is not a second lookup.

``requests_*`` count requests and ``sequences_*`` their choices: an ``n = 3`` request admitted
and then aborted adds 1 to ``requests_total`` and ``requests_aborted_total`` and 3 to
``sequences_total`` and ``sequences_aborted_total``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from typing import Any, Mapping, Protocol

from radixkv.eviction.cost_model import CostShape, saved_prefill_flops


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


# Prometheus-style upper bounds (seconds) of the TTFT / ITL histograms.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0)


class LatencyHistogram:
    """Latency samples (seconds): cumulative bucket counts for Prometheus and a window of the
    most recent samples for percentiles. Not locked itself: ``EngineStats`` holds its lock."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S, window: int = 4096) -> None:
        self.buckets = tuple(buckets)
        self.bucket_counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum_s = 0.0
        self.count = 0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self.bucket_counts[bisect.bisect_left(self.buckets, seconds)] += 1  # le = upper bound
        self.sum_s += seconds
        self.count += 1
        self.recent.append(seconds)

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound, samples <= bound), …, (inf, count)]``."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.bucket_counts):
            total += n
            out.append((bound, total))
        return out


def _percentile_ms(samples: list[float], q: float) -> float | None:
    """Nearest-rank percentile in milliseconds; None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000.0


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
                         num_store_tokens: int = 0) -> None:
        """A request's one prefix-cache lookup, at its first admission (``num_sequences``:
        its choices, ``n``; ``num_store_tokens``: the part of ``num_cached_tokens`` the store
        tier loaded)."""
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
        return {"ttft_p50": _percentile_ms(ttft, 0.5), "ttft_p99": _percentile_ms(ttft, 0.99),
                "itl_p50": _percentile_ms(itl, 0.5), "itl_p99": _percentile_ms(itl, 0.99)}

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
            store_tokens = self.store_cached_prompt_tokens_total
            fetch = list(self.store_fetch_latency.recent), self.store_fetch_latency.count
        out["cached_prompt_tokens_by_tier"] = {
            "device": out["cached_prompt_tokens_total"] - store_tokens, "store": store_tokens}
        store = getattr(cache, "store", None)
        if store is not None:
            out["store"] = store.snapshot()
            out["store"]["fetches_total"] = fetch[1]
            out["store"]["fetch_ms_p50"] = _percentile_ms(fetch[0], 0.5)
            out["store"]["fetch_ms_p90"] = _percentile_ms(fetch[0], 0.9)
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

"""``GET /metrics``: the engine's numbers in Prometheus text format (prometheus-client).

Every name is ``radixkv_`` prefixed with its unit in the name (``_tokens``, ``_blocks``,
``_seconds``, ``_flops``, ``_requests``, ``_sequences``); counters end in ``_total``.
``_requests`` counters count requests, ``_sequences`` ones their choices (``n`` each), as the
``requests_*`` / ``sequences_*`` keys of ``/stats`` do. Values are read from the
same counters as ``/stats`` at scrape time by a collector registered in a per-application
``CollectorRegistry`` (never the process-global one), so several servers in one process — the
tests run many — do not collide. With API keys configured the route needs an admin key: hit
counters are a side channel across tenants. The KV pool's state and the engine's per-step KV
work (token occupancy, tail waste, forks, lookup and step times, cancel → release) are in
``radixkv.server.kv_metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixkv.server.generation import OUTCOMES
from radixkv.server.kv_metrics import kv_families
from radixkv.server.param_policy import IGNORED_COUNTS

if TYPE_CHECKING:
    from radixkv.server.generation import ServerState

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.utils import floatToGoString
except ImportError:  # pragma: no cover - a declared dependency; /metrics says so if missing
    CollectorRegistry = None  # type: ignore[assignment,misc]  # the class is absent: /metrics says so

# (name without _total, /stats key, help)
_COUNTERS = (
    ("radixkv_prefix_cache_queries_tokens", "prompt_tokens_total",
     "Prompt tokens looked up in the prefix cache (once per request, at admission)."),
    ("radixkv_prefix_cache_hits_tokens", "cached_prompt_tokens_total",
     "Prompt tokens served from the prefix cache."),
    ("radixkv_prefix_cache_queries_requests", "requests_total",
     "Requests admitted (one prefix-cache lookup each)."),
    ("radixkv_prefix_cache_hits_requests", "requests_with_hit_total",
     "Requests whose lookup hit at least one cached block."),
    ("radixkv_saved_prefill_tokens", "cached_prompt_tokens_total",
     "Prefill tokens not computed thanks to the prefix cache."),
    ("radixkv_saved_prefill_flops", "saved_prefill_flops_total",
     "Prefill FLOPs not spent thanks to the prefix cache (cost model)."),
    ("radixkv_computed_prompt_tokens", "computed_prompt_tokens_total",
     "Prompt tokens prefilled by the model."),
    ("radixkv_generated_tokens", "generated_tokens_total", "Tokens sampled."),
    ("radixkv_evicted_blocks", "evicted_blocks_total", "KV blocks evicted from the prefix cache."),
    ("radixkv_preemptions_requests", "preemptions_total", "Requests preempted (recompute)."),
    ("radixkv_resumed_cached_tokens", "resumed_cached_tokens_total",
     "Cached tokens matched again when preempted requests resumed (not new lookups)."),
    ("radixkv_admitted_requests", "requests_total", "Requests admitted (/stats requests_total)."),
    ("radixkv_admitted_sequences", "sequences_total",
     "Sequences (choices, n per request) of the admitted requests."),
    ("radixkv_aborted_requests", "requests_aborted_total",
     "Requests aborted in the engine: client disconnects and shutdown."),
    ("radixkv_aborted_sequences", "sequences_aborted_total",
     "Sequences (choices) unfinished when their request was aborted."),
    ("radixkv_failed_requests", "requests_failed_total",
     "Requests ended by a fault of their own in the engine (answered 500 internal_error)."),
    ("radixkv_failed_sequences", "sequences_failed_total",
     "Sequences (choices) unfinished when their request failed in the engine."),
    ("radixkv_server_error_requests", "server_errors_total",
     "Requests answered 500 internal_error for a fault in the server's own code."),
)
_POOL_GAUGES = (
    ("radixkv_kv_total_blocks", "total_blocks", "KV blocks in the pool."),
    ("radixkv_kv_free_blocks", "free_blocks", "KV blocks holding nothing."),
    ("radixkv_kv_cached_evictable_blocks", "cached_evictable_blocks",
     "KV blocks cached in the prefix tree and evictable."),
    ("radixkv_kv_in_use_blocks", "in_use_blocks", "KV blocks held by running requests."),
    ("radixkv_kv_block_size_tokens", "block_size_tokens", "Tokens per KV block."),
    ("radixkv_kv_block_size_bytes", "bytes_per_block", "Bytes per KV block (all layers)."),
)
_TENANT_COUNTERS = (
    ("radixkv_tenant_requests", "requests_total", "Requests admitted, by tenant."),
    ("radixkv_tenant_sequences", "sequences_total", "Sequences (choices) admitted, by tenant."),
    ("radixkv_tenant_aborted_requests", "requests_aborted_total", "Requests aborted, by tenant."),
    ("radixkv_tenant_aborted_sequences", "sequences_aborted_total",
     "Sequences (choices) aborted, by tenant."),
    ("radixkv_tenant_failed_requests", "requests_failed_total",
     "Requests failed in the engine, by tenant."),
    ("radixkv_tenant_failed_sequences", "sequences_failed_total",
     "Sequences (choices) failed in the engine, by tenant."),
    ("radixkv_tenant_server_error_requests", "server_errors_total",
     "Requests answered 500 for a server fault, by tenant."),
    ("radixkv_tenant_prompt_tokens", "prompt_tokens_total", "Prompt tokens, by tenant."),
    ("radixkv_tenant_cached_prompt_tokens", "cached_prompt_tokens_total",
     "Prompt tokens served from the cache, by tenant."),
    ("radixkv_tenant_generated_tokens", "generated_tokens_total", "Tokens generated, by tenant."),
)


def _histogram(name: str, doc: str, cumulative: list[tuple[float, int]], sum_s: float
               ) -> Any:
    buckets = [("+Inf" if math.isinf(le) else floatToGoString(le), count)
               for le, count in cumulative]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum_s)


def window_pool_families(window: dict[str, int]) -> Iterator[Any]:
    """The window layers' pool under ``--sliding-window-kv window`` (``/stats``
    ``pool.window``): blocks by state, and the cached window blocks evicted so far."""
    blocks = GaugeMetricFamily("radixkv_kv_window_blocks",
                               "Blocks of the window layers' pool (--sliding-window-kv window) "
                               "by state: free, held (running requests' windows), plain "
                               "(cached, evicted first), anchor (cached resume points).",
                               labels=["state"])
    evictable = window["num_evictable_blocks"]
    for state, value in (("free", window["num_free_blocks"]),
                         ("held", window["num_held_blocks"]),
                         ("plain", evictable - window["num_anchor_blocks"]),
                         ("anchor", window["num_anchor_blocks"])):
        blocks.add_metric([state], value)
    yield blocks
    yield CounterMetricFamily("radixkv_kv_window_evicted_blocks",
                              "Cached window blocks dropped to make room or with their "
                              "full-attention blocks.", value=window["evicted_blocks_total"])


class RadixkvCollector:
    """Reads the engine's counters and gauges and the server's outcomes at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        engine = self.state.engine
        stats = engine.stats()
        for name, key, doc in _COUNTERS:
            if key in stats:  # saved_prefill_flops_total appears once the cost model lands
                yield CounterMetricFamily(name, doc, value=stats[key])
        miss = CounterMetricFamily("radixkv_prefix_cache_miss_tokens",
                                   "Prompt tokens not served from the cache, by cause.",
                                   labels=["cause"])
        for cause, value in sorted(stats.get("miss_tokens", {}).items()):
            miss.add_metric([cause], value)
        yield miss
        outcomes = CounterMetricFamily("radixkv_requests",
                                       "Completion requests by outcome (stop, length, abort, "
                                       "rejected = 4xx, overloaded = 429/503, error = 5xx).",
                                       labels=["outcome"])
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], self.state.outcomes[outcome])
        yield outcomes
        yield _ignored_parameters()
        pool = stats["pool"]
        for name, key, doc in _POOL_GAUGES:
            yield GaugeMetricFamily(name, doc, value=pool[key])
        if "window" in pool:
            yield from window_pool_families(pool["window"])
        yield from kv_families(stats, engine.engine_stats)
        yield GaugeMetricFamily("radixkv_prefix_tree_nodes", "Nodes in the radix tree.",
                                value=stats["tree"]["nodes"])
        yield GaugeMetricFamily("radixkv_prefix_tree_cached_blocks",
                                "KV blocks referenced by the radix tree.",
                                value=stats["tree"]["cached_blocks"])
        sched = engine.scheduler_gauges()
        yield GaugeMetricFamily("radixkv_running_sequences", "Sequences running in the engine.",
                                value=sched["running"])
        yield GaugeMetricFamily("radixkv_waiting_sequences", "Sequences waiting for admission.",
                                value=sched["waiting"])
        yield GaugeMetricFamily("radixkv_in_flight_requests",
                                "Completion requests admitted by the server and not finished.",
                                value=self.state.in_flight)
        yield GaugeMetricFamily("radixkv_engine_healthy_bool", "1 while the engine thread runs.",
                                value=1 if engine.is_healthy else 0)
        hist = engine.engine_stats.latency_histograms()
        yield _histogram("radixkv_time_to_first_token_seconds",
                         "Time from submission to the first token of each choice.", *hist["ttft"])
        yield _histogram("radixkv_inter_token_latency_seconds",
                         "Time between consecutive tokens of a choice.", *hist["itl"])
        yield _histogram("radixkv_tokenize_queue_seconds",
                         "Time a templating/tokenizing job waited for a tokenizer worker.",
                         *engine.tokenize_pool.queue_seconds.cumulative())
        yield from _store_families(stats, engine.engine_stats)
        yield from _retention_families(stats.get("retention"))
        tenants = engine.engine_stats.tenant_names()
        views = {tenant: engine.tenant_stats(tenant) for tenant in tenants}
        for name, key, doc in _TENANT_COUNTERS if views else ():
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant, view in views.items():
                family.add_metric([tenant], view[key])
            yield family


_STORE_COUNTERS = (
    ("lookup_blocks_total", "Blocks looked up in the store tier (past the device match)."),
    ("hit_blocks_total", "Blocks the store tier served (verified, inserted into the tree)."),
    ("miss_blocks_total", "Blocks looked up that the store tier did not hold."),
    ("read_bytes_total", "Bytes of verified block values read from the store tier."),
    ("written_blocks_total", "Blocks written to the store tier."),
    ("written_bytes_total", "Bytes written to the store tier."),
    ("dropped_write_blocks_total", "Blocks not written: no staging slot, or the store down."),
    ("errors_total", "Store tier calls that failed."),
    ("load_timeouts_total", "Store loads abandoned at their deadline (blocks computed)."),
    ("loads_skipped_down_total", "Store loads not tried: the store was down or not answering."),
    ("skipped_existing_blocks_total", "Blocks not written: the store held them already."),
    ("refused_write_blocks_total", "Blocks the store refused to take (no space)."),
    ("reconnects_total", "Times the store tier came back after being down."),
    ("reset_blocks_total", "Blocks a prefix-cache reset dropped from a per-replica store tier."),
)


def _store_families(stats: dict, engine_stats: Any) -> Iterator[Any]:
    """Cached tokens by tier, and the store tier's counters when one is configured."""
    tiers = CounterMetricFamily("radixkv_cached_prompt_tokens_by_tier",
                                "Prompt tokens served from the cache, by tier (device pool, "
                                "store tier).", labels=["tier"])
    for tier, value in stats["cached_prompt_tokens_by_tier"].items():
        tiers.add_metric([tier], value)
    yield tiers
    store = stats.get("store")
    if store is None:
        return
    for key, doc in _STORE_COUNTERS:
        yield CounterMetricFamily(f"radixkv_kv_store_{key.removesuffix('_total')}", doc,
                                  value=store[key])
    rejected = CounterMetricFamily("radixkv_kv_store_rejected_blocks",
                                   "Store values refused by their header or checksum check.",
                                   labels=["reason"])
    for reason, value in store["rejected_blocks_by_reason"].items():
        rejected.add_metric([reason], value)
    yield rejected
    yield GaugeMetricFamily("radixkv_kv_store_down_bool",
                            "1 while the store tier is unreachable (requests compute).",
                            value=1 if store["down"] else 0)
    yield from _disk_families(store)
    hist = engine_stats.store_fetch_latency
    yield _histogram("radixkv_kv_store_fetch_seconds",
                     "Backend time of a store load (exists + get).", hist.cumulative(),
                     hist.sum_s)


_DISK_GAUGES = (
    ("radixkv_kv_store_disk_used_bytes", "disk_used_bytes", "Bytes of block values on disk."),
    ("radixkv_kv_store_disk_capacity_bytes", "disk_capacity_bytes",
     "Most bytes of block values the disk tier keeps."),
    ("radixkv_kv_store_disk_blocks", "disk_num_blocks", "Block values on disk."),
    ("radixkv_kv_store_disk_retained_blocks", "disk_retained_blocks",
     "Block values on disk under a live retention (evicted last)."),
)
_DISK_COUNTERS = (
    ("radixkv_kv_store_disk_evicted_blocks", "disk_evicted_blocks_total",
     "Block values the disk tier deleted for room."),
    ("radixkv_kv_store_disk_refused_puts", "disk_refused_puts_total",
     "Block values the disk tier refused to take (no room)."),
    ("radixkv_kv_store_disk_errors", "disk_errors_total",
     "Disk tier calls that failed while the memory tier in front of it went on (host,disk stack)."),
)


def _disk_families(store: dict) -> Iterator[Any]:
    """The disk tier's gauges and counters, when the store snapshot has them (``disk_*``)."""
    for name, key, doc in _DISK_GAUGES:
        if key in store:
            yield GaugeMetricFamily(name, doc, value=store[key])
    for name, key, doc in _DISK_COUNTERS:
        if key in store:
            yield CounterMetricFamily(name, doc, value=store[key])
    by_reason = store.get("disk_rejected_blocks_by_reason")
    if by_reason is not None:
        rejected = CounterMetricFamily("radixkv_kv_store_disk_rejected_blocks",
                                       "Disk values refused when read (corrupt, truncated, "
                                       "foreign, unreadable), by reason.", labels=["reason"])
        for reason, value in sorted(by_reason.items()):
            rejected.add_metric([reason], value)
        yield rejected
    if "promoted_blocks_total" in store:
        yield CounterMetricFamily("radixkv_kv_store_promoted_blocks",
                                  "Blocks a stacked tier read from a back tier and copied to "
                                  "its front tier.", value=store["promoted_blocks_total"])


_RETENTION_COUNTERS = (
    ("radixkv_retention_created", "created_total", "Retentions made (client TTL pins)."),
    ("radixkv_retention_refreshes", "refreshes_total",
     "Retention expiries pushed back by a hit or a repeated retain."),
    ("radixkv_retention_expirations", "expired_total",
     "Retentions that expired (their blocks became ordinary cached blocks)."),
    ("radixkv_retention_released", "released_total", "Retentions released by the operator route."),
    ("radixkv_retention_demoted_blocks", "demoted_blocks_total",
     "Retained blocks demoted from the device pool to the store tier under pressure."),
    ("radixkv_retention_repinned", "repinned_total",
     "Demoted retentions pinned in the pool again after their prefix was loaded back."),
    ("radixkv_retention_preempted_tokens", "preempted_tokens_total",
     "Retained tokens unpinned early (no store tier) so running requests got blocks."),
    ("radixkv_retention_refused_tokens", "refused_tokens_total",
     "Tokens asked for retention beyond a budget (pool fraction or tenant cap), not retained."),
)


def _retention_families(retention: dict | None) -> Iterator[Any]:
    """Retention gauges (retained blocks and tokens by TTL class and tenant) and counters."""
    if retention is None:
        return
    for name, key, doc in _RETENTION_COUNTERS:
        yield CounterMetricFamily(name, doc, value=retention[key])
    yield GaugeMetricFamily("radixkv_retention_retained_blocks",
                            "KV blocks pinned in the pool by live retentions (counted once).",
                            value=retention["retained_blocks"])
    yield GaugeMetricFamily("radixkv_retention_max_retained_blocks",
                            "KV blocks retentions may pin (--max-retained-fraction of the pool).",
                            value=retention["max_retained_blocks"])
    yield GaugeMetricFamily("radixkv_retention_demoted_retentions",
                            "Live retentions demoted to the store tier.",
                            value=retention["demoted_retentions"])
    by_ttl = retention["by_ttl"]
    for name, key, doc in (
            ("radixkv_retention_retentions", "retentions",
             "Live retentions pinned in the pool, by TTL class."),
            ("radixkv_retention_retained_tokens", "retained_tokens",
             "Tokens of the live pinned retentions, by TTL class (a prefix shared by two "
             "retentions counts for each)."),
            ("radixkv_retention_retained_class_blocks", "retained_blocks",
             "Blocks of the live pinned retentions, by TTL class (summed per retention).")):
        family = GaugeMetricFamily(name, doc, labels=["ttl"])
        for ttl, view in by_ttl.items():
            family.add_metric([ttl], view[key])
        yield family
    expired = CounterMetricFamily("radixkv_retention_expirations_by_ttl",
                                  "Retentions that expired, by TTL class.", labels=["ttl"])
    for ttl, view in by_ttl.items():
        expired.add_metric([ttl], view["expired_total"])
    yield expired
    by_tenant = sorted(retention["by_tenant"].items())
    if by_tenant:
        blocks = GaugeMetricFamily("radixkv_retention_tenant_retained_blocks",
                                   "KV blocks pinned by a tenant's retentions.", labels=["tenant"])
        tokens = GaugeMetricFamily("radixkv_retention_tenant_retained_tokens",
                                   "Tokens pinned by a tenant's retentions.", labels=["tenant"])
        refused = CounterMetricFamily("radixkv_retention_tenant_refused_tokens",
                                      "Tokens refused retention by the budgets, by tenant.",
                                      labels=["tenant"])
        for tenant, view in by_tenant:
            blocks.add_metric([tenant], view["retained_blocks"])
            tokens.add_metric([tenant], view["retained_tokens"])
            refused.add_metric([tenant], view["refused_tokens_total"])
        yield from (blocks, tokens, refused)


def _ignored_parameters() -> Any:
    # param_policy counts per process; "(unknown)" sums the names in no policy table.
    family = CounterMetricFamily("radixkv_ignored_parameters",
                                 "Request fields accepted and ignored (docs/api.md 'Parameter "
                                 "policy'), by field; '(unknown)' = names in no table.",
                                 labels=["param"])
    for name, value in sorted(IGNORED_COUNTS.snapshot().items()):
        family.add_metric([name], value)
    return family


def make_registry(state: ServerState) -> Any:
    """A fresh registry holding only this application's collector (None without the package)."""
    if CollectorRegistry is None:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RadixkvCollector(state))
    return registry


def render(registry: Any) -> tuple[bytes, str]:
    """The exposition body and its Content-Type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST

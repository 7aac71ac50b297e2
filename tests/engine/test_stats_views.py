"""Per-tenant counters and latency percentiles in ``EngineStats`` (what /stats and /metrics read)."""

from __future__ import annotations

import math

from radixkv.engine.stats import EngineStats, LatencyHistogram


def test_tenant_counters_are_recorded_once_at_admission_and_sum_to_global():
    stats = EngineStats()
    stats.record_admission(12, 8, tenant="a")
    stats.record_admission(12, 0, tenant="b")
    stats.record_admission(5, 4)  # no tenant (single-tenant server): global only
    stats.record_generated(2, tenant="a")
    stats.record_latency("a", ttft_s=0.010)
    stats.record_latency("a", itl_s=0.002)
    stats.record_abort(tenant="b")
    a, b = stats.tenant_snapshot("a"), stats.tenant_snapshot("b")
    assert (a["requests_total"], a["prompt_tokens_total"], a["cached_prompt_tokens_total"],
            a["computed_prompt_tokens_total"], a["requests_with_hit_total"],
            a["generated_tokens_total"]) == (1, 12, 8, 4, 1, 2)
    assert a["token_hit_rate"] == 8 / 12 and a["request_hit_rate"] == 1.0
    assert (b["requests_with_hit_total"], b["requests_aborted_total"], b["token_hit_rate"]) == (0, 1, 0.0)
    assert b["latency_ms"] == {"ttft_p50": None, "ttft_p99": None, "itl_p50": None, "itl_p99": None}
    assert math.isclose(a["latency_ms"]["ttft_p50"], 10.0)
    assert math.isclose(a["latency_ms"]["itl_p50"], 2.0)
    assert stats.tenant_snapshot("never-seen")["requests_total"] == 0
    assert stats.tenant_names() == ["a", "b"]
    assert stats.totals.requests_total == 3 and stats.totals.cached_prompt_tokens_total == 12
    assert (stats.totals.generated_tokens_total, stats.totals.requests_aborted_total) == (2, 1)
    assert math.isclose(stats.latency_ms()["ttft_p99"], 10.0)  # global includes tenants


def test_latency_histogram_buckets_and_percentiles():
    hist = LatencyHistogram(buckets=(0.01, 0.1, 1.0), window=4)
    for s in (0.005, 0.01, 0.05, 2.0, 0.2):
        hist.observe(s)
    assert hist.cumulative() == [(0.01, 2), (0.1, 3), (1.0, 4), (math.inf, 5)]
    assert hist.count == 5 and math.isclose(hist.sum_s, 2.265)
    assert list(hist.recent) == [0.01, 0.05, 2.0, 0.2]  # the window keeps the newest
    stats = EngineStats()
    for ms in range(1, 101):
        stats.record_latency(None, ttft_s=ms / 1000)
    latency = stats.latency_ms()
    assert math.isclose(latency["ttft_p50"], 50.0) and math.isclose(latency["ttft_p99"], 99.0)

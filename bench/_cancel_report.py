"""The numbers and the report of ``radixkv bench cancel-release`` (``bench/cancel_release.py``):
Prometheus text parsing (histogram buckets, nearest-rank bucket, ``histogram_quantile``), the
pairing of each cancel with the server's ``request_aborted`` log line, the summary with its
checks, and the table. ``streams`` below are ``cancel_release.Stream`` objects (what a
request sent and saw: ``cancelled``, ``phase``, ``closed_at_s``, ``chunk_wall_s``,
``release_ms``, ``step_end_ms``, ``itl_ms``, ``ttft_ms``, ...).
"""

# No ``from __future__ import annotations``: loaded beside the bench modules by path.
import argparse
import json
import math
from datetime import datetime
from typing import Any

from radixkv.engine.histogram import percentile_ms

CANCEL_HISTOGRAM = "radixkv_cancel_release_seconds"


def parse_histogram(metrics_text: str, name: str) -> list[tuple[float, int]]:
    """The cumulative buckets ``[(upper bound s, count), ..., (inf, count)]`` of histogram
    ``name`` in a Prometheus text exposition, in bound order."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == name:
            buckets = [(float(s.labels["le"]), int(s.value)) for s in family.samples
                       if s.name == name + "_bucket"]
            return sorted(buckets)
    raise ValueError(f"/metrics has no histogram {name}")


def metric_values(metrics_text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition as ``{name{labels}: value}`` (labels
    sorted, ``name`` alone when unlabelled)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def bucket_of_rank(buckets: list[tuple[float, int]], q: float) -> tuple[float, float] | None:
    """``(lower, upper]`` bounds (ms) of the bucket holding the nearest-rank ``q`` quantile
    (rank ``ceil(q x count)``, as ``/stats`` ranks); None without samples."""
    count = buckets[-1][1] if buckets else 0
    if count == 0:
        return None
    rank = min(count, max(1, math.ceil(q * count)))
    lower = 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            return lower * 1e3, bound * 1e3
        lower = bound
    return None  # unreachable: the +Inf bucket holds every sample


def histogram_quantile_ms(buckets: list[tuple[float, int]], q: float) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket where the
    cumulative count reaches ``q x count`` (ms); the bucket's lower bound in the +Inf bucket;
    None without samples."""
    count = buckets[-1][1] if buckets else 0
    if count == 0:
        return None
    target = q * count
    lower, below = 0.0, 0
    for bound, cumulative in buckets:
        if cumulative >= target:
            if math.isinf(bound):
                return lower * 1e3
            inside = cumulative - below
            fraction = (target - below) / inside if inside else 1.0
            return (lower + (bound - lower) * fraction) * 1e3
        lower, below = bound, cumulative
    return lower * 1e3


def outcomes(metrics: dict[str, float]) -> dict[str, int]:
    """Requests ended by outcome (``radixkv_requests_total``) in :func:`metric_values`."""
    prefix = 'radixkv_requests_total{outcome="'
    return {k[len(prefix):-2]: int(v) for k, v in metrics.items() if k.startswith(prefix)}


def _phase_times(streams: list[Any]) -> dict[str, Any]:
    """Client close -> released (``Stream.release_ms``) of one phase's cancels: how many were
    sent and timed, p50 and max (ms); how many had the step in flight observed
    (``Stream.step_end_ms``) and the most any was released after that step's end (ms)."""
    times = [s.release_ms for s in streams if s.release_ms is not None]
    beyond = [s.release_ms - s.step_end_ms for s in streams
              if s.release_ms is not None and s.step_end_ms is not None]
    return {"cancels": len(streams), "timed": len(times), "p50": _pct(times, 0.5),
            "max": max(times, default=None), "step_observed": len(beyond),
            "beyond_step_end_max": max(beyond, default=None)}


def _released_at_step_end(cancelled: list[Any], margin_ms: float) -> bool | None:
    """Whether every cancel whose step in flight was observed was released within
    ``margin_ms`` of that step's end (None: none observed)."""
    beyond = [s.release_ms - s.step_end_ms for s in cancelled
              if s.release_ms is not None and s.step_end_ms is not None]
    return None if not beyond else max(beyond) <= margin_ms


def _bound(value: float) -> float | str:
    """A bucket bound for JSON, which has no infinity: ``"+Inf"`` as Prometheus writes it."""
    return value if math.isfinite(value) else "+Inf"


def _span(span: tuple[float, float] | None) -> list[float | str] | None:
    return None if span is None else [_bound(span[0]), _bound(span[1])]


def _log_time_s(stamp: str) -> float:
    """A structlog ISO timestamp (UTC, ``...Z``) as a Unix time in seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def attach_release_times(streams: list[Any], log_text: str) -> int:
    """Set each cancelled stream's ``release_ms`` from the server's JSON log lines: its
    ``request_admitted`` line pairs the ``X-Request-Id`` sent with the engine's id, and the
    engine thread writes ``request_aborted`` with that id right after releasing the blocks.
    Returns how many cancelled streams got a time."""
    engine_id: dict[str, str] = {}
    aborted_s: dict[str, float] = {}
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        event = entry.get("event")
        if event == "request_admitted" and "completion_id" in entry:
            engine_id[entry.get("request_id", "")] = entry["completion_id"]
        elif event == "request_aborted" and "timestamp" in entry:
            aborted_s[entry.get("request_id", "")] = _log_time_s(entry["timestamp"])
    found = 0
    for stream in streams:
        released = aborted_s.get(engine_id.get(stream.request_id, ""))
        if stream.cancelled and stream.closed_at_s is not None and released is not None:
            stream.release_ms = (released - stream.closed_at_s) * 1e3
            found += 1
    return found


def attach_step_ends(streams: list[Any]) -> None:
    """Set each cancelled stream's ``step_end_ms``: the earliest chunk after its close among
    the streams that were decoding across it (a chunk before the close, one after), which is
    when the step in flight ended: every decoding stream gets a token from every step."""
    for stream in streams:
        if stream.closed_at_s is None:
            continue
        closed = stream.closed_at_s
        ends = [next(t for t in other.chunk_wall_s if t > closed) for other in streams
                if other is not stream and other.chunk_wall_s
                and other.chunk_wall_s[0] <= closed < other.chunk_wall_s[-1]]
        if ends:
            stream.step_end_ms = (min(ends) - closed) * 1e3


def _pct(values_ms: list[float], q: float) -> float | None:
    """Nearest-rank percentile (ms), the rank ``/stats`` uses for the cancel times."""
    return percentile_ms([v / 1e3 for v in values_ms], q)


def summarise(streams: list[Any], stats: dict[str, Any], metrics_text: str,
              base: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The measured numbers and the checks (see the module docstring)."""
    activity = stats["kv_activity"]
    metrics = metric_values(metrics_text)
    cancelled = [s for s in streams if s.cancelled]
    kept = [s for s in streams if not s.cancelled]
    itl = [gap for s in kept for gap in s.itl_ms]
    ttft = [s.ttft_ms for s in kept if s.ttft_ms is not None]
    counted = activity["cancels_total"] - base["cancels_total"]
    p50, p99 = activity["cancel_release_ms_p50"], activity["cancel_release_ms_p99"]
    buckets = parse_histogram(metrics_text, CANCEL_HISTOGRAM)
    itl_p99 = _pct(itl, 0.99)
    step_max = activity.get("step_ms_max")
    bound = None if step_max is None else step_max + args.margin_ms
    within = None if bound is None or p99 is None else p99 <= bound
    itl_bound = None if itl_p99 is None else itl_p99 + args.margin_ms
    within_itl = None if itl_bound is None or p99 is None else p99 <= itl_bound

    def in_bucket(value: float | None, q: float) -> bool:
        span = bucket_of_rank(buckets, q)
        return (value is None) == (span is None) and (
            span is None or span[0] - 1e-6 < value <= span[1] + 1e-6)

    pool = {k: v for k, v in stats["pool"].items() if k != "populate"}
    running = metrics.get("radixkv_running_sequences")
    waiting = metrics.get("radixkv_waiting_sequences")
    leak = stats.get("leak_check") or {}
    ended = sum(outcomes(metrics).values()) - sum(base["outcomes"].values())
    checks = {
        "cancels_counted": counted == len(cancelled),
        "all_requests_ended": ended == len(streams) and all(
            s.error is None and s.finish_reason is not None and s.chunks >= 1 for s in kept)
        and not any(s.error for s in cancelled),
        "pool_idle": (pool["live_blocks"] == 0 and pool["in_use_blocks"] == 0
                      and running == 0 and waiting == 0
                      and pool["free_blocks"] + pool["cached_evictable_blocks"]
                      + pool["in_use_blocks"] == pool["total_blocks"]
                      and not leak.get("failures_total")),
        "histogram_agrees": (buckets[-1][1] == activity["cancels_total"]
                             and in_bucket(p50, 0.5) and in_bucket(p99, 0.99)),
        "within_bound": within,
    }
    return {
        "requests": len(streams), "concurrency": args.concurrency,
        "cancel_fraction": args.cancel_fraction, "max_tokens": args.max_tokens,
        "seed": args.seed, "margin_ms": args.margin_ms,
        "prompt_tokens_min": min(s.prompt_tokens for s in streams),
        "prompt_tokens_max": max(s.prompt_tokens for s in streams),
        "cancels_sent": len(cancelled),
        "cancels_sent_prefill": sum(s.phase == "prefill" for s in cancelled),
        "cancels_sent_decode": sum(s.phase == "decode" for s in cancelled),
        "cancels_counted": counted,
        "cancel_release_ms_p50": p50, "cancel_release_ms_p99": p99,
        "histogram": {"buckets_s": [[_bound(b), c] for b, c in buckets],
                      "sum_s": metrics.get(CANCEL_HISTOGRAM + "_sum"),
                      "p50_ms_estimate": histogram_quantile_ms(buckets, 0.5),
                      "p99_ms_estimate": histogram_quantile_ms(buckets, 0.99),
                      "p50_bucket_ms": _span(bucket_of_rank(buckets, 0.5)),
                      "p99_bucket_ms": _span(bucket_of_rank(buckets, 0.99))},
        "close_to_release_ms": {phase: _phase_times([s for s in cancelled if s.phase == phase])
                                for phase in ("prefill", "decode")},
        "itl_streams": len(kept), "itl_samples": len(itl),
        "itl_ms_p50": _pct(itl, 0.5), "itl_ms_p99": itl_p99,
        "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
        "server_latency_ms": stats.get("latency_ms"),
        "step_ms_p50": activity.get("step_ms_p50"), "step_ms_p99": activity.get("step_ms_p99"),
        "step_ms_max": step_max,
        "bound_ms": bound, "within_bound": within,
        "itl_bound_ms": itl_bound, "within_itl_bound": within_itl,
        "pool": pool, "running_sequences": running, "waiting_sequences": waiting,
        "leak_check": leak, "outcomes": {k: v - base["outcomes"].get(k, 0)
                                         for k, v in outcomes(metrics).items()},
        "checks": checks,
        "released_at_step_end": _released_at_step_end(cancelled, args.margin_ms),
        "all_checks_ok": all(v is not False for v in checks.values()),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_report(r: dict[str, Any]) -> str:
    """The result as a compact table."""
    hist, phases = r["histogram"], r["close_to_release_ms"]
    def span(b: list[float | str] | None) -> str:
        return "-" if b is None else "({}, {}]".format(
            *(f"{x:g}" if isinstance(x, float) else x for x in b))

    within = {True: "yes", False: "NO", None: "- (nothing measured)"}[r["within_bound"]]
    rows = [
        ("requests (concurrency, max tokens)",
         f"{r['requests']} ({r['concurrency']}, {r['max_tokens']})"),
        ("cancels sent: prefill + decode", f"{r['cancels_sent']}: {r['cancels_sent_prefill']} "
                                           f"+ {r['cancels_sent_decode']}"),
        ("cancels counted by the server", str(r["cancels_counted"])),
        ("cancel -> released p50 / p99 ms",
         f"{_ms(r['cancel_release_ms_p50'])} / {_ms(r['cancel_release_ms_p99'])}"),
        ("  /metrics buckets p50 / p99 ms",
         f"{span(hist['p50_bucket_ms'])} / {span(hist['p99_bucket_ms'])}"),
        ("  client close -> released max ms",
         f"prefill {_ms(phases['prefill']['max'])}, decode {_ms(phases['decode']['max'])}"),
        ("  released after the step in flight, max ms",
         f"prefill {_ms(phases['prefill']['beyond_step_end_max'])} "
         f"({phases['prefill']['step_observed']} observed), decode "
         f"{_ms(phases['decode']['beyond_step_end_max'])} "
         f"({phases['decode']['step_observed']} observed)"),
        (f"ITL p50 / p99 ms ({r['itl_streams']} streams)",
         f"{_ms(r['itl_ms_p50'])} / {_ms(r['itl_ms_p99'])}"),
        ("engine step p50 / p99 / max ms",
         f"{_ms(r['step_ms_p50'])} / {_ms(r['step_ms_p99'])} / {_ms(r['step_ms_max'])}"),
        (f"bound: longest step + {r['margin_ms']:g} ms", _ms(r["bound_ms"])),
        ("within bound", within),
        (f"within ITL p99 + {r['margin_ms']:g} ms ({_ms(r['itl_bound_ms'])})",
         {True: "yes", False: "no", None: "-"}[r["within_itl_bound"]]),
        ("pool idle after the load", "yes" if r["checks"]["pool_idle"] else "NO"),
    ]
    failed = [k for k, v in r["checks"].items() if v is False]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    lines.append(f"  checks: {'all ok' if not failed else 'FAILED ' + ', '.join(failed)}")
    return "bench cancel-release:\n" + "\n".join(lines)

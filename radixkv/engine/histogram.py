"""Latency histograms: cumulative Prometheus buckets plus a window of recent samples.

Not locked: the owner (``EngineStats``, ``KVActivity``) holds its lock around every call.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

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


def percentile_ms(samples: list[float], q: float) -> float | None:
    """Nearest-rank percentile in milliseconds; None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000.0

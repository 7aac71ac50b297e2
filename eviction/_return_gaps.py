"""Online model of when a cached prefix is asked for again: the distribution of *return gaps*
(time from the end of a request to the next request of the same session), learned from the
cache's own events, for ``predicted-reuse`` (:mod:`eviction.predicted_reuse`).

An agent session alternates model calls and tool calls: its next request arrives one tool
latency after its previous request ended, and after its last request nothing comes back. When
those gaps are *regular* (most fall in a narrow band around their median), the time at which a
session's leaf is used next is predictable (its request's end plus the median gap), and a leaf
whose session is well past that time has most likely finished. When the gaps are spread over
orders of magnitude (chat users coming back after seconds or hours), neither holds and a
policy must fall back to value and recency.

What is learned (all from events the policy already sees; nothing is rescored by the clock):

* a gap sample per returning session: the session's latest release (``request_end_s`` of the
  leaf it left, :meth:`ReturnGapModel.observe_end`) to the first hit of its next request
  (:meth:`ReturnGapModel.observe_return`); for nodes without a session key, the node's own
  release to its next hit;
* over the last ``window`` samples (a ring): the median ``median_s`` and the share of samples
  within ``[median / band, median · band]``; the gaps are *regular* when that share is at least
  ``share_min`` (*banded*). Refitted every ``refit_every`` new samples (one sort of ≤ ``window``
  floats);
* gaps outside a narrow band but *bounded* for the pool are regular too: when at least their
  median is no longer than the pool's mean victim idle time ``T̂`` (read from ``victim_idle`` at
  the refit: a leaf kept that long would still be resident) and at least ``return_share_min``
  (0.6) of recent releases were followed by a return (a release is more often a session's turn
  than its last; both counts halve every ``16 · window`` releases, so the share follows the
  workload in a long-running server). The return window ``window_s`` is then the largest of the
  ``quantiles`` (50th, 60th, … 90th percentile) of the kept gaps that is within ``T̂``: a live
  leaf is kept as long as the pool can afford, to catch as many returns as it can. Agent
  sessions with randomly distributed tool latencies (exponential with mean 1 s: 28 % of gaps in
  the band) are so; a chat trace whose users return after 40 s to 25 min, after fewer than half
  of their requests, is not. On the agent chat traces with exponential tool latency
  (``bench eviction --format chat --tool-latency-dist exp``) this lifted
  tau-bench 10 % from 0.610 to 0.697 FLOP hit, SWE-agent 10 % from 0.211 to 0.265 and
  mini-swe-agent-gemini3 5 % from 0.377 to 0.418.

Before ``min_samples`` samples exist the model answers with its prior (``prior_regular``).
"""

from __future__ import annotations

import time
from typing import Callable

#: Sessions whose latest end is remembered; past this the table is cleared (rare).
_SESSIONS_MAX = 1 << 16


class ReturnGapModel:
    """Learned return-gap distribution (module docstring).

    Args:
        window: Gap samples kept (newest replace oldest), ≥ 1.
        min_samples: Samples needed before the fitted answer replaces the prior, ≥ 1.
        refit_every: New samples between refits, ≥ 1.
        band: Half-width of the regular band as a factor around the median, > 1.
        share_min: Share of samples in the band that makes the gaps regular, in (0, 1].
        prior_regular: Answer of :attr:`regular` before ``min_samples`` samples.
        quantiles: Quantiles of the kept samples the bounded test compares with ``T̂``, each in
            (0, 1); the least of them must fit for the gaps to be bounded.
        return_share_min: Least share of releases followed by a return for the bounded test,
            in [0, 1].
        victim_idle: Callable giving the pool's mean victim idle time ``T̂`` (clock units; ≤ 0
            while unknown); None disables the bounded test.

    Attributes:
        median_s: Median of the kept samples at the last refit (clock units; 0 before any).
        window_s: The return window ``ĝ``: the largest of the ``quantiles`` within ``T̂`` when
            the gaps are regular by the bounded test, else ``median_s``.
        in_band_share: Share of kept samples within the band at the last refit.
        bounded: Whether the last refit found the gaps regular by the bounded test (not banded).
        num_samples: Samples observed in total (returns).
        num_ends: Releases observed in total (:meth:`observe_end` calls).
        fit_s: Wall seconds spent refitting (reported as the policy's training time).

    Raises:
        ValueError: naming the argument when a value is out of range.
    """

    def __init__(self, *, window: int = 256, min_samples: int = 32, refit_every: int = 8,
                 band: float = 1.5, share_min: float = 0.8, prior_regular: bool = True,
                 quantiles: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9),
                 return_share_min: float = 0.6,
                 victim_idle: Callable[[], float] | None = None) -> None:
        if window < 1:
            raise ValueError(f"window: must be ≥ 1, got {window!r}")
        if min_samples < 1:
            raise ValueError(f"min_samples: must be ≥ 1, got {min_samples!r}")
        if refit_every < 1:
            raise ValueError(f"refit_every: must be ≥ 1, got {refit_every!r}")
        if not band > 1.0:
            raise ValueError(f"band: must be > 1, got {band!r}")
        if not 0.0 < share_min <= 1.0:
            raise ValueError(f"share_min: must be in (0, 1], got {share_min!r}")
        if not quantiles or not all(0.0 < q < 1.0 for q in quantiles):
            raise ValueError(f"quantiles: must be values in (0, 1), got {quantiles!r}")
        if not 0.0 <= return_share_min <= 1.0:
            raise ValueError(f"return_share_min: must be in [0, 1], got {return_share_min!r}")
        self.window = window
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.band = band
        self.share_min = share_min
        self.prior_regular = prior_regular
        self.quantiles = tuple(sorted(quantiles))
        self.return_share_min = return_share_min
        self.victim_idle = victim_idle
        self.median_s = self.window_s = 0.0
        self.in_band_share = 0.0
        self.bounded = False
        self.num_samples = 0
        self.num_ends = 0
        self._recent_returns = self._recent_ends = 0  # halved every 16 * window releases
        self.fit_s = 0.0
        self._gaps: list[float] = []
        self._next = 0  # ring position of the oldest sample once full
        self._since_fit = 0
        self._regular = prior_regular
        self._ends: dict[object, float] = {}  # session key (or node uid) -> latest release

    @property
    def regular(self) -> bool:
        """Whether return gaps are regular (the prior until ``min_samples`` samples)."""
        return self._regular

    def observe_end(self, key: object, end_s: float) -> None:
        """A request of session ``key`` (or the node ``key``) released its path at ``end_s``."""
        self.num_ends += 1
        self._recent_ends += 1
        if self._recent_ends >= 16 * self.window:
            self._recent_ends //= 2
            self._recent_returns //= 2
        ends = self._ends
        if len(ends) >= _SESSIONS_MAX and key not in ends:
            ends.clear()
        ends[key] = end_s

    def observe_return(self, key: object, now_s: float) -> float | None:
        """Session (or node) ``key`` is back at ``now_s``: record the gap since its latest end
        once (later hits of the same request find no end); returns the gap or None."""
        end = self._ends.get(key)
        if end is None or now_s < end:  # an overlapping request of the session: not a return
            return None
        del self._ends[key]
        gap = now_s - end
        self.add(gap)
        return gap

    def add(self, gap_s: float) -> None:
        """Record one return gap (clock units, ≥ 0) and refit when due."""
        gaps = self._gaps
        if len(gaps) < self.window:
            gaps.append(gap_s)
        else:
            gaps[self._next] = gap_s
            self._next = (self._next + 1) % self.window
        self.num_samples += 1
        self._recent_returns += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every or len(gaps) <= self.min_samples:
            self._fit()

    def _fit(self) -> None:
        t0 = time.perf_counter()
        self._since_fit = 0
        s = sorted(self._gaps)
        n = len(s)
        m = s[n // 2]
        lo, hi = m / self.band, m * self.band
        share = sum(1 for g in s if lo <= g <= hi) / n
        self.median_s, self.in_band_share = m, share
        self.bounded = False
        window = m
        if n < self.min_samples:
            self._regular = self.prior_regular
        elif share >= self.share_min:
            self._regular = True
        else:
            idle = self.victim_idle() if self.victim_idle is not None else 0.0
            if idle > 0.0 and self._recent_returns >= self.return_share_min * self._recent_ends:
                for p in self.quantiles:
                    q = s[min(n - 1, int(p * n))]
                    if not q <= idle:
                        break
                    if q > 0.0:
                        window, self.bounded = q, True
            self._regular = self.bounded
        self.window_s = window
        self.fit_s += time.perf_counter() - t0

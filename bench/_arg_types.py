"""argparse types shared by the bench drivers (loaded by path: ``bench/`` is on ``sys.path``)."""

import argparse
import math
import random
from dataclasses import dataclass

from radixkv.arg_types import fraction, positive_int_list

# The generic value types are the package's (``radixkv.arg_types``), under the names the bench
# drivers use: ``sizes`` a comma list of ints >= 1, ``share`` a number in [0, 1].
sizes = positive_int_list
share = fraction


THINK_TIME_DISTS = ("fixed", "exp")
"""Distributions ``--think-time-s`` takes: ``S`` / ``fixed:S`` (every gap S seconds) or
``exp:MEAN`` (exponential gaps of that mean)."""


@dataclass(frozen=True)
class ThinkTime:
    """Think time between a session's turns: the agent's tool run or the user's pause, from the
    end of one reply to the next turn's request.

    Attributes:
        dist: ``fixed`` or ``exp`` (:data:`THINK_TIME_DISTS`).
        mean_s: The fixed gap, or the exponential's mean, in seconds (>= 0).
    """

    dist: str = "fixed"
    mean_s: float = 0.0

    def __post_init__(self) -> None:
        if self.dist not in THINK_TIME_DISTS:
            raise ValueError(f"think_time_s: distribution must be one of {THINK_TIME_DISTS}, "
                             f"got {self.dist!r}")
        if not (math.isfinite(self.mean_s) and self.mean_s >= 0):
            raise ValueError(f"think_time_s: seconds must be finite and >= 0, got {self.mean_s!r}")

    def draw_s(self, seed: int, session: str, turn: int) -> float:
        """The gap before ``turn`` (>= 1) of ``session``, seconds: ``mean_s`` when fixed; an
        exponential draw from ``random.Random`` seeded with ``(seed, session, turn)`` otherwise,
        so a gap does not depend on the order in which turns are scheduled (every target and
        every policy of a run sees the same gaps)."""
        if self.dist == "fixed" or self.mean_s == 0:
            return self.mean_s
        return random.Random(f"{seed}|{session}|{turn}").expovariate(1.0 / self.mean_s)

    def __str__(self) -> str:
        return f"{self.mean_s:g}" if self.dist == "fixed" else f"{self.dist}:{self.mean_s:g}"


def think_time(text: str) -> ThinkTime:
    """``"30"`` / ``"fixed:30"`` -> 30 s between turns; ``"exp:60"`` -> exponential gaps of mean
    60 s. Raises ``argparse.ArgumentTypeError`` (the CLI exits 2 naming the flag) otherwise."""
    dist, sep, value = text.strip().rpartition(":")
    try:
        return ThinkTime(dist if sep else "fixed", float(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected S or fixed:S or exp:MEAN (seconds >= 0), got {text!r} ({exc})") from None


def chosen_sessions(num_sessions: int, fraction: float) -> list[bool]:
    """Which of ``num_sessions`` sessions (in their run order) are in a share ``fraction``:
    session ``i`` is chosen when ``floor((i + 1) * fraction) > floor(i * fraction)``, so exactly
    ``floor(num_sessions * fraction)`` are, spread evenly (0.5: every second one, from the
    second; 0.25: the 4th, 8th, ...).

    Raises:
        ValueError: naming ``retain_share`` when ``fraction`` is outside ``[0, 1]``.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"retain_share: must be in [0, 1], got {fraction!r}")
    return [math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)
            for i in range(num_sessions)]

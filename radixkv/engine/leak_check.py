"""The serving process's idle self-check of the KV pool: log and count a leak, never raise.

When the engine runs out of work every block is free, cached in the tree, or pinned by a
retention; none may be private, and no request may still hold cache state. ``IdleLeakCheck``
verifies that (and the pool's conservation, ``free + cached_evictable + in_use == total``, with
every other invariant ``CacheManager.check_integrity`` holds) at most once per
``interval_s`` while idle. A failure is an ``kv_leak_check_failed`` error event in the log and
one more ``failures_total``; the engine goes on serving (tests run the same checks and fail).

The check is O(blocks + tree nodes) on the engine thread: at most one per interval, only when
no request is waiting or running, so a request arriving meanwhile waits for one check at most.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Protocol

from radixkv.log import get_logger

log = get_logger(__name__)

#: Default seconds between two idle checks.
DEFAULT_INTERVAL_S = 60.0


class _IdleCache(Protocol):
    """What the check reads of the cache (``CacheManager``)."""

    @property
    def num_active_requests(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_evictable_blocks(self) -> int: ...
    @property
    def num_in_use_blocks(self) -> int: ...
    @property
    def pool(self) -> Any: ...
    def check_integrity(self, *, verify_hashes: bool = False) -> None: ...


def check_idle_pool(cache: _IdleCache) -> None:
    """Verify an idle cache: no active request, no private block, conservation, and
    ``check_integrity``.

    Raises:
        AssertionError: naming the first violated invariant.
    """
    assert cache.num_active_requests == 0, (
        f"{cache.num_active_requests} requests still hold cache state with the engine idle")
    private = cache.pool.num_private_blocks
    assert private == 0, f"{private} blocks owned by no running request with the engine idle"
    total = cache.num_free_blocks + cache.num_cached_evictable_blocks + cache.num_in_use_blocks
    assert total == cache.num_blocks, (
        f"free + cached_evictable + in_use = {total} != num_blocks {cache.num_blocks}")
    cache.check_integrity()


class IdleLeakCheck:
    """Runs :func:`check_idle_pool` at most once per ``interval_s`` (engine thread).

    Args:
        interval_s: Least seconds between two checks (≥ 0; 0 checks at every idle moment).
        clock: Seconds, monotonic (tests inject one).

    Attributes:
        checks_total: Checks run.
        failures_total: Checks that found a violated invariant.
        last_error: The latest failure's message, or None.

    Raises:
        ValueError: naming ``interval_s`` if negative or not a finite number.
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (isinstance(interval_s, bool) or not isinstance(interval_s, (int, float))
                or not math.isfinite(interval_s) or interval_s < 0):
            raise ValueError(f"interval_s: must be a finite number >= 0, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self._clock = clock
        self._last_s = -math.inf
        self.checks_total = 0
        self.failures_total = 0
        self.last_error: str | None = None

    def maybe_run(self, cache: _IdleCache) -> bool | None:
        """Check if ``interval_s`` passed since the last check: True (clean), False (a leak,
        logged and counted), None (not due)."""
        now = self._clock()
        if now - self._last_s < self.interval_s:
            return None
        self._last_s = now
        return self.run(cache)

    def run(self, cache: _IdleCache) -> bool:
        """Check now; on failure log ``kv_leak_check_failed`` (error) and count it."""
        self.checks_total += 1
        try:
            check_idle_pool(cache)
        except Exception as exc:  # noqa: BLE001 - a self-check reports, it never stops serving
            self.failures_total += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("kv_leak_check_failed", error=self.last_error,
                      failures_total=self.failures_total, free_blocks=cache.num_free_blocks,
                      cached_evictable_blocks=cache.num_cached_evictable_blocks,
                      in_use_blocks=cache.num_in_use_blocks, total_blocks=cache.num_blocks)
            return False
        return True

    def snapshot(self) -> dict[str, Any]:
        """The ``leak_check`` object of ``/stats``."""
        return {"checks_total": self.checks_total, "failures_total": self.failures_total,
                "interval_s": self.interval_s, "last_error": self.last_error}

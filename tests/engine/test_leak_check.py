"""The idle KV pool self-check (``radixkv.engine.leak_check``): a clean idle pool passes, a
deliberately broken one is logged and counted (never raised), at most once per interval."""

from __future__ import annotations

import itertools

import pytest
from structlog.testing import capture_logs

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.engine.leak_check import IdleLeakCheck

ROPE = "theta=100000.0;scaling=None"


def warm_cache() -> tuple[CacheManager, bytes]:
    """A 16-block pool (B = 4) after one finished request: 2 cached blocks, the rest free."""
    ticks = itertools.count()
    cm = CacheManager(16, 4, clock=lambda: float(next(ticks)))
    root = cm.identity_root(CacheIdentity("r1", 4, "float32", ROPE))
    tokens = list(range(1, 10))
    cm.begin("done", root, tokens)
    assert cm.allocate("done", 9)
    cm.publish("done", tokens, 9)
    cm.release("done")
    return cm, root


def test_a_clean_idle_pool_passes() -> None:
    cm, _ = warm_cache()
    check = IdleLeakCheck(0)
    with capture_logs() as logs:
        assert check.run(cm) is True
    assert (check.checks_total, check.failures_total, check.last_error) == (1, 0, None)
    assert logs == []


def test_a_block_owned_by_no_request_is_logged_and_counted() -> None:
    cm, _ = warm_cache()
    leaked = cm.pool.allocate(1)  # taken off the free list, never given to a request
    assert leaked == [3]
    check = IdleLeakCheck(0)
    with capture_logs() as logs:
        assert check.run(cm) is False
    assert (check.checks_total, check.failures_total) == (1, 1)
    assert check.last_error == ("AssertionError: 1 blocks owned by no running request with the "
                                "engine idle")
    (event,) = logs
    assert event["event"] == "kv_leak_check_failed" and event["log_level"] == "error"
    assert (event["free_blocks"], event["cached_evictable_blocks"], event["in_use_blocks"],
            event["total_blocks"]) == (13, 2, 1, 16)


def test_a_request_left_active_and_a_broken_count_are_leaks() -> None:
    cm, root = warm_cache()
    cm.begin("finished-but-not-released", root, [1, 2, 3, 4, 5])
    check = IdleLeakCheck(0)
    assert check.run(cm) is False
    assert check.last_error == ("AssertionError: 1 requests still hold cache state with the "
                                "engine idle")
    cm.release("finished-but-not-released")
    assert check.run(cm) is True
    cm.pool._num_cached += 1  # the pool's books disagree with the tree
    assert check.run(cm) is False
    assert check.last_error is not None and "cached" in check.last_error
    assert (check.checks_total, check.failures_total) == (3, 2)


def test_at_most_once_per_interval() -> None:
    now = [100.0]
    cm, _ = warm_cache()
    check = IdleLeakCheck(60, clock=lambda: now[0])
    assert check.maybe_run(cm) is True  # the first idle moment checks
    now[0] = 159.0
    assert check.maybe_run(cm) is None
    now[0] = 160.0
    assert check.maybe_run(cm) is True
    assert check.checks_total == 2
    assert check.snapshot() == {"checks_total": 2, "failures_total": 0, "interval_s": 60.0,
                                "last_error": None}


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "60", True])
def test_a_bad_interval_names_the_field(bad) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        IdleLeakCheck(bad)

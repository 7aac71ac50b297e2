"""A policy's own CPU time in ``radixkv bench eviction``: wall-clock accumulators
(``time.perf_counter``) around every hook the cache calls on the policy instance.

The hooks of the ``radixkv.eviction`` protocol are wrapped on the instance (instance attributes
shadow the class's methods), before the tree that calls them is built. A hook called from
inside another hook (a policy calling its own ``priority`` from ``on_evict``) is counted once,
in the outer call. A policy that trains synchronously does so inside a hook (it trains every K
evictions, from ``on_evict`` / ``on_ghost_drop``), so the hook time includes that training;
training on a background worker runs outside the hooks and is reported apart
(``background_train_cpu_s``). Wall time, not thread CPU time: ``time.thread_time`` is a system
call here (1.4 µs against ``perf_counter``'s 0.1 µs), which would bias every hook call. So the
figures hold only while nothing stops the replay or crowds its core (a job that SIGSTOPs other
processes for quiet timing inflates them: rerun then).
"""

from __future__ import annotations

import time
from typing import Any

HOOKS = ("priority", "on_evict", "on_ghost_hit", "on_ghost_drop", "on_hit", "on_insert",
         "add_leaf", "remove_leaf", "choose_victim")
"""Every hook of ``radixkv.eviction.EvictionPolicy`` the cache may call."""


class HookTimer:
    """Time spent in ``policy``'s hooks, wrapped by :meth:`install`.

    Attributes:
        seconds: Per hook name, total seconds in its outermost calls.
        calls: Per hook name, number of calls (outermost or nested).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = 0

    def install(self, policy: Any) -> Any:
        """Wrap every hook ``policy`` has with a timer; returns ``policy`` (same instance)."""
        for name in HOOKS:
            fn = getattr(policy, name, None)
            if callable(fn):
                self.seconds[name] = 0.0
                self.calls[name] = 0
                setattr(policy, name, self._wrap(name, fn))
        return policy

    def _wrap(self, name: str, fn):
        clock = time.perf_counter
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            calls[name] += 1
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - t0
                self._depth = 0

        timed.__wrapped__ = fn
        return timed

    @property
    def total_s(self) -> float:
        """Seconds in all hooks together."""
        return sum(self.seconds.values())


def policy_cost(timer: HookTimer, policy: Any, evicted_blocks: int) -> dict:
    """The report fields of a policy's own cost.

    Returns:
        ``policy_hook_s`` (all hooks, sync training included), ``policy_us_per_eviction``
        (= hook time ÷ evicted blocks, µs; None when nothing was evicted),
        ``train_cpu_s`` / ``background_train_cpu_s`` (the policy's own counters; None when it
        has none), ``sync_train_cpu_s`` (their difference: training on the replay thread, part
        of the hook time) and ``hook_calls``.
    """
    hook_s = timer.total_s
    train = getattr(policy, "train_cpu_s", None)
    background = getattr(policy, "background_train_cpu_s", None)
    sync = None
    if train is not None:
        sync = float(train) - float(background or 0.0)
    return {
        "policy_hook_s": round(hook_s, 6),
        "policy_us_per_eviction": (round(1e6 * hook_s / evicted_blocks, 3)
                                   if evicted_blocks else None),
        "train_cpu_s": None if train is None else round(float(train), 6),
        "background_train_cpu_s": None if background is None else round(float(background), 6),
        "sync_train_cpu_s": None if sync is None else round(sync, 6),
        "hook_calls": sum(timer.calls.values()),
    }

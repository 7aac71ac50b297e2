"""Continuous-batching scheduler: waiting and running queues under a per-step token budget.

Each step every running request decodes one token, and waiting requests are admitted in
arrival order while the token budget and the pool allow. Admission matches the prompt against
the prefix cache (the lookup is recorded in the stats exactly once, at first admission) and
allocates blocks for the unmatched suffix; a request that does not fit waits: admitting never
preempts a running request. When a running request needs a new block and none can be freed or
evicted, the most recently admitted running request is preempted by recompute: its published
blocks stay in the tree, so its resume is mostly a prefix hit.

The scheduler talks only to the ``CacheManager`` facade, never to the tree or the pool.
"""

from __future__ import annotations

from collections import deque

from radixkv.cache_manager import CacheManager
from radixkv.config import SchedulerConfig
from radixkv.log import get_logger
from radixkv.request import Request, RequestStatus
from radixkv.stats import EngineStats

log = get_logger(__name__)


class Scheduler:
    """Decides which requests run in the next forward step.

    Args:
        config: batching limits.
        cache: the cache-manager facade.
        stats: counters updated at admission.
    """

    def __init__(self, config: SchedulerConfig, cache: CacheManager, stats: EngineStats) -> None:
        self.config = config
        self.cache = cache
        self.stats = stats
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> list[Request]:
        """Pick this step's requests and make sure each has blocks for its new tokens.

        Returns:
            The requests to run, running (decoding) ones first, then newly admitted ones whose
            suffix is prefilled this step. For each, ``req.new_token_ids()`` are the tokens to
            compute and ``req.num_computed_tokens`` the prefix already in the pool.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.cache.allocate(req.request_id, len(req.token_ids)):
                scheduled.append(req)
                budget -= len(req.token_ids) - req.num_computed_tokens
                i += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is req:
                break
        # A step that had to preempt admits nobody: the pool is short already.
        if not preempted:
            self._admit(scheduled, budget)
        return scheduled

    def _admit(self, scheduled: list[Request], budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_cached = self.cache.begin(req.request_id, req.cache_root, req.token_ids)
            num_new = len(req.token_ids) - num_cached
            # One prompt longer than the budget still runs, alone, so it cannot starve.
            if (num_new > budget and scheduled) or not self.cache.allocate(
                    req.request_id, len(req.token_ids)):
                self.cache.release(req.request_id)
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = num_cached
                self.stats.record_admission(req.num_prompt_tokens, num_cached)
            self.running.append(req)
            scheduled.append(req)
            budget -= num_new
            if budget <= 0:
                break

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions_total += 1
        log.info("preempted", request_id=req.request_id, num_tokens=len(req.token_ids))

    def finish(self, req: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Remove a running request and release its blocks (published ones stay cached)."""
        self.running.remove(req)
        self.cache.release(req.request_id)
        req.status = status

    def abort(self, request_id: str) -> Request | None:
        """Drop a request in any phase; returns it, or None if it is not here."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.status = RequestStatus.ABORTED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, RequestStatus.ABORTED)
                return req
        return None

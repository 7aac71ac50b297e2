"""Continuous-batching scheduler: waiting and running queues under a per-step token budget.

Each step packs, in one forward, one decode token for every decoding request plus suffix
prefill chunks (at most ``prefill_chunk_tokens`` each) for requests still prefilling, within
``max_num_batched_tokens``. Running requests go first (oldest first), then waiting requests are
admitted in arrival order while the budget, ``max_num_seqs`` and the pool allow.

Admission order (``admission_policy``): preempted requests resume first; then, under ``lpm``,
the waiting request with the longest cached prefix (a read-only ``peek``), unless some request
has been overtaken ``max_bypass`` times, in which case the oldest such one goes next; ``fcfs``
is plain arrival order. Under both, a waiting request whose next uncached block a running
request is computing right now waits until that request's chunk publishes it (it would compute
the same blocks otherwise: agents started together share their system prompt). Admission
matches the prompt against the prefix cache; a request's lookup is recorded in the stats
exactly once, at its first admission. Blocks are allocated chunk by chunk, so a long prompt
holds only what it has computed plus the chunk in flight. A
waiting request that does not fit waits: admitting never preempts a running request. When a
running request needs a block to grow and none can be freed or evicted, the most recently
admitted running request is preempted by recompute: its published blocks stay in the tree, so
its resume is mostly a prefix hit (counted apart from first-admission hits).

With a store tier (``radixkv.cache.store``), a request whose device match ends before its hit
cap first *loads*: it leaves the waiting queue for ``loading`` (holding only its matched path)
while the tier looks the next blocks up off the step loop; other requests keep stepping. Once
its load is done (or past its deadline) it is admitted ahead of the waiting queue with the
loaded blocks in the tree. If the pool cannot take its next chunk yet, it keeps those blocks
(locked, in ``loaded``) until running requests free room, or gives them back to the pool
(cached, evictable) and waits when nothing is running.

The scheduler talks only to the ``CacheManager`` facade, never to the tree or the pool.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from radixkv.cache.manager import CacheManager
from radixkv.config import SchedulerConfig
from radixkv.engine.request import Request, RequestStatus
from radixkv.engine.stats import EngineStats
from radixkv.log import get_logger

log = get_logger(__name__)


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute tokens ``[start, start + num_tokens)``."""

    request: Request
    num_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def completes_prompt(self) -> bool:
        """The chunk reaches the newest token, so this step samples the next one."""
        return self.start + self.num_tokens == len(self.request.token_ids)


class Scheduler:
    """Decides which requests run in the next forward step, and how many tokens each.

    Args:
        config: batching limits.
        cache: the cache-manager facade.
        stats: counters updated at admission and preemption (the engine counts aborts: it
            knows a request's choices).
    """

    def __init__(self, config: SchedulerConfig, cache: CacheManager, stats: EngineStats) -> None:
        self.config = config
        #: ``config.prefill_chunk_tokens`` (an int once the config is built; frozen).
        self._chunk_tokens: int = config.prefill_chunk_tokens or config.max_num_batched_tokens
        self.cache = cache
        self.stats = stats
        self._window_groups = cache.window is not None  # window KV groups (a window pool)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # begun, waiting for their store load
        self.loaded: deque[Request] = deque()  # loaded blocks in the tree, waiting for room
        # Preempted requests' computed tokens at preemption (K/V dropped), until their resume
        # computes past them: chunks below it are recomputation (KVActivity).
        self._recompute_until: dict[str, int] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.loaded)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's work and make sure each chunk has blocks for its tokens.

        Returns:
            Chunks in batch order: running requests first, then newly admitted ones.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_tokens = self._chunk_size(req, req.num_computed_tokens, budget,
                                          len(self.running) - i - 1)
            if self.cache.allocate(req.request_id, req.num_computed_tokens + num_tokens):
                scheduled.append(ScheduledChunk(req, num_tokens))
                budget -= num_tokens
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
        if self._recompute_until:
            self._count_recomputed(scheduled)
        return scheduled

    def _count_recomputed(self, scheduled: list[ScheduledChunk]) -> None:
        """Count the tokens of resumed requests' chunks that their first run had computed."""
        for chunk in scheduled:
            rid = chunk.request.request_id
            until = self._recompute_until.get(rid)
            if until is None:
                continue
            end = chunk.start + chunk.num_tokens
            if until > chunk.start:
                self.stats.activity.record_recomputed(min(end, until) - chunk.start)
            if end >= until:
                del self._recompute_until[rid]

    def _chunk_size(self, req: Request, start: int, budget: int, reserve_blocks: int = 0) -> int:
        remaining = len(req.token_ids) - start
        num = min(remaining, self._chunk_tokens, budget)
        if num > 1 and self._window_groups and self.cache.is_active(req.request_id):
            # Window KV groups: a prefill chunk holds a window block per position; shrink it
            # to the room left, a block kept for each running request scheduled after it
            # (``reserve_blocks``), rather than preempt one (0: allocate fails and the
            # request waits or preempts, as for full-attention blocks).
            room = self.cache.window_room_tokens(req.request_id, start, reserve_blocks)
            if room is not None and 0 < room < num:
                num = room
        return num

    def _next_waiting(self) -> Request | None:
        """The waiting request to admit next (see the module docstring for the order), or
        None when every candidate in the admission window waits for a running request's
        prefill of the same prefix (:meth:`_waits_for_inflight_prefix`)."""
        head = self.waiting[0]
        if head.status is RequestStatus.PREEMPTED:
            return head
        window = [r for _, r in zip(range(self.config.admission_window), self.waiting)]
        cached = {id(r): self.cache.peek(r.cache_root, bytes(r.token_bytes)) for r in window}
        window = [r for r in window if not self._waits_for_inflight_prefix(r, cached[id(r)])]
        if not window:
            return None
        if self.config.admission_policy == "fcfs":
            return window[0]
        for req in window:
            if req.num_bypassed >= self.config.max_bypass:
                return req
        # Longest cached prefix first; arrival order breaks ties (max keeps the first).
        return max(window, key=lambda r: cached[id(r)])

    def _waits_for_inflight_prefix(self, req: Request, num_cached: int) -> bool:
        """Whether ``req`` should wait for a running request that is computing the same
        uncached prefix: at least one full block past ``req``'s cached ``num_cached`` tokens
        (within its hit cap) equal to a running request's prompt under the same cache
        identity, not computed yet. Admitted now, both would compute those blocks; admitted
        after the other's prefill chunk publishes them, ``req`` reads them from the cache
        (SGLang's scheduler defers such requests the same way). The wait ends when the
        running request's chunk covering them completes; a preempted request never waits.
        """
        bs = self.cache.block_size
        cap_blocks = (req.num_prompt_tokens - 1) // bs
        first_block = num_cached // bs
        if cap_blocks <= first_block:
            return False
        mine = memoryview(req.token_bytes)
        for other in self.running:
            if other.cache_root != req.cache_root or other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            limit = min(cap_blocks, other.num_prompt_tokens // bs)
            if limit <= first_block:
                continue
            theirs = memoryview(other.token_bytes)
            block_bytes = 4 * bs  # token_bytes packs one u32 per token
            lo = first_block * block_bytes
            # The blocks before num_cached are equal wherever both hit them; test the next one.
            if mine[lo:lo + block_bytes] != theirs[lo:lo + block_bytes]:
                continue
            if mine[:lo] != theirs[:lo]:
                continue
            if other.num_computed_tokens < (first_block + 1) * bs:
                return True
        return False

    def _next_loaded(self) -> Request | None:
        """The oldest request whose store load is done (or past its deadline)."""
        for req in self.loading:
            if self.cache.store_ready(req.request_id):
                return req
        return None

    def _room_for_load(self, req: Request, budget: int) -> bool:
        """Whether the pool can take the request's verified store blocks and its first chunk
        after them (else ``store_finish`` would load only what fits and compute the rest)."""
        cache, bs = self.cache, self.cache.block_size
        loaded = cache.store_loaded_blocks(req.request_id)
        start = cache.num_cached_tokens(req.request_id) + loaded * bs
        chunk = self._chunk_size(req, start, budget)
        need = loaded + -(-(start + chunk) // bs) - start // bs
        return (need <= cache.num_free_blocks + cache.num_cached_evictable_blocks
                or need <= cache.num_obtainable_blocks())

    def _admit(self, scheduled: list[ScheduledChunk], budget: int) -> None:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.loaded[0] if self.loaded else None
            if req is not None:
                num_cached = self.cache.num_cached_tokens(req.request_id)
            elif self.loading and (req := self._next_loaded()) is not None:
                if self.running and not self._room_for_load(req, budget):
                    break  # running requests will free room; loading it now would cut it short
                self.loading.remove(req)
                num_cached, loaded, more = self.cache.store_finish(req.request_id,
                                                                   bytes(req.token_bytes))
                req.num_store_tokens += loaded
                if more:  # a full load: the next blocks are being looked up too
                    self.loading.append(req)
                    continue
                self.loaded.append(req)
            elif self.waiting:
                if (req := self._next_waiting()) is None:
                    break
                t0 = time.perf_counter()
                num_cached = self.cache.begin(req.request_id, req.cache_root,
                                              bytes(req.token_bytes),
                                              session_key=req.session_key, tenant=req.tenant)
                self.stats.activity.observe_lookup(time.perf_counter() - t0)
                if not req.store_checked and self.cache.store_begin(req.request_id,
                                                                    bytes(req.token_bytes)):
                    req.store_checked = True
                    self.waiting.remove(req)
                    req.status = RequestStatus.LOADING
                    self.loading.append(req)
                    continue
            else:
                break
            num_tokens = self._chunk_size(req, num_cached, budget, len(self.running))
            if not self.cache.allocate(req.request_id, num_cached + num_tokens):
                if req.status is not RequestStatus.LOADING:
                    self.cache.release(req.request_id)
                elif not self.running:
                    # Nothing running will free blocks: give the loaded blocks back to the
                    # pool (they stay cached, evictable) and wait like any request.
                    self.loaded.popleft()
                    self.cache.release(req.request_id)
                    req.status = RequestStatus.WAITING
                    self.waiting.appendleft(req)
                # else: it keeps its loaded blocks (locked) until running requests free room
                break
            if req.status is RequestStatus.LOADING:
                self.loaded.popleft()
                req.status = RequestStatus.WAITING
            else:
                for older in self.waiting:
                    if older is req:
                        break
                    older.num_bypassed += 1
                self.waiting.remove(req)
            req.store_checked = False  # a resume after preemption may load again
            req.num_computed_tokens = num_cached
            if req.admitted:  # a resume after preemption: not a new lookup
                self.stats.record_resume(num_cached)
            else:
                req.admitted = True
                req.num_cached_tokens = num_cached
                self.stats.record_admission(req.num_prompt_tokens, num_cached,
                                            num_sequences=req.params.n, tenant=req.tenant,
                                            num_store_tokens=min(req.num_store_tokens,
                                                                 num_cached),
                                            num_evicted_tokens=self.cache.miss_breakdown(
                                                req.request_id)["evicted"])
                self.cache.record_admission(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledChunk(req, num_tokens))
            budget -= num_tokens

    def _release(self, req: Request, *, finished: bool = False) -> None:
        """Publish the request's remaining computed blocks (generated blocks are published in
        batches while decoding), retain the whole sequence when it finished with a ``-1``
        retention breakpoint, then release its locks and private blocks."""
        self.cache.publish(req.request_id, req.token_bytes, req.num_computed_tokens)
        if finished:
            whole = [(len(req.token_ids), bp.ttl_class) for bp in req.retention
                     if bp.num_tokens == -1]
            if whole:
                result = self.cache.retain(req.request_id, whole,
                                           num_prompt_tokens=req.num_prompt_tokens,
                                           refresh=False,
                                           num_cached_tokens=req.num_cached_tokens)
                req.num_retained_tokens = result.num_retained_tokens
                req.retention_ids = req.retention_ids + tuple(
                    rid for rid in result.retention_ids if rid not in req.retention_ids)
        self.cache.release(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        self.stats.activity.record_preempted(req.num_computed_tokens)
        self._recompute_until[req.request_id] = max(
            req.num_computed_tokens, self._recompute_until.get(req.request_id, 0))
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.stats.record_preemption()
        log.info("preempted", request_id=req.request_id, num_tokens=len(req.token_ids))

    def finish(self, req: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Remove a running request and release its blocks (published ones stay cached)."""
        self.running.remove(req)
        self._release(req, finished=status is RequestStatus.FINISHED and req.index == 0)
        req.status = status

    def abort(self, request_id: str) -> Request | None:
        """Drop a request in any phase; returns it, or None if it is not here (finished)."""
        self._recompute_until.pop(request_id, None)
        for queue in (self.waiting, self.loading, self.loaded):
            req = next((r for r in queue if r.request_id == request_id), None)
            if req is not None:
                if queue is not self.waiting:
                    self.cache.release(request_id)  # drops its load too
                queue.remove(req)
                req.status = RequestStatus.ABORTED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, RequestStatus.ABORTED)
                return req
        return None

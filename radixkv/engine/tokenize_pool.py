"""A fair worker pool for chat templating, tokenization and detokenization, off the event loop.

Jobs queue per key (the server passes the tenant; None is one key like any other) and the
workers take them round-robin across keys, FIFO within a key: a tenant that queued a hundred
long prompts delays another tenant's request by at most one job per busy worker, not a hundred.
With two or more workers no named key runs on all of them at once (at most ``workers - 1``),
so a tenant's long prompts leave a worker for the others: another tenant's short request never
waits behind a job of that tenant that has already started. The key None (the one tenant of a
server without API keys: nobody to leave a worker for) may use them all.
The queue is bounded (``TokenizeQueueFullError`` past ``max_queue`` waiting jobs, the server's
503). Each worker owns a copy of the tokenizer (``ChatTokenizer.clone``, made as the worker
starts, with the first job): HF fast tokenizers must not be called from two threads at once,
and one shared copy behind a lock would run one job at a time, however many workers (a
tokenizer that cannot be copied is shared, and its lock serialises the workers). The tokenizers release
the GIL while encoding, so the workers really run in parallel.

Queue time (submission to a worker taking the job) is recorded in ``queue_seconds``, exported
by ``/metrics`` as ``radixkv_tokenize_queue_seconds``.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixkv.errors import TokenizeQueueFullError
from radixkv.log import get_logger
from radixkv.model.tokenizer import ChatTokenizer

log = get_logger(__name__)

T = TypeVar("T")
MAX_DEFAULT_WORKERS = 8
DEFAULT_MAX_TOKENIZE_QUEUE = 256
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   math.inf)


# The queue a job waits in when the caller names none: the server sets it per request (to the
# tenant) so that every tokenizer call a request makes, wherever it is made, queues as its tenant.
TOKENIZE_KEY: contextvars.ContextVar[Hashable] = contextvars.ContextVar("radixkv_tokenize_key",
                                                                        default=None)
CONTEXT_KEY: Any = object()  # sentinel: "use TOKENIZE_KEY"


def pool_key(key: Hashable) -> Hashable:
    """``key``, or the calling context's ``TOKENIZE_KEY`` for ``CONTEXT_KEY``."""
    return TOKENIZE_KEY.get() if key is CONTEXT_KEY else key


def default_workers() -> int:
    """Workers for this machine: one per CPU, at least 1 and at most ``MAX_DEFAULT_WORKERS``."""
    return max(1, min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1))


class QueueHistogram:
    """Cumulative histogram of queue times in seconds (thread-safe)."""

    def __init__(self, buckets: tuple[float, ...] = QUEUE_BUCKETS_S) -> None:
        self.buckets = buckets
        self._counts = [0] * len(buckets)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._sum += seconds
            for i, le in enumerate(self.buckets):
                if seconds <= le:
                    self._counts[i] += 1
                    break

    def cumulative(self) -> tuple[list[tuple[float, int]], float]:
        """``([(upper bound, observations <= it), ...], sum of seconds)``, Prometheus-style."""
        with self._lock:
            total, out = 0, []
            for le, count in zip(self.buckets, self._counts):
                total += count
                out.append((le, total))
            return out, self._sum


class _NoKey:
    """No key may run now (None is a real key: the single tenant's)."""


_NONE = _NoKey()


@dataclass(eq=False)
class _Job:
    fn: Callable[[ChatTokenizer], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    key: Hashable
    queued_s: float = field(default_factory=time.monotonic)


class TokenizePool:
    """Worker threads running ``fn(tokenizer)`` jobs fairly across keys.

    Args:
        tokenizer: the model's tokenizer; each worker clones it as it starts.
        workers: worker threads (None: ``default_workers()``), started by ``start`` or the
            first job.
        max_queue: most jobs waiting for a worker; one more raises ``TokenizeQueueFullError``.
    """

    def __init__(self, tokenizer: ChatTokenizer, *, workers: int | None = None,
                 max_queue: int = DEFAULT_MAX_TOKENIZE_QUEUE) -> None:
        workers = default_workers() if workers is None else workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"tokenizer workers: must be an int >= 1, got {workers!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max tokenize queue: must be an int >= 1, got {max_queue!r}")
        self.tokenizer = tokenizer
        tokenizer.min_tokens(())  # the context bound's constants, computed once at load
        self.workers = workers
        self.max_queue = max_queue
        self.queue_seconds = QueueHistogram()
        self._cond = threading.Condition()
        self._queues: OrderedDict[Hashable, deque[_Job]] = OrderedDict()
        self._queued = 0
        self.max_running_per_key = max(1, workers - 1)
        self._running: dict[Hashable, int] = {}  # key -> jobs running now
        self._permits: int | None = None  # test hook: jobs the workers may still start
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return self._queued

    async def run(self, fn: Callable[[ChatTokenizer], T], *, key: Hashable = None) -> T:
        """Run ``fn(worker's tokenizer)`` in a worker and return its result (or raise its error).

        Cancelling the caller removes a job that has not started (a started one runs to its end
        and its result is dropped).

        Raises:
            TokenizeQueueFullError: ``max_queue`` jobs are already waiting.
            RuntimeError: the pool is shut down.
        """
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop, loop.create_future(), key)
        with self._cond:
            if self._closed:
                raise RuntimeError("the tokenizer pool is shut down")
            if self._queued >= self.max_queue:
                raise TokenizeQueueFullError(
                    f"the tokenizer queue is full: {self._queued} requests are waiting for "
                    f"{self.workers} tokenizer worker(s)")
            self._queues.setdefault(key, deque()).append(job)
            self._queued += 1
            self._start_workers()
            self._cond.notify()
        try:
            return await job.future
        except asyncio.CancelledError:
            self._discard(job)
            raise

    def start(self) -> None:
        """Start the workers now (each copies the tokenizer, ~0.2 s) rather than on the first
        job, so the first request does not wait for the copies."""
        with self._cond:
            if not self._closed:
                self._start_workers()

    def hold(self, permits: int = 0) -> None:
        """Test hook: let the workers start only ``permits`` more jobs until ``allow``/``release``
        (jobs keep queueing meanwhile)."""
        with self._cond:
            self._permits = permits

    def allow(self, jobs: int = 1) -> None:
        """Test hook: ``jobs`` more may start while held."""
        with self._cond:
            self._permits = (self._permits or 0) + jobs
            self._cond.notify_all()

    def release(self) -> None:
        """Test hook: end ``hold``."""
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    def shutdown(self, wait: bool = False) -> None:
        """Stop the workers after their current job; queued jobs fail with RuntimeError."""
        with self._cond:
            self._closed = True
            dropped = [job for q in self._queues.values() for job in q]
            self._queues.clear()
            self._queued = 0
            self._cond.notify_all()
        for job in dropped:
            _settle(job, RuntimeError("the tokenizer pool is shut down"), ok=False)
        if wait:
            for thread in self._threads:
                thread.join()

    # ------------------------------------------------------------------ internals
    def _start_workers(self) -> None:
        while len(self._threads) < self.workers:
            thread = threading.Thread(target=self._work, daemon=True,
                                      name=f"radixkv-tok-{len(self._threads)}")
            self._threads.append(thread)
            thread.start()

    def _discard(self, job: _Job) -> None:
        with self._cond:
            q = self._queues.get(job.key)
            if q is not None and job in q:
                q.remove(job)
                self._queued -= 1
                if not q:
                    del self._queues[job.key]

    def _runnable_key(self) -> Hashable | _NoKey:
        """The first key in round-robin order below its running cap (caller holds the lock)."""
        if self._permits == 0:
            return _NONE
        for key in self._queues:
            if key is None or self._running.get(key, 0) < self.max_running_per_key:
                return key
        return _NONE

    def _next(self) -> _Job | None:
        """The next job, round-robin across keys (caller holds the lock); None: shut down."""
        while not self._closed and (key := self._runnable_key()) is _NONE:
            self._cond.wait()
        if self._closed:
            return None
        q = self._queues[key]
        job = q.popleft()
        self._running[key] = self._running.get(key, 0) + 1
        if q:
            self._queues.move_to_end(key)
        else:
            del self._queues[key]
        self._queued -= 1
        if self._permits is not None:
            self._permits -= 1
        return job

    def _work(self) -> None:
        try:
            tokenizer = self.tokenizer.clone()
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (locked)
            log.warning("tokenizer_not_copied", exc_info=True)
            tokenizer = self.tokenizer
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            self.queue_seconds.observe(time.monotonic() - job.queued_s)
            try:
                if job.future.cancelled():
                    continue
                result, ok = job.fn(tokenizer), True
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                result, ok = exc, False
            finally:
                self._finished(job.key)
            _settle(job, result, ok=ok)

    def _finished(self, key: Hashable) -> None:
        with self._cond:
            left = self._running[key] - 1
            if left:
                self._running[key] = left
            else:
                del self._running[key]
            self._cond.notify_all()


def _settle(job: _Job, value: Any, *, ok: bool) -> None:
    def settle() -> None:
        if not job.future.done():
            if ok:
                job.future.set_result(value)
            else:
                job.future.set_exception(value)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the caller's loop is closed: nobody waits for this result

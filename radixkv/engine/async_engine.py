"""The asynchronous engine: ``AsyncEngine`` runs the synchronous ``LLMEngine``
(``radixkv.engine.llm_engine``) in a dedicated thread, bridged to asyncio. The server uses
this engine (and ``SamplingParams``), never ``LLMEngine`` itself.

Threads. Once ``start`` has run, the engine thread alone touches cache state: the cache
manager, its pool, tree, identity memo, KV-event log and eviction policy, and the scheduler.
The event loop never runs model or cache code: it validates a request into an immutable
``RequestSpec`` (``LLMEngine.prepare_request``: bad input raises there, synchronously) and puts
it, aborts and calls such as ``reset_prefix_cache`` into a thread-safe inbox that the engine
thread drains before each step; the engine thread resolves the cache identity when it admits
the request. Outputs come back through ``loop.call_soon_threadsafe`` into one
``asyncio.Queue`` per request; ``/stats`` and the scheduler gauges are snapshots the engine
thread takes after each step. Tokenizing (chat
template rendering) and detokenizing run on a fair, bounded pool of worker threads, each with
its own tokenizer copy (``radixkv.engine.tokenize_pool``), so a long prompt never blocks the
loop, the engine thread's detokenizer, or other tenants' prompts.

A fault that belongs to one request (``radixkv.engine.faults``) ends that request with a
final ``finish_reason == "error"`` output and the thread goes on; anything ``LLMEngine.step``
raises stops the thread, and every open stream then ends with ``EngineDeadError``.

Admission control lives here too: ``max_queue`` bounds the sequences waiting beyond the
scheduler's ``max_num_seqs`` (``QueueFullError`` past it, the server's 503), and every request's
tenant, time to first token and inter-token latency are recorded as its outputs are delivered.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
import uuid
from typing import Any, Callable, Hashable, Sequence, cast

from radixkv.cache.events import KVEventLog
from radixkv.cache.manager import CacheManager
from radixkv.cache.retention import RetentionBreakpoint, RetentionInfo
from radixkv.cache.store.backend import StoreBackend
from radixkv.config import EngineConfig, check_int
from radixkv.engine.async_lora import AsyncLoRAMixin
from radixkv.engine.kv_events import KVEventPublisher, KVEventsConfig
from radixkv.engine.leak_check import DEFAULT_INTERVAL_S, IdleLeakCheck
from radixkv.engine.llm_engine import LLMEngine, RequestOutput
from radixkv.engine.request_stream import ENDS_REQUEST, RequestStream, _Live
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.tokenize_pool import (
    CONTEXT_KEY,
    DEFAULT_MAX_TOKENIZE_QUEUE,
    TokenizePool,
    pool_key,
)
from radixkv.errors import EngineDeadError, QueueFullError
from radixkv.log import get_logger
from radixkv.model.loader import LoadedModel

log = get_logger(__name__)

__all__ = ["AsyncEngine", "RequestOutput", "RequestStream", "SamplingParams"]


def _settle(done: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if not done.done():
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)


class AsyncEngine(AsyncLoRAMixin):
    """Asyncio front of the engine (what the server uses).

    Args:
        config: engine configuration.
        model: an already loaded model (tests share one); None loads ``config.model``.
        check_integrity_when_idle: run the cache manager's ``check_integrity()`` whenever the
            engine runs out of work (tests turn this on).
        max_queue: most sequences (choices) in flight beyond ``max_num_seqs``; one more is
            refused with ``QueueFullError``. None: unbounded. A request arriving when nothing is
            in flight is always accepted, whatever its ``n``.
        tokenizer_workers: threads templating and tokenizing (``TokenizePool``; None: one per
            CPU, at most 8).
        max_tokenize_queue: most tokenization jobs waiting for a worker; one more raises
            ``TokenizeQueueFullError``.
        kv_events: publish KV cache events (``radixkv.engine.kv_events``) when enabled; the
            sockets are bound by ``start``. A ``KVEventPublisher`` (started or not, same block
            size) is used as is: ``radixkv serve`` binds it before loading the model.
        store_backend: the store tier's backend, built already (see ``LLMEngine``).
        leak_check_interval_s: least seconds between two idle self-checks of the KV pool
            (``radixkv.engine.leak_check``: a leak is logged and counted, never raised);
            None: off.

    Attributes:
        instance_id: Unique per engine (a restarted replica gets a new one).
        kv_events: The event publisher, or None.
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, *,
                 check_integrity_when_idle: bool = False, max_queue: int | None = None,
                 tokenizer_workers: int | None = None,
                 max_tokenize_queue: int = DEFAULT_MAX_TOKENIZE_QUEUE,
                 kv_events: KVEventsConfig | KVEventPublisher | None = None,
                 store_backend: StoreBackend | None = None,
                 leak_check_interval_s: float | None = DEFAULT_INTERVAL_S) -> None:
        if max_queue is not None:
            check_int("max_queue", max_queue, minimum=0)
        #: The idle KV pool self-check (engine thread), or None.
        self.leak_check = (IdleLeakCheck(leak_check_interval_s)
                           if leak_check_interval_s is not None else None)
        self._engine = LLMEngine(config, model, store_backend=store_backend)
        self.tokenizer = self._engine.tokenizer
        self.model_name = self._engine.model_name
        self.max_model_len = self._engine.max_model_len
        self.block_size = self._engine.block_size
        #: The KV pool dtype actually allocated and one token's K+V bytes (scales included).
        self.kv_cache_dtype = self._engine.runner.kv_cache_dtype
        self.kv_bytes_per_token = self._engine.runner.kv_bytes_per_token
        self.vocab_size = self._engine.model.shape.vocab_size  # token ids lie in [0, vocab_size)
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_queue = max_queue
        self._check_integrity = check_integrity_when_idle
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Live] = {}  # request id -> delivery target (engine thread)
        self._streams_lock = threading.Lock()  # registration vs. the dying thread's final flush
        self._closed = False
        self._active: set[RequestStream] = set()  # event-loop side: open streams
        self._num_seqs = 0  # choices of the open streams
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Public for /metrics (its queue-time histogram) and tests (its hold/allow hooks).
        self.tokenize_pool = self._tokenize_pool = TokenizePool(
            self.tokenizer, workers=tokenizer_workers, max_queue=max_tokenize_queue)
        self._stats = self._engine.stats_snapshot()
        self._gauges = self._engine.scheduler_gauges()
        self.error: BaseException | None = None
        self.instance_id = uuid.uuid4().hex
        self.kv_events: KVEventPublisher | None = None
        publisher = kv_events if isinstance(kv_events, KVEventPublisher) else None
        if publisher is not None and publisher.block_size != self.block_size:
            raise ValueError(f"kv_events: a publisher for block size {publisher.block_size}, "
                             f"the engine uses {self.block_size}")
        if publisher is not None or (isinstance(kv_events, KVEventsConfig) and kv_events.enabled):
            if not config.cache.enable_prefix_caching:  # nothing is ever cached to announce
                log.warning("kv_events_off_without_prefix_caching")
                if publisher is not None:
                    publisher.close()
            else:
                self._engine.cache.events = KVEventLog(self.block_size)
                self.kv_events = publisher or KVEventPublisher(cast(KVEventsConfig, kv_events),
                                                               self.block_size)

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (and bind the KV event sockets first: ValueError naming
        the endpoint when one cannot be bound)."""
        if self.kv_events is not None:
            self.kv_events.start()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests end with ``EngineDeadError``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self._tokenize_pool.shutdown(wait=False)
        if self._engine.store is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._engine.store.close)
        if self.kv_events is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.kv_events.close)

    # ------------------------------------------------------------------ requests
    async def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None, *,
                            known_outputs: Any = None, template_kwargs: dict | None = None,
                            tenant: Hashable = CONTEXT_KEY) -> list[int]:
        """Render the chat template and tokenize, on the tokenizer pool (``TokenizePool``).

        ``known_outputs``: ``text → ids | None`` for recent replies (see
        ``ChatTokenizer.apply_chat_template``); None tokenizes plainly. ``template_kwargs``:
        extra template variables (``chat_template_kwargs``). ``tenant``: the queue
        the job waits in (jobs are taken round-robin across tenants); by default the calling
        context's ``TOKENIZE_KEY`` (the server sets it per request).

        Raises:
            ValueError: the template cannot render these messages.
            TokenizeQueueFullError: too many jobs wait for a worker already.
        """
        extra: dict[str, Any] = {} if known_outputs is None else {"known_outputs": known_outputs}
        if template_kwargs:
            extra["template_kwargs"] = template_kwargs
        return await self._tokenize_pool.run(
            lambda tok: tok.apply_chat_template(messages, tools, **extra), key=pool_key(tenant))

    async def tokenize_text(self, text: str, *, add_special_tokens: bool = False,
                            tenant: Hashable = CONTEXT_KEY) -> list[int]:
        """Tokenize text on the pool (see ``tokenize_chat``): as is, or with
        ``add_special_tokens`` behind the tokenizer's BOS (``ChatTokenizer.encode_prompt``)."""
        return await self._tokenize_pool.run(
            lambda tok: tok.encode_prompt(text, add_special_tokens), key=pool_key(tenant))

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                         tenant: Hashable = CONTEXT_KEY) -> str:
        """Text of token ids, on the tokenizer pool (see ``tokenize_chat``)."""
        ids = list(token_ids)
        return await self._tokenize_pool.run(
            lambda tok: tok.decode(ids, skip_special_tokens=skip_special_tokens),
            key=pool_key(tenant))

    @functools.cached_property
    def side_tokenizer(self) -> Any:
        """A ``ChatTokenizer`` copy (made on first use, ~0.2 s) for work outside the fair pool,
        such as recording replies for reuse once their request has finished: that work must
        not wait behind other tenants' prompts, nor take the engine thread's tokenizer lock,
        which its detokenizer needs every step."""
        return self.tokenizer.clone()

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self._engine.default_max_tokens(num_prompt_tokens)

    @property
    def num_requests_in_flight(self) -> int:
        """Requests whose stream is open (queued or running)."""
        return len(self._active)

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 cache_salt: str | None = None, request_id: str | None = None,
                 tenant: str | None = None, lora_name: str | None = None,
                 capacity_checked: bool = False, session_key: str | None = None,
                 retention: Sequence[RetentionBreakpoint] = ()) -> RequestStream:
        """Submit a request and return its stream of per-step outputs (call from the loop).

        Validation happens here, before anything is queued; the engine thread builds the
        request (``LLMEngine.admit``). See ``RequestStream``.

        Args:
            tenant: labels the request for per-tenant stats and latency (not isolation: that
                is ``cache_salt``).
            lora_name: a loaded LoRA adapter to run with (None: the base model).
            capacity_checked: the caller ran ``check_capacity`` for a group of requests.
            session_key: session hint for the eviction policy (``prompt_cache_key`` / ``user``).
            retention: retention breakpoints (``radixkv.cache.retention``); the outputs report
                ``cache_creation_tokens_by_ttl`` and ``num_retained_tokens``.

        Raises:
            LoRANotFoundError: no adapter named ``lora_name`` is loaded (a ValueError).
            ValueError: the request is invalid (see ``LLMEngine.prepare_request``).
            QueueFullError: the admission bound (``max_queue``) is reached.
            EngineDeadError: the engine thread has stopped.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        if not capacity_checked:
            self.check_capacity(params.n)
        spec = self._engine.prepare_request(prompt_token_ids, params, cache_salt=cache_salt,
                                            request_id=request_id, tenant=tenant,
                                            lora_name=lora_name, session_key=session_key,
                                            retention=retention)
        out_queue: asyncio.Queue = asyncio.Queue()
        live = _Live(asyncio.get_running_loop(), out_queue, params.n, tenant, spec.arrival_s)
        with self._streams_lock:
            if self._closed:
                self._engine.discard_request(spec)
                raise EngineDeadError(f"engine stopped: {self.error!r}")
            self._streams[spec.request_id] = live
        stream = RequestStream(self, spec.request_id, params.n, out_queue)
        self._active.add(stream)
        self._num_seqs += params.n
        self._inbox.put(("add", spec))
        self._wake.set()
        return stream

    def check_capacity(self, num_sequences: int) -> None:
        """QueueFullError if ``num_sequences`` more would pass the admission bound; a request
        (or group) arriving when nothing is in flight is always accepted, whatever its size."""
        if (self.max_queue is not None and self._num_seqs
                and self._num_seqs + num_sequences > self.max_num_seqs + self.max_queue):
            raise QueueFullError(
                f"the engine is at capacity: {self._num_seqs} sequences in flight, "
                f"{self.max_num_seqs} running at most and {self.max_queue} queued at most")

    def _release(self, stream: RequestStream) -> None:
        if stream in self._active:
            self._active.discard(stream)
            self._num_seqs -= stream.n

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (any phase); returns immediately. The
        time of asking starts the request's cancel → blocks released measure."""
        self._inbox.put(("abort", (request_id, time.perf_counter())))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Evict every cached block no running request holds (on the engine thread); with
        KV events on, subscribers get one ``AllBlocksCleared``. Returns the blocks evicted.

        Raises:
            EngineDeadError: the engine thread has stopped.
        """
        return await self._call(self._engine.reset_prefix_cache)

    async def list_retentions(self, tenant: str | None, *, all_tenants: bool = False
                              ) -> list[RetentionInfo]:
        """Live retentions of ``tenant`` (every tenant's when ``all_tenants``: admin only),
        soonest expiry first, read on the engine thread.

        Raises:
            EngineDeadError: the engine thread has stopped.
        """
        return await self._call(functools.partial(self._engine.list_retentions, tenant,
                                                  all_tenants=all_tenants))

    async def release_retentions(self, tenant: str | None, retention_id: str | None = None, *,
                                 all_tenants: bool = False) -> int:
        """Release ``tenant``'s retentions (only ``retention_id`` when given; another
        tenant's never, unless ``all_tenants``: admin). Returns how many were released.

        Raises:
            EngineDeadError: the engine thread has stopped.
        """
        return await self._call(functools.partial(self._engine.release_retentions, tenant,
                                                  retention_id, all_tenants=all_tenants))

    async def read_cache(self, fn: Callable[[CacheManager], Any]) -> Any:
        """``fn(cache)`` run on the engine thread, its result returned here: how the event loop
        reads tree and pool state (the dashboard's tree explorer). ``fn`` must only read, and
        return plain values (never nodes: the cache goes on changing once it returns).

        Raises:
            EngineDeadError: the engine thread has stopped.
        """
        return await self._call(functools.partial(fn, self._engine.cache))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread and return its result (or raise its exception)."""
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._inbox.put(("call", (fn, loop, done)))
        self._wake.set()
        while True:  # a thread that dies first never answers
            try:
                return await asyncio.wait_for(asyncio.shield(done), 1.0)
            except asyncio.TimeoutError:
                if not self.is_healthy:
                    raise EngineDeadError(f"engine stopped: {self.error!r}") from None

    def abort_all(self) -> int:
        """Abort every open request (graceful shutdown past its timeout); returns how many."""
        streams = [s for s in self._active if not s.finished]
        for stream in streams:
            self.abort(stream.request_id)
        return len(streams)

    def stats(self) -> dict:
        """The latest ``/stats`` snapshot (gauges taken by the engine thread after each step;
        counters and rates as of now), with ``latency_ms`` over the recent window."""
        out = dict(self._stats)
        out.update(self._engine.stats.counts())
        out["latency_ms"] = self._engine.stats.latency_ms()
        if self.leak_check is not None:
            out["leak_check"] = self.leak_check.snapshot()
        return out

    def record_server_error(self, tenant: str | None = None) -> None:
        """Count a request the server answered 500 for a fault in its own code
        (``server_errors_total``; any thread)."""
        self._engine.stats.record_server_error(tenant=tenant)

    def tenant_stats(self, tenant: str) -> dict:
        """One tenant's counters, rates and latency (docs/design.md §7 tenant view)."""
        return self._engine.stats.tenant_snapshot(tenant)

    @property
    def engine_stats(self):
        """The live ``EngineStats`` (latency histograms for /metrics)."""
        return self._engine.stats

    def scheduler_gauges(self) -> dict[str, int]:
        """Sequences running and waiting in the scheduler (``LLMEngine.scheduler_gauges``), as
        the engine thread saw them after its latest step: the scheduler is its alone."""
        return self._gauges

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if engine.has_work:
                    outputs = engine.step()
                    self._snapshot()
                    self._deliver(outputs)
                    self._publish_events()
                    continue
                self._snapshot()
                if engine.store is not None:  # blocks still waiting for a write slot
                    engine.store.pump()
                self._publish_events()  # the store tier's writes finish between steps
                if self.leak_check is not None:
                    self.leak_check.maybe_run(engine.cache)
                if self._check_integrity:
                    engine.cache.check_integrity()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine_thread_failed")
            self.error = exc
        finally:
            dead = EngineDeadError(f"engine stopped: {self.error!r}" if self.error else "engine stopped")
            with self._streams_lock:
                self._closed = True
                for live in list(self._streams.values()):
                    self._put(live.loop, live.queue, dead)
                self._streams.clear()

    def _drain_inbox(self) -> None:
        engine = self._engine
        outputs = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                if payload.request_id in self._streams:
                    outputs += engine.admit(payload)  # a fault of its own ends it there
                else:  # its stream closed before this thread saw it
                    engine.discard_request(payload)
            elif kind == "call":  # run on this thread, answer the waiting coroutine
                fn, loop, done = payload
                try:
                    result = fn()
                except BaseException as exc:  # the caller learns it; a cache fault stays fatal
                    loop.call_soon_threadsafe(_settle, done, None, exc)
                    raise
                self._publish_events()
                self._snapshot()  # a /stats read after the answer sees what the call did
                loop.call_soon_threadsafe(_settle, done, result, None)
            else:
                payload, cancel_s = payload
                aborted = engine.abort_request(payload, cancel_s=cancel_s)
                live = self._streams.get(payload)
                if aborted:
                    outputs += aborted
                    log.info("request_aborted", request_id=payload)
                elif live is not None and not any(o.request_id == payload for o in outputs):
                    # Not in the engine (finished meanwhile): end the stream. One whose final
                    # output this batch produced (a failed admit, an earlier abort) keeps it
                    # until that output is delivered, else its reader would wait forever.
                    del self._streams[payload]
        if outputs:
            self._snapshot()
            self._deliver(outputs)

    def _snapshot(self) -> None:
        """Take what other threads may read of the engine's state (engine thread); each is
        replaced whole, so a reader sees one snapshot or the next."""
        self._stats = self._engine.stats_snapshot()
        self._gauges = self._engine.scheduler_gauges()

    def _publish_events(self) -> None:
        """One batch per step that stored or removed blocks (engine thread)."""
        event_log = self._engine.cache.events  # set whenever kv_events is
        if self.kv_events is not None and event_log is not None:
            if self._engine.store is not None:
                self._engine.store.drain_kv_events(event_log)
            events = event_log.drain()
            if events:
                self.kv_events.publish(events)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        stats = self._engine.stats
        for out in outputs:
            live = self._streams.get(out.request_id)
            if live is None:
                continue
            if out.new_token_ids:  # counted by the engine as sampled; timed here, as delivered
                last = live.last_token_s.get(out.index)
                if last is None:
                    stats.record_latency(live.tenant, ttft_s=now - live.arrival_s)
                else:
                    stats.record_latency(live.tenant,
                                         itl_s=(now - last) / len(out.new_token_ids))
                live.last_token_s[out.index] = now
            if out.finished:
                live.remaining -= 1
                if live.remaining <= 0 or out.finish_reason in ENDS_REQUEST:
                    del self._streams[out.request_id]
            self._put(live.loop, live.queue, out)

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, out_queue: asyncio.Queue, item: Any) -> None:
        try:
            loop.call_soon_threadsafe(out_queue.put_nowait, item)
        except RuntimeError:
            pass  # the client's loop is closed: nobody is listening any more

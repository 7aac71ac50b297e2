"""``AsyncEngine``: runs ``LLMEngine.step()`` in a dedicated thread, bridged to asyncio.

The event loop never runs model or cache code: requests and aborts go into a thread-safe
inbox that the engine thread drains before each step, and outputs come back through
``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request. Tokenizing (chat
template rendering) runs in a worker thread, so a long prompt never blocks the loop; the
``ChatTokenizer`` serialises calls into the HF tokenizer, which is not re-entrant.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, AsyncIterator, Sequence

from radixkv.config import EngineConfig
from radixkv.llm_engine import LLMEngine, RequestOutput
from radixkv.log import get_logger
from radixkv.model.loader import LoadedModel
from radixkv.sampling import SamplingParams

log = get_logger(__name__)

__all__ = ["AsyncEngine", "RequestOutput", "SamplingParams"]


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can make progress."""


class AsyncEngine:
    """Asyncio front of the engine (what the server uses).

    Args:
        config: engine configuration.
        model: an already loaded model (tests share one); None loads ``config.model``.
        check_integrity_when_idle: run the cache manager's ``check_integrity()`` whenever the
            engine runs out of work (tests turn this on).
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, *,
                 check_integrity_when_idle: bool = False) -> None:
        self._engine = LLMEngine(config, model)
        self.tokenizer = self._engine.tokenizer
        self.model_name = self._engine.model_name
        self.max_model_len = self._engine.max_model_len
        self.block_size = self._engine.block_size
        self._check_integrity = check_integrity_when_idle
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (client loop, output queue, [choices still unfinished])
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[int]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-tok")
        self._stats = self._engine.stats_snapshot()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
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

    # ------------------------------------------------------------------ requests
    async def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render the chat template and tokenize, in a worker thread.

        Raises:
            ValueError: the template cannot render these messages.
        """
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, partial(self.tokenizer.apply_chat_template, messages, tools))

    async def tokenize_text(self, text: str) -> list[int]:
        """Tokenize plain text (no special tokens), in a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self.tokenizer.encode, text)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self._engine.default_max_tokens(num_prompt_tokens)

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 cache_salt: str | None = None, request_id: str | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Submit a request and return its stream of per-step outputs.

        Validation happens here, before anything is queued. With ``params.n > 1`` the outputs
        of all choices arrive interleaved, told apart by ``RequestOutput.index``; the iterator
        ends after every choice finished. Closing or cancelling the returned iterator before
        that aborts the request; its blocks are released within one engine step.

        Raises:
            ValueError: the request is invalid (see ``LLMEngine.make_request``).
            EngineDeadError: the engine thread has stopped.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        req = self._engine.make_request(prompt_token_ids, params, cache_salt=cache_salt,
                                        request_id=request_id)
        return self._stream(req)

    async def _stream(self, req) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (loop, out_queue, [req.params.n])
        self._inbox.put(("add", req))
        self._wake.set()
        remaining = req.params.n
        try:
            while remaining:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield item
        finally:
            if remaining:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (any phase); returns immediately."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        """The latest ``/stats`` snapshot, taken by the engine thread after each step."""
        return self._stats

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if engine.has_work:
                    outputs = engine.step()
                    self._stats = engine.stats_snapshot()
                    self._deliver(outputs)
                    continue
                self._stats = engine.stats_snapshot()
                if self._check_integrity:
                    engine.cache.check_integrity()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine_thread_failed")
            self.error = exc
        finally:
            dead = EngineDeadError(f"engine stopped: {self.error!r}" if self.error else "engine stopped")
            for loop, out_queue, _ in list(self._streams.values()):
                self._put(loop, out_queue, dead)
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
                    engine.add_request(payload)
            else:
                aborted = engine.abort_request(payload)
                if aborted:
                    outputs += aborted
                    log.info("request_aborted", request_id=payload)
        if outputs:
            self._stats = engine.stats_snapshot()
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            loop, out_queue, remaining = target
            if out.finished:
                remaining[0] -= 1
                if remaining[0] == 0:
                    del self._streams[out.request_id]
            self._put(loop, out_queue, out)

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, out_queue: asyncio.Queue, item: Any) -> None:
        try:
            loop.call_soon_threadsafe(out_queue.put_nowait, item)
        except RuntimeError:
            pass  # the client's loop is closed: nobody is listening any more

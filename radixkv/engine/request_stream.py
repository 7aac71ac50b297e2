"""One request's output stream, between the engine thread and the event loop.

``RequestStream`` is what ``AsyncEngine.generate`` returns (the event-loop side); ``_Live`` is
the engine thread's record of where that request's outputs go. ``AsyncEngine`` is the
``StreamOwner``: closing a stream asks it to abort the request and to release the stream's
place in the admission bound.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from radixkv.engine.faults import FAILED, RequestOutput

ENDS_REQUEST = ("abort", FAILED)  # finish reasons after which no choice produces more


class StreamOwner(Protocol):
    """What a stream needs of its engine (``AsyncEngine``)."""

    def abort(self, request_id: str) -> None: ...

    def _release(self, stream: RequestStream) -> None: ...


class _Live:
    """Engine-thread side of one request's output stream."""

    __slots__ = ("loop", "queue", "remaining", "tenant", "arrival_s", "last_token_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, out_queue: asyncio.Queue, n: int,
                 tenant: str | None, arrival_s: float) -> None:
        self.loop = loop
        self.queue = out_queue
        self.remaining = n
        self.tenant = tenant
        self.arrival_s = arrival_s
        self.last_token_s: dict[int, float] = {}  # choice index -> when its last token came


class RequestStream:
    """The outputs of one request, as an async iterator (``AsyncEngine.generate``).

    With ``n > 1`` the choices' outputs arrive interleaved (``RequestOutput.index``); the
    iteration ends after every choice finished, or at the first ``finish_reason`` of
    ``"abort"`` (the request was aborted: by ``close``, ``AsyncEngine.abort`` or ``abort_all``)
    or ``"error"`` (a fault of the request's own ended it in the engine). Closing it
    earlier aborts the request; its blocks are released within one engine step. Every stream
    must be closed or run to its end: it holds its place in the admission bound until then.
    """

    def __init__(self, engine: StreamOwner, request_id: str, n: int,
                 out_queue: asyncio.Queue) -> None:
        self._engine = engine
        self.request_id = request_id
        self.n = n
        self._queue = out_queue
        self._remaining = n
        self._open = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._remaining or not self._open:
            self._release()
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._release()
            raise item
        self._remaining -= item.finished
        if item.finish_reason in ENDS_REQUEST:
            self._remaining = 0
        if not self._remaining:
            self._release()
        return item

    @property
    def finished(self) -> bool:
        return not self._remaining

    def close(self) -> None:
        """Abort the request if it is unfinished; idempotent."""
        if self._open and self._remaining:
            self._engine.abort(self.request_id)
        self._release()

    async def aclose(self) -> None:
        self.close()

    def _release(self) -> None:
        if self._open:
            self._open = False
            self._engine._release(self)

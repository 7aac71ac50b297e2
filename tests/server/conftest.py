"""A real radixkv server on 127.0.0.1 (tiny random-init model) in a background thread.

The server runs on its own event loop in its own thread, so sync clients (the official
``openai`` client, ``bench/serve.py``'s ``asyncio.run``) and async tests can all talk to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from radixkv.engine.async_engine import AsyncEngine
from radixkv.model.loader import LoadedModel
from radixkv.server.app import serve
from tests.factories import make_async_engine

BLOCK_SIZE = 16
NUM_BLOCKS = 512
MAX_BODY_BYTES = 1 << 20


@dataclass
class RunningServer:
    engine: AsyncEngine
    port: int
    loop: asyncio.AbstractEventLoop | None = None
    holder: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Signal shutdown (as SIGTERM would): the server drains, then exits."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.holder["stop"].set)

    @property
    def stopped(self) -> bool:
        return self.holder.get("done", False)


def run_server_in_thread(engine: AsyncEngine, *, max_body_bytes: int = MAX_BODY_BYTES,
                         shutdown_timeout_s: float = 5.0, expect_engine_error: bool = False,
                         port: int = 0, **serve_kwargs: Any) -> Iterator[RunningServer]:
    """Start ``engine`` and a server on ``port`` (0: a free one); stop both when the generator
    resumes.

    ``serve_kwargs`` go to ``radixkv.server.app.serve`` (``api_keys``,
    ``max_concurrency_per_tenant``).
    """
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def main() -> None:
        holder["stop"] = asyncio.Event()
        engine.start()
        try:
            await serve(engine, "127.0.0.1", port, max_body_bytes=max_body_bytes,
                        shutdown_timeout_s=shutdown_timeout_s, stop=holder["stop"],
                        ready=lambda port: (holder.__setitem__("port", port), ready.set()),
                        **serve_kwargs)
        finally:
            await engine.shutdown()
            holder["done"] = True

    def target() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced to the fixture below
            holder["error"] = exc
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=target, name="radixkv-test-server", daemon=True)
    thread.start()
    assert ready.wait(60), "server did not start"
    if "error" in holder:
        raise holder["error"]
    try:
        yield RunningServer(engine, holder["port"], loop, holder)
    finally:
        if not holder.get("done"):
            loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
        assert not thread.is_alive(), "server thread did not stop"
        if not expect_engine_error:
            assert engine.error is None, f"engine thread failed: {engine.error!r}"


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    """One tiny-model server per test module (context 2048 tokens, B = 16, 512 blocks)."""
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=BLOCK_SIZE,
                                                      num_blocks=NUM_BLOCKS))

"""A real radixkv server on 127.0.0.1 (tiny random-init model) in a background thread.

The server runs on its own event loop in its own thread, so sync clients (the official
``openai`` client, ``bench/serve.py``'s ``asyncio.run``) and async tests can all talk to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine import AsyncEngine
from radixkv.model.loader import LoadedModel
from radixkv.server.app import serve

BLOCK_SIZE = 16
MAX_BODY_BYTES = 1 << 20


@dataclass
class RunningServer:
    engine: AsyncEngine
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def make_engine(model: LoadedModel, *, num_blocks: int = 512) -> AsyncEngine:
    config = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks))
    return AsyncEngine(config, model, check_integrity_when_idle=True)


def run_server_in_thread(engine: AsyncEngine, *, max_body_bytes: int = MAX_BODY_BYTES
                         ) -> Iterator[RunningServer]:
    """Start ``engine`` and a server on a free port; stop both when the generator resumes."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def main() -> None:
        holder["stop"] = asyncio.Event()
        engine.start()
        try:
            await serve(engine, "127.0.0.1", 0, max_body_bytes=max_body_bytes,
                        shutdown_timeout_s=5.0, stop=holder["stop"],
                        ready=lambda port: (holder.__setitem__("port", port), ready.set()))
        finally:
            await engine.shutdown()

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
        yield RunningServer(engine, holder["port"])
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
        assert not thread.is_alive(), "server thread did not stop"
        assert engine.error is None, f"engine thread failed: {engine.error!r}"


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    """One tiny-model server per test module (context 2048 tokens, B = 16, 512 blocks)."""
    yield from run_server_in_thread(make_engine(tiny_model))

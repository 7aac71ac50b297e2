"""The thread contract: once the engine thread runs, only it touches cache state.

Cache state is the cache manager, its block pool, radix tree and nodes, identity memo, KV-event
log and eviction policy, and the scheduler. The event loop hands the engine thread immutable
request descriptions and commands through its inbox and reads snapshots the engine thread took;
it never reads or writes those objects itself (``radixkv.engine.async_engine``).

The check is patched in here, not built into the classes (their hot paths stay as they are):
every attribute read on an instance of those classes records the thread it happened on, and
the test drives a real server with KV events and a host store tier on through chat,
completions with ``n > 1``, a salted request, a LoRA adapter loaded at run time, a prompt
served from the store tier after eviction, a client that hangs up mid-stream, requests refused
with a 4xx, ``/stats``, ``/metrics``, ``/kv_event_sources`` and ``/reset_prefix_cache``, then
asserts no read happened outside the engine thread (the event loop's, the store tier's loader
and writer, the tokenizer workers', the KV-event publisher's).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest
import zmq

from radixkv.cache.events import KVEventLog
from radixkv.cache.ghost import GhostList
from radixkv.cache.identity_memo import IdentityMemo
from radixkv.cache.manager import CacheManager
from radixkv.cache.pool import BlockPool
from radixkv.cache.tree.leaves import LeafIndex
from radixkv.cache.tree.node import Node
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.engine.kv_events import KVEventsConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.eviction.base import EvictionPolicy
from tests.factories import make_async_engine
from tests.lora_files import write_adapter
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import HI, complete, get, post_json, wait_idle

# Every class whose instances are cache state (subclasses are covered: a patched
# ``__getattribute__`` is inherited by every subclass that does not define its own).
OWNED = (CacheManager, BlockPool, RadixTree, Node, LeafIndex, IdentityMemo, KVEventLog,
         GhostList, EvictionPolicy, Scheduler)
B = 4
LOOPBACK = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                          replay_endpoint="tcp://127.0.0.1:0")


class OwnerCheck:
    """Records, per thread, which attributes of the ``OWNED`` classes were read.

    Armed by ``arm(thread)``: from then on a read on any other thread is a violation, except on
    the instances passed to ``exempt`` (the host store backend's own index and policy: the
    backend is not cache state but a store behind its own lock, which the store tier's threads
    call). Reads are counted, not raised: an exception inside the engine's own code paths would
    be caught by their fault handling and hide where it came from.
    """

    def __init__(self) -> None:
        self.owner: int | None = None
        self.exempt_ids: set[int] = set()
        self.violations: Counter[tuple[str, str, str]] = Counter()  # (class, attribute, thread)
        self.owner_reads: Counter[tuple[str, str]] = Counter()
        self._saved: list[tuple[type, object | None]] = []

    def arm(self, thread: threading.Thread) -> None:
        assert thread.ident is not None
        self.owner = thread.ident

    def exempt(self, *objects: object) -> None:
        self.exempt_ids.update(id(obj) for obj in objects)

    def install(self) -> None:
        for cls in OWNED:
            self._saved.append((cls, cls.__dict__.get("__getattribute__")))
            cls.__getattribute__ = self._wrap(cls, cls.__getattribute__)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for cls, own in reversed(self._saved):
            if own is None:
                del cls.__getattribute__  # back to the inherited slot: no cost left behind
            else:
                cls.__getattribute__ = own  # type: ignore[method-assign]
        self._saved.clear()

    def _wrap(self, cls: type, original):
        check = self
        name_of_cls = cls.__name__

        def __getattribute__(obj, name: str):
            owner = check.owner
            if owner is not None and id(obj) not in check.exempt_ids:
                ident = threading.get_ident()
                if ident == owner:
                    check.owner_reads[(name_of_cls, name)] += 1
                else:
                    check.violations[(name_of_cls, name, threading.current_thread().name)] += 1
            return original(obj, name)

        return __getattribute__


@pytest.fixture(scope="module")
def lora_path(tiny_model, tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("contract-lora") / "A", tiny_model.shape, seed=3)


@pytest.fixture
def checked(tiny_model) -> Iterator[tuple[RunningServer, OwnerCheck]]:
    check = OwnerCheck()
    check.install()
    try:
        # 96 blocks: the long prompt below evicts, so the store tier's threads load and write.
        engine = make_async_engine(tiny_model, kv_events=LOOPBACK, block_size=B, num_blocks=96,
                                   max_num_seqs=8, kv_store="host:0.01")
        backend = engine._engine.store.backend
        check.exempt(backend._leaves, backend.policy)
        for server in run_server_in_thread(engine):
            assert engine._thread is not None
            check.arm(engine._thread)
            yield server, check
    finally:
        check.uninstall()


async def hang_up_mid_stream(url: str) -> None:
    """A streaming chat whose client goes away after the first content event (abort)."""
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url + "/v1/chat/completions",
                               json={"messages": HI, "max_tokens": 200, "temperature": 0,
                                     "ignore_eos": True, "stream": True})
        assert resp.status == 200
        seen = b""
        while b'"content":"' not in seen:
            seen += await resp.content.readany()
        resp.close()


async def test_the_event_loop_never_touches_cache_state(checked, lora_path):
    server, check = checked
    url = server.url
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        status, sources = await get(url, "/kv_event_sources")
        assert status == 200
        sub.connect(sources["0"]["endpoint"])

        status, body = await post_json(url, "/v1/chat/completions",
                                       {"messages": HI, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        status, body = await complete(url, list(range(100, 140)), max_tokens=3, n=3,
                                      temperature=1.0, seed=7)
        assert status == 200 and sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
        status, body = await complete(url, list(range(100, 140)), max_tokens=2,
                                      cache_salt="tenant-x")
        assert status == 200, body

        status, body = await post_json(url, "/v1/load_lora_adapter",
                                       {"lora_name": "contract-A", "lora_path": str(lora_path)})
        assert status == 200, body
        status, body = await complete(url, list(range(200, 230)), model="contract-A",
                                      max_tokens=2)
        assert status == 200 and body["model"] == "contract-A", body
        status, body = await post_json(url, "/v1/unload_lora_adapter",
                                       {"lora_name": "contract-A"})
        assert status == 200, body

        # Refusals still reach the client as 4xx before anything is queued.
        status, body = await complete(url, [1, 2, 3], model="no-such-adapter")
        assert status == 404 and body["error"]["param"] == "model", body
        status, body = await complete(url, [1, 2, 3], max_tokens=4000)
        assert status == 400 and "maximum context length" in body["error"]["message"], body
        status, body = await complete(url, [1, 10**9])
        assert status == 400 and "prompt[1]" in body["error"]["message"], body

        status, body = await complete(url, list(range(1000, 1300)), max_tokens=1)
        assert status == 200, body  # 75 of the 96 blocks: the earlier prompts are evicted
        status, body = await complete(url, list(range(100, 140)), max_tokens=1)
        assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
        status, stats = await get(url, "/stats")
        # Part of the 36 came from the store (how much depends on the writer thread's pace).
        assert stats["store"]["hit_blocks_total"] > 0, stats["store"]

        await hang_up_mid_stream(url)
        stats = await wait_idle(url)
        assert stats["pool"]["in_use_blocks"] == 0
        status, metrics = await get(url, "/metrics")
        assert status == 200 and "radixkv_running_sequences 0.0" in metrics
        status, body = await post_json(url, "/reset_prefix_cache", {})
        assert status == 200 and body["num_evicted_blocks"] > 0, body
        status, stats = await get(url, "/stats")
        assert status == 200 and stats["tree"]["cached_blocks"] == 0
        assert sub.poll(5000), "no KV event batch was published"
    finally:
        sub.close()

    assert not check.violations, "\n".join(f"{c}.{a} on {t}: {n}" for (c, a, t), n in sorted(check.violations.items()))
    # The flows above ran through the owned state on the engine thread (the check saw them).
    for read in [("CacheManager", "identity_root"), ("KVEventLog", "allow_root"),
                 ("Scheduler", "add"), ("Scheduler", "running"),
                 ("CacheManager", "reset_prefix_cache")]:
        assert check.owner_reads[read] > 0, read


async def test_a_reset_answers_after_the_snapshot_that_shows_it(tiny_model, monkeypatch):
    """``/stats`` is the engine thread's snapshot: one taken before a reset's answer, so a read
    right after the answer never shows the blocks it evicted. The engine thread is held just
    after the call (before its next step or idle snapshot) to make the order deterministic."""
    engine = make_async_engine(tiny_model, block_size=B, num_blocks=64)
    called, held, release = threading.Event(), threading.Event(), threading.Event()
    real_reset, real_has_work = LLMEngine.reset_prefix_cache, LLMEngine.has_work

    def reset(self):
        called.set()
        return real_reset(self)

    def has_work(self):  # the engine thread asks this right after draining its inbox
        if called.is_set() and not held.is_set():
            held.set()
            release.wait(10)
        return real_has_work.fget(self)

    monkeypatch.setattr(LLMEngine, "reset_prefix_cache", reset)
    monkeypatch.setattr(LLMEngine, "has_work", property(has_work))
    engine.start()
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        outputs = [out async for out in engine.generate(list(range(100, 140)), params)]
        assert outputs[-1].finished
        deadline = time.monotonic() + 10
        while engine.stats()["tree"]["cached_blocks"] != 10:  # 40 prompt tokens, B = 4
            assert time.monotonic() < deadline, engine.stats()["tree"]
            await asyncio.sleep(0.01)
        assert await engine.reset_prefix_cache() == 10
        assert engine.stats()["tree"]["cached_blocks"] == 0
    finally:
        release.set()
        await engine.shutdown()

"""KV events agree with the tiers: with a host store tier under the device pool, a real ZMQ
subscriber that applies every event holds exactly what the replica caches — per medium, after
writes to the tier, after loads from it, and after ``reset_prefix_cache`` (which empties the
host tier too, so its ``AllBlocksCleared`` is true of every tier)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from radixkv.cache.events import KVEventLog, decode_event
from radixkv.engine.kv_events import KVEventsConfig
from radixkv.engine.sampling import SamplingParams
from radixkv.model.loader import LoadedModel
from tests.factories import make_async_engine, make_engine

B = 4
PROMPT = [(37 * i) % 400 + 5 for i in range(41)]  # 10 full prompt blocks (+1 from the output)
OTHER = [(53 * i) % 400 + 7 for i in range(57)]  # 15 blocks: 11 + 15 > the pool's 24
LOOPBACK = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                          replay_endpoint="tcp://127.0.0.1:0")


class SubscriberView:
    """What a KV-aware router's index holds for this replica: block ids per medium."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.blocks: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.kinds: list[str] = []
        self.next_seq = 0

    def catch_up(self, quiet_s: float = 0.6, timeout_s: float = 10.0) -> None:
        """Apply every batch until none arrives for ``quiet_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sock.poll(int(quiet_s * 1000)):
            _, seq, payload = self.sock.recv_multipart()
            assert int.from_bytes(seq, "big", signed=True) == self.next_seq  # no gap
            self.next_seq += 1
            for event in msgspec.msgpack.decode(payload)[1]:
                self.kinds.append(event["type"])
                if event["type"] == "AllBlocksCleared":
                    for ids in self.blocks.values():
                        ids.clear()
                elif event["type"] == "BlockStored":
                    self.blocks[event["medium"]].update(event["block_hashes"])
                elif event["type"] == "BlockRemoved":
                    self.blocks[event["medium"]].difference_update(event["block_hashes"])


@pytest.fixture
def engine(tiny_model: LoadedModel) -> Iterator:
    # 24 blocks: two 12-block sequences cannot both stay in the device pool.
    eng = make_async_engine(tiny_model, kv_events=LOOPBACK, block_size=B, num_blocks=24,
                            kv_store="host:0.01")
    eng.start()
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture
def view(engine) -> Iterator[SubscriberView]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.kv_events.advertised_endpoint)
    sock.subscribe(b"")
    time.sleep(0.3)  # the slow-joiner: a SUB sees only what is sent after it has connected
    yield SubscriberView(sock)
    sock.close()


def generate(engine, prompt: list[int], max_tokens: int = 6) -> object:
    async def run():
        last = None
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for out in engine.generate(prompt, params):
            last = out
        return last

    return asyncio.run(run())


def settle(engine, view: SubscriberView) -> None:
    """Let the tier finish its writes, then make the engine publish them: the host tier's
    events go out with the next step's batch (a one-token request)."""
    assert engine._engine.store.flush()
    generate(engine, [1, 2], max_tokens=1)  # under one block: stores nothing itself
    view.catch_up()


def replica_holds(engine) -> dict[str, int]:
    """Blocks the replica serves from, per medium: the device tree and the host tier."""
    inner = engine._engine
    return {"GPU": inner.cache.num_cached_blocks,
            "CPU": inner.store.backend.stats()["num_blocks"]}


def view_holds(view: SubscriberView) -> dict[str, int]:
    return {medium: len(ids) for medium, ids in view.blocks.items()}


def store_tokens(engine) -> int:
    return engine.stats()["cached_prompt_tokens_by_tier"]["store"]


def test_the_subscriber_holds_what_the_tiers_hold_through_writes_loads_and_reset(engine, view):
    generate(engine, PROMPT)
    settle(engine, view)
    assert replica_holds(engine) == view_holds(view) == {"GPU": 11, "CPU": 11}
    assert view.blocks["GPU"] == view.blocks["CPU"]
    prompt_blocks = set(view.blocks["CPU"])

    # OTHER pushes PROMPT's blocks out of the 24-block pool (BlockRemoved GPU); PROMPT then
    # comes back from the host tier, and the loaded blocks are announced on the device again.
    generate(engine, OTHER)
    settle(engine, view)
    assert replica_holds(engine) == view_holds(view)
    assert view_holds(view)["CPU"] == 26
    pushed_out = prompt_blocks - view.blocks["GPU"]
    assert pushed_out
    before = store_tokens(engine)
    back = generate(engine, PROMPT)
    settle(engine, view)
    assert back.num_cached_tokens == 40
    assert store_tokens(engine) > before
    assert pushed_out <= view.blocks["GPU"]  # loaded from the tier: BlockStored GPU again
    assert replica_holds(engine) == view_holds(view)

    # Reset: the subscriber is told every tier is empty, and every tier is.
    assert asyncio.run(engine.reset_prefix_cache()) > 0
    view.catch_up()
    assert view.kinds[-1] == "AllBlocksCleared"
    assert view_holds(view) == {"GPU": 0, "CPU": 0}
    assert replica_holds(engine) == {"GPU": 0, "CPU": 0}
    assert engine.stats()["store"]["reset_blocks_total"] == 26

    # ... so the next request is cold in every tier (no store hit a router cannot see), and
    # the view follows the tiers again as they refill.
    before = store_tokens(engine)
    again = generate(engine, PROMPT)
    assert (again.num_cached_tokens, store_tokens(engine) - before) == (0, 0)
    settle(engine, view)
    assert replica_holds(engine) == view_holds(view) == {"GPU": 11, "CPU": 11}


def test_a_reset_in_evict_mode_writes_then_drops_what_the_device_evicts(tiny_model):
    """``--kv-store-write evict``: the reset's device eviction hands every block to the host
    tier; the reset waits for those writes and then empties the tier, so none of them is
    announced (no BlockStored CPU) and the next request is cold."""
    engine = make_engine(tiny_model, block_size=B, num_blocks=24, kv_store="host:0.01",
                         kv_store_write="evict")
    engine.cache.events = KVEventLog(B)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        (first,) = engine.generate([PROMPT], params)
        assert engine.store.flush()
        assert engine.store.backend.stats()["num_blocks"] == 0  # still on the device only
        assert engine.cache.reset_prefix_cache() == 11
        assert engine.store.flush()  # nothing left to land after the reset
        snapshot = engine.store.snapshot()
        assert (snapshot["written_blocks_total"], snapshot["num_blocks"]) == (11, 0)
        assert snapshot["reset_blocks_total"] == 11
        engine.store.drain_kv_events(engine.cache.events)
        events = [decode_event(e) for e in engine.cache.events.drain()]
        assert [e[0] for e in events].count("cleared") == 1
        assert [e for e in events if e[0] == "stored" and e[5] == "CPU"] == []
        (again,) = engine.generate([PROMPT], params)
        assert (again.num_cached_tokens, again.num_store_tokens) == (0, 0)
        assert again.output_token_ids == first.output_token_ids
    finally:
        engine.store.close()


def test_a_load_done_before_a_reset_does_not_mark_its_blocks_stored(tiny_model):
    """A load the loader finished before a reset is copied into the pool after it: its keys
    must not go back into the "already stored" memo (the host tier is empty now), else the
    request's own writes are skipped and the blocks are in no tier but the device."""
    engine = make_engine(tiny_model, block_size=B, num_blocks=24, kv_store="host:0.01")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    host = engine.store.backend
    try:
        engine.generate([PROMPT], params)
        assert engine.store.flush()
        engine.cache.evict(engine.num_blocks)
        assert host.stats()["num_blocks"] == 11
        skipped_before = engine.store.snapshot()["skipped_existing_blocks_total"]
        req = engine.make_request(PROMPT, params)
        engine.add_request(req)
        for _ in range(5):  # until the lookup has queued its load
            engine.step()
            if engine.store._jobs:
                break
        (job,) = engine.store._jobs.values()
        deadline = time.monotonic() + 10
        while not job.done:  # the loader finished it; the engine has not consumed it yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.cache.reset_prefix_cache()
        assert host.stats()["num_blocks"] == 0
        while engine.has_work:
            engine.step()
        assert req.num_store_tokens == 40  # served from the load that finished before
        assert engine.store.flush()
        snapshot = engine.store.snapshot()
        # The request's 10 prompt blocks and its output block are written again, none skipped.
        assert snapshot["skipped_existing_blocks_total"] == skipped_before
        assert host.stats()["num_blocks"] == 11
    finally:
        engine.store.close()


def test_a_store_fault_during_a_reset_is_counted_not_fatal(tiny_model, monkeypatch):
    """A StoreError from the backend's clear marks the tier down (as any store fault does);
    the reset itself completes and the engine keeps serving from the device."""
    from radixkv.errors import StoreError

    engine = make_engine(tiny_model, block_size=B, num_blocks=24, kv_store="host:0.01")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def refuse() -> int:
        raise StoreError("host store: refused")

    try:
        (first,) = engine.generate([PROMPT], params)
        assert engine.store.flush()
        monkeypatch.setattr(engine.store.backend, "clear", refuse)
        assert engine.cache.reset_prefix_cache() == 11
        snapshot = engine.store.snapshot()
        assert (snapshot["errors_total"], snapshot["reset_blocks_total"]) == (1, 0)
        assert engine.store.down
        (again,) = engine.generate([PROMPT], params)
        assert again.output_token_ids == first.output_token_ids
    finally:
        engine.store.close()

"""KV events on the wire (``radixkv.engine.kv_events``): a real ZMQ subscriber and replay
client against an engine publishing vLLM 0.33's format (docs/routers-and-kv-events.md
§2.2, §2.3, §2.7): three frames, big-endian seqs from 0, positional batches, tagged event maps
with ``type`` first, replay of buffered batches ending with seq -1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from radixkv.cache.events import event_block_id
from radixkv.engine.kv_events import (
    KVEventPublisher,
    KVEventsConfig,
    encode_batch,
    parse_kv_events_config,
)
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import EngineDeadError
from radixkv.model.loader import LoadedModel
from tests.factories import make_async_engine

B = 4
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "lora_name", "extra_keys", "group_idx"]
LOOPBACK = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                          replay_endpoint="tcp://127.0.0.1:0")


def recv_all(sub: zmq.Socket, count: int, timeout_s: float = 5.0) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        if sub.poll(50):
            got.append(sub.recv_multipart())
    return got


def seq_of(frame: bytes) -> int:
    assert len(frame) == 8
    return int.from_bytes(frame, "big", signed=True)


@pytest.fixture
def engine(tiny_model: LoadedModel) -> Iterator:
    eng = make_async_engine(tiny_model, kv_events=LOOPBACK, block_size=B, num_blocks=64)
    eng.start()
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture
def sub(engine) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.kv_events.advertised_endpoint)
    sock.subscribe(b"")
    time.sleep(0.3)  # the slow-joiner: a SUB sees only what is sent after it has connected
    yield sock
    sock.close()


async def finish(engine, prompt: list[int], max_tokens: int = 1) -> None:
    async for _ in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)):
        pass


def test_batches_on_the_wire_are_vllms_format(engine, sub: zmq.Socket) -> None:
    prompt = list(range(10, 19))  # 2 full blocks computed by the prefill, then 1 token
    asyncio.run(finish(engine, prompt))
    asyncio.run(finish(engine, list(range(10, 14)) + [7, 7, 7, 7, 7]))
    (first, second) = recv_all(sub, 2)
    assert [len(first), first[0], seq_of(first[1])] == [3, b"", 0]
    assert seq_of(second[1]) == 1
    ts, events, rank = msgspec.msgpack.decode(first[2])
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    (stored,) = events
    assert list(stored) == STORED_KEYS
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["token_ids"] == list(range(10, 18))
    assert (stored["block_size"], stored["medium"], stored["lora_name"], stored["lora_id"],
            stored["extra_keys"], stored["group_idx"]) == (B, "GPU", None, None, [None, None], 0)
    # The ids are the tree's chained hashes as uint64s; the second run chains on block 0.
    node = next(iter(engine._engine.cache.tree.roots.values()))
    head = next(iter(node.children.values()))
    assert stored["block_hashes"][0] == event_block_id(head.hashes[0])
    (stored2,) = msgspec.msgpack.decode(second[2])[1]
    assert stored2["parent_block_hash"] == stored["block_hashes"][0]
    assert stored2["token_ids"] == [7, 7, 7, 7]


def test_reset_publishes_all_blocks_cleared(engine, sub: zmq.Socket) -> None:
    asyncio.run(finish(engine, list(range(30, 39))))
    assert asyncio.run(engine.reset_prefix_cache()) == 2
    frames = recv_all(sub, 2)
    assert [seq_of(f[1]) for f in frames] == [0, 1]
    assert msgspec.msgpack.decode(frames[1][2])[1] == [{"type": "AllBlocksCleared"}]
    assert engine._engine.cache.num_cached_blocks == 0


def test_a_withheld_batch_is_recovered_by_replay(engine, sub: zmq.Socket) -> None:
    engine.kv_events.withhold_seqs = {1}
    for start in (100, 200, 300):
        asyncio.run(finish(engine, list(range(start, start + 5))))
    live = recv_all(sub, 3, timeout_s=1.5)
    assert [seq_of(f[1]) for f in live] == [0, 2]  # seq 1 never reached PUB: a gap
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(engine.kv_events.advertised_replay_endpoint)
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big", signed=True)])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if seq_of(frames[2]) == -1:
                assert frames[1] == b"" and frames[3] == b""
                break
            replies.append(frames)
    finally:
        dealer.close()
    assert [seq_of(f[2]) for f in replies] == [1, 2]
    assert msgspec.msgpack.decode(replies[0][3])[1][0]["token_ids"] == [200, 201, 202, 203]
    assert replies[1][3] == live[1][2]  # the very payload that went out live


def test_salted_requests_publish_nothing(engine, sub: zmq.Socket) -> None:
    async def salted() -> None:
        stream = engine.generate(list(range(40, 49)), SamplingParams(max_tokens=1, temperature=0),
                                 cache_salt="tenant:a")
        async for _ in stream:
            pass
    asyncio.run(salted())
    assert recv_all(sub, 1, timeout_s=0.5) == []
    assert engine._engine.cache.num_cached_blocks == 2


def test_sources_and_bind_errors(tiny_model: LoadedModel, engine) -> None:
    (source,) = engine.kv_events.sources().values()
    assert source["endpoint"] == engine.kv_events.advertised_endpoint
    assert source["endpoint"].startswith("tcp://127.0.0.1:") and not source["endpoint"].endswith(":0")
    assert {k: source[k] for k in ("topic", "hwm", "buffer_steps", "publisher", "encoding",
                                   "schema_version", "enable_kv_cache_events")} == {
        "topic": "", "hwm": 100000, "buffer_steps": 10000, "publisher": "zmq",
        "encoding": "msgpack", "schema_version": 1, "enable_kv_cache_events": True}
    taken = KVEventsConfig(enable_kv_cache_events=True, endpoint=source["endpoint"])
    other = make_async_engine(tiny_model, kv_events=taken, block_size=B, num_blocks=8)
    with pytest.raises(ValueError, match="kv_events_config.endpoint: cannot bind"):
        other.kv_events.start()


def test_config_parsing_names_the_field() -> None:
    assert parse_kv_events_config({"enable_kv_cache_events": True}) == KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:5557", buffer_steps=10000, hwm=100000)
    with pytest.raises(ValueError, match="kv_events_config.endpont: unknown key"):
        parse_kv_events_config({"endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="kv_events_config.buffer_steps"):
        parse_kv_events_config({"buffer_steps": 0})
    with pytest.raises(ValueError, match="kv_events_config.endpoint"):
        parse_kv_events_config({"endpoint": "5557"})
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).enabled


def test_encoding_matches_the_reference_bytes() -> None:
    """The exact head of the bytes msgspec writes with vLLM 0.33's own structs for one
    BlockStored (the reference's measured dump, §2.3): a 3-array, a float64, a 1-array of a
    10-key map whose first pair is "type": "BlockStored"."""
    hashes = [(9561501211280363793).to_bytes(16, "big"), (1).to_bytes(16, "big")]
    tokens = b"".join(t.to_bytes(4, "little") for t in range(1, 9))
    payload = encode_batch([("stored", hashes, None, tokens, None)], 4, ts=1.5)
    (stored,) = msgspec.msgpack.decode(payload)[1]
    assert stored["block_hashes"] == [9561501211280363793, 1]
    assert stored["token_ids"] == list(range(1, 9))
    assert payload[:10] == bytes.fromhex("93cb3ff8000000000000")
    assert payload[10:13] == bytes.fromhex("918aa4")
    assert payload[13:17] == b"type" and payload[17:18] == b"\xab" and payload[18:29] == b"BlockStored"


def test_nothing_queues_once_the_publisher_has_stopped(tiny_model: LoadedModel) -> None:
    eng = make_async_engine(tiny_model, kv_events=LOOPBACK, block_size=B, num_blocks=8)
    publisher = eng.kv_events
    publisher.publish([("cleared",)])  # not started: nothing to send it on
    assert publisher.num_queued_batches == 0
    publisher.start()
    publisher.close()
    publisher.publish([("cleared",)])
    assert (publisher.num_queued_batches, publisher.next_seq) == (0, 0)


def test_no_publisher_without_prefix_caching(tiny_model: LoadedModel) -> None:
    eng = make_async_engine(tiny_model, kv_events=LOOPBACK, block_size=B, num_blocks=8,
                            prefix_cache=False)
    assert eng.kv_events is None and eng._engine.cache.events is None


@pytest.mark.parametrize("endpoint,prefix", [("tcp://[::1]:0", "tcp://[::1]:"),
                                             ("tcp://127.0.0.1:*", "tcp://127.0.0.1:")])
def test_ipv6_and_wildcard_ports_bind(endpoint: str, prefix: str) -> None:
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint), B)
    try:
        publisher.start()
    except ValueError as exc:
        if "[::1]" not in endpoint:
            raise  # 127.0.0.1 binds on every host: a failure there is a defect
        pytest.skip(f"cannot bind {endpoint}: {exc} (a host without IPv6 at all)")
    try:
        bound = publisher.advertised_endpoint
        assert bound.startswith(prefix) and 0 < int(bound.rpartition(":")[2]) < 65536
    finally:
        publisher.close()


def test_reset_on_a_stopped_engine_raises(tiny_model: LoadedModel) -> None:
    eng = make_async_engine(tiny_model, block_size=B, num_blocks=8)
    eng.start()
    asyncio.run(eng.shutdown())
    with pytest.raises(EngineDeadError):
        asyncio.run(eng.reset_prefix_cache())

"""KV cache events in vLLM 0.33's wire format, published over ZMQ for KV-aware routers.

vllm-router's ``kv_aware`` policy subscribes to each replica's events and keeps an index of
which replica holds which prefix blocks (``docs/routers-and-kv-events.md`` §2). The
cache records what its tree stored and removed (``radixkv.cache.events.KVEventLog``); after each
engine step that changed anything, the engine thread hands the step's events here as one batch.

Wire format (vLLM 0.33 ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

* a PUB socket sends three frames per batch: ``[topic, seq, payload]``, ``seq`` an int64
  big-endian counting batches from 0 in this process (a subscriber that sees it go back knows
  the replica restarted), ``payload`` msgpack;
* ``payload = [ts, [events], data_parallel_rank]`` (``EventBatch``: a positional array), each
  event a map whose first key is ``"type"`` (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``), then its fields in declaration order; ``None`` defaults are omitted;
* an optional ROUTER socket answers replay requests ``[id, b"", start_seq]`` with every
  buffered batch from ``start_seq`` on (``[id, b"", topic, seq, payload]`` each), then the end
  marker ``[id, b"", b"", seq=-1, b""]``; the buffer keeps the last ``buffer_steps`` batches.

Replay is lossless. A ROUTER drops what it cannot queue for a peer past its high-water mark,
so a reader slower than the replay would miss batches and still get the end marker. Here the
ROUTER is ``ZMQ_ROUTER_MANDATORY`` and replies are sent without blocking: when the reader's
pipe is full the rest waits (flow control) and goes out as the reader drains it, between live
batches, and the end marker goes only after the last batch. A reader that takes nothing for
``replay_stall_s`` (``REPLAY_STALL_S``) is given up (logged, counted in
``num_replays_abandoned``): it never gets the end marker, so it knows its replay is incomplete
(vllm-router also checks that seqs are contiguous, within its own 5 s deadline).

Unlike vLLM, which connects when the endpoint names a concrete host, the PUB socket always
binds: the routers connect to it. Port ``0`` (or ``*``) binds a free port;
``advertised_endpoint`` reports it. ZMQ sockets are not thread-safe: one publisher thread owns
both, fed by a queue, so the engine thread never blocks on the network.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from radixkv.cache.events import decode_event
from radixkv.log import get_logger

log = get_logger(__name__)

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVEventPublisher",
           "KVEventsConfig", "encode_batch", "parse_kv_events_config"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # the publisher thread's wait between replay checks when no batch arrives
_REPLAY_POLL_S = 0.002  # ... while a replay waits for its reader to drain (flow control)
#: Seconds a replay may go without sending anything (its reader's pipe full) before it is
#: given up.
REPLAY_STALL_S = 10.0


@dataclasses.dataclass
class _Replay:
    """One replay in progress (publisher thread): what is left to send, in order; seq -1 is
    the end marker."""

    client: bytes
    pending: deque[tuple[int, bytes]]
    last_progress_s: float


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys and defaults (``vllm.config.KVEventsConfig``).

    Attributes:
        enable_kv_cache_events: Publish events at all.
        publisher: ``"zmq"`` (``"null"``: publish nothing).
        endpoint: PUB endpoint, e.g. ``tcp://*:5557`` (all interfaces) or
            ``tcp://127.0.0.1:0`` (a free port on loopback).
        replay_endpoint: ROUTER endpoint answering replay requests; None: no replay.
        buffer_steps: Batches kept for replay.
        hwm: ZMQ send high-water mark of the PUB socket (messages).
        max_queue_size: Batches waiting for the publisher thread; past it the oldest waits
            and the engine drops the newest with a warning (a subscriber then sees a gap).
        topic: Topic frame of every message (vllm-router's static sources expect ``""``).

    Raises:
        ValueError: naming the field.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if type(self.enable_kv_cache_events) is not bool:
            raise ValueError("kv_events_config.enable_kv_cache_events: must be true or false")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher: must be 'zmq' or 'null', "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"kv_events_config.{name}: must be a ZMQ endpoint such as "
                                 f"tcp://*:5557, got {value!r}")
            port = value.rpartition(":")[2]
            if value.startswith("tcp://") and port != "*" and not (
                    port.isdigit() and int(port) <= 65535):
                raise ValueError(f"kv_events_config.{name}: the port must be 0-65535 or *, "
                                 f"got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"kv_events_config.{name}: must be an integer >= 1, "
                                 f"got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic: must be a string, got {self.topic!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(data: Any) -> KVEventsConfig:
    """A ``KVEventsConfig`` from vLLM's JSON object (``--kv-events-config``).

    Raises:
        ValueError: naming an unknown key or a bad value.
    """
    if not isinstance(data, dict):
        raise ValueError("kv_events_config: must be a JSON object")
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"kv_events_config.{unknown[0]}: unknown key (known: "
                         f"{', '.join(sorted(known))})")
    return KVEventsConfig(**data)


# ---- wire structs: the shapes of vLLM 0.33's, field for field ------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event maps (``"type"`` is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def to_wire(event: tuple, block_size: int) -> KVCacheEvent:
    """One ``KVEventLog`` entry as its vLLM struct. ``extra_keys`` carries vLLM's per-block
    keys: ``[lora_name]`` for an adapter's block, None for the base model's."""
    event = decode_event(event)
    kind = event[0]
    if kind == "stored":
        _, ids, parent, tokens, lora_name, medium = event
        return BlockStored(block_hashes=ids, parent_block_hash=parent, token_ids=tokens,
                           block_size=block_size, lora_id=None, medium=medium,
                           lora_name=lora_name,
                           extra_keys=[[lora_name] if lora_name else None] * len(ids),
                           group_idx=0)
    if kind == "removed":
        return BlockRemoved(block_hashes=event[1], medium=event[2], group_idx=0)
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"event: unknown kind {kind!r}")


def encode_batch(events: list[tuple], block_size: int, *, ts: float | None = None,
                 data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one batch of ``KVEventLog`` entries (``ts``: Unix seconds)."""
    batch = EventBatch(ts=time.time() if ts is None else ts,
                       events=[to_wire(e, block_size) for e in events],
                       data_parallel_rank=data_parallel_rank)
    return _ENCODER.encode(batch)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` (port 0 or * picks a free one); return the endpoint as bound."""
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port in ("0", "*"):
        host = head[len("tcp://"):]
        bound = sock.bind_to_random_port(f"tcp://{host}")
        return f"{head}:{bound}"
    sock.bind(endpoint)
    return endpoint


class KVEventPublisher:
    """Publishes batches of KV events on ZMQ from its own thread (see the module docstring).

    Args:
        config: An enabled ``KVEventsConfig``.
        block_size: Tokens per block, written into every ``BlockStored``.
        data_parallel_rank: This engine's rank (0: radixkv runs one engine per process).

    Attributes:
        withhold_seqs: Test hook: batches with these seqs go into the replay buffer but not
            onto PUB (a subscriber sees a gap and must replay).
        replay_stall_s: Seconds a replay's reader may take nothing before the replay is
            given up (``REPLAY_STALL_S``).
        num_replays_abandoned: Replays given up that way (their readers got no end marker).
        advertised_endpoint, advertised_replay_endpoint: The endpoints as bound (the chosen
            port when the config asked for port 0); set by :meth:`start`.
    """

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.withhold_seqs: set[int] = set()
        self.replay_stall_s = REPLAY_STALL_S
        self.num_replays_abandoned = 0
        self._replays: list[_Replay] = []  # publisher thread only
        self.advertised_endpoint = config.endpoint
        self.advertised_replay_endpoint = config.replay_endpoint
        self.num_batches_published = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._sending = False  # the thread has its sockets and has not stopped

    @property
    def next_seq(self) -> int:
        """The seq the next batch will get (batches encoded so far; read across threads)."""
        return self._seq

    @property
    def num_queued_batches(self) -> int:
        """Batches the engine handed over that the publisher thread has not sent yet."""
        return self._queue.qsize()

    def start(self) -> None:
        """Bind the sockets (in the publisher thread) and wait until they are.

        Raises:
            ValueError: naming ``kv_events_config.endpoint`` / ``replay_endpoint`` when it
                cannot be bound (in use, malformed).
        """
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            self._thread.join(timeout=5)
            raise self._error

    def publish(self, events: list[tuple]) -> None:
        """Queue one step's events (engine thread; never blocks). Dropped once the publisher
        thread has stopped (closed, or failed: logged then), so nothing piles up."""
        if not self._sending:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            log.warning("kv_events_queue_full", dropped_events=len(events))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the sockets and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT too (IPv4 addresses still work)
            which = "endpoint"
            try:
                self.advertised_endpoint = _bind(pub, self.config.endpoint)
                if self.config.replay_endpoint is not None:
                    which = "replay_endpoint"
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    # A full reader pipe: EAGAIN (the reply waits), never a silent drop.
                    replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                    replay.setsockopt(zmq.IPV6, 1)
                    self.advertised_replay_endpoint = _bind(replay, self.config.replay_endpoint)
                self._sending = True  # before start() returns: the first step's batch counts
            except zmq.ZMQError as exc:
                value = getattr(self.config, which)
                self._error = ValueError(f"kv_events_config.{which}: cannot bind {value!r}: {exc}")
                return
            finally:
                self._ready.set()
            log.info("kv_events_publishing", endpoint=self.advertised_endpoint,
                     replay_endpoint=self.advertised_replay_endpoint, topic=self.config.topic)
            if any(e is not None and ("tcp://*:" in e or "tcp://0.0.0.0:" in e)
                   for e in (self.advertised_endpoint, self.advertised_replay_endpoint)):
                # vLLM's default, but BlockStored carries every prompt's token ids.
                log.warning("kv_events_on_all_interfaces", endpoint=self.advertised_endpoint,
                            note="events carry prompt token ids; bind a private address "
                                 "unless every host that can reach it may read prompts")
            self._loop(pub, replay)
        except Exception:  # noqa: BLE001 - routing degrades to load balancing; serving goes on
            log.exception("kv_events_publisher_failed")
        finally:
            self._sending = False
            pub.close()
            if replay is not None:
                replay.close()

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        while True:
            try:
                events = self._queue.get(timeout=_REPLAY_POLL_S if self._replays else _POLL_S)
            except queue.Empty:
                events = None
                if self._stop.is_set():
                    return
            if events:
                self._send(pub, events)
            while replay is not None and replay.poll(0):
                self._answer_replay(replay)
            if self._replays and replay is not None:  # replays come only through it
                self._pump_replays(replay)

    def _send(self, pub: zmq.Socket, events: list[tuple]) -> None:
        payload = encode_batch(events, self.block_size, data_parallel_rank=self.data_parallel_rank)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if seq in self.withhold_seqs:
            return
        pub.send_multipart((self._topic, seq.to_bytes(8, "big", signed=True), payload))
        self.num_batches_published += 1

    def _answer_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        # The batches as buffered now (the buffer may roll on while the reader drains them).
        pending = deque((seq, payload) for seq, payload in self._buffer if seq >= start)
        pending.append((-1, b""))
        self._replays.append(_Replay(client, pending, time.monotonic()))

    def _pump_replays(self, replay: zmq.Socket) -> None:
        """Send each replay's next replies until its reader's pipe is full (``zmq.Again``: the
        rest waits for the next pass); drop a replay whose reader is gone or stalled."""
        now = time.monotonic()
        for job in list(self._replays):
            try:
                while job.pending:
                    seq, payload = job.pending[0]
                    # EAGAIN comes on the first frame only: a message goes whole or not at all.
                    replay.send_multipart(
                        (job.client, b"", b"", END_SEQ, b"") if seq < 0 else
                        (job.client, b"", self._topic, seq.to_bytes(8, "big", signed=True),
                         payload), flags=zmq.NOBLOCK)
                    job.pending.popleft()
                    job.last_progress_s = now
            except zmq.Again:
                if now - job.last_progress_s < self.replay_stall_s:
                    continue
                self.num_replays_abandoned += 1
                log.warning("kv_events_replay_abandoned", unsent_batches=len(job.pending) - 1,
                            stalled_s=round(now - job.last_progress_s, 3))
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the reader disconnected
                log.info("kv_events_replay_reader_gone", error=str(exc),
                         unsent_batches=len(job.pending) - 1)
            self._replays.remove(job)

    def sources(self) -> dict[str, dict[str, Any]]:
        """``GET /kv_event_sources``: this engine's source keyed by DP rank, with the keys
        vllm-router's discovery requires (``encoding``, ``schema_version``)."""
        return {str(self.data_parallel_rank): {
            "endpoint": self.advertised_endpoint,
            "replay_endpoint": self.advertised_replay_endpoint,
            "topic": self.config.topic, "hwm": self.config.hwm,
            "buffer_steps": self.config.buffer_steps, "publisher": "zmq",
            "encoding": "msgpack", "schema_version": 1, "enable_kv_cache_events": True}}

"""KV-event replay to a reader slower than the ROUTER's high-water mark: every buffered batch
arrives, contiguous, before the end marker (flow control, never a silent drop); a reader that
stops reading altogether is given up after ``replay_stall_s`` without holding up the live
stream, and it never gets an end marker, so it knows its replay is incomplete.

Deterministic: the replay socket is ``inproc://`` (no kernel buffers: a pipe holds exactly the
two high-water marks), the high-water marks are tiny, and the reader does not read until the
publisher has had the request for a second — far longer than sending everything takes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import zmq

from radixkv.engine.kv_events import KVEventPublisher, KVEventsConfig

N = 3000
HWM = 8
B = 4
_names = itertools.count()


def stored_event(i: int) -> tuple:
    """A one-block ``KVEventLog`` entry (16-byte chained hash, B packed tokens)."""
    return ("stored", [i.to_bytes(16, "big")], None, bytes(4 * B), None)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def start_publisher(replay_endpoint: str, **kw) -> KVEventPublisher:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                            replay_endpoint=replay_endpoint, buffer_steps=N + 100, hwm=HWM)
    publisher = KVEventPublisher(config, block_size=B)
    for key, value in kw.items():
        setattr(publisher, key, value)
    publisher.start()
    for i in range(N):
        publisher.publish([stored_event(i)])
    deadline = time.monotonic() + 30
    while publisher.next_seq < N or publisher.num_queued_batches:
        assert time.monotonic() < deadline, "the publisher did not take every batch"
        time.sleep(0.01)
    return publisher


@pytest.fixture
def inproc() -> str:
    return f"inproc://radixkv-replay-test-{next(_names)}"


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.connect(endpoint)
    return sock


def read_replay(sock: zmq.Socket, quiet_ms: int = 3000) -> tuple[list[int], bool]:
    """Seqs received, and whether the end marker came (bounded: stops after ``quiet_ms``
    without a message)."""
    seqs: list[int] = []
    while sock.poll(quiet_ms):
        frames = sock.recv_multipart()
        assert len(frames) == 4 and frames[0] == b""
        if seq_of(frames[2]) == -1:
            assert frames[1] == b"" and frames[3] == b""
            return seqs, True
        seqs.append(seq_of(frames[2]))
    return seqs, False


@pytest.fixture
def closing() -> Iterator[list]:
    things: list = []
    yield things
    for thing in things:
        thing.close()


def test_a_slow_reader_gets_every_batch_then_the_end_marker(inproc, closing):
    publisher = start_publisher(inproc)
    closing.append(publisher)
    sock = dealer(inproc)
    closing.append(sock)
    sock.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
    time.sleep(1.0)  # the publisher has had the request: sending all at once would overflow
    seqs, ended = read_replay(sock)
    assert (len(seqs), ended) == (N, True)
    assert seqs == list(range(N))


def test_a_replay_from_a_later_seq_over_tcp_is_contiguous(closing):
    publisher = start_publisher("tcp://127.0.0.1:0")
    closing.append(publisher)
    sock = dealer(publisher.advertised_replay_endpoint)
    closing.append(sock)
    sock.send_multipart([b"", (1234).to_bytes(8, "big", signed=True)])
    time.sleep(1.0)
    seqs, ended = read_replay(sock)
    assert ended and seqs == list(range(1234, N))


def test_a_reader_that_never_reads_is_given_up_without_stalling_the_live_stream(inproc,
                                                                                closing):
    publisher = start_publisher(inproc, replay_stall_s=0.3)
    closing.append(publisher)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(publisher.advertised_endpoint)
    sub.subscribe(b"")
    closing.append(sub)
    time.sleep(0.3)  # the slow-joiner: a SUB sees only what is sent after it has connected
    sock = dealer(inproc)
    closing.append(sock)
    sock.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
    time.sleep(0.2)
    for i in range(N, N + 5):  # live batches go out while the replay is stuck
        publisher.publish([stored_event(i)])
    live = []
    deadline = time.monotonic() + 5
    while len(live) < 5 and time.monotonic() < deadline:
        if sub.poll(100):
            live.append(seq_of(sub.recv_multipart()[1]))
    assert live == list(range(N, N + 5))
    deadline = time.monotonic() + 5
    while publisher.num_replays_abandoned == 0:
        assert time.monotonic() < deadline, "the stuck replay was never given up"
        time.sleep(0.05)
    assert publisher.num_replays_abandoned == 1
    seqs, ended = read_replay(sock, quiet_ms=500)
    # What the pipe held, contiguous from the start; no end marker: the reader knows.
    assert not ended
    assert 0 < len(seqs) < N and seqs == list(range(len(seqs)))

"""Trace loading for ``radixkv bench eviction``: Mooncake, token-id JSONL and chat transcripts.

Every format becomes a :class:`Trace`: requests in replay order, each with its clock reading
(seconds), cache salt, prompt length, session key, modeled duration and dense ids of its blocks
(one per ``block_size`` tokens, the last one partial when the length is not a multiple; equal id
= same tokens and same prefix). Token ids are kept packed (uint32-LE ``bytes``); a Mooncake
request has no tokens, so its prompt is synthesised when replayed: block ``k`` holds its hash id
repeated ``block_size`` times (a partial last block: repeated for the remaining tokens), which
the tree stores and compares like any tokens, so equal ids match and different ids never do.

Sessions and durations: a Mooncake record has no session id, so the session key is derived from
its hash-id chain: ``m<hash_ids[1]>``, the first block after the block every request shares
(id 0, the common system prompt). Ids are chained, so two requests with the same second block
have the same first 1,024 tokens: the turns of one conversation (on the conversation trace the
groups by ``hash_ids[1]``, ``[2]`` and ``[3]`` nearly coincide: 7,373 / 6,572 / 6,015 keys).
A one-block request has none. Its duration is ``output_length × ITL``. Token JSONL may carry
``session`` and ``output_length``. Chat traces: see ``_eviction_chat``.
"""

from __future__ import annotations

import json
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

from _arg_types import ThinkTime  # bench/ is on sys.path (see bench/eviction.py)

from radixkv.config import check_block_size

DEFAULT_ITL_MS = 20.0
"""Modeled inter-token latency (ms per output token) when a trace gives none."""

_U32 = struct.Struct("<I")


class TraceRequest(NamedTuple):
    """One request of a trace.

    Attributes:
        time_s: Clock reading (trace timestamp in seconds, or the request's ordinal).
        salt: Cache salt (tenant namespace), None for none.
        num_tokens: Prompt tokens N.
        blocks: Dense block ids, ``ceil(N / B)`` of them.
        tokens: Packed prompt tokens, or None to synthesise them from ``blocks`` (Mooncake).
        session: Session key handed to ``CacheManager.begin`` (None: none).
        duration_s: Modeled request duration (output tokens × ITL), seconds: the replay
            releases the request with ``end_s = time_s + duration_s``.
    """

    time_s: float
    salt: str | None
    num_tokens: int
    blocks: array
    tokens: bytes | None
    session: str | None = None
    duration_s: float = 0.0


@dataclass
class Trace:
    """A loaded trace and the facts every replay of it shares.

    Attributes:
        name: Label (file stem or source name).
        format: ``mooncake``, ``tokens`` or ``chat``.
        block_size: Tokens per block.
        requests: In replay order.
        distinct_blocks: Distinct block ids (full and partial), the capacity reference.
        notes: Facts worth reporting with the results (chat: sessions, concurrency).
    """

    name: str
    format: str
    block_size: int
    requests: list[TraceRequest]
    distinct_blocks: int = 0
    notes: dict = field(default_factory=dict)

    def prompt(self, req: TraceRequest) -> bytes:
        """Packed prompt tokens of ``req`` (synthesised for Mooncake)."""
        if req.tokens is not None:
            return req.tokens
        bs = self.block_size
        blocks = req.blocks
        last = req.num_tokens - bs * (len(blocks) - 1)
        parts = [_U32.pack(b) * bs for b in blocks[:-1]]
        parts.append(_U32.pack(blocks[-1]) * last)
        return b"".join(parts)

    def cap_blocks(self, req: TraceRequest) -> int:
        """Blocks a lookup may match: ``floor((N - 1) / B)`` (the hit cap)."""
        return (req.num_tokens - 1) // self.block_size


def load_mooncake(path: str | Path, block_size: int, *, itl_ms: float = DEFAULT_ITL_MS,
                  sessions: bool = True, max_requests: int | None = None) -> Trace:
    """Mooncake JSONL (``timestamp`` ms, ``input_length``, ``hash_ids``, ``output_length``):
    ids are chained already. Session keys ``m<hash_ids[1]>`` (module docstring; none with
    ``sessions=False``), duration ``output_length × itl_ms`` (0 without ``output_length``);
    only the first ``max_requests`` requests when given.

    Raises:
        ValueError: a line lacks a field, or ``hash_ids`` disagrees with ``input_length``.
    """
    requests: list[TraceRequest] = []
    distinct: set[int] = set()
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if max_requests is not None and len(requests) >= max_requests:
                break
            rec = json.loads(line)
            try:
                n, ids = int(rec["input_length"]), rec["hash_ids"]
                t = float(rec.get("timestamp", lineno - 1)) / 1000.0
                duration = float(rec.get("output_length") or 0) * itl_ms / 1e3
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"trace: {path}:{lineno} is not a Mooncake record ({exc})") from None
            if n <= 0 or len(ids) != -(-n // block_size):
                raise ValueError(f"trace: {path}:{lineno}: {len(ids)} hash_ids for input_length {n} "
                                 f"with --block-size {block_size}")
            distinct.update(ids)
            session = f"m{ids[1]}" if sessions and len(ids) > 1 else None
            requests.append(TraceRequest(t, None, n, array("q", ids), None, session, duration))
    return Trace(Path(path).stem, "mooncake", block_size, requests, len(distinct))


class _BlockIds:
    """Dense ids of chained blocks: ``(parent id, block bytes)`` -> id (partial blocks too)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, bytes], int] = {}

    def of(self, pb: bytes, block_size: int) -> array:
        bb = 4 * block_size
        out = array("q")
        parent = -1
        ids = self.ids
        for pos in range(0, len(pb), bb):
            key = (parent, pb[pos : pos + bb])
            parent = ids.get(key, -1)
            if parent < 0:
                parent = ids[key] = len(ids)
            out.append(parent)
        return out


def trace_from_prompts(name: str, fmt: str, block_size: int,
                       prompts: Iterable[tuple]) -> Trace:
    """Build a trace from ``(time_s, salt, packed tokens[, session, duration_s])`` in replay
    order."""
    ids: dict[str | None, _BlockIds] = {}  # blocks of different salts never share
    requests = []
    for t, salt, pb, *extra in prompts:
        if not pb:
            continue
        per_salt = ids.setdefault(salt, _BlockIds())
        requests.append(TraceRequest(t, salt, len(pb) // 4, per_salt.of(pb, block_size), pb,
                                     *extra))
    offset = 0
    if len(ids) > 1:  # make ids unique across salts
        shifted = []
        bases = {}
        for salt, table in ids.items():
            bases[salt] = offset
            offset += len(table.ids)
        for r in requests:
            base = bases[r.salt]
            shifted.append(r._replace(blocks=array("q", (b + base for b in r.blocks))))
        requests = shifted
    distinct = sum(len(t.ids) for t in ids.values())
    return Trace(name, fmt, block_size, requests, distinct)


def load_tokens(path: str | Path, block_size: int, *, itl_ms: float = DEFAULT_ITL_MS,
                sessions: bool = True) -> Trace:
    """radixkv token JSONL: ``{"token_ids": [...], "timestamp": ms?, "cache_salt": str?,
    "session": str?, "output_length": int?}`` (duration ``output_length × itl_ms``, else 0).

    Raises:
        ValueError: a line has no ``token_ids`` list.
    """
    def prompts():
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                toks = rec.get("token_ids") if isinstance(rec, dict) else None
                if not isinstance(toks, list):
                    raise ValueError(f"trace: {path}:{lineno} has no token_ids list")
                ts = rec.get("timestamp")
                t = float(ts) / 1000.0 if ts is not None else float(lineno - 1)
                duration = float(rec.get("output_length") or 0) * itl_ms / 1e3
                session = rec.get("session") if sessions else None
                yield (t, rec.get("cache_salt"), array("I", toks).tobytes(),
                       None if session is None else str(session), duration)
    return trace_from_prompts(Path(path).stem, "tokens", block_size, prompts())


def interleave(sessions: list[list], concurrency: int) -> list:
    """Replay order of session turns with ``concurrency`` sessions in flight.

    Sessions start in file order; the in-flight sessions take turns (one request each, round
    robin) and a finished session's slot goes to the next one, as ``bench serve`` runs them.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    pending = [list(s) for s in sessions if s][::-1]
    live: list[list] = []
    order = []
    while pending or live:
        while pending and len(live) < concurrency:
            live.append(pending.pop())
        for session in list(live):
            order.append(session.pop(0))
            if not session:
                live.remove(session)
    return order


def load_chat(source: str, path: str | None, block_size: int, concurrency: int,
              tokenizer=None, *, itl_ms: float = DEFAULT_ITL_MS, tool_latency_ms: float = 1000.0,
              tool_latency_dist: str = "fixed", default_output_tokens: int = 128,
              sessions: bool = True, max_sessions: int | None = None,
              cache_dir: str | None = None, think_time: ThinkTime | None = None,
              think_seed: int = 0) -> Trace:
    """Agent transcripts (``radixkv.tools.transcripts`` source), tokenized with the embedded model's
    chat template, on the modeled clock of ``_eviction_chat`` (turn duration = reply tokens ×
    ``itl_ms``; next turn ``tool_latency_ms`` plus a ``think_time`` draw after; ``concurrency``
    sessions live); session key = the transcript's session id. ``max_sessions`` keeps that many
    sessions, evenly spread.
    """
    import _eviction_chat as chat

    tokenized = chat.tokenize_sessions(source, path, tokenizer, cache_dir)
    tokenized = chat.subsample(tokenized, max_sessions)
    trace = chat.chat_trace(source, tokenized, block_size, concurrency=concurrency,
                            itl_ms=itl_ms, tool_latency_ms=tool_latency_ms,
                            tool_latency_dist=tool_latency_dist,
                            default_output_tokens=default_output_tokens, with_sessions=sessions,
                            think_time=think_time, think_seed=think_seed)
    if max_sessions:
        trace.notes["max_sessions"] = max_sessions
    return trace


def peak_working_set(trace: Trace) -> int:
    """The most blocks the live sessions hold at once: replaying ``trace`` in order, a session
    is live from its first request to its last, and holds the blocks of its latest request
    (full and partial; a block shared by several live sessions, such as a common system prompt,
    counts once); a request without a session holds its blocks only while it runs. The
    reference of ``bench eviction --capacity-basis working-set``: a pool of a fraction f of it
    holds f of what the sessions live at the busiest moment need.
    """
    last = {}
    for i, req in enumerate(trace.requests):
        if req.session is not None:
            last[req.session] = i
    refs: dict[int, int] = {}
    held: dict[str, array] = {}
    live = peak = 0

    def add(blocks: Iterable[int]) -> None:
        nonlocal live
        for b in blocks:
            n = refs.get(b, 0)
            refs[b] = n + 1
            live += n == 0

    def drop(blocks: Iterable[int]) -> None:
        nonlocal live
        for b in blocks:
            n = refs[b] - 1
            if n:
                refs[b] = n
            else:
                del refs[b]
                live -= 1

    for i, req in enumerate(trace.requests):
        add(req.blocks)
        if req.session is not None:
            old = held.pop(req.session, None)
            if old is not None:
                drop(old)
        peak = max(peak, live)
        if req.session is not None and last[req.session] > i:
            held[req.session] = req.blocks
        else:
            drop(req.blocks)
    return peak


def add_think_time(trace: Trace, think_time: ThinkTime, seed: int = 0) -> Trace:
    """``trace`` with think time added between each session's requests: request ``k`` (>= 1,
    in trace order) of a session starts later by the sum of the draws
    ``think_time.draw_s(seed, session, j)`` for ``j = 1..k``, so every gap of the session grows
    by one draw; requests without a session keep their time. Requests are re-sorted by time
    (stable: ties keep trace order). ``notes["think_time_s"]`` records the spec.
    """
    shift: dict[str, float] = {}
    turns: dict[str, int] = {}
    moved = []
    for req in trace.requests:
        if req.session is None:
            moved.append(req)
            continue
        k = turns.get(req.session, 0)
        turns[req.session] = k + 1
        if k:
            shift[req.session] = shift.get(req.session, 0.0) + think_time.draw_s(seed, req.session, k)
        moved.append(req._replace(time_s=req.time_s + shift.get(req.session, 0.0)))
    moved.sort(key=lambda r: r.time_s)
    trace.requests = moved
    trace.notes["think_time_s"] = str(think_time)
    return trace


def load_trace(fmt: str, path: str | None, block_size: int, *, source: str = "tau-bench",
               concurrency: int = 8, itl_ms: float = DEFAULT_ITL_MS, sessions: bool = True,
               max_requests: int | None = None, think_time: ThinkTime | None = None,
               think_seed: int = 0, **chat_options) -> Trace:
    """Load a trace in ``fmt`` (``mooncake`` / ``tokens`` / ``chat``); ``chat_options`` go to
    :func:`load_chat` (``tool_latency_ms``, ``tool_latency_dist``, ``default_output_tokens``,
    ``max_sessions``, ``cache_dir``); ``max_requests`` cuts a Mooncake trace to its head.
    ``think_time`` (seeded by ``think_seed``) lengthens the gaps between a session's turns: on
    the modeled clock of a chat trace, or on the timestamps (:func:`add_think_time`)."""
    check_block_size(block_size)
    think = think_time if think_time is not None and think_time.mean_s > 0 else None
    if fmt == "chat":
        return load_chat(source, path, block_size, concurrency, itl_ms=itl_ms,
                         sessions=sessions, think_time=think, think_seed=think_seed,
                         **chat_options)
    if path is None:
        raise ValueError(f"trace: a path is required for --format {fmt}")
    if fmt == "mooncake":
        trace = load_mooncake(path, block_size, itl_ms=itl_ms, sessions=sessions,
                              max_requests=max_requests)
    elif fmt == "tokens":
        trace = load_tokens(path, block_size, itl_ms=itl_ms, sessions=sessions)
    else:
        raise ValueError(f"format: unknown trace format {fmt!r} (mooncake, tokens, chat)")
    return add_think_time(trace, think, think_seed) if think is not None else trace

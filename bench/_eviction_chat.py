"""Chat traces for ``radixkv bench eviction``: agent transcripts tokenized with the embedded
model's chat template, on a modeled clock.

Clock model (so that time-based policy features mean something): a request lasts its reply's
decode, ``duration_s = output_tokens × ITL`` (``output_tokens``: tokens of the assistant reply
that answered the prompt in the transcript; prefill time is not modeled); a session's next turn
starts ``tool_latency`` after its previous turn ended (the agent runs its tool); ``concurrency``
sessions are live at once, the first ones start at 0 and a finished session's slot goes to the
next session in file order when its last turn ends. Requests are replayed in start-time order
(ties: the session that became ready first). Tool latency is fixed, or drawn from an
exponential distribution of that mean with a fixed seed (``tool_latency_dist="exp"``); a think
time (``ThinkTime``: fixed or exponential, drawn per session and turn) can be added to each gap.

Tokenizing every request's whole history costs O(turns²) per session (tau-bench: ~50 s; the
100 mini-swe-agent-gemini3 sessions: over 10 minutes), so :class:`PieceTokenizer` renders each
prompt with the chat template, splits the text at the tokenizer's added tokens (which the
tokenizer splits out before anything else) and tokenizes each piece between them once per
session (a message's text recurs in every later turn). The last request of every session is
checked against the plain ``apply_chat_template``; a session that differs is tokenized the
plain way. Tokenized sessions can also be kept in a cache folder (``cache_dir``), keyed by
source, data path, the data files' sizes and mtimes and the tokenizer.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import pickle
import random
import re
from array import array
from pathlib import Path
from typing import Callable, NamedTuple

from _arg_types import ThinkTime  # bench/ is on sys.path (see bench/eviction.py)
from _eviction_trace import Trace, trace_from_prompts

CACHE_VERSION = 1
"""Bump when what :func:`tokenize_sessions` stores changes."""


class ChatTurn(NamedTuple):
    """One tokenized request of a session.

    Attributes:
        prompt: Packed prompt tokens (uint32-LE).
        output_tokens: Tokens of the reply that answered it, None when the transcript has none.
    """

    prompt: bytes
    output_tokens: int | None


def schedule(outputs: list[list[int]], concurrency: int, itl_s: float,
             tool_latency_s: float, *, dist: str = "fixed", seed: int = 0,
             think_s: Callable[[int, int], float] | None = None
             ) -> list[tuple[float, float, int, int]]:
    """Start times of every turn under the clock model (module docstring).

    Args:
        outputs: Per session, the output tokens of each turn.
        concurrency: Sessions live at once (≥ 1).
        itl_s: Inter-token latency, seconds per output token.
        tool_latency_s: Gap between a turn's end and the session's next turn, seconds (the
            mean when ``dist="exp"``).
        dist: ``fixed`` or ``exp`` (exponential, ``random.Random(seed)``).
        seed: Seed of the tool-latency draws.
        think_s: ``(session index, turn index) -> seconds`` of think time added to the gap
            before that turn (>= 1), on top of the tool latency (None: none).

    Returns:
        ``(start_s, duration_s, session index, turn index)`` in replay order.

    Raises:
        ValueError: naming ``concurrency``, ``itl_ms``, ``tool_latency_ms`` or
            ``tool_latency_dist`` when out of range.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    if itl_s < 0 or tool_latency_s < 0:
        raise ValueError(f"itl_ms / tool_latency_ms: must be >= 0, got {itl_s * 1e3}, "
                         f"{tool_latency_s * 1e3}")
    if dist not in ("fixed", "exp"):
        raise ValueError(f"tool_latency_dist: fixed or exp, got {dist!r}")
    rng = random.Random(seed)
    pending = [i for i, s in enumerate(outputs) if s]
    pending.reverse()
    ready: list[tuple[float, int, int, int]] = []  # (ready_s, fifo seq, session, turn)
    seq = 0
    while pending and seq < concurrency:
        heapq.heappush(ready, (0.0, seq, pending.pop(), 0))
        seq += 1
    out = []
    while ready:
        start, _, s, k = heapq.heappop(ready)
        duration = outputs[s][k] * itl_s
        end = start + duration
        out.append((start, duration, s, k))
        if k + 1 < len(outputs[s]):
            gap = rng.expovariate(1.0 / tool_latency_s) if dist == "exp" and tool_latency_s \
                else tool_latency_s
            if think_s is not None:
                gap += think_s(s, k + 1)
            heapq.heappush(ready, (end + gap, seq, s, k + 1))
        elif pending:
            heapq.heappush(ready, (end, seq, pending.pop(), 0))
        seq += 1
    return out


class PieceTokenizer:
    """``apply_chat_template`` of a ``ChatTokenizer`` by pieces (module docstring); ``ids``
    returns None when the tokenizer is not a Hugging Face one with a template (then use the
    plain call)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "hf_tokenizer", None)
        self.hf = hf if hf is not None and getattr(hf, "chat_template", None) else None
        self.memo: dict[str, list[int]] = {}
        if self.hf is not None:
            self.added = dict(self.hf.get_added_vocab())
            alternatives = "|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True))
            self.split = re.compile(f"({alternatives})") if alternatives else None

    def ids(self, messages: list[dict], tools: list[dict] | None) -> list[int] | None:
        if self.hf is None or self.split is None:
            return None
        from radixkv.model.tool_render import render_tools_fallback, template_handles_tools

        msgs = [dict(m, content=m.get("content") or "") for m in messages]
        if not template_handles_tools(self.hf.chat_template):
            msgs, tools = render_tools_fallback(msgs, tools), None
        text = self.hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                           tokenize=False)
        out: list[int] = []
        for piece in self.split.split(text):
            if not piece:
                continue
            tid = self.added.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            ids = self.memo.get(piece)
            if ids is None:
                ids = self.memo[piece] = self.tokenizer.encode(piece)
            out.extend(ids)
        return out


def _session_prompts(tokenizer, requests: list[dict]) -> tuple[list[list[int]], bool]:
    """Token ids of every request of a session, and whether the piecewise path was used."""
    pieces = PieceTokenizer(tokenizer)
    try:
        fast = [pieces.ids(r["messages"], r.get("tools")) for r in requests]
    except Exception:  # noqa: BLE001 - any template trouble: the plain path raises it properly
        fast = [None]
    last = requests[-1]
    if fast and all(f is not None for f in fast) and fast[-1] == tokenizer.apply_chat_template(
            last["messages"], last.get("tools")):
        return fast, True
    return [tokenizer.apply_chat_template(r["messages"], r.get("tools")) for r in requests], False


def _reply_tokens(tokenizer, reply: dict | None) -> int | None:
    """Tokens of a reply message: its content, plus its tool calls as JSON."""
    if reply is None:
        return None
    text = reply.get("content") or ""
    if reply.get("tool_calls"):
        text += json.dumps(reply["tool_calls"], separators=(",", ":"))
    return len(tokenizer.encode(text)) if text else 0


def _cache_key(source: str, path: Path, tokenizer_name: str) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256(f"{CACHE_VERSION}|{source}|{path.resolve()}|{tokenizer_name}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def tokenize_sessions(source: str, path: str | None, tokenizer=None,
                      cache_dir: str | None = None) -> list[tuple[str, list[ChatTurn]]]:
    """``(session id, turns)`` of every session of a transcript source, tokenized.

    Args:
        source: ``radixkv.tools.transcripts`` source name.
        path: Its data (default: the source's shipped sample).
        tokenizer: A ``ChatTokenizer`` (default: the embedded SmolLM2's).
        cache_dir: Folder keeping tokenized sessions between runs (None: no cache).
    """
    from radixkv.tools.transcripts import default_path, load_source

    data = Path(path) if path is not None else default_path(source)
    if tokenizer is None:
        from radixkv.model.loader import load_model
        tokenizer = load_model(None).tokenizer
    cache_file = None
    if cache_dir is not None and data.exists():
        hf = getattr(tokenizer, "hf_tokenizer", None)
        name = (f"{type(tokenizer).__name__}|{getattr(hf, 'name_or_path', '')}|"
                f"{len(hf) if hf is not None else ''}|{getattr(hf, 'chat_template', '')}")
        cache_file = Path(cache_dir) / f"chat-{source}-{_cache_key(source, data, name)}.pkl"
        if cache_file.is_file():
            with open(cache_file, "rb") as f:
                return pickle.load(f)
    sessions = load_source(source, path, replies=True)
    out = []
    for requests in sessions:
        if not requests:
            continue
        prompts, _ = _session_prompts(tokenizer, requests)
        turns = [ChatTurn(array("I", ids).tobytes(), _reply_tokens(tokenizer, r.get("reply")))
                 for ids, r in zip(prompts, requests)]
        out.append((requests[0]["session_id"], turns))
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(cache_file)
    return out


def subsample(sessions: list, max_sessions: int | None) -> list:
    """``max_sessions`` sessions spread evenly over the list (all when None or enough)."""
    if not max_sessions or len(sessions) <= max_sessions:
        return sessions
    n = len(sessions)
    return [sessions[i * n // max_sessions] for i in range(max_sessions)]


def chat_trace(name: str, sessions: list[tuple[str, list[ChatTurn]]], block_size: int, *,
               concurrency: int, itl_ms: float, tool_latency_ms: float,
               tool_latency_dist: str = "fixed", default_output_tokens: int = 128,
               with_sessions: bool = True, think_time: ThinkTime | None = None,
               think_seed: int = 0) -> Trace:
    """A :class:`Trace` of tokenized sessions on the modeled clock (module docstring).

    A turn whose reply is unknown (a crewAI response recorded gzip'ed or as SSE) decodes
    ``default_output_tokens``. ``with_sessions=False`` drops the session keys (an ablation).
    ``think_time`` adds its draws (``ThinkTime.draw_s(think_seed, session id, turn)``) to the
    gap before every turn after a session's first, on top of the tool latency.
    """
    outputs = [[default_output_tokens if t.output_tokens is None else t.output_tokens
                for t in turns] for _, turns in sessions]
    think: Callable[[int, int], float] | None = None
    if think_time is not None and think_time.mean_s > 0:
        gaps = think_time

        def draw(s: int, k: int) -> float:
            return gaps.draw_s(think_seed, sessions[s][0], k)
        think = draw
    order = schedule(outputs, concurrency, itl_ms / 1e3, tool_latency_ms / 1e3,
                     dist=tool_latency_dist, think_s=think)
    prompts = ((start, None, sessions[s][1][k].prompt,
                sessions[s][0] if with_sessions else None, duration)
               for start, duration, s, k in order)
    trace = trace_from_prompts(name, "chat", block_size, prompts)
    trace.notes.update(
        sessions=len(sessions), concurrency=concurrency, itl_ms=itl_ms,
        tool_latency_ms=tool_latency_ms, tool_latency_dist=tool_latency_dist,
        think_time_s=None if think_time is None else str(think_time),
        unknown_replies=sum(t.output_tokens is None for _, turns in sessions for t in turns),
        default_output_tokens=default_output_tokens, session_keys=with_sessions,
        modeled_span_s=round(max((s + d for s, d, _, _ in order), default=0.0), 3))
    return trace

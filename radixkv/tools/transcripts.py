"""Agent-transcript loaders and the ideal prefix-reuse reference for `radixkv bench serve`.

The loaders turn recorded agent sessions into the normalised request form described in
the shared data folder's ``agent-transcripts/SOURCES.md``: one request per LLM call, each
carrying the whole chat history up to that call, so consecutive requests of a session share long
prefixes.
Sources: ``tau-bench`` (airline JSON), ``swe-agent`` (``*.traj``), ``mini-swe-agent``
(``*.traj.json``, a ``{"messages": [...]}`` record or a bare message list) and ``crewai``
(VCR.py cassettes: every recorded ``chat/completions`` request as sent, in cassette order),
``mini-swe-agent-gemini3`` (the mini-swe-agent loader on that run's folder) and ``openhands``
(``prompt_NNN.log`` mock prompts, :mod:`radixkv.tools.openhands`).

With no path, a loader reads the small sample of its source shipped in the package
(:func:`default_path`); ``default_path(source, shared=True)`` is the full data in the shared
data folder (``$RADIXKV_SHARED_DIR``, default ``<repo>/../shared``; see ``radixkv.tools.data``).

``ideal_cached_tokens`` gives what a perfect (unbounded, never evicting) prefix cache could
reuse for a run: per request, the longest common token prefix with any earlier request of the
run, capped like the engine's hit cap ``floor(min(lcp, N - 1) / B) * B``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.config import check_block_size
from radixkv.tools.cassettes import cassette_chat_bodies
from radixkv.tools.data import sample_path, shared_path

TRANSCRIPTS = Path("agent-transcripts")
"""The transcripts' folder, under the shipped samples and under the shared data folder."""
TAU_BENCH_AIRLINE = Path("tau-bench") / "historical_trajectories" / "gpt-4o-airline.json"
SOURCE_PATHS = {"tau-bench": TAU_BENCH_AIRLINE, "swe-agent": Path("swe-agent"),
                "mini-swe-agent": Path("mini-swe-agent"), "crewai": Path("crewai-cassettes")}
"""Source name → its file or folder, relative to :data:`TRANSCRIPTS` (a sample is shipped)."""
SHARED_ONLY_PATHS = {"mini-swe-agent-gemini3": Path("mini-swe-agent-gemini3"),
                     "openhands": Path("openhands-mock-prompts")}
"""Sources with no shipped sample (only the shared data folder holds them): name → folder."""

_KEPT_ROLES = frozenset({"system", "user", "assistant", "tool"})

Request = dict[str, Any]
"""A normalised request: ``{"session_id": str, "turn": int, "messages": list[dict]}``; with
``replies=True`` also ``"reply"``: the assistant message that answered it (None if unknown)."""


def normalise_message(message: dict[str, Any]) -> dict[str, Any] | None:
    """Clean one recorded chat message per SOURCES.md rule 2.

    Args:
        message: A recorded OpenAI-style message (any extra keys allowed).

    Returns:
        ``{"role", "content"}`` plus ``tool_calls`` (assistant) or ``tool_call_id`` / ``name``
        (tool) when present; ``None`` for roles other than system/user/assistant/tool.
    """
    role = message.get("role")
    if role not in _KEPT_ROLES:
        return None
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        # Content parts: text parts joined by newlines, other parts as a "[<type>]" marker.
        content = "\n".join(
            part.get("text", "") if part.get("type") == "text" else f"[{part.get('type')}]"
            for part in content
        )
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                out[key] = message[key]
    return out


def requests_from_history(session_id: str, history: Sequence[dict[str, Any]], *,
                          replies: bool = False) -> list[Request]:
    """Split one session's history into requests per SOURCES.md rule 3.

    For each assistant message at index ``i > 0`` one request with ``messages = history[:i]``;
    messages after the last assistant message produce no request.

    Args:
        session_id: Identifier stored in each request.
        history: Normalised messages of the session, in order.
        replies: Also give each request ``"reply"``: ``history[i]``, the assistant message
            that answered it.

    Returns:
        The session's requests, ``turn`` counting from 0.
    """
    requests: list[Request] = []
    for i, message in enumerate(history):
        if i > 0 and message["role"] == "assistant":
            request = {"session_id": session_id, "turn": len(requests),
                       "messages": list(history[:i])}
            if replies:
                request["reply"] = message
            requests.append(request)
    return requests


def default_path(source: str, shared: bool = False) -> Path:
    """The data a source's loader reads when given no path.

    Args:
        source: A source name (``tau-bench``, ``swe-agent``, ``mini-swe-agent``, ``crewai``;
            ``mini-swe-agent-gemini3`` and ``openhands`` have no shipped sample).
        shared: False: the small sample shipped in the package; True: the full data under the
            shared data folder (``$RADIXKV_SHARED_DIR/agent-transcripts/...``, which may not exist).

    Raises:
        ValueError: Unknown source name (the message names ``source``).
    """
    folder = SOURCE_PATHS.get(source) or SHARED_ONLY_PATHS.get(source)
    if folder is None:
        raise ValueError(f"source: unknown transcript source {source!r}; known: {sorted(SOURCES)}")
    relative = TRANSCRIPTS / folder
    return shared_path(relative) if shared else sample_path(relative)


def _existing(path: str | Path | None, source: str) -> Path:
    """``path`` (default: ``source``'s shipped sample) as a Path that exists.

    Raises:
        FileNotFoundError: it does not exist (the message names ``path``).
    """
    if path is None and source in SHARED_ONLY_PATHS:
        raise FileNotFoundError(f"path: no sample of {source} is shipped; give its data "
                                f"({default_path(source, shared=True)} with --shared)")
    base = Path(path) if path is not None else default_path(source)
    if not base.exists():
        raise FileNotFoundError(f"path: {base} does not exist")
    return base


def _read_json(file: Path, expected: str) -> Any:
    """The JSON in ``file``; a ``ValueError`` naming the file and ``expected`` if it is not JSON."""
    with open(file, "rb") as f:
        try:
            return json.load(f)
        except ValueError as exc:  # also UnicodeDecodeError
            raise ValueError(f"path: {file} is not JSON ({expected} expected): {exc}") from exc


def load_tau_bench(path: str | Path | None = None, *, replies: bool = False) -> list[list[Request]]:
    """Load tau-bench ``gpt-4o-airline.json`` as normalised sessions, in file order.

    Args:
        path: The JSON file; default the shipped sample (the file's first 3 records: 3 sessions,
            31 requests). The full file, ``default_path("tau-bench", shared=True)``, holds 200
            sessions and 2,454 requests.
        replies: Give each request its ``"reply"`` (see :data:`Request`).

    Returns:
        One list of requests per record (session ``gpt-4o-airline/task{task_id}/trial{trial}``).

    Raises:
        FileNotFoundError: The file does not exist.
        IsADirectoryError: ``path`` is a folder (tau-bench reads one JSON file).
        ValueError: The file is not a list of ``{task_id, trial, traj}`` records.
    """
    file = _existing(path, "tau-bench")
    expected = "a tau-bench trajectories JSON file such as gpt-4o-airline.json"
    if file.is_dir():
        raise IsADirectoryError(f"path: {file} is a folder; the tau-bench source reads one "
                                f"file, {expected}")
    records = _read_json(file, expected)
    if not isinstance(records, list):
        raise ValueError(f"path: {file} is not a JSON list of tau-bench records")
    sessions: list[list[Request]] = []
    for record in records:
        try:
            session_id = f"gpt-4o-airline/task{record['task_id']}/trial{record['trial']}"
            traj = record["traj"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"path: {file} has a record without task_id/trial/traj") from exc
        history = [m for m in (normalise_message(x) for x in traj) if m is not None]
        sessions.append(requests_from_history(session_id, history, replies=replies))
    return sessions


def load_swe_agent(path: str | Path | None = None, *, replies: bool = False) -> list[list[Request]]:
    """Load SWE-agent ``*.traj`` trajectories as normalised sessions (one per file).

    Each file's ``history`` is cleaned per SOURCES.md rule 2 (a tool message's
    ``tool_call_ids[0]`` becomes its ``tool_call_id``) and split per rule 3. Files are read in
    sorted path order; the session id is the path relative to ``path``.

    Args:
        path: A ``.traj`` file or a folder searched recursively; default the shipped sample
            (2 sessions, 9 requests; the shared folder's ``swe-agent``: 22 sessions, 230).
        replies: Give each request its ``"reply"`` (see :data:`Request`).

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no ``.traj`` file.
        ValueError: A file has no ``history`` list.
    """
    base, files = _files(path, "swe-agent", "*.traj")
    sessions: list[list[Request]] = []
    for file in files:
        record = _read_json(file, "a SWE-agent .traj file")
        history = record.get("history") if isinstance(record, dict) else None
        if not isinstance(history, list):
            raise ValueError(f"path: {file} has no 'history' list")
        messages = []
        for raw in history:
            ids = raw.get("tool_call_ids")
            if raw.get("role") == "tool" and raw.get("tool_call_id") is None and ids:
                raw = {**raw, "tool_call_id": ids[0]}
            message = normalise_message(raw)
            if message is not None:
                messages.append(message)
        session_id = file.name if base.is_file() else str(file.relative_to(base))
        sessions.append(requests_from_history(session_id, messages, replies=replies))
    return sessions


def _files(path: str | Path | None, source: str, pattern: str) -> tuple[Path, list[Path]]:
    """``(base, files)``: ``path`` itself if it is a file, else every ``pattern`` match under it
    (default: ``source``'s shipped sample), in sorted path order."""
    base = _existing(path, source)
    if base.is_file():
        return base, [base]
    files = sorted(base.rglob(pattern))
    if not files:
        raise FileNotFoundError(f"path: no {pattern} file under {base}")
    return base, files


def _session_id(base: Path, file: Path) -> str:
    return file.name if base.is_file() else str(file.relative_to(base))


def load_mini_swe_agent(path: str | Path | None = None, *,
                        replies: bool = False) -> list[list[Request]]:
    """Load mini-swe-agent ``*.traj.json`` trajectories as normalised sessions (one per file).

    Both formats are read: ``{"messages": [...], ...}`` (``mini-swe-agent-1``, e.g. the
    ``mini-swe-agent-gemini3`` run) and a bare list of messages (the ``tests/test_data`` files,
    v2 text format). Messages are cleaned per SOURCES.md rule 2 (``extra`` dropped) and split
    per rule 3.

    Args:
        path: A file or a folder searched recursively for ``*.traj.json``; default the shipped
            sample (both files of the shared folder's ``mini-swe-agent``: 2 sessions, 12 requests).
        replies: Give each request its ``"reply"`` (see :data:`Request`).

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no ``.traj.json`` file.
        ValueError: A file is neither a message list nor a record with a ``messages`` list.
    """
    base, files = _files(path, "mini-swe-agent", "*.traj.json")
    sessions: list[list[Request]] = []
    for file in files:
        record = _read_json(file, "a mini-swe-agent .traj.json file")
        history = record.get("messages") if isinstance(record, dict) else record
        if not isinstance(history, list) or not all(isinstance(m, dict) for m in history):
            raise ValueError(f"path: {file} is neither a message list nor has a 'messages' list")
        messages = [m for m in map(normalise_message, history) if m is not None]
        sessions.append(requests_from_history(_session_id(base, file), messages,
                                              replies=replies))
    return sessions


def load_crewai(path: str | Path | None = None, *, replies: bool = False) -> list[list[Request]]:
    """Load crewAI VCR cassettes (``*.yaml``) as sessions of recorded requests (rule 4).

    Each interaction whose ``uri`` contains ``chat/completions`` and whose JSON body has
    ``messages`` is one request: its messages as recorded (cleaned per rule 2) and its
    ``tools``; ``turn`` is its order in the cassette. Consecutive requests of a cassette may
    belong to different agents, so they need not extend each other.

    Args:
        path: A cassette or a folder searched recursively for ``*.yaml``; default the shipped
            sample (3 sessions, 9 requests; the shared folder's ``crewai-cassettes``: 204 sessions,
            737 requests).
        replies: Give each request its ``"reply"`` (see :data:`Request`).

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no ``.yaml`` file.
        ValueError: A file is not a cassette.
    """
    base, files = _files(path, "crewai", "*.yaml")
    sessions: list[list[Request]] = []
    for file in files:
        session_id = _session_id(base, file)
        requests: list[Request] = []
        for body, reply in cassette_chat_bodies(file):
            cleaned = (normalise_message(m) for m in body["messages"] if isinstance(m, dict))
            messages = [m for m in cleaned if m is not None]
            request: Request = {"session_id": session_id, "turn": len(requests),
                                "messages": messages}
            if body.get("tools"):
                request["tools"] = body["tools"]
            if replies:
                request["reply"] = reply if reply is None else normalise_message(reply)
            requests.append(request)
        sessions.append(requests)
    return sessions


def load_openhands(path: str | Path | None = None, *,
                   replies: bool = False) -> list[list[Request]]:
    """Load OpenHands mock prompts (rule 5); see :func:`radixkv.tools.openhands.load_openhands`.
    No sample is shipped: give ``path`` (or ``default_path("openhands", shared=True)``)."""
    from radixkv.tools.openhands import load_openhands as load

    return load(_existing(path, "openhands"), replies=replies)


SOURCES = {"tau-bench": load_tau_bench, "swe-agent": load_swe_agent,
           "mini-swe-agent": load_mini_swe_agent, "crewai": load_crewai,
           "mini-swe-agent-gemini3": load_mini_swe_agent, "openhands": load_openhands}
"""Source name (``--source``) → loader returning sessions of normalised requests."""


def load_source(name: str, path: str | Path | None = None, *,
                replies: bool = False) -> list[list[Request]]:
    """Load a transcript source by name, from ``path`` (default: the source's shipped sample;
    ``mini-swe-agent-gemini3`` and ``openhands`` ship none). ``replies``: see :data:`Request`.

    Raises:
        ValueError: Unknown source name (the message names ``source``).
    """
    try:
        loader = SOURCES[name]
    except KeyError:
        raise ValueError(f"source: unknown transcript source {name!r}; known: "
                         f"{sorted(SOURCES)}") from None
    return loader(path, replies=replies)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays, in elements."""
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


def ideal_cached_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Per request, the tokens a perfect prefix cache could reuse, in run order.

    Request k may reuse the longest common prefix ``lcp`` with any request ``j < k``, capped as
    the engine caps hits: ``floor(min(lcp, N_k - 1) / B) * B`` (at least one token is always
    computed; only whole blocks are shared). The best earlier match of a sequence is one of its
    two lexicographic neighbours among the earlier sequences, so a sorted list of the earlier
    prompts answers each query with two comparisons: O(K log K) comparisons for K requests.

    Args:
        prompts: Token ids of each request's prompt, in the order the requests ran.
        block_size: B, tokens per KV block.

    Returns:
        ``ideal[k]`` in tokens for each request.

    Raises:
        ValueError: naming ``block_size`` outside ``[1, MAX_BLOCK_SIZE]`` (``radixkv.config``).
    """
    check_block_size(block_size)
    # Big-endian uint32 bytes sort exactly like the token sequences (a prefix sorts first).
    keys: list[bytes] = []
    arrays: list[np.ndarray] = []
    ideal: list[int] = []
    for prompt in prompts:
        arr = np.asarray(prompt, dtype=np.int64)
        key = arr.astype(">u4").tobytes()
        pos = bisect.bisect_left(keys, key)
        lcp = 0
        for j in (pos - 1, pos):
            if 0 <= j < len(keys):
                lcp = max(lcp, _lcp(arrays[j], arr))
        n = len(arr)
        ideal.append(max(0, min(lcp, n - 1)) // block_size * block_size)
        keys.insert(pos, key)
        arrays.insert(pos, arr)
    return ideal

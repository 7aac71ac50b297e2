"""Loader of the OpenHands mock prompts (``openhands-mock-prompts``) as agent sessions.

The data are OpenHands' integration-test mocks (All-Hands-AI/OpenHands @ ``f60652dc``,
``tests/integration/mock/eventstream_runtime/<Agent>/<test>/{prompt,response}_NNN.log``): each
``prompt_NNN.log`` is the whole prompt of one LLM call rendered as text, messages joined by
``\\n\\n----------\\n\\n`` with no role marks; ``response_NNN.log`` is the model's reply to it.
The shared data folder's ``agent-transcripts/SOURCES.md`` (rule 5) gives the normalisation
used here:

- one session per ``<Agent>/<test>`` folder (every folder holding a ``prompt_*.log``), one
  request per ``prompt_NNN.log`` in ``NNN`` order;
- a prompt is split on the separator, empty chunks dropped; chunk 0 is ``system``; a chunk is
  ``assistant`` when its first 60 non-whitespace characters equal those of one of the folder's
  ``response_*.log`` files, else ``user``.

Requests need not extend each other (a CodeAct prompt ends in a turn counter that changes on
every call; Delegator, Manager and Planner prompts embed their state), which is what makes the
source a test of partial prefix reuse.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SEPARATOR = "\n\n----------\n\n"
"""What joins two messages in a ``prompt_NNN.log``."""

MATCH_CHARS = 60
"""Non-whitespace characters compared to tell an assistant chunk (SOURCES.md rule 5)."""

_NUMBERED = re.compile(r"^(prompt|response)_(\d+)\.log$")


def _head(text: str) -> str:
    """The first :data:`MATCH_CHARS` non-whitespace characters of ``text``."""
    return "".join(text.split())[:MATCH_CHARS]


def _numbered(folder: Path, kind: str) -> dict[int, Path]:
    """``NNN`` → path of each ``<kind>_NNN.log`` in ``folder``."""
    out = {}
    for file in folder.iterdir():
        m = _NUMBERED.match(file.name)
        if m and m.group(1) == kind and file.is_file():
            out[int(m.group(2))] = file
    return out


def _read(file: Path) -> str:
    return file.read_text(encoding="utf-8", errors="replace")


def load_openhands(base: Path, *, replies: bool = False) -> list[list[dict[str, Any]]]:
    """Load the OpenHands mock prompts under ``base`` as normalised sessions.

    Args:
        base: A ``<Agent>/<test>`` folder, or any folder above such folders (searched
            recursively, sessions in sorted path order).
        replies: Also give each request ``"reply"``: its ``response_NNN.log`` as an assistant
            message (None when the folder has no response of that number).

    Returns:
        One list of requests per folder, ``{"session_id": <folder relative to base>, "turn",
        "messages"}`` (plus ``"reply"``); the shared folder holds 18 sessions, 93 requests.

    Raises:
        FileNotFoundError: ``base`` does not exist or holds no ``prompt_*.log``.
    """
    base = Path(base)
    if not base.exists():
        raise FileNotFoundError(f"path: {base} does not exist")
    folders = sorted({p.parent for p in base.rglob("prompt_*.log")})
    if not folders:
        raise FileNotFoundError(f"path: no prompt_*.log file under {base}")
    sessions = []
    for folder in folders:
        session_id = folder.name if folder == base else str(folder.relative_to(base))
        responses = {n: _read(f) for n, f in _numbered(folder, "response").items()}
        heads = {_head(text) for text in responses.values()} - {""}
        requests: list[dict[str, Any]] = []
        for n, file in sorted(_numbered(folder, "prompt").items()):
            chunks = [c for c in _read(file).split(SEPARATOR) if c.strip()]
            messages = [{"role": "system" if i == 0 else
                         "assistant" if _head(c) in heads else "user", "content": c}
                        for i, c in enumerate(chunks)]
            request: dict[str, Any] = {"session_id": session_id, "turn": len(requests),
                                       "messages": messages}
            if replies:
                reply = responses.get(n)
                request["reply"] = (None if reply is None
                                    else {"role": "assistant", "content": reply})
            requests.append(request)
        sessions.append(requests)
    return sessions

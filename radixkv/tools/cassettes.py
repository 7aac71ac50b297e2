"""VCR.py cassettes (crewAI's recorded provider calls): the ``chat/completions`` requests they
hold, each with the reply recorded for it. Used by ``radixkv.tools.transcripts.load_crewai``; the
format is described in the shared data folder's ``agent-transcripts/SOURCES.md``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def reply_message(response: Any) -> dict[str, Any] | None:
    """The assistant message of a recorded ``chat/completions`` response body, if it is plain
    JSON (``choices[0].message``, as recorded); None for gzip/base64/SSE bodies or anything else."""
    body = (response or {}).get("body") if isinstance(response, dict) else None
    if isinstance(body, dict):
        body = body.get("string")
    if not isinstance(body, (str, bytes)):
        return None
    try:
        message = json.loads(body)["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return message if isinstance(message, dict) else None


def cassette_chat_bodies(file: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
    """``(JSON body, reply)`` of a cassette's ``chat/completions`` requests that carry messages
    (reply: see :func:`reply_message`)."""
    import yaml  # only this loader needs it (imported lazily)

    with open(file, "rb") as f:
        try:
            cassette = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except yaml.YAMLError as exc:
            raise ValueError(f"path: {file} is not YAML (a VCR cassette expected): {exc}") from exc
    if not isinstance(cassette, dict) or not isinstance(cassette.get("interactions"), list):
        raise ValueError(f"path: {file} is not a VCR cassette (no 'interactions' list)")
    for interaction in cassette["interactions"]:
        request = (interaction or {}).get("request") or {}
        if "chat/completions" not in str(request.get("uri", "")):
            continue  # embeddings, telemetry, other providers' APIs
        body = request.get("body")
        if isinstance(body, dict):  # some VCR versions store {"string": ...}
            body = body.get("string")
        if isinstance(body, bytes):
            body = body.decode("utf-8", errors="replace")
        try:
            parsed = json.loads(body) if isinstance(body, str) else None
        except ValueError:
            continue
        if isinstance(parsed, dict) and isinstance(parsed.get("messages"), list):
            yield parsed, reply_message((interaction or {}).get("response"))

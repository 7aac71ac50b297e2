"""``X-Request-Id`` on every response and every log line of the request; ``GET /version``;
``max_model_len`` in ``/v1/models`` entries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog

from radixkv.server.request_id import valid_request_id
from tests.server.helpers import HI, get

HEX32 = re.compile(r"[0-9a-f]{32}")


async def request(url: str, method: str, path: str, *, rid: str | None = None,
                  body: object = None) -> tuple[int, Any, bytes]:
    """Status, headers (case-insensitive, as HTTP's) and body."""
    headers = {"X-Request-Id": rid} if rid is not None else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, json=body, headers=headers) as resp:
            return resp.status, resp.headers.copy(), await resp.read()


def test_ids_are_validated():
    assert valid_request_id("req-123_ABC.x:y/z") == "req-123_ABC.x:y/z"
    assert valid_request_id("a" * 128) == "a" * 128
    for bad in (None, "", "a" * 129, "has space", "tab\there", "caf\u00e9", "nl\n"):
        assert HEX32.fullmatch(valid_request_id(bad)), bad


@pytest.mark.parametrize("method,path,body,status", [
    ("GET", "/health", None, 200),
    ("GET", "/no/such/route", None, 404),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "stream": True}, 200),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}, 200),
])
async def test_every_response_echoes_the_clients_id(server, method, path, body, status):
    got, headers, raw = await request(server.url, method, path, rid="client-id-42", body=body)
    assert (got, headers["X-Request-Id"]) == (status, "client-id-42")
    if body is not None and body.get("stream"):
        assert raw.endswith(b"data: [DONE]\n\n")


async def test_an_id_is_generated_when_absent_or_unacceptable(server):
    ids = []
    for rid in (None, None, "x" * 200, "two words"):
        status, headers, _ = await request(server.url, "GET", "/health", rid=rid)
        assert status == 200 and HEX32.fullmatch(headers["X-Request-Id"])
        ids.append(headers["X-Request-Id"])
    assert len(set(ids)) == 4


async def test_the_requests_log_lines_carry_its_id(server):
    lines: list[dict] = []

    def capture(logger, method_name, event_dict):
        lines.append(dict(event_dict))
        raise structlog.DropEvent

    saved = structlog.get_config()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    try:
        status, _, _ = await request(server.url, "POST", "/v1/chat/completions",
                                     rid="log-me-7", body={"messages": []})
        await request(server.url, "GET", "/no/such/route", rid="log-me-8")
        ok, _, body = await request(server.url, "POST", "/v1/completions", rid="log-me-9",
                                    body={"prompt": "hi", "max_tokens": 1})
    finally:
        structlog.configure(**saved)
    assert status == 400 and ok == 200
    # The engine's id (the response's "id") is paired with the client's id once, at admission.
    admitted = [(e["request_id"], e["completion_id"]) for e in lines
                if e.get("event") == "request_admitted"]
    assert admitted == [("log-me-9", json.loads(body)["id"])]
    rejected = [(e["request_id"], e["path"], e["status"]) for e in lines
                if e.get("event") == "request_rejected"]
    assert rejected == [("log-me-7", "/v1/chat/completions", 400),
                        ("log-me-8", "/no/such/route", 404)]


async def test_version_and_max_model_len(server):
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert await get(server.url, "/version") == (200, {"version": version})
    status, models = await get(server.url, "/v1/models")
    assert status == 200
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [
        (server.engine.model_name, 2048)]

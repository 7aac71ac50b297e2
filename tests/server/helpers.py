"""Small HTTP helpers shared by the server tests (aiohttp client, one session per call)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

HI = [{"role": "user", "content": "Hello there"}]


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def post(url: str, path: str, body: Any = None, *, data: Any = None,
               headers: dict | None = None) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body, data=data, headers=headers) as resp:
            return resp.status, await resp.read(), dict(resp.headers)


async def post_json(url: str, path: str, body: Any, key: str | None = None) -> tuple[int, Any]:
    status, raw, _ = await post(url, path, body, headers=bearer(key))
    return status, orjson.loads(raw)


async def get(url: str, path: str, key: str | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path, headers=bearer(key)) as resp:
            raw = await resp.read()
            try:
                return resp.status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                return resp.status, raw.decode()


async def complete(url: str, prompt: Any, key: str | None = None, **body: Any) -> tuple[int, Any]:
    """POST /v1/completions (max_tokens 1 unless given)."""
    return await post_json(url, "/v1/completions",
                           {"prompt": prompt, "max_tokens": body.pop("max_tokens", 1), **body},
                           key)


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    return [e[len(b"data: "):] for e in events[:-2]]


async def wait_idle(url: str, key: str | None = None, timeout_s: float = 60.0) -> dict:
    """Poll /stats until no block is held by a request (admin or single-tenant view)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, stats = await get(url, "/stats", key)
        if stats["pool"]["in_use_blocks"] == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token-id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def capped(match: int, num_prompt: int, block_size: int) -> int:
    """Cached tokens a prefix match of ``match`` tokens can give: whole blocks, and never the
    prompt's last token (it is always computed, to sample from)."""
    return min(match, num_prompt - 1) // block_size * block_size


async def wait_process_healthy(proc: Any, url: str, timeout_s: float = 120.0) -> None:
    """Poll ``url``/health until 200; fail with the process's stderr tail if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if (await get(url, "/health"))[0] == 200:
                return
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        await asyncio.sleep(0.2)


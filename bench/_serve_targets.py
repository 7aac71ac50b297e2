"""The servers ``bench serve`` measures: labels, what each serves, the ``/tokenize`` cross-check.

A target is one OpenAI-compatible server (or a router, or several replicas) under a label. Its
facts come from what it serves: the model id (first entry of ``GET /v1/models``; vLLM serves a
model under its folder path), ``max_model_len`` (radixkv and vLLM list it there), and, for
radixkv, ``GET /stats`` (KV block size, ``prefix_caching``, request / cached-token counters).
A server without ``/stats`` gets its block size from ``--block-size`` (vLLM-CPU: 128 by
default; llama.cpp's cache is token-granular: 1).
"""

# No ``from __future__ import annotations``: loaded by path (see bench/serve.py).
import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass
class Target:
    """One server to replay against. ``label`` None: named after its /stats or URL."""

    url: str
    label: str | None = None


def parse_target(value: str) -> Target:
    """``LABEL=URL`` or ``URL`` (a URL's own ``=`` signs, after ``://``, are kept).

    Raises:
        ValueError: an empty label or URL.
    """
    head, sep, tail = value.partition("=")
    if sep and "://" not in head:
        if not head or not tail:
            raise ValueError(f"expected LABEL=URL or URL, got {value!r}")
        return Target(tail.rstrip("/"), head)
    if not value:
        raise ValueError("empty URL")
    return Target(value.rstrip("/"))


def parse_block_sizes(values: list[str]) -> dict[str | None, int]:
    """``--block-size`` values ``N`` (every target without /stats) or ``LABEL=N``.

    Returns:
        label (None for the plain form) -> block size in tokens.

    Raises:
        ValueError: a size that is not an integer >= 1.
    """
    out: dict[str | None, int] = {}
    for value in values:
        label, sep, number = value.rpartition("=")
        try:
            size = int(number)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"--block-size: expected N or LABEL=N with N >= 1, got {value!r}")
        out[label if sep else None] = size
    return out


class NotServed(RuntimeError):
    """The server answered 404 or 405 for a path the replay needs (``/tokenize``, ``/stats``):
    typically a router that does not forward it to its replicas. ``path`` and ``status`` say
    which."""

    def __init__(self, base_url: str, path: str, status: int) -> None:
        super().__init__(f"{base_url} answered {status} to {path}")
        self.base_url, self.path, self.status = base_url, path, status


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)  # sglang-router's /v1/models says text/plain


async def get_stats(http: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """``GET /stats``; raises NotServed on 404/405, ClientResponseError on other errors."""
    async with http.get(f"{base_url}/stats") as resp:
        if resp.status in (404, 405):
            raise NotServed(base_url, "GET /stats", resp.status)
        resp.raise_for_status()
        return await resp.json()


async def stats_or_none(http: aiohttp.ClientSession, base_url: str) -> dict[str, Any] | None:
    """``GET /stats`` when it is radixkv's (has ``pool.block_size_tokens``), else None."""
    try:
        stats = await get_stats(http, base_url)
    except (NotServed, aiohttp.ContentTypeError):
        return None
    if not isinstance(stats, dict) or "block_size_tokens" not in (stats.get("pool") or {}):
        return None
    return stats


async def probe(http: aiohttp.ClientSession, info_url: str) -> dict[str, Any]:
    """What the server at ``info_url`` serves: ``model`` (first ``/v1/models`` id),
    ``max_model_len`` (from there, or None) and ``stats`` (radixkv's ``/stats`` or None).

    Raises:
        aiohttp.ClientError: unreachable, or ``/v1/models`` fails.
    """
    models = (await get_json(http, f"{info_url}/v1/models"))["data"]
    first = models[0] if models else {}
    max_len = first.get("max_model_len")
    return {"model": first.get("id", "unknown"),
            "max_model_len": max_len if isinstance(max_len, int) and max_len > 0 else None,
            "stats": await stats_or_none(http, info_url)}


async def tokenize_all(http: aiohttp.ClientSession, url: str, model: str,
                       requests: list[dict], cache_salt: str | None = None
                       ) -> tuple[list[list[int]], int]:
    """Token ids of every request's prompt (via the server's ``POST /tokenize``, as a chat
    request with the same ``cache_salt`` would run it), and the server's context length.

    Raises:
        NotServed: ``/tokenize`` answered 404 or 405.
        RuntimeError: it answered another non-200 status.
    """
    sem = asyncio.Semaphore(4)
    max_model_len = 0

    async def one(req: dict) -> list[int]:
        nonlocal max_model_len
        body = {"model": model, "messages": req["messages"]}
        if req.get("tools"):
            body["tools"] = req["tools"]
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        async with sem, http.post(f"{url}/tokenize", json=body) as resp:
            if resp.status in (404, 405):
                raise NotServed(url, "POST /tokenize", resp.status)
            if resp.status != 200:
                raise RuntimeError(f"/tokenize failed ({resp.status}): {await resp.text()}")
            out = await resp.json()
        max_model_len = out["max_model_len"]
        return out["tokens"]

    tokens = await asyncio.gather(*(one(r) for r in requests))
    return list(tokens), max_model_len


async def count_mismatches(http: aiohttp.ClientSession, url: str, model: str,
                           requests: list[dict], tokens: list[list[int]]) -> int | None:
    """Requests whose server ``/tokenize`` ids differ from the client-side ``tokens``; None when
    the server does not serve ``/tokenize`` (or it fails): nothing was checked."""
    try:
        served, _ = await tokenize_all(http, url, model, requests)
    except (NotServed, RuntimeError, KeyError, aiohttp.ClientError):
        return None
    return sum(1 for a, b in zip(served, tokens) if list(a) != list(b))

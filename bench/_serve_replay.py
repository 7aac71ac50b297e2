"""Replay core of ``radixkv bench serve``: dispatch transcript turns to one server, summarise.

A session's turns always run in order, each sent only after the previous reply finished (an
agent cannot send turn k+1 before it read reply k). Two dispatch modes:

- closed loop (``request_rate=None``): ``concurrency`` sessions in flight, each sending its
  next turn as soon as its previous reply ends;
- open loop (``request_rate=R``): a Poisson clock ticks R times per second on average; each
  tick sends the next turn of the longest-waiting ready session (sessions wait in file order
  at the start), or of the next session to become ready if none is. ``concurrency`` then
  caps the requests in flight (None: no cap).

Think time (``think_time``): a session waits its drawn think time between the end of a reply and
its next turn (closed loop: holding its slot; open loop: the turn becomes ready after it).
Retention (``retention``, ``retain_share``): see ``bench/serve.py``.

Every request streams with ``stream_options.include_usage`` at temperature 0: TTFT is the time
to the first chunk with content, ITL the gaps between content chunks, decode ms/token a
request's (last content - first content) / (completion tokens - 1); token counts come from
``usage`` (``prompt_tokens_details.cached_tokens`` per response, which is also what a router in
front of several replicas passes back) or llama.cpp's ``timings`` (``_serve_tokens.read_usage``).

The caller (``bench/serve.py``) hands in the token ids (tokenized client side), the context
length, the block size and the model id, so that every target is replayed with the same
requests, skipped and idealised the same way; ``/stats`` counters are read only from the
servers given as ``stats_urls`` (radixkv's).
"""

# No ``from __future__ import annotations``: loaded by path (see bench/serve.py).
import asyncio
import random
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from _arg_types import ThinkTime, chosen_sessions
from _serve_targets import NotServed, get_json, get_stats, tokenize_all  # noqa: F401 - re-exported
from _serve_tokens import (
    RETENTION_MODES,
    anthropic_messages,
    read_anthropic_usage,
    read_usage,
    sse_events,
)
from tqdm import tqdm

from radixkv.tools.transcripts import ideal_cached_tokens

WARMUP_SALT_PREFIX = "radixkv-bench-warmup-"


@dataclass
class Sample:
    """One replayed request. Token counts come from the server's reply (``prompt_tokens``
    falls back to the client-side count; ``cached_tokens`` None: not reported); times in ms."""

    session_id: str
    turn: int
    request: dict
    prompt_token_ids: list[int]
    dispatch_index: int = -1
    url: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    decode_ms: float = 0.0  # first to last content chunk
    error: str | None = None
    retain: bool = False  # the session sends retention (``--retain-share``)
    think_s: float = 0.0  # think time before this turn is sent (0 for a session's first)
    cache_creation_tokens: int | None = None  # prompt tokens this request newly retained

    @property
    def decode_ms_per_token(self) -> float | None:
        """Decode time per generated token after the first; None below 2 tokens."""
        if self.completion_tokens < 2 or self.ttft_ms is None:
            return None
        return self.decode_ms / (self.completion_tokens - 1)


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    return float(np.percentile(values, q)) if values else None


ANTHROPIC_VERSION = "2023-06-01"
"""``anthropic-version`` header of the Messages API requests."""


async def stream_one(http: aiohttp.ClientSession, url: str, model: str, sample: Sample,
                     max_tokens: int, cache_salt: str | None = None,
                     retention: str | None = None) -> None:
    """Send ``sample.request`` (its ``messages`` only: requests come flattened, see
    ``_serve_tokens``) as a streamed chat completion, or with ``retention`` ``anthropic-*``
    through ``/v1/messages`` (:func:`stream_message`); fill in times and token counts. A
    ``sample.retain`` request carries the retention: ``prompt_cache_retention: "24h"`` for
    ``openai-24h``."""
    if retention is not None and retention.startswith("anthropic-"):
        await stream_message(http, url, model, sample, max_tokens, cache_salt, retention)
        return
    body = {"model": model, "messages": sample.request["messages"], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if retention == "openai-24h" and sample.retain:
        body["prompt_cache_retention"] = "24h"
    sample.prompt_tokens = len(sample.prompt_token_ids)
    start = first = last = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for chunk in sse_events(resp.content):
            if "error" in chunk:
                error = chunk["error"]
                sample.error = error.get("message", "stream error") if isinstance(error, dict) else str(error)
                return
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    if sample.ttft_ms is None:
                        sample.ttft_ms = (now - start) * 1e3
                        first = now
                    else:
                        sample.itl_ms.append((now - last) * 1e3)
                    last = now
                elif choice.get("finish_reason") and sample.ttft_ms is None:
                    sample.ttft_ms = (now - start) * 1e3  # finished without any text
                    first = last = now
            ext = chunk.get("radixkv")  # the retention report of a request that asked for it
            if isinstance(ext, dict) and ext.get("cache_creation_tokens") is not None:
                sample.cache_creation_tokens = ext["cache_creation_tokens"]
            use = read_usage(chunk)
            if use is not None:
                if use["prompt_tokens"] is not None:
                    sample.prompt_tokens = use["prompt_tokens"]
                if use["completion_tokens"] is not None:
                    sample.completion_tokens = use["completion_tokens"]
                if use["cached_tokens"] is not None:
                    sample.cached_tokens = use["cached_tokens"]
    sample.decode_ms = (last - first) * 1e3


async def stream_message(http: aiohttp.ClientSession, url: str, model: str, sample: Sample,
                         max_tokens: int, cache_salt: str | None, retention: str) -> None:
    """Send ``sample.request`` as a streamed Anthropic Messages API request
    (``_serve_tokens.anthropic_messages``; ``cache_control`` with the TTL of ``retention`` on
    the last block when ``sample.retain``); times as :func:`stream_one` (content = a
    ``content_block_delta``'s text), tokens from ``message_start`` / ``message_delta`` usage
    (``cache_read_input_tokens`` is ``cached_tokens``). ``cache_salt`` goes in the body as on
    the chat route (a radixkv extension)."""
    ttl = retention.rpartition("-")[2] if sample.retain else None
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            **anthropic_messages(sample.request["messages"], ttl)}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"anthropic-version": ANTHROPIC_VERSION}
    sample.prompt_tokens = len(sample.prompt_token_ids)
    start = first = last = time.perf_counter()
    async with http.post(f"{url}/v1/messages", json=body, headers=headers) as resp:
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for event in sse_events(resp.content):
            kind = event.get("type")
            if kind == "error":
                error = event.get("error")
                sample.error = (error.get("message", "stream error") if isinstance(error, dict)
                                else str(error))
                return
            now = time.perf_counter()
            if kind == "content_block_delta" and (event.get("delta") or {}).get(
                    "text", (event.get("delta") or {}).get("partial_json")):
                if sample.ttft_ms is None:
                    sample.ttft_ms = (now - start) * 1e3
                    first = now
                else:
                    sample.itl_ms.append((now - last) * 1e3)
                last = now
            elif kind == "message_delta" and sample.ttft_ms is None:
                sample.ttft_ms = (now - start) * 1e3  # finished without any text
                first = last = now
            use = read_anthropic_usage(event) if kind in ("message_start", "message_delta") \
                else None
            if use is not None:
                for key in ("prompt_tokens", "completion_tokens", "cached_tokens",
                            "cache_creation_tokens"):
                    if use[key] is not None:
                        setattr(sample, key, use[key])
            if kind == "message_stop":
                break
    sample.decode_ms = (last - first) * 1e3


DISPATCH_MODES = ("session", "alternate")


def target_url(urls: list[str], dispatch: str, session_id: str, position: int) -> str:
    """The server a turn goes to: ``session`` keeps a session on one URL (CRC-32 of its id mod
    ``len(urls)``, stable across runs); ``alternate`` sends the session's turn at ``position``
    (0-based, among its replayed turns) to ``urls[position % len(urls)]``, so consecutive turns
    never share a server when there are several (no affinity).

    Raises:
        ValueError: ``dispatch`` is not one of ``DISPATCH_MODES`` or ``urls`` is empty.
    """
    if not urls:
        raise ValueError("no URLs to dispatch to")
    if dispatch == "session":
        return urls[zlib.crc32(session_id.encode()) % len(urls)]
    if dispatch == "alternate":
        return urls[position % len(urls)]
    raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")


async def _send(http, url, model, sample, max_tokens, cache_salt, dispatched, bar,
                retention=None) -> None:
    sample.dispatch_index = len(dispatched)
    sample.url = url
    dispatched.append(sample)
    try:
        await stream_one(http, url, model, sample, max_tokens, cache_salt, retention)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    bar.update(1)


async def _closed_loop(plan: list[list[Sample]], concurrency: int, send) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def run_session(samples: list[Sample]) -> None:
        async with sem:  # a thinking session keeps its slot: it is still live
            for sample in samples:
                if sample.think_s > 0:
                    await asyncio.sleep(sample.think_s)
                await send(sample)

    await asyncio.gather(*(run_session(s) for s in plan))


async def _open_loop(plan: list[list[Sample]], rate: float, cap: int | None, seed: int,
                     send) -> None:
    rng = random.Random(seed)
    ready: asyncio.Queue = asyncio.Queue()
    for index, samples in enumerate(plan):
        if samples:
            ready.put_nowait((index, 0))
    left = sum(len(s) for s in plan)
    cap_sem = asyncio.Semaphore(cap) if cap else None
    tasks: set[asyncio.Task] = set()

    async def run(index: int, turn: int) -> None:
        try:
            await send(plan[index][turn])
        finally:
            if cap_sem is not None:
                cap_sem.release()
        if turn + 1 < len(plan[index]):  # the agent read the reply: next turn ready
            think = plan[index][turn + 1].think_s  # ... once it has thought
            if think > 0:
                asyncio.get_running_loop().call_later(think, ready.put_nowait, (index, turn + 1))
            else:
                ready.put_nowait((index, turn + 1))

    next_tick = time.perf_counter()
    while left:
        next_tick += rng.expovariate(rate)
        delay = next_tick - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        index, turn = await ready.get()
        if cap_sem is not None:
            await cap_sem.acquire()
        task = asyncio.create_task(run(index, turn))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        left -= 1
    await asyncio.gather(*tasks)


async def replay(url: str, sessions: list[list[dict]], tokens: list[list[list[int]]], *,
                 model: str, max_model_len: int, block_size: int, concurrency: int | None,
                 max_tokens: int, request_rate: float | None = None, seed: int = 0,
                 warmup_requests: int = 0, cache_salt: str | None = None,
                 request_timeout_s: float = 900.0, progress: bool | None = None,
                 stats_urls: list[str] | None = None, more_urls: tuple[str, ...] = (),
                 dispatch: str = "session", think_time: ThinkTime | None = None,
                 retention: str | None = None, retain_share: float = 0.0) -> dict[str, Any]:
    """Replay ``sessions`` against the server at ``url`` and summarise.

    Args:
        url: Server base URL.
        sessions: Flattened requests per session (``_serve_tokens.flatten_request``), already
            cut to the turns to replay.
        tokens: Prompt token ids of each request, parallel to ``sessions`` (client side).
        model: The model id sent in every request.
        max_model_len: Context length, tokens: a request whose prompt plus ``max_tokens``
            exceeds it is skipped and counted, never truncated.
        block_size: The server's KV block size in tokens (the hit cap of the ideal).
        concurrency: Closed loop: sessions in flight (>= 1; None means 1). Open loop: most
            requests in flight (None: no cap).
        max_tokens: Output tokens requested per request (temperature 0).
        request_rate: Open-loop dispatch rate in requests per second (> 0); None: closed loop.
        seed: Seed of the open-loop Poisson clock.
        warmup_requests: Requests sent first, one at a time, and left out of every number:
            the first runnable requests of the plan, each under its own throwaway
            ``cache_salt`` so they warm the server without caching anything the measured
            requests could hit.
        cache_salt: Sent with every measured request: a fresh salt per run keeps runs against
            the same server from hitting each other's blocks.
        request_timeout_s: Seconds without data before a request fails.
        progress: Show a progress bar (None: only on a terminal).
        stats_urls: Servers whose radixkv ``/stats`` counters are read before and after the run
            (summed); None or empty: none (the server counters are then None).
        more_urls: Further servers (replicas) next to ``url``; each turn goes to one of
            ``[url, *more_urls]`` per ``dispatch`` (see ``target_url``).
        dispatch: ``session`` (a session stays on one server) or ``alternate`` (a session's
            turns go round the servers).
        think_time: Think time before every replayed turn of a session after its first (from
            the end of the previous reply), drawn per session and transcript turn with
            ``seed`` (``ThinkTime.draw_s``); a thinking session keeps its closed-loop slot.
            None: none.
        retention: How retention is sent (``_serve_tokens.RETENTION_MODES``); ``anthropic-*``
            sends every request through ``/v1/messages``. None: plain chat completions.
        retain_share: Share of the sessions (in ``sessions`` order, spread evenly:
            ``_arg_types.chosen_sessions``) whose every request carries the retention.

    Returns:
        ``summarise``'s keys plus run facts, ``server_requests`` and
        ``server_cached_prompt_tokens`` (the increase of the ``/stats`` counters
        ``requests_total`` and ``cached_prompt_tokens_total``; the latter is None unless the
        former equals the requests dispatched, i.e. when ``/stats`` saw exactly this run),
        ``prefix_caching`` (the server's own report, or None), ``urls``, ``dispatch`` and
        ``per_url`` (per server: requests, prompt / cached / ideal tokens of this run, and the
        increase of its ``/stats`` counters, including ``cached_prompt_tokens_by_tier`` where
        the server has it); with ``retention``: ``retained_sessions`` (ids) and ``groups``
        (``summarise``).

    Raises:
        ValueError: concurrency < 1, request_rate <= 0, warmup_requests < 0, ``tokens``
            not parallel to ``sessions``, ``retention`` not one of ``RETENTION_MODES``, or
            ``retain_share`` outside [0, 1] (each naming its argument).
        aiohttp.ClientError: the server cannot be reached, or /stats fails.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if warmup_requests < 0:
        raise ValueError(f"warmup_requests must be >= 0, got {warmup_requests}")
    if [len(s) for s in sessions] != [len(t) for t in tokens]:
        raise ValueError("tokens must hold one id list per request of sessions")
    if retention is not None and retention not in RETENTION_MODES:
        raise ValueError(f"retention: one of {RETENTION_MODES}, got {retention!r}")
    chosen = chosen_sessions(len(sessions), retain_share)
    url = url.rstrip("/")
    urls = [url, *(u.rstrip("/") for u in more_urls)]
    target_url(urls, dispatch, "", 0)  # ValueError for an unknown mode, before any request
    stats_urls = [u.rstrip("/") for u in stats_urls or ()]
    plan = [[Sample(r["session_id"], r["turn"], r, t, retain=keep) for r, t in zip(ss, ts)]
            for ss, ts, keep in zip(sessions, tokens, chosen)]
    fits = [[s for s in ss if len(s.prompt_token_ids) + max_tokens <= max_model_len]
            for ss in plan]
    if think_time is not None:
        for ss in fits:
            for s in ss[1:]:
                s.think_s = think_time.draw_s(seed, s.session_id, s.turn)
    skipped = sum(len(ss) for ss in plan) - sum(len(ss) for ss in fits)
    runnable = [s for ss in fits for s in ss]
    position = {id(s): i for ss in fits for i, s in enumerate(ss)}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=request_timeout_s)
    # A new connection per request: llama-server drops idle keep-alive connections after a few
    # seconds without telling the pool, and a POST on such a connection fails ("Can not write
    # request body"; 23 of 63 requests in a first side-by-side run). Connecting on loopback
    # costs well under a millisecond.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for sample in runnable[:warmup_requests]:
            warm = Sample(sample.session_id, sample.turn, sample.request, [])
            for each in urls:
                await stream_one(http, each, model, warm, max_tokens,
                                 cache_salt=WARMUP_SALT_PREFIX + uuid.uuid4().hex,
                                 retention=retention)
        stats_before = {u: await get_stats(http, u) for u in stats_urls}
        dispatched: list[Sample] = []
        bar = tqdm(total=len(runnable), desc=f"replay {url}", unit="req",
                   disable=None if progress is None else not progress)

        async def send(sample: Sample) -> None:
            to = target_url(urls, dispatch, sample.session_id, position[id(sample)])
            await _send(http, to, model, sample, max_tokens, cache_salt, dispatched, bar,
                        retention)

        start = time.perf_counter()
        if request_rate is None:
            await _closed_loop(fits, concurrency or 1, send)
        else:
            await _open_loop(fits, request_rate, concurrency, seed, send)
        wall_s = time.perf_counter() - start
        bar.close()
        stats_after = {u: await get_stats(http, u) for u in stats_urls}
    out = summarise(dispatched, block_size, groups=retention is not None)
    deltas = {u: _stats_delta(stats_before[u], stats_after[u]) for u in stats_urls}
    server_requests = sum(d["requests_total"] for d in deltas.values()) if deltas else None
    server_cached = sum(d["cached_prompt_tokens_total"] for d in deltas.values()) if deltas else None
    out["per_url"] = _per_url(urls, dispatched, out["per_request"], deltas)
    out.update({
        "url": url, "urls": urls, "dispatch": dispatch, "model": model,
        "max_model_len": max_model_len,
        "prefix_caching": stats_after[stats_urls[0]].get("prefix_caching") if stats_urls else None,
        "sessions": len(sessions),
        "mode": "closed-loop" if request_rate is None else "poisson",
        "concurrency": concurrency if request_rate is not None else (concurrency or 1),
        "request_rate": request_rate, "max_tokens": max_tokens, "cache_salt": cache_salt,
        "think_time_s": None if think_time is None else str(think_time), "seed": seed,
        "retention": retention, "retain_share": retain_share if retention is not None else None,
        "retained_sessions": ([ss[0]["session_id"] for ss, keep in zip(sessions, chosen)
                               if keep and ss] if retention is not None else None),
        "warmup_requests": min(warmup_requests, len(runnable)), "skipped_requests": skipped,
        "server_requests": server_requests,
        "server_cached_prompt_tokens": server_cached if server_requests == len(dispatched) else None,
        "wall_s": wall_s,
        "requests_per_s": out["requests"] / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": out["output_tokens"] / wall_s if wall_s > 0 else None,
    })
    return out


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The increase of a server's request and cached-token counters over the run (by tier
    where ``/stats`` has ``cached_prompt_tokens_by_tier``)."""
    out = {key: after[key] - before[key]
           for key in ("requests_total", "cached_prompt_tokens_total")}
    tiers = after.get("cached_prompt_tokens_by_tier")
    if isinstance(tiers, dict):
        was = before.get("cached_prompt_tokens_by_tier") or {}
        out["cached_prompt_tokens_by_tier"] = {k: v - was.get(k, 0) for k, v in tiers.items()}
    return out


def _per_url(urls: list[str], dispatched: list[Sample], rows: list[dict[str, Any]],
             deltas: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per server: this run's requests (ok and failed), prompt / cached / ideal tokens, and its
    ``/stats`` deltas when they were read from it."""
    out: dict[str, dict[str, Any]] = {}
    for u in urls:
        mine = [r for s, r in zip(dispatched, rows) if s.url == u]
        ok = [r for r in mine if "error" not in r]
        out[u] = {"requests": len(ok), "failed_requests": len(mine) - len(ok),
                  **{k: sum(r[k] for r in ok) for k in ("prompt_tokens", "ideal_cached_tokens")},
                  "cached_tokens": _sum_reported(r["cached_tokens"] for r in ok),
                  "server": deltas.get(u)}
    return out


def _sum_reported(values) -> int | None:
    """Sum of the reported values (None: not reported); None when there were values and none
    was reported (0 for no values)."""
    values = list(values)
    reported = [v for v in values if v is not None]
    return sum(reported) if reported or not values else None


GROUPS = ("retained", "not_retained")
"""The two groups ``summarise(groups=True)`` reports: sessions that send retention, the rest."""


def _group(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of one group's per-request rows (the ones without an error)."""
    ok = [r for r in rows if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    ideal = sum(r["ideal_cached_tokens"] for r in ok)
    cached = _sum_reported(r["cached_tokens"] for r in ok)
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    return {"sessions": len({r["session_id"] for r in rows}), "requests": len(ok),
            "failed_requests": len(rows) - len(ok),
            "prompt_tokens": prompt, "cached_tokens": cached, "ideal_cached_tokens": ideal,
            "cache_creation_tokens": _sum_reported(r.get("cache_creation_tokens") for r in ok),
            "cached_over_prompt": cached / prompt if prompt and cached is not None else None,
            "cached_over_ideal": cached / ideal if ideal and cached is not None else None,
            "ttft_ms_mean": float(np.mean(ttft)) if ttft else None,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90)}


def summarise(dispatched: list[Sample], block_size: int, *, groups: bool = False
              ) -> dict[str, Any]:
    """Totals and percentiles over the requests that succeeded, in dispatch order.

    ``ideal_cached_tokens`` is what a perfect prefix cache could have reused for the same
    dispatch order: per request, the longest common token prefix (of the client-side token
    ids) with any earlier dispatched request, capped as the engine caps hits at
    ``block_size``. ``cached_tokens`` and the ratios built on it are None when the server
    reported cached tokens for none of the requests (``cached_tokens_reported`` False);
    ``decode_ms_per_token_p50`` is the median of the requests' decode ms/token. With
    ``groups``, ``groups`` holds per group of :data:`GROUPS` (``retained``: the requests of the
    sessions that sent retention) its sessions, requests, prompt / cached / ideal /
    cache-creation tokens, cached ÷ prompt, cached ÷ ideal and TTFT mean / p50 / p90 (ms), and
    each per-request row says ``retained`` and ``cache_creation_tokens`` (each row says
    ``think_s``, the think time waited before it).
    """
    ideal = ideal_cached_tokens([s.prompt_token_ids for s in dispatched], block_size)
    ok = [(s, i) for s, i in zip(dispatched, ideal) if s.error is None]
    prompt = sum(s.prompt_tokens for s, _ in ok)
    cached = _sum_reported(s.cached_tokens for s, _ in ok)
    decode = [d for s, _ in ok if (d := s.decode_ms_per_token) is not None]
    ideal_total = sum(i for _, i in ok)
    ttft = [s.ttft_ms for s, _ in ok if s.ttft_ms is not None]
    itl = [x for s, _ in ok for x in s.itl_ms]
    per_request = []
    for s, i in zip(dispatched, ideal):
        row = {"session_id": s.session_id, "turn": s.turn, "url": s.url,
               "prompt_tokens": s.prompt_tokens,
               "cached_tokens": s.cached_tokens, "ideal_cached_tokens": i,
               "ttft_ms": None if s.ttft_ms is None else round(s.ttft_ms, 3),
               "think_s": round(s.think_s, 6)}
        if groups:
            row.update(retained=s.retain, cache_creation_tokens=s.cache_creation_tokens)
        if s.error is not None:
            row["error"] = s.error
        per_request.append(row)
    out = {
        "block_size_tokens": block_size,
        "requests": len(ok), "failed_requests": len(dispatched) - len(ok),
        "errors": sorted({s.error for s in dispatched if s.error})[:5],
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_tokens_reported": any(s.cached_tokens is not None for s, _ in ok),
        "computed_tokens": None if cached is None else prompt - cached,
        "ideal_cached_tokens": ideal_total,
        "cached_over_prompt": cached / prompt if prompt and cached is not None else None,
        "cached_over_ideal": cached / ideal_total if ideal_total and cached is not None else None,
        "ttft_ms_mean": float(np.mean(ttft)) if ttft else None,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90), "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50), "itl_ms_p90": pct(itl, 90), "itl_ms_p99": pct(itl, 99),
        "decode_ms_per_token_p50": pct(decode, 50),
        "output_tokens": sum(s.completion_tokens for s, _ in ok),
        "per_request": per_request,
    }
    if groups:
        out["groups"] = {name: _group([r for r in per_request
                                       if r["retained"] == (name == GROUPS[0])])
                         for name in GROUPS}
    return out

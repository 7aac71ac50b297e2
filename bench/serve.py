"""``radixkv bench serve``: replay agent transcripts against a running OpenAI-compatible server.

Sessions run concurrently (at most ``--concurrency`` at once); the turns of one session run in
order, each re-sending the transcript's recorded history (never the model's own output), so
consecutive requests share long prefixes. Every request streams (``stream_options.include_usage``)
to measure time to first token (TTFT: first chunk with content) and inter-token latency (ITL: gaps
between content chunks).

Token ids come from the server's ``POST /tokenize`` and the block size from ``GET /stats``;
requests whose prompt plus ``--max-tokens`` exceed the server's ``max_model_len`` are skipped and
counted (never truncated). ``ideal_cached_tokens`` is what a perfect prefix cache could reuse:
per request, the longest common prefix with any earlier dispatched request, capped like the
engine's hit cap.

Usage::

    radixkv bench serve --url http://127.0.0.1:8000 --source tau-bench --sessions 5 \\
        --concurrency 2 --max-turns 8 --json out.json [--compare-url http://127.0.0.1:8001]
"""

# No ``from __future__ import annotations``: the CLI loads this file by path, possibly without
# registering it in sys.modules, and dataclasses resolve string annotations through it.
import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from radixkv.transcripts import SOURCES, ideal_cached_tokens, load_source


@dataclass
class Sample:
    """One replayed request. Token counts come from the server's ``usage``; times in ms."""

    session_id: str
    turn: int
    prompt_token_ids: list[int]
    dispatch_index: int = -1
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    error: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench serve``)."""
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--source", default="tau-bench", choices=sorted(SOURCES))
    parser.add_argument("--data-path", default=None,
                        help="transcript file (default: the source's file under ../shared)")
    parser.add_argument("--sessions", type=int, default=5, help="first N sessions, file order")
    parser.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once")
    parser.add_argument("--max-turns", type=int, default=None, help="first K turns per session")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--request-timeout", type=float, default=900.0,
                        help="seconds without data before a request fails")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--compare-url", default=None,
                        help="a second server, replayed after the first (e.g. cache off)")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


async def _tokenize_all(http: aiohttp.ClientSession, url: str, model: str,
                        requests: list[dict]) -> tuple[list[list[int]], int]:
    """Token ids of every request's prompt (via the server), and the server's context length."""
    sem = asyncio.Semaphore(4)
    max_model_len = 0

    async def one(req: dict) -> list[int]:
        nonlocal max_model_len
        body = {"model": model, "messages": req["messages"]}
        if req.get("tools"):
            body["tools"] = req["tools"]
        async with sem, http.post(f"{url}/tokenize", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"/tokenize failed ({resp.status}): {await resp.text()}")
            out = await resp.json()
        max_model_len = out["max_model_len"]
        return out["tokens"]

    tokens = await asyncio.gather(*(one(r) for r in requests))
    return list(tokens), max_model_len


async def _stream_one(http: aiohttp.ClientSession, url: str, model: str, req: dict,
                      sample: Sample, max_tokens: int) -> None:
    body = {"model": model, "messages": req["messages"], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if req.get("tools"):
        body["tools"] = req["tools"]
    start = last = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                sample.error = chunk["error"].get("message", "stream error")
                return
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    if sample.ttft_ms is None:
                        sample.ttft_ms = (now - start) * 1e3
                    else:
                        sample.itl_ms.append((now - last) * 1e3)
                    last = now
                elif choice.get("finish_reason") and sample.ttft_ms is None:
                    sample.ttft_ms = (now - start) * 1e3  # finished without any text
            if chunk.get("usage"):
                use = chunk["usage"]
                sample.prompt_tokens = use["prompt_tokens"]
                sample.completion_tokens = use["completion_tokens"]
                sample.cached_tokens = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def replay(url: str, sessions: list[list[dict]], *, concurrency: int, max_tokens: int,
                 request_timeout_s: float = 900.0) -> dict[str, Any]:
    """Replay ``sessions`` against the server at ``url`` and summarise.

    Args:
        url: Server base URL.
        sessions: Normalised requests per session (``radixkv.transcripts``), already cut to
            the turns to replay.
        concurrency: Sessions in flight at once (>= 1).
        max_tokens: Output tokens requested per request (temperature 0).
        request_timeout_s: Seconds without data before a request fails.

    Returns:
        The result keys of DESIGN.md §8 plus ``failed_requests``, ``cached_over_prompt``,
        ``server_cached_prompt_tokens`` (the ``/stats`` counter's increase) and run facts.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model = (await _get_json(http, f"{url}/v1/models"))["data"][0]["id"]
        stats_before = await _get_json(http, f"{url}/stats")
        block_size = stats_before["pool"]["block_size_tokens"]
        flat = [req for session in sessions for req in session]
        tokens, max_model_len = await _tokenize_all(http, url, model, flat)
        samples = iter([Sample(r["session_id"], r["turn"], t) for r, t in zip(flat, tokens)])
        plan = [[next(samples) for _ in session] for session in sessions]
        runnable = [s for ss in plan for s in ss if len(s.prompt_token_ids) + max_tokens <= max_model_len]
        skipped = sum(len(ss) for ss in plan) - len(runnable)
        sem = asyncio.Semaphore(concurrency)
        dispatched: list[Sample] = []
        bar = tqdm(total=len(runnable), desc=f"replay {url}", unit="req", disable=None)

        async def run_session(session: list[dict], session_samples: list[Sample]) -> None:
            async with sem:
                for req, sample in zip(session, session_samples):
                    if len(sample.prompt_token_ids) + max_tokens > max_model_len:
                        continue  # skipped: counted above, never truncated
                    sample.dispatch_index = len(dispatched)
                    dispatched.append(sample)
                    try:
                        await _stream_one(http, url, model, req, sample, max_tokens)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        sample.error = f"{type(exc).__name__}: {exc}"
                    bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(run_session(s, p) for s, p in zip(sessions, plan)))
        wall_s = time.perf_counter() - start
        bar.close()
        stats_after = await _get_json(http, f"{url}/stats")

    ideal = ideal_cached_tokens([s.prompt_token_ids for s in dispatched], block_size)
    ok = [(s, i) for s, i in zip(dispatched, ideal) if s.error is None]
    prompt = sum(s.prompt_tokens for s, _ in ok)
    cached = sum(s.cached_tokens for s, _ in ok)
    ideal_total = sum(i for _, i in ok)
    ttft = [s.ttft_ms for s, _ in ok if s.ttft_ms is not None]
    itl = [x for s, _ in ok for x in s.itl_ms]
    output = sum(s.completion_tokens for s, _ in ok)
    return {
        "url": url, "model": model, "block_size_tokens": block_size,
        "max_model_len": max_model_len, "sessions": len(sessions), "concurrency": concurrency,
        "max_tokens": max_tokens,
        "requests": len(ok), "skipped_requests": skipped,
        "failed_requests": len(dispatched) - len(ok),
        "errors": sorted({s.error for s in dispatched if s.error})[:5],
        "prompt_tokens": prompt, "cached_tokens": cached, "ideal_cached_tokens": ideal_total,
        "cached_over_prompt": cached / prompt if prompt else None,
        "cached_over_ideal": cached / ideal_total if ideal_total else None,
        "server_cached_prompt_tokens": (stats_after["cached_prompt_tokens_total"]
                                        - stats_before["cached_prompt_tokens_total"]),
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p90": _pct(ttft, 90),
        "ttft_ms_p99": _pct(ttft, 99), "itl_ms_p50": _pct(itl, 50),
        "output_tokens": output, "wall_s": wall_s,
        "output_tokens_per_s": output / wall_s if wall_s > 0 else None,
    }


_ROWS = [("requests", "requests", "{}"), ("skipped", "skipped_requests", "{}"),
         ("failed", "failed_requests", "{}"), ("prompt tokens", "prompt_tokens", "{}"),
         ("cached tokens", "cached_tokens", "{}"), ("cached/prompt", "cached_over_prompt", "{:.3f}"),
         ("ideal cached", "ideal_cached_tokens", "{}"), ("cached/ideal", "cached_over_ideal", "{:.3f}"),
         ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"), ("TTFT p90 ms", "ttft_ms_p90", "{:.1f}"),
         ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"), ("ITL p50 ms", "itl_ms_p50", "{:.1f}"),
         ("output tok/s", "output_tokens_per_s", "{:.1f}")]


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table, one column per server."""
    cols = [[r["url"]] + [("-" if r[k] is None else fmt.format(r[k])) for _, k, fmt in _ROWS]
            for r in results]
    labels = [""] + [label for label, _, _ in _ROWS]
    widths = [max(len(x) for x in labels)] + [max(len(x) for x in c) for c in cols]
    lines = []
    for i, label in enumerate(labels):
        cells = [label.ljust(widths[0])] + [c[i].rjust(w) for c, w in zip(cols, widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay per ``args``, print the table, write ``--json``; returns the results dict."""
    for name in ("sessions", "concurrency", "max_tokens", "max_turns"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    sessions = load_source(args.source, args.data_path)[: args.sessions]
    if args.max_turns is not None:
        sessions = [s[: args.max_turns] for s in sessions]
    try:
        results = asyncio.run(replay(args.url, sessions, concurrency=args.concurrency,
                                     max_tokens=args.max_tokens,
                                     request_timeout_s=args.request_timeout))
    except aiohttp.ClientError as exc:  # unreachable server, or /stats and /tokenize failing
        raise SystemExit(f"bench serve: cannot use the server at {args.url}: {exc}") from exc
    shown = [results]
    if args.compare_url:
        try:
            compare = asyncio.run(replay(args.compare_url, sessions, concurrency=args.concurrency,
                                         max_tokens=args.max_tokens,
                                         request_timeout_s=args.request_timeout))
        except aiohttp.ClientError as exc:
            raise SystemExit(f"bench serve: cannot use the server at {args.compare_url}: {exc}") from exc
        results["compare"] = compare
        shown.append(compare)
    print(format_table(shown))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/serve.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

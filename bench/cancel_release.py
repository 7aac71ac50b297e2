"""``radixkv bench cancel-release``: how long a cancelled request's KV blocks take to come back
to the pool, under a load where a share of the streams is cancelled, against one engine step of
that same load.

The driver starts one fresh ``radixkv serve`` on 127.0.0.1 (``--model``, default the embedded
SmolLM2-135M-Instruct; ``--kv-cache-memory``; more flags with ``--serve-arg``), sends it one
untimed warm-up request, then a bounded closed-loop load: ``--requests`` streamed
``/v1/chat/completions`` built from the shipped tau-bench sample's turns (flattened to plain
text as ``bench serve`` sends them; sessions interleaved turn by turn, each pass over the turns
with its own ``cache_salt`` so a second pass is not all hits; turns longer than the context
less ``--max-tokens`` skipped), ``--concurrency`` in flight, ``--max-tokens`` each with
``ignore_eos`` and temperature 0, so every stream that is not cancelled runs its full length.

A seeded share ``--cancel-fraction`` of the requests (``round(requests x fraction)`` of them,
drawn with ``--seed``) is cancelled by the client closing its connection; alternately:

- **prefill**: once the server has admitted every request sent so far (``/stats``
  ``requests_total``, polled every 10 ms: the cancelled request is then in the engine, its
  prompt's blocks allocated) and a further uniform 0 .. ``--prefill-close-window-ms`` (100),
  before the first token; if the
  first token comes first, the connection is closed at it (counted as a decode cancel);
- **decode**: after a random 1 .. ``max_tokens // 2`` content chunks (one token each, except
  where the detokenizer holds back a partial character).

The server times each abort from the moment it is asked (the disconnect) to the blocks being
back in the pool (``kv_activity.cancel_release_ms_p50/p99`` in ``/stats``, the histogram
``radixkv_cancel_release_seconds`` in ``/metrics``). The engine drains aborts between steps,
so a cancel waits for the step in flight; the server times every step
(``kv_activity.step_ms_p50/p99/max``, ``radixkv_engine_step_seconds``). The target:
cancel-release p99 <= one engine step (the longest of the run) + ``--margin-ms`` (50). The
inter-token latency (ITL) of the streams that were not cancelled is reported beside it, with
``within_itl_bound`` (p99 <= ITL p99 + margin): on a CPU a step that carries a long prefill
chunk lasts seconds while decode steps last tens of milliseconds, so that stricter bound
measures the step budget (``--max-num-batched-tokens``), not the release.

After the load the driver waits (at most ``--settle-timeout``) until the server has ended every
request (``/metrics`` ``radixkv_requests_total`` by outcome, no running or waiting sequence)
and counted every cancel, then reads ``/stats`` and ``/metrics`` and checks:

- ``cancels_counted``: the server counted as many cancels as the client sent;
- ``all_requests_ended``: every request ended on the server, and every stream that was not
  cancelled received ``--max-tokens`` chunks' worth of text and a finish reason;
- ``pool_idle``: no live block, nothing in use (no retention is asked for), no running or
  waiting sequence, ``free + cached_evictable + in_use = total``, no leak-check failure;
- ``histogram_agrees``: ``/metrics``' histogram holds ``cancels_total`` samples, and the
  ``/stats`` p50 and p99 (nearest rank over every cancel of the run: a fresh server's window
  holds them all) lie in the histogram's buckets of the same ranks;
- ``within_bound``: cancel-release p99 <= the longest engine step + margin;
- (reported, not a check) ``released_at_step_end``: every cancel whose step in flight was
  observed was released at most the margin after that step ended. The step end is inferred
  on the client (below), and a close the server's event loop reads just after the engine
  thread began the next step waits for that one too, so a decode cancel can land one short
  decode step past it without anything being wrong.

Where the time goes, per cancel: the server runs with ``--log-level info`` and each request
carries an ``X-Request-Id``, so the driver pairs the client's close (wall clock) with the
engine thread's ``request_aborted`` line, written right after the blocks were released:
client close -> released, disconnect detection included (``close_to_release_ms`` per phase).
The end of the engine step in flight at the close is the next chunk any stream decoding
across the close received (every decoding stream gets a token from every step); the engine
drains aborts only between steps, so a cancel should be released by then, plus little.

``all_checks_ok`` is the conjunction of the checks that have a verdict (None: nothing to
judge, e.g. no cancel); the CLI exits 1 when one fails. The table and the JSON (``--json``,
with ``provenance``, the load averages before and after, and one compact row per request)
give: requests, cancels sent (prefill / decode) and counted, cancel-release p50 / p99
(``/stats`` and the histogram's estimate), per phase the client-side times, ITL p50 / p99,
the bound and ``within_bound``.

Usage::

    radixkv bench cancel-release --json bench/results/cpu-zen3/cancel-release-smollm2.json
    radixkv bench cancel-release --model /path/to/hf-dir --requests 100 --concurrency 8
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import asyncio
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fleet_procs as procs  # noqa: E402
import _serve_targets  # noqa: E402
import _serve_tokens  # noqa: E402
import aiohttp  # noqa: E402
from _arg_types import share  # noqa: E402
from _cancel_report import (  # noqa: E402, F401 - bucket_of_rank, histogram_quantile_ms re-exported
    CANCEL_HISTOGRAM,
    attach_release_times,
    attach_step_ends,
    bucket_of_rank,
    format_report,
    histogram_quantile_ms,
    metric_values,
    outcomes,
    summarise,
)
from _provenance import provenance  # noqa: E402

from radixkv.arg_types import bounded_int, positive_float, positive_int  # noqa: E402
from radixkv.tools.transcripts import load_tau_bench  # noqa: E402

#: ``/stats`` polling period while a prefill cancel waits for its request's admission (s).
ADMISSION_POLL_S = 0.01
#: ``/stats`` / ``/metrics`` polling period while waiting for the server to settle (s).
SETTLE_POLL_S = 0.1
#: Seconds one streamed request may take (a loaded 2-core CPU prefills a 5k-token turn in
#: seconds; this only stops a hung run).
REQUEST_TIMEOUT_S = 600.0


def _non_negative_ms(text: str) -> float:
    """A finite number of milliseconds >= 0 (argparse exits 2 naming the flag otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of ms >= 0, got {text!r}")
    return value


def _serve_arg(text: str) -> str:
    """A ``--serve-arg``: anything but the address, which the driver chooses and polls."""
    if text.split("=", 1)[0] in ("--host", "--port"):
        raise argparse.ArgumentTypeError(f"{text.split('=', 1)[0]} is chosen by the driver (a free "
                                         "port on 127.0.0.1), got " + repr(text))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench cancel-release``)."""
    parser.add_argument("--model", default=None,
                        help="what the server serves: an HF directory, a .gguf file or "
                             "gemma3-270m (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-cache-memory", type=positive_float, default=2.0, metavar="GIB",
                        help="the server's KV pool in GiB (default 2: every request in flight "
                             "fits, nothing is preempted)")
    parser.add_argument("--requests", type=positive_int, default=50,
                        help="streamed chat completions sent (default 50)")
    parser.add_argument("--concurrency", type=positive_int, default=4,
                        help="requests in flight, closed loop (default 4)")
    parser.add_argument("--cancel-fraction", type=share, default=0.2, metavar="F",
                        help="share of the requests the client cancels, in [0, 1] (default 0.2)")
    parser.add_argument("--max-tokens", type=bounded_int(4, 1 << 20), default=64,
                        help="tokens each request generates (ignore_eos; default 64, at least 4 "
                             "so a decode cancel has tokens to land between)")
    parser.add_argument("--prefill-close-window-ms", type=_non_negative_ms, default=100.0,
                        metavar="MS",
                        help="a prefill cancel closes a uniform 0..MS after the server admitted "
                             "its request, spread over the step that prefills it (default 100)")
    parser.add_argument("--margin-ms", type=positive_float, default=50.0,
                        help="the bound is the longest engine step + this (ms, default 50)")
    parser.add_argument("--seed", type=int, default=0,
                        help="which requests are cancelled and when (default 0)")
    parser.add_argument("--trace-path", default=None, metavar="PATH",
                        help="tau-bench transcript file (default: the shipped sample)")
    parser.add_argument("--serve-arg", action="append", type=_serve_arg, default=[], metavar="ARG",
                        help="one more argument for radixkv serve (repeatable, e.g. "
                             "--serve-arg=--max-num-batched-tokens=2048; not --host / --port, "
                             "which the driver picks)")
    parser.add_argument("--startup-timeout", type=positive_float, default=300.0, metavar="S",
                        help="seconds to wait for the server's /health (default 300)")
    parser.add_argument("--settle-timeout", type=positive_float, default=60.0, metavar="S",
                        help="seconds to wait after the load for the server to end every "
                             "request and count every cancel (default 60)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")


@dataclass
class Stream:
    """One request of the load and what the client saw of it (times in ms).

    Attributes:
        close_after_chunks: close the connection once this many content chunks arrived (None:
            read to the end); a prefill cancel has 1 (its close normally comes before).
        prefill_close_ms: a prefill cancel's extra wait after admission (ms), else None.
        chunks: content chunks received; ``responded``: the response's headers came;
            ``cancelled``: the client closed before the end.
        release_ms: from the client's close to the server's ``request_aborted`` log line,
            written on the engine thread right after the blocks were released (ms; None when
            not cancelled or not found). Unlike ``/stats``, this includes the server noticing
            the disconnect.
        step_end_ms: from the client's close to the end of the engine step that was running
            then, as another stream decoding across the close saw it (its next chunk; None
            when no stream was decoding then). The engine drains aborts between steps, so
            ``release_ms`` close to ``step_end_ms`` means the cancel waited for that step only.
    """

    index: int
    messages: list[dict[str, Any]]
    prompt_tokens: int
    cache_salt: str
    close_after_chunks: int | None = None
    prefill_close_ms: float | None = None
    chunks: int = 0
    chunk_wall_s: list[float] = field(default_factory=list)  # time.time() of each chunk
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    responded: bool = False
    closed_at_s: float | None = None  # wall clock (time.time) of the client's close
    release_ms: float | None = None  # client close -> the server's request_aborted line
    step_end_ms: float | None = None  # client close -> the end of the step then in flight
    error: str | None = None
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def phase(self) -> str | None:
        """``prefill`` (closed before the server answered: its response headers go with the
        first output), ``decode`` (after) or None (not cancelled)."""
        if not self.cancelled:
            return None
        return "decode" if self.responded else "prefill"

    @property
    def request_id(self) -> str:
        """The ``X-Request-Id`` sent: the server's log lines of this request carry it."""
        return f"cancel-release-{self.index}"

    def close(self) -> None:
        """Mark the client's close (call just before closing)."""
        self.cancelled = True
        self.closed_at_s = time.time()

    def row(self) -> list[Any]:
        """Compact JSON row: index, prompt tokens, planned close (``p`` prefill, a chunk count,
        or None), chunks received, phase of the cancel (or None), TTFT ms, client close ->
        released ms, client close -> end of the step in flight ms, error."""
        planned = "p" if self.prefill_close_ms is not None else self.close_after_chunks
        return [self.index, self.prompt_tokens, planned, self.chunks, self.phase,
                _round(self.ttft_ms), _round(self.release_ms), _round(self.step_end_ms),
                self.error]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def load_turns(trace_path: str | None) -> list[dict[str, Any]]:
    """The tau-bench sample's turns, flattened (``bench serve``'s plain-text messages), with
    the sessions interleaved turn by turn (s0t0, s1t0, s2t0, s0t1, ...): requests in flight
    together come from different sessions, and a session's next turn follows its last one.

    Raises:
        SystemExit: ``--trace-path`` cannot be read (the message names it).
    """
    try:
        sessions = load_tau_bench(trace_path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench cancel-release: --trace-path: {exc}") from exc
    flat = [[_serve_tokens.flatten_request(r) for r in s] for s in sessions]
    turns = []
    for position in range(max((len(s) for s in flat), default=0)):
        turns += [s[position] for s in flat if position < len(s)]
    if not turns:
        raise SystemExit(f"bench cancel-release: --trace-path: no turns in {trace_path}")
    return turns


def plan_cancels(num_requests: int, fraction: float, max_tokens: int, seed: int,
                 prefill_window_ms: float) -> dict[int, tuple[str, float]]:
    """Which requests the client cancels and when: ``{index: ("prefill", close ms after
    admission) or ("decode", chunks before the close)}``, ``round(num_requests x fraction)``
    of them drawn with ``random.Random(seed)``; in index order they alternate prefill, decode,
    so both phases appear from two cancels on."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(num_requests), round(num_requests * fraction)))
    plan: dict[int, tuple[str, float]] = {}
    for ordinal, index in enumerate(chosen):
        if ordinal % 2 == 0:
            plan[index] = ("prefill", rng.uniform(0.0, prefill_window_ms))
        else:
            plan[index] = ("decode", float(rng.randint(1, max_tokens // 2)))
    return plan


def build_streams(turns: list[dict[str, Any]], prompt_tokens: list[int], num_requests: int,
                  plan: dict[int, tuple[str, float]], seed: int) -> list[Stream]:
    """``num_requests`` streams over ``turns`` in order, again from the first with a new
    ``cache_salt`` after each pass, each with its planned cancel."""
    streams = []
    for index in range(num_requests):
        lap, position = divmod(index, len(turns))
        stream = Stream(index, turns[position]["messages"], prompt_tokens[position],
                        cache_salt=f"cancel-release-{seed}-pass{lap}")
        kind, value = plan.get(index, ("none", 0.0))
        if kind == "prefill":
            stream.close_after_chunks, stream.prefill_close_ms = 1, value
        elif kind == "decode":
            stream.close_after_chunks = int(value)
        streams.append(stream)
    return streams


async def read_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      stream: Stream) -> None:
    """Send ``body`` streamed and read it into ``stream``; close the connection (a cancel)
    once ``stream.close_after_chunks`` content chunks arrived."""
    start = last = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body,
                         headers={"X-Request-Id": stream.request_id}) as resp:
        if resp.status != 200:
            stream.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        stream.responded = True
        async for chunk in _serve_tokens.sse_events(resp.content):
            if "error" in chunk:
                stream.error = str(chunk["error"])[:200]
                return
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    if stream.chunks == 0:
                        stream.ttft_ms = (now - start) * 1e3
                        stream.first_chunk.set()
                    else:
                        stream.itl_ms.append((now - last) * 1e3)
                    stream.chunks += 1
                    stream.chunk_wall_s.append(time.time())
                    last = now
                if choice.get("finish_reason"):
                    stream.finish_reason = choice["finish_reason"]
            if (stream.close_after_chunks is not None and stream.finish_reason is None
                    and stream.chunks >= stream.close_after_chunks):
                # Closing the response drops the connection: the server sees the client go.
                stream.close()
                resp.close()
                return


class Load:
    """The closed loop: ``concurrency`` workers send the streams in order; counts what was sent
    (for the prefill cancels' admission check)."""

    def __init__(self, url: str, model: str, max_tokens: int, requests_base: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.requests_base = requests_base  # /stats requests_total before the load
        self.sent = 0

    def body(self, stream: Stream) -> dict[str, Any]:
        return {"model": self.model, "messages": stream.messages, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "cache_salt": stream.cache_salt}

    async def _admitted(self, http: aiohttp.ClientSession, stream: Stream,
                        task: asyncio.Task) -> None:
        """Until the server has admitted every request sent so far (this one among them), or
        this one's first token came, or it ended."""
        while not (task.done() or stream.first_chunk.is_set()):
            stats = await _serve_targets.get_stats(http, self.url)
            if stats["requests_total"] - self.requests_base >= self.sent:
                return
            await asyncio.sleep(ADMISSION_POLL_S)

    async def one(self, http: aiohttp.ClientSession, stream: Stream) -> None:
        self.sent += 1
        task = asyncio.create_task(read_stream(http, self.url, self.body(stream), stream))
        if stream.prefill_close_ms is not None:
            await self._admitted(http, stream, task)
            first = asyncio.create_task(stream.first_chunk.wait())
            await asyncio.wait({first, task}, timeout=stream.prefill_close_ms / 1e3)
            first.cancel()
            if not (task.done() or stream.first_chunk.is_set()):
                # Cancelling the request task makes aiohttp close the connection, whether it
                # still waits for the response's headers (sent with the first output) or not.
                stream.close()
                task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not stream.cancelled:
                raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            stream.error = f"{type(exc).__name__}: {exc}"[:200]

    async def run(self, streams: list[Stream], concurrency: int) -> None:
        pending = iter(streams)
        # One connection per request (no keep-alive): a cancel closes only its own stream.
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            async def worker() -> None:
                for stream in pending:
                    await self.one(http, stream)

            await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _read_server(http: aiohttp.ClientSession, url: str) -> tuple[dict[str, Any], str]:
    stats = await _serve_targets.get_stats(http, url)
    async with http.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        return stats, await resp.text()


async def settle(url: str, expect_requests: int, expect_cancels: int, base: dict[str, Any],
                 timeout_s: float) -> tuple[dict[str, Any], str, float]:
    """Poll until the server has ended ``expect_requests`` more requests (by outcome), counted
    ``expect_cancels`` more cancels, and runs and queues nothing, or ``timeout_s`` passed.

    Returns:
        The last ``/stats``, ``/metrics`` text and the seconds waited.
    """
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while True:
            stats, text = await _read_server(http, url)
            metrics = metric_values(text)
            ended = sum(outcomes(metrics).values()) - sum(base["outcomes"].values())
            cancels = stats["kv_activity"]["cancels_total"] - base["cancels_total"]
            idle = (metrics.get("radixkv_running_sequences") == 0
                    and metrics.get("radixkv_waiting_sequences") == 0)
            waited = time.monotonic() - started
            if (ended >= expect_requests and cancels >= expect_cancels and idle) \
                    or waited > timeout_s:
                return stats, text, waited
            await asyncio.sleep(SETTLE_POLL_S)


async def _warm_up(url: str, model: str) -> dict[str, Any]:
    """One short untimed request (first-call costs: thread pools, page faults), then the
    server's counters to subtract."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4, "temperature": 0, "cache_salt": f"warm-up-{uuid.uuid4().hex}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise procs.FleetError(f"warm-up request: HTTP {resp.status}: "
                                       f"{(await resp.text())[:300]}")
            await resp.read()
        stats, text = await _read_server(http, url)
    return {"requests_total": stats["requests_total"],
            "cancels_total": stats["kv_activity"]["cancels_total"],
            "outcomes": outcomes(metric_values(text))}


async def _prepare(url: str, turns: list[dict[str, Any]], max_tokens: int
                   ) -> tuple[str, list[dict[str, Any]], list[int], int]:
    """The served model id, the turns that fit the context with ``max_tokens`` (their
    server-side prompt lengths) and how many did not."""
    async with aiohttp.ClientSession() as http:
        info = await _serve_targets.probe(http, url)
        tokens, max_model_len = await _serve_targets.tokenize_all(http, url, info["model"], turns)
    fits = [i for i, t in enumerate(tokens) if len(t) + max_tokens <= max_model_len]
    return (info["model"], [turns[i] for i in fits], [len(tokens[i]) for i in fits],
            len(turns) - len(fits))


def _start_server(args: argparse.Namespace, log_dir: Path) -> procs.Proc:
    port = procs.free_port()
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--kv-cache-memory", repr(args.kv_cache_memory),
            "--log-level", "info"]  # request_admitted / request_aborted: per-cancel times
    if args.model:
        argv += ["--model", args.model]
    argv += list(args.serve_arg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return procs._popen("radixkv-serve", argv, f"http://127.0.0.1:{port}",
                        log_dir / "serve.log", env)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure per ``args``; prints the table, writes ``--json``; returns the results."""
    turns = load_turns(args.trace_path)
    plan = plan_cancels(args.requests, args.cancel_fraction, args.max_tokens, args.seed,
                        args.prefill_close_window_ms)
    log_dir = Path(tempfile.mkdtemp(prefix="radixkv-cancel-release-"))
    load_before = os.getloadavg()
    server = _start_server(args, log_dir)
    ok = False
    try:
        procs.wait_all([server], args.startup_timeout)
        model, fitting, lengths, skipped = asyncio.run(_prepare(server.url, turns,
                                                                args.max_tokens))
        if not fitting:
            raise SystemExit(f"bench cancel-release: no turn of the trace fits the context "
                             f"with --max-tokens {args.max_tokens}")
        base = asyncio.run(_warm_up(server.url, model))
        streams = build_streams(fitting, lengths, args.requests, plan, args.seed)
        load = Load(server.url, model, args.max_tokens, base["requests_total"])
        print(f"bench cancel-release: {args.requests} requests, {len(plan)} to cancel, "
              f"concurrency {args.concurrency}", file=sys.stderr)
        started = time.monotonic()
        asyncio.run(load.run(streams, args.concurrency))
        wall_s = time.monotonic() - started
        stats, metrics_text, settle_s = asyncio.run(settle(
            server.url, len(streams), sum(s.cancelled for s in streams), base,
            args.settle_timeout))
        ok = True
    except procs.FleetError as exc:
        raise SystemExit(f"bench cancel-release: {exc}") from exc
    finally:
        if server.stop() not in (0, None) and ok:
            print(f"bench cancel-release: the server exited {server.proc.returncode}:\n"
                  f"{server.log_tail()}", file=sys.stderr)
        if ok:
            attach_release_times(streams, server.log_path.read_text(errors="replace"))
            attach_step_ends(streams)
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"bench cancel-release: server log kept in {log_dir}", file=sys.stderr)
    results = {"provenance": provenance(), "model": args.model or "SmolLM2-135M-Instruct",
               "kv_cache_memory_gib": args.kv_cache_memory, "serve_args": args.serve_arg,
               "trace": "tau-bench", "trace_path": args.trace_path,
               "turns_skipped_too_long": skipped,
               **summarise(streams, stats, metrics_text, base, args),
               "load_wall_s": round(wall_s, 2), "settle_s": round(settle_s, 2),
               "loadavg_before": [round(x, 2) for x in load_before],
               "loadavg_after": [round(x, 2) for x in os.getloadavg()],
               "per_request_columns": ["index", "prompt_tokens", "planned_close", "chunks",
                                       "cancel_phase", "ttft_ms", "close_to_release_ms",
                                       "close_to_step_end_ms", "error"],
               "per_request": [s.row() for s in streams]}
    print(format_report(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, separators=(",", ":")) + "\n")
        print(f"bench cancel-release: wrote {args.json}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv bench cancel-release", description=__doc__)
    add_arguments(parser)
    return 0 if run(parser.parse_args(argv))["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""``radixkv bench plan-check``: ``radixkv plan --trace`` against a real ``bench serve`` run of
the same trace on the same pool, side by side in one run.

For each pool (``--pools``: ``large`` holds every prompt block of the run plus every request's
output; a fraction ``f`` is ``ceil(f x working set)`` blocks, at least ``--concurrency`` times
the largest request, skipped where that is the large pool or more) and each ``--concurrency``,
the driver:

1. starts a FRESH ``radixkv serve`` on 127.0.0.1 with ``--num-blocks`` that pool (one compute
   thread), replays the trace with ``bench serve --concurrency C --max-tokens M --cache-salt
   none``, and samples ``GET /stats`` every ``--poll-ms`` meanwhile for the peak blocks
   (``in_use_blocks``: held by running requests; ``total - free``: held by requests or the
   tree), then stops the server by PID;
2. runs ``radixkv plan --config <model>/config.json --kv-memory-gib <pool bytes> --trace
   tau-bench --concurrency C --max-tokens M --json`` as a subprocess (the pool in GiB is the
   server's blocks x its bytes per block) and checks that the plan's ``num_blocks`` is the
   server's;
3. prints the plan's and the server's token hit rate (cached ÷ prompt tokens), peak live blocks
   and peak used blocks with their ratios, and whether each is within ``--tolerance`` (5 %).

The model is ``tiny`` by default (a random-init 2-layer Llama with SmolLM2's tokenizer and chat
template, so its prompts tokenize exactly as the plan's replay tokenizes them; the hit rate and
the block counts depend on tokens, block size and pool, not on the weights): the run takes
minutes on 2 cores. ``--model smollm2`` serves the embedded SmolLM2 instead. What the replay
models and leaves out (real timing, chunked prefill, preemption): ``radixkv/tools/plan/
replay.py``. Peak blocks by polling can read low by what lived between two polls; the peak of
a closed loop holds for at least one decode step, longer than a poll at the default 10 ms.

Usage::

    radixkv bench plan-check --concurrency 1,4 --pools large,0.5 --json plan-check.json
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fleet_procs as procs  # noqa: E402
import requests  # noqa: E402
from _arg_types import sizes as _sizes  # noqa: E402
from _provenance import provenance  # noqa: E402
from fleet import parse_pools, working_set  # noqa: E402

from radixkv.arg_types import positive_float, positive_int  # noqa: E402
from radixkv.tools.plan.trace_input import trace_prompts  # noqa: E402

#: Compared quantities: (label, plan replay key, server key).
MEASURES = (("token hit rate", "token_hit_rate", "token_hit_rate"),
            ("peak live blocks", "peak_live_blocks", "peak_in_use_blocks"),
            ("peak used blocks", "peak_used_blocks", "peak_used_blocks"))


def _pools(text: str) -> list[str | float]:
    """``--pools`` as argparse reads it: ``parse_pools``' error becomes a usage error (exit 2)."""
    try:
        return parse_pools(text)
    except SystemExit as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--pools: ")) from None


def _poll_ms(text: str) -> float:
    """A period in (0, 1000] ms."""
    value = positive_float(text)
    if value > 1000:
        raise argparse.ArgumentTypeError(f"expected a period in (0, 1000] ms, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench plan-check``)."""
    parser.add_argument("--concurrency", type=_sizes, default=[1, 4], metavar="LIST",
                        help="comma-separated sessions in flight (default 1,4)")
    parser.add_argument("--pools", type=_pools, default="large,0.5",
                        help="comma-separated pools: 'large' (nothing evicted) or a fraction of "
                             "the trace's working set (default large,0.5)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="output tokens per request (default 16)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per KV block, on the server and in the plan (default 16)")
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2"),
                        help="served model (default tiny: SmolLM2's tokenizer, random weights)")
    parser.add_argument("--trace-path", default=None, metavar="PATH",
                        help="tau-bench transcript file (default: the shipped sample)")
    parser.add_argument("--poll-ms", type=_poll_ms, default=10.0,
                        help="/stats sampling period during the replay, in (0, 1000] (default 10)")
    parser.add_argument("--tolerance", type=positive_float, default=0.05,
                        help="relative difference counted as agreement (default 0.05)")
    parser.add_argument("--startup-timeout", type=positive_float, default=180.0, metavar="S",
                        help="seconds each fresh server may take to start (default 180)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")


class StatsPoller:
    """Samples a server's ``/stats`` pool on a thread; keeps the peaks (blocks)."""

    def __init__(self, url: str, period_s: float) -> None:
        self.url, self.period_s = url, period_s
        self.peak_in_use_blocks = self.peak_used_blocks = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with requests.Session() as http:
            while not self._stop.is_set():
                pool = http.get(self.url + "/stats", timeout=30).json()["pool"]
                self.peak_in_use_blocks = max(self.peak_in_use_blocks, pool["in_use_blocks"])
                self.peak_used_blocks = max(self.peak_used_blocks,
                                            pool["total_blocks"] - pool["free_blocks"])
                self.samples += 1
                self._stop.wait(self.period_s)

    def __enter__(self) -> "StatsPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def run_plan(config: Path, num_blocks: int, bytes_per_block: int, args: argparse.Namespace,
             concurrency: int) -> dict[str, Any]:
    """``radixkv plan ... --json`` as a user runs it; returns its JSON."""
    gib = num_blocks * bytes_per_block / 2**30
    argv = [sys.executable, "-m", "radixkv.cli", "plan", "--config", str(config),
            "--block-size", str(args.block_size), "--kv-memory-gib", repr(gib),
            "--trace", "tau-bench", "--concurrency", str(concurrency),
            "--max-tokens", str(args.max_tokens), "--json"]
    if args.trace_path:
        argv += ["--trace-path", args.trace_path]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench plan-check: radixkv plan exited {done.returncode}:\n{done.stderr}")
    plan = json.loads(done.stdout)
    if plan["num_blocks"] != num_blocks:
        raise SystemExit(f"bench plan-check: radixkv plan sized {plan['num_blocks']} blocks for "
                         f"{gib!r} GiB, the server has {num_blocks}")
    return plan


def run_server(model: str | None, num_blocks: int, serve: Any, args: argparse.Namespace,
               concurrency: int, log_dir: Path) -> dict[str, Any]:
    """A fresh server of ``num_blocks`` blocks, ``bench serve`` against it, peaks from /stats."""
    replica = procs.start_replica(f"serve-{num_blocks}-c{concurrency}", model, log_dir,
                                  block_size=args.block_size, num_blocks=num_blocks,
                                  kv_events=False, flags=procs.serve_flags())
    try:
        procs.wait_all([replica], args.startup_timeout)
        flags = ["--url", replica.url, "--source", "tau-bench", "--concurrency", str(concurrency),
                 "--max-tokens", str(args.max_tokens), "--cache-salt", "none",
                 "--json", str(log_dir / f"serve-{num_blocks}-c{concurrency}.json")]
        if args.trace_path:
            flags += ["--path", args.trace_path]
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        with StatsPoller(replica.url, args.poll_ms / 1000) as poller:
            result = serve.run(parser.parse_args(flags))
        stats = procs.stats(replica.url)
    finally:
        replica.stop()
    prompt, cached = result["prompt_tokens"], result["cached_tokens"] or 0
    return {"requests": result["requests"], "failed_requests": result.get("failed_requests"),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "token_hit_rate": cached / prompt if prompt else 0.0,
            "generated_tokens": stats.get("generated_tokens_total"),
            "evicted_blocks": stats.get("evicted_blocks_total"),
            "preemptions": stats.get("preemptions_total"),
            "peak_in_use_blocks": poller.peak_in_use_blocks,
            "peak_used_blocks": poller.peak_used_blocks, "stats_samples": poller.samples,
            "bytes_per_block": stats["pool"]["bytes_per_block"]}


def compare(plan: dict[str, Any], server: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Per measure: plan, server, plan ÷ server and whether ``|ratio - 1| <= tolerance``."""
    rows = []
    for label, plan_key, server_key in MEASURES:
        p, s = plan[plan_key], server[server_key]
        ratio = p / s if s else (1.0 if p == s else math.inf)
        rows.append({"measure": label, "plan": p, "server": s, "plan_over_server": ratio,
                     "within": abs(ratio - 1) <= tolerance})
    return rows


def format_report(results: dict[str, Any]) -> str:
    """The comparison tables as text."""
    lines = []
    for run in results["runs"]:
        lines.append(f"pool {run['pool']} ({run['num_blocks']} blocks), concurrency "
                     f"{run['concurrency']}: {run['server']['requests']} requests, "
                     f"{run['server']['evicted_blocks']} blocks evicted by the server, "
                     f"{run['plan']['allocation_failures']} plan allocation failures")
        lines.append(f"  {'measure':<18}{'plan':>12}{'server':>12}{'plan/server':>13}  within")
        for row in run["rows"]:
            fmt = "{:.4f}" if isinstance(row["plan"], float) else "{}"
            lines.append(f"  {row['measure']:<18}{fmt.format(row['plan']):>12}"
                         f"{fmt.format(row['server']):>12}{row['plan_over_server']:>13.3f}  "
                         f"{'yes' if row['within'] else 'NO'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure per ``args``; prints the tables, writes ``--json``; returns the results."""
    pools = args.pools if isinstance(args.pools, list) else parse_pools(args.pools)
    try:
        sessions = trace_prompts("tau-bench", args.trace_path)
    except ValueError as exc:
        raise SystemExit(f"bench plan-check: --trace-path: {exc}") from exc
    flat = [t for s in sessions for t in s]
    bs = args.block_size
    max_request_blocks = max(math.ceil((len(t) + args.max_tokens) / bs) for t in flat)
    out_blocks = sum(math.ceil(args.max_tokens / bs) + 1 for _ in flat)
    ws = working_set(flat, bs)
    from radixkv.cli import load_bench

    serve = load_bench("serve")
    tmp = Path(tempfile.mkdtemp(prefix="radixkv-plan-check-"))
    runs = []
    try:
        if args.model == "tiny":
            model: str | None = str(procs.make_tiny_model(tmp / "tiny-model"))
            config = Path(model) / "config.json"
        else:
            from radixkv.model.loader import embedded_tokenizer_dir

            model, config = None, embedded_tokenizer_dir() / "config.json"
        large = ws + out_blocks + 16
        for pool in pools:
            for concurrency in args.concurrency:
                # A smaller pool than every in-flight request's blocks fails the replay's
                # allocations where the server would queue: not a like-for-like comparison.
                floor = min(concurrency, len(sessions)) * max_request_blocks + 1
                blocks = large if pool == "large" else max(math.ceil(float(pool) * ws), floor)
                if pool != "large" and blocks >= large:
                    print(f"bench plan-check: pool {pool} at concurrency {concurrency} skipped: "
                          f"{concurrency} requests in flight need {floor} blocks, not less than "
                          f"the large pool's {large}", file=sys.stderr)
                    continue
                print(f"bench plan-check: pool {pool} ({blocks} blocks), concurrency "
                      f"{concurrency}", file=sys.stderr)
                server = run_server(model, blocks, serve, args, concurrency, tmp)
                plan = run_plan(config, blocks, server["bytes_per_block"], args, concurrency)
                runs.append({"pool": pool, "num_blocks": blocks, "concurrency": concurrency,
                             "plan": plan["replay"], "server": server,
                             "rows": compare(plan["replay"], server, args.tolerance)})
    except procs.FleetError as exc:
        raise SystemExit(f"bench plan-check: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {"provenance": provenance(), "model": args.model, "trace": "tau-bench",
               "trace_path": args.trace_path, "block_size": bs, "max_tokens": args.max_tokens,
               "working_set_blocks": ws, "max_request_blocks": max_request_blocks,
               "tolerance": args.tolerance, "runs": runs,
               "all_within": all(r["within"] for run in runs for r in run["rows"])}
    print(format_report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, separators=(",", ":")) + "\n")
        print(f"bench plan-check: wrote {args.json}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv bench plan-check", description=__doc__)
    add_arguments(parser)
    return 0 if run(parser.parse_args(argv))["all_within"] else 1


if __name__ == "__main__":
    sys.exit(main())

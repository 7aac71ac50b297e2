"""``radixkv bench fleet``: several radixkv replicas behind vllm-router, one routing policy each.

For each pool size (``--pools``) and each policy (``--policies``, default ``round_robin``,
``cache_aware``, ``kv_aware``) the driver starts ``--replicas`` FRESH ``radixkv serve``
processes (127.0.0.1, free ports, one compute thread each, KV events on a ZMQ PUB and a replay
endpoint), then ``vllm-router --policy P --router-temperature 0 --worker-urls ...``
(``kv_aware`` finds each replica's events through its ``GET /get_server_info`` and ``GET
/kv_event_sources``; no static flags), runs ``bench
serve`` through the router (``--tokenize-url`` the first replica, ``--cache-salt none``: salted
blocks are not published) and stops every process by PID.

Pools: ``large`` gives each replica room for every prompt block of the run plus every
request's output blocks (nothing is evicted); a fraction ``f`` gives each replica
``ceil(f x working set)`` blocks, where the working set is the run's distinct full prompt
blocks (at least the largest request plus its output). The working set comes from a first,
short-lived replica's ``/tokenize``.

One table per pool: policy, cached ÷ ideal (ideal: a single cache that saw every request),
TTFT p50 / p90, requests (and failures), requests per replica, blocks evicted. ``--json``
(default ``results.json`` in a new ``./radixkv-bench-results/fleet-<timestamp>/``) holds it
all; each run's own ``bench serve`` JSON, PNG and the process logs go to ``<json stem>-runs/``
beside it.

Usage::

    radixkv bench fleet --shared --sessions 12 --concurrency 3 --replicas 3 --pools large,0.3
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import asyncio
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fleet_procs as procs  # noqa: E402
import _serve_replay  # noqa: E402
import aiohttp  # noqa: E402
from _provenance import provenance  # noqa: E402

from radixkv.tools.data import SHARED_DIR_ENV, default_results_dir, require_shared  # noqa: E402
from radixkv.tools.transcripts import SOURCES, default_path, load_source  # noqa: E402

POLICIES = ("round_robin", "cache_aware", "kv_aware")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench fleet``)."""
    parser.add_argument("--replicas", type=int, default=3, help="radixkv replicas per run")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated vllm-router policies (default {','.join(POLICIES)})")
    parser.add_argument("--pools", default="large,0.3",
                        help="comma-separated pool sizes per replica: 'large' (nothing evicted) "
                             "or a fraction of the run's working set (default large,0.3)")
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (default: a random-init 2-layer Llama with SmolLM2's "
                             "tokenizer, 16k context), 'smollm2' (the embedded model) or a path")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--source", default="tau-bench", choices=sorted(SOURCES))
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--path", default=None, help="transcript file or folder (default: sample)")
    data.add_argument("--shared", action="store_true",
                      help=f"the source's full data under ${SHARED_DIR_ENV} (default <repo>/../shared)")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=3, help="sessions in flight")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--startup-timeout", type=float, default=180.0,
                        help="seconds each set of processes may take to get ready")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="results (default: results.json in ./radixkv-bench-results/fleet-<ts>/)")


def parse_pools(text: str) -> list[str | float]:
    """``large,0.3`` -> ``["large", 0.3]``; raises SystemExit naming ``--pools`` otherwise."""
    out: list[str | float] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item == "large":
            out.append(item)
            continue
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0 < value <= 1:
            raise SystemExit(f"--pools: expected 'large' or a fraction in (0, 1], got {item!r}")
        out.append(value)
    if not out:
        raise SystemExit("--pools: give at least one pool size")
    return out


def working_set(tokens: list[list[int]], block_size: int) -> int:
    """Distinct full prompt blocks over ``tokens`` (blocks equal only with equal prefixes)."""
    seen: set[int] = set()
    for ids in tokens:
        h = 0
        for k in range(len(ids) // block_size):
            h = hash((h, tuple(ids[k * block_size:(k + 1) * block_size])))
            seen.add(h)
    return len(seen)


def size_run(model: str | None, sessions: list, args: argparse.Namespace, log_dir: Path) -> dict:
    """Token ids of every request from one throwaway replica: working set, largest request,
    context length and how many requests fit."""
    replica = procs.start_replica("sizing", model, log_dir, block_size=args.block_size,
                                  num_blocks=64, kv_events=False, flags=set())
    try:
        procs.wait_all([replica], args.startup_timeout)

        async def tokenize() -> tuple[str, list[list[int]], int]:
            async with aiohttp.ClientSession() as http:
                model_id = (await _serve_replay.get_json(http, replica.url + "/v1/models"))["data"][0]["id"]
                flat = [r for s in sessions for r in s]
                ids, ctx = await _serve_replay.tokenize_all(http, replica.url, model_id, flat)
                return model_id, ids, ctx

        model_id, tokens, max_model_len = asyncio.run(tokenize())
    finally:
        replica.stop()
    fits = [t for t in tokens if len(t) + args.max_tokens <= max_model_len]
    bs = args.block_size
    return {"model_id": model_id, "max_model_len": max_model_len, "requests": len(tokens),
            "runnable_requests": len(fits), "working_set_blocks": working_set(fits, bs),
            "max_request_blocks": max((math.ceil((len(t) + args.max_tokens) / bs) for t in fits),
                                      default=1)}


def pool_blocks(pool: str | float, sizing: dict, args: argparse.Namespace) -> int:
    """Blocks per replica for one ``--pools`` entry."""
    out_blocks = math.ceil(args.max_tokens / args.block_size) + 1
    if pool == "large":
        return sizing["working_set_blocks"] + sizing["runnable_requests"] * out_blocks + 16
    return max(math.ceil(pool * sizing["working_set_blocks"]), sizing["max_request_blocks"] + 1)


def one_run(policy: str, num_blocks: int, model: str | None, serve: Any, sessions_flags: list[str],
            args: argparse.Namespace, run_dir: Path, tag: str, kv_events: bool,
            flags: set[str]) -> dict[str, Any]:
    """Fresh replicas + router for ``policy``, bench serve through it; every process stopped."""
    log_dir = run_dir / tag
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[procs.Proc] = []
    try:
        replicas = [procs.start_replica(f"replica{i}", model, log_dir, block_size=args.block_size,
                                        num_blocks=num_blocks, kv_events=kv_events, flags=flags)
                    for i in range(args.replicas)]
        started += replicas
        procs.wait_all(replicas, args.startup_timeout)
        router = procs.start_router(policy, [r.url for r in replicas], log_dir)
        started.append(router)
        procs.wait_all([router], 60.0, path="/readiness", workers=args.replicas)
        if policy == "kv_aware":
            time.sleep(1.0)  # the router's SUB sockets connect after readiness
        bench_json = log_dir / "serve.json"
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        result = serve.run(parser.parse_args(
            ["--url", router.url, "--tokenize-url", replicas[0].url, *sessions_flags,
             "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
             "--cache-salt", "none", "--json", str(bench_json)]))
        per_replica = [procs.stats(r.url) for r in replicas]
    finally:
        for proc in reversed(started):
            proc.stop()
    return {"policy": policy, "num_blocks": num_blocks,
            **{k: result.get(k) for k in ("requests", "failed_requests", "skipped_requests",
                                          "prompt_tokens", "cached_tokens", "ideal_cached_tokens",
                                          "cached_over_ideal", "ttft_ms_p50", "ttft_ms_p90",
                                          "ttft_ms_p99", "wall_s", "errors")},
            "replica_requests": [s["requests_total"] for s in per_replica],
            "replica_cached_tokens": [s["cached_prompt_tokens_total"] for s in per_replica],
            "evicted_blocks": sum(s["evicted_blocks_total"] for s in per_replica),
            "preemptions": sum(s.get("preemptions_total", 0) for s in per_replica),
            "bench_json": str(bench_json)}


_COLS = [("policy", "policy", "{}"), ("cached/ideal", "cached_over_ideal", "{:.3f}"),
         ("TTFT p50 ms", "ttft_ms_p50", "{:.0f}"), ("TTFT p90 ms", "ttft_ms_p90", "{:.0f}"),
         ("requests", "requests", "{}"), ("failed", "failed_requests", "{}"),
         ("per replica", "replica_requests", "{}"), ("evicted blocks", "evicted_blocks", "{}")]


def format_table(phase: dict[str, Any]) -> str:
    """One phase's runs as a plain-text table."""
    rows = [[name for name, _, _ in _COLS]]
    rows += [[("-" if run.get(k) is None else fmt.format(run[k])) for _, k, fmt in _COLS]
             for run in phase["runs"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLS))]
    lines = [f"pool {phase['pool']}: {phase['num_blocks']} blocks per replica"]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure per ``args``; prints one table per pool, writes ``--json``; returns the results."""
    for name in ("replicas", "sessions", "concurrency", "max_tokens", "block_size", "max_turns"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise SystemExit(f"--policies: expected some of {', '.join(POLICIES)}, got {args.policies!r}")
    pools = parse_pools(args.pools)
    path = require_shared(default_path(args.source, shared=True)) if args.shared else args.path
    try:
        sessions = load_source(args.source, path)[: args.sessions]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench fleet: {exc}") from exc
    if args.max_turns is not None:
        sessions = [s[: args.max_turns] for s in sessions]
    sessions_flags = ["--source", args.source, "--sessions", str(args.sessions)]
    sessions_flags += ["--path", str(path)] if path is not None else []
    sessions_flags += ["--max-turns", str(args.max_turns)] if args.max_turns else []
    json_path = Path(args.json) if args.json else default_results_dir("fleet") / "results.json"
    run_dir = json_path.parent / f"{json_path.stem}-runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    flags = procs.serve_flags()
    from radixkv.cli import load_bench

    serve = load_bench("serve")
    tmp = Path(tempfile.mkdtemp(prefix="radixkv-fleet-"))
    try:
        model = {"tiny": lambda: str(procs.make_tiny_model(tmp / "tiny-model")),
                 "smollm2": lambda: None}.get(args.model, lambda: args.model)()
        try:
            sizing = size_run(model, sessions, args, run_dir)
            phases = []
            for pool in pools:
                blocks = pool_blocks(pool, sizing, args)
                phase = {"pool": pool, "num_blocks": blocks, "runs": []}
                for policy in policies:
                    print(f"bench fleet: pool {pool} ({blocks} blocks), {policy}", file=sys.stderr)
                    phase["runs"].append(one_run(policy, blocks, model, serve, sessions_flags, args,
                                                 run_dir, f"{pool}-{policy}", True, flags))
                phases.append(phase)
        except procs.FleetError as exc:
            raise SystemExit(f"bench fleet: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {"provenance": provenance(), "replicas": args.replicas, "model": args.model,
               "model_id": sizing["model_id"],
               "source": args.source, "data_path": str(path or default_path(args.source)),
               "sessions": len(sessions), "max_turns": args.max_turns,
               "concurrency": args.concurrency, "max_tokens": args.max_tokens,
               "block_size": args.block_size, "kv_events": True,
               "num_threads_flag": "--num-threads" in flags, **sizing, "phases": phases}
    print("\n\n".join(format_table(p) for p in phases))
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"bench fleet: wrote {json_path} (runs and logs in {run_dir})", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/fleet.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``radixkv bench window-kv``: the same agent replay against keep-all and window KV layouts.

One server at a time on 127.0.0.1 (a free port, or ``--port``), each a fresh ``radixkv serve
--model gemma3-270m`` (``--model``), three configurations in this order (``--configs`` picks
some):

- ``unconstrained``: ``--sliding-window-kv keep-all --kv-cache-memory 8`` (``--unconstrained-gib``),
  a pool that holds the whole replay;
- ``keep-all``: ``--sliding-window-kv keep-all`` with a pool of ``--pool-share`` (a quarter) of
  the working set;
- ``window``: ``--sliding-window-kv window --window-kv-fraction F`` with the same GiB as
  ``keep-all``.

The working set, in tokens, is the sum over the replayed sessions of each session's longest
prompt, read from the unconstrained run's ``bench serve`` JSON (its per-request prompt tokens:
the server's ``usage``, else the client-side count of the served model's tokenizer and chat
template, so exactly what was sent). The constrained pool is ``working set x --pool-share x
bytes per token`` rounded up to 1e-4 GiB, the bytes per token being the unconstrained
server's ``/stats`` ``pool.bytes_per_block / pool.block_size_tokens`` (keep-all: every
layer's K and V). ``--pool-gib`` gives that pool directly (then no unconstrained run is
needed for it).

For each configuration the driver starts the server (log: ``OUTDIR/logs/CONFIG-window-kv.log``),
waits until it lists its model and its KV pool is mapped (``pool.populate``), runs ``radixkv
bench serve --source S [--shared | --path P] --sessions N --concurrency C --max-tokens M
--max-model-len L --tokenizer MODEL --cache-salt none`` against it (JSON:
``OUTDIR/parts/serve-CONFIG.json``, with per-request rows), reads ``GET /stats`` and stops
it (SIGTERM to its process group, ``side_by_side.stop``). A replay that runs past
``--replay-timeout`` is killed and that configuration is reported failed, with its server's
log tail.

``--out PATH`` gets one JSON, without per-request rows: per configuration the replay summary
(cached ÷ ideal, cached ÷ prompt, TTFT p50 / p90, ITL p50, wall seconds, ...), the server's
``/stats`` ``pool`` (with ``pool.window`` under the window layout), ``miss_tokens`` and
``hit_granularity``, and derived ``kv_memory_gib`` (the ``--kv-cache-memory`` given),
``cacheable_tokens`` (``pool.total_blocks x pool.block_size_tokens``: under ``window`` the
full-attention layers' pool, the tokens a hit can reach back to) and ``tokens_per_gib``; at the
top ``ratios``: window ÷ keep-all tokens per GiB, and each constrained run's cached ÷ ideal
over the unconstrained run's; plus the provenance. A table is printed.

Usage::

    radixkv bench window-kv --out /tmp/window-kv/result.json [--dry-run]
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import math
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import side_by_side as sbs  # noqa: E402
from _provenance import git_commit, provenance  # noqa: E402

from radixkv.arg_types import open_fraction, positive_float, positive_int  # noqa: E402

CONFIGS = ("unconstrained", "keep-all", "window")  # measured in this order
GIB = 1 << 30
TAG = "window-kv"

#: ``bench serve`` summary keys kept per configuration (its per-request rows are left out).
SUMMARY_KEYS = ("requests", "failed_requests", "skipped_requests", "errors", "prompt_tokens",
                "cached_tokens", "ideal_cached_tokens", "cached_over_ideal",
                "cached_over_prompt", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90",
                "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "decode_ms_per_token_p50",
                "wall_s", "max_model_len", "block_size_tokens", "tokenize_mismatches",
                "server_cached_prompt_tokens")
#: ``/stats`` keys kept per configuration.
STATS_KEYS = ("pool", "miss_tokens", "hit_granularity", "cached_prompt_tokens_total",
              "prompt_tokens_total", "token_hit_rate", "evicted_blocks_total",
              "kv_bytes_per_token", "kv_cache_dtype", "preemptions_total",
              "resumed_cached_tokens_total")


def _configs(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names among {','.join(CONFIGS)}, "
                                         f"got {text!r}")
    return [c for c in CONFIGS if c in names]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench window-kv``)."""
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="the result JSON (its folder also gets parts/ and logs/); "
                             "required unless --dry-run")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    parser.add_argument("--port", type=sbs._port, default=None,
                        help="port of every server on 127.0.0.1 (default: a free one per server)")
    parser.add_argument("--model", default="gemma3-270m",
                        help="radixkv serve --model, also bench serve's --tokenizer "
                             "(default gemma3-270m)")
    parser.add_argument("--configs", type=_configs, default=list(CONFIGS), metavar="LIST",
                        help="comma-separated configurations to run, always in the order "
                             f"{','.join(CONFIGS)} (default: all)")
    parser.add_argument("--source", default="mini-swe-agent-gemini3",
                        help="bench serve --source (default mini-swe-agent-gemini3)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--shared", action="store_true", default=True,
                      help="the source's full data in the shared data folder "
                           "($RADIXKV_SHARED_DIR; the default)")
    data.add_argument("--path", default=None,
                      help="transcript file or folder instead of the shared data")
    parser.add_argument("--sessions", type=positive_int, default=6, help="sessions replayed")
    parser.add_argument("--max-turns", type=positive_int, default=None,
                        help="first K turns per session (default: all)")
    parser.add_argument("--concurrency", type=positive_int, default=6,
                        help="sessions in flight (closed loop; default 6)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="output tokens per request (default 16)")
    parser.add_argument("--max-model-len", type=positive_int, default=32768,
                        help="bench serve skips requests longer than this (default 32768)")
    parser.add_argument("--request-timeout", type=positive_float, default=3600.0,
                        help="bench serve: seconds without data before a request fails")
    parser.add_argument("--replay-timeout", type=positive_float, default=7200.0,
                        help="seconds one configuration's replay may take before it is killed "
                             "and reported failed (default 7200)")
    parser.add_argument("--unconstrained-gib", type=positive_float, default=8.0,
                        help="--kv-cache-memory of the unconstrained run (default 8)")
    parser.add_argument("--pool-share", type=open_fraction, default=0.25,
                        help="share of the working set the constrained pool holds (keep-all "
                             "bytes per token; default 0.25)")
    parser.add_argument("--pool-gib", type=positive_float, default=None,
                        help="--kv-cache-memory of the keep-all and window runs (default: "
                             "computed from the unconstrained run)")
    parser.add_argument("--window-kv-fraction", type=open_fraction, default=0.25,
                        help="the window run's --window-kv-fraction (default 0.25)")
    parser.add_argument("--start-timeout", type=positive_float, default=600.0,
                        help="seconds to wait for a server to list its model")
    parser.add_argument("--server-log-level", default="info",
                        help="radixkv serve --log-level (default info)")


# ---------------------------------------------------------------------------- arithmetic
def working_set_tokens(per_request: list[dict]) -> int:
    """Sum over sessions of each session's longest prompt (``prompt_tokens`` per row)."""
    longest: dict[str, int] = {}
    for row in per_request:
        sid = row["session_id"]
        longest[sid] = max(longest.get(sid, 0), int(row["prompt_tokens"]))
    return sum(longest.values())


def bytes_per_token(stats: dict) -> float:
    """One token's KV bytes in the (full) pool: ``pool.bytes_per_block / block_size_tokens``."""
    pool = stats["pool"]
    return pool["bytes_per_block"] / pool["block_size_tokens"]


def constrained_gib(working_set: int, per_token: float, share: float) -> float:
    """GiB of ``share`` of ``working_set`` tokens at ``per_token`` bytes, rounded up to 1e-4."""
    return math.ceil(working_set * share * per_token / GIB * 1e4 - 1e-9) / 1e4


def summarize_config(label: str, window_kv: str, kv_memory_gib: float | None,
                     serve: dict | None, stats: dict | None) -> dict:
    """One configuration's entry: the replay summary (``SUMMARY_KEYS`` of ``serve``), the
    server's ``STATS_KEYS`` and ``kv_memory_gib``, ``cacheable_tokens`` (full pool blocks x
    block size) and ``tokens_per_gib``; either input None leaves its keys out."""
    out: dict = {"config": label, "sliding_window_kv": window_kv, "kv_memory_gib": kv_memory_gib}
    if serve is not None:
        out.update({k: serve.get(k) for k in SUMMARY_KEYS})
    if stats is not None:
        out.update({k: stats[k] for k in STATS_KEYS if k in stats})
        pool = stats.get("pool") or {}
        if "total_blocks" in pool and "block_size_tokens" in pool:
            out["cacheable_tokens"] = pool["total_blocks"] * pool["block_size_tokens"]
            out["tokens_per_gib"] = (out["cacheable_tokens"] / kv_memory_gib
                                     if kv_memory_gib else None)
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(configs: dict[str, dict]) -> dict:
    """Window ÷ keep-all tokens per GiB; keep-all's and window's cached ÷ ideal over the
    unconstrained run's (None where a side is missing)."""
    def get(label: str, key: str) -> float | None:
        return (configs.get(label) or {}).get(key)

    base = get("unconstrained", "cached_over_ideal")
    return {"window_over_keep_all_tokens_per_gib": _div(get("window", "tokens_per_gib"),
                                                        get("keep-all", "tokens_per_gib")),
            "keep_all_hit_over_unconstrained": _div(get("keep-all", "cached_over_ideal"), base),
            "window_hit_over_unconstrained": _div(get("window", "cached_over_ideal"), base)}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    """The printed table: a row per configuration, then the ratios."""
    head = (f"{'config':<14}{'GiB':>8}{'cacheable tok':>15}{'tok/GiB':>10}{'cached/ideal':>14}"
            f"{'failed':>8}{'ttft p50 s':>12}{'ttft p90 s':>12}{'itl p50 ms':>12}{'wall s':>9}"
            f"{'win_evicted':>13}{'evicted':>11}")
    lines = [head]
    for label, c in result["configs"].items():
        miss = c.get("miss_tokens") or {}
        ttft50, ttft90 = c.get("ttft_ms_p50"), c.get("ttft_ms_p90")
        lines.append(
            f"{label:<14}{_fmt(c.get('kv_memory_gib'), '.4g'):>8}"
            f"{_fmt(c.get('cacheable_tokens'), ','):>15}{_fmt(c.get('tokens_per_gib'), ',.0f'):>10}"
            f"{_fmt(c.get('cached_over_ideal'), '.3f'):>14}{_fmt(c.get('failed_requests'), 'd'):>8}"
            f"{_fmt(None if ttft50 is None else ttft50 / 1e3, '.2f'):>12}"
            f"{_fmt(None if ttft90 is None else ttft90 / 1e3, '.2f'):>12}"
            f"{_fmt(c.get('itl_ms_p50'), '.1f'):>12}{_fmt(c.get('wall_s'), '.0f'):>9}"
            f"{_fmt(miss.get('window_evicted'), ','):>13}{_fmt(miss.get('evicted'), ','):>11}"
            + (f"  ERROR: {c['error']}" if c.get("error") else ""))
    r = result.get("ratios") or {}
    lines.append(f"window / keep-all tokens per GiB: "
                 f"{_fmt(r.get('window_over_keep_all_tokens_per_gib'), '.3f')}; cached/ideal over "
                 f"unconstrained: keep-all {_fmt(r.get('keep_all_hit_over_unconstrained'), '.3f')}, "
                 f"window {_fmt(r.get('window_hit_over_unconstrained'), '.3f')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- commands
def server_cmd(args: argparse.Namespace, label: str, port: int | str, gib: float | str) -> list[str]:
    """``radixkv serve`` of configuration ``label`` on ``port`` with ``gib`` of KV pool."""
    cmd = sbs.radixkv_cmd("serve", "--model", args.model, "--host", "127.0.0.1", "--port",
                          str(port), "--kv-cache-memory", str(gib), "--sliding-window-kv",
                          "window" if label == "window" else "keep-all")
    if label == "window":
        cmd += ["--window-kv-fraction", str(args.window_kv_fraction)]
    return cmd + ["--log-level", args.server_log_level]


def serve_cmd(args: argparse.Namespace, port: int | str, part: Path) -> list[str]:
    """``bench serve`` of the replay against the server on ``port``, into ``part``."""
    cmd = sbs.radixkv_cmd("bench", "serve", "--url", f"http://127.0.0.1:{port}", "--source",
                          args.source)
    cmd += ["--path", args.path] if args.path else ["--shared"]
    cmd += ["--sessions", str(args.sessions), "--concurrency", str(args.concurrency),
            "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len),
            "--tokenizer", args.model, "--cache-salt", "none", "--request-timeout",
            f"{args.request_timeout:g}", "--label", "radixkv", "--json", str(part)]
    if args.max_turns:
        cmd += ["--max-turns", str(args.max_turns)]
    return cmd


def check(args: argparse.Namespace) -> dict:
    """Resolve and check every prerequisite before anything starts.

    Returns:
        ``{"out": result JSON path or None, "dir": its folder or None, "data": transcripts}``.

    Raises:
        side_by_side.Missing: naming the flag (``--out``, ``--shared``, ``--path``,
            ``--pool-gib``, ``--port``).
    """
    if args.path:
        data = Path(args.path)
        if not data.exists():
            raise sbs.Missing(f"--path: {data} does not exist")
    else:
        from radixkv.tools.data import SHARED_DIR_ENV
        from radixkv.tools.transcripts import default_path

        try:
            data = default_path(args.source, shared=True)
        except ValueError as exc:
            raise sbs.Missing(f"--source: {exc}") from None
        if not data.exists():
            raise sbs.Missing(f"--shared: {args.source} transcripts not found at {data} (set "
                              f"{SHARED_DIR_ENV}, or give --path)")
    if ("unconstrained" not in args.configs and args.pool_gib is None
            and set(args.configs) & {"keep-all", "window"}):
        raise sbs.Missing("--pool-gib: the keep-all and window pools come from the "
                          "unconstrained run; give --pool-gib without it")
    out = None
    if not args.dry_run:
        if not args.out:
            raise sbs.Missing("--out: not given (the result JSON path)")
        out = Path(args.out)
        if out.is_dir():
            raise sbs.Missing(f"--out: {out} is a folder; give a file path")
        if args.port is not None and not sbs._port_free(args.port):
            raise sbs.Missing(f"--port: {args.port} on 127.0.0.1 is in use")
    elif args.out:
        out = Path(args.out)
    return {"out": None if out is None else str(out),
            "dir": None if out is None else str(out.parent), "data": str(data)}


def plan(args: argparse.Namespace, paths: dict) -> list[dict]:
    """The steps, in order: per configuration its server and replay commands (the
    constrained GiB ``<from unconstrained>`` until the unconstrained run measured it)."""
    folder = Path(paths["dir"] or ".")
    port = args.port if args.port is not None else "<free port>"
    gib = args.pool_gib if args.pool_gib is not None else "<from unconstrained>"
    steps = []
    for label in args.configs:
        pool = args.unconstrained_gib if label == "unconstrained" else gib
        steps.append({"config": label, "kv_memory_gib": pool,
                      "server": shlex.join(server_cmd(args, label, port, pool)),
                      "replay": shlex.join(serve_cmd(args, port, _part(folder, label)))})
    return steps


def _part(folder: Path, label: str) -> Path:
    return folder / "parts" / f"serve-{label}.json"


# ---------------------------------------------------------------------------- running
def _stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=60) as resp:
        return json.loads(resp.read())


def _wait_populated(port: int, timeout: float) -> None:
    """Until ``/stats`` ``pool.populate`` is no longer pending or running (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = ((_stats(port).get("pool") or {}).get("populate") or {}).get("state")
        except (OSError, ValueError):
            state = None
        if state not in ("pending", "running", None):
            return
        if state is None:  # no populator (lazy pool): nothing to wait for
            return
        time.sleep(1.0)


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(args: argparse.Namespace, label: str, gib: float, folder: Path) -> dict:
    """Start configuration ``label``'s server alone, replay, read ``/stats``, stop it.

    Returns:
        ``{"server": command, "replay": command, "log", "part", "code": the checkout's commit and
        dirty flag when the server started, "serve": bench serve's JSON or None, "stats": /stats
        or None, "error" (only on failure), "log_tail" (idem)}``.
    """
    port = args.port if args.port is not None else _free_port()
    logs = folder / "logs"
    spec = {"label": label, "port": port, "env": {}, "cmd": server_cmd(args, label, port, gib)}
    part = _part(folder, label)
    part.unlink(missing_ok=True)  # a part left by an earlier run must not pass for this one's
    log = logs / f"{label}-{TAG}.log"
    # The server imports the checkout as it is now: its commit (and whether tracked files differ)
    # per configuration, since the tree may change between the runs of a long session.
    rec: dict = {"server": shlex.join(spec["cmd"]), "replay": shlex.join(serve_cmd(args, port, part)),
                 "log": str(log), "part": str(part), "serve": None, "stats": None,
                 "code": git_commit()}
    print(f"window-kv: server {label}: {rec['server']}", file=sys.stderr, flush=True)
    procs = []
    try:
        procs.append(sbs.start(spec, logs, TAG))
        why = sbs.wait_up(spec, procs[0], args.start_timeout)
        if why:
            rec["error"] = f"server {why}"
            return rec
        _wait_populated(port, 300.0)
        print(f"window-kv: replay {label}: {rec['replay']}", file=sys.stderr, flush=True)
        started = time.time()
        try:
            rc = subprocess.run(serve_cmd(args, port, part), cwd=str(sbs.REPO),
                                timeout=args.replay_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
            rec["error"] = f"replay not done after {args.replay_timeout:g} s (killed)"
        rec["replay_seconds"] = round(time.time() - started, 1)
        if rc:
            rec["error"] = f"bench serve exited with status {rc}"
        if procs[0].poll() is not None:
            rec["error"] = (rec.get("error", "") + f"; server exited with status "
                            f"{procs[0].returncode}").lstrip("; ")
        else:
            try:
                rec["stats"] = _stats(port)
            except (OSError, ValueError) as exc:
                rec["error"] = (rec.get("error", "") + f"; GET /stats failed: {exc}").lstrip("; ")
        rec["serve"] = sbs._load(part) if rc == 0 else None
    finally:
        if procs:
            print(f"window-kv: stopping {label}", file=sys.stderr, flush=True)
            sbs.stop(procs)
        if rec.get("error"):
            rec["log_tail"] = _log_tail(log)
    return rec


def merge(args: argparse.Namespace, runs: dict[str, dict], gibs: dict[str, float | None],
          sizing: dict) -> dict:
    """The result JSON (less provenance) from each configuration's ``measure`` record."""
    configs = {}
    for label, rec in runs.items():
        entry = summarize_config(label, "window" if label == "window" else "keep-all",
                                 gibs.get(label), rec.get("serve"), rec.get("stats"))
        entry.update({k: rec[k] for k in ("server", "replay", "log", "part", "code",
                                          "replay_seconds", "error", "log_tail") if k in rec})
        configs[label] = entry
    failed = [f"{label}: {c['error']}" for label, c in configs.items() if c.get("error")]
    result = {"model": args.model, "source": args.source,
              "data": "path" if args.path else "shared", "sessions": args.sessions,
              "max_turns": args.max_turns, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "max_model_len": args.max_model_len,
              "unconstrained_gib": args.unconstrained_gib, "pool_share": args.pool_share,
              "window_kv_fraction": args.window_kv_fraction, **sizing,
              "one_server_at_a_time": True, "configs": configs, "ratios": ratios(configs)}
    if failed:
        result["error"] = "; ".join(failed)
    return result


def run(args: argparse.Namespace) -> dict:
    """Check, then each configuration per the module doc; write ``--out``."""
    try:
        paths = check(args)
    except sbs.Missing as exc:
        print(f"radixkv bench window-kv: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    steps = plan(args, paths)
    if args.dry_run:
        for s in steps:
            print(f"{s['config']}: kv-cache-memory {s['kv_memory_gib']} GiB\n"
                  f"  server: {s['server']}\n  replay: {s['replay']}")
        return {"dry_run": True, "plan": steps, "paths": paths}
    out, folder = Path(paths["out"]), Path(paths["dir"])
    (folder / "parts").mkdir(parents=True, exist_ok=True)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    gibs: dict[str, float | None] = {"unconstrained": args.unconstrained_gib,
                                     "keep-all": args.pool_gib, "window": args.pool_gib}
    sizing: dict = {"working_set_tokens": None, "keep_all_bytes_per_token": None,
                    "pool_gib": args.pool_gib,
                    "pool_gib_source": "--pool-gib" if args.pool_gib is not None else None}
    runs: dict[str, dict] = {}
    previous = signal.signal(signal.SIGTERM, sbs._on_sigterm) if sbs.threading_main() else None
    try:
        for label in args.configs:
            if gibs[label] is None:
                runs[label] = {"error": "no pool size: the unconstrained run gave none"}
                continue
            runs[label] = rec = measure(args, label, gibs[label], folder)
            if label == "unconstrained" and rec.get("serve") and rec.get("stats"):
                ws = working_set_tokens(rec["serve"].get("per_request") or [])
                per_token = bytes_per_token(rec["stats"])
                sizing.update(working_set_tokens=ws, keep_all_bytes_per_token=per_token)
                if args.pool_gib is None:
                    gib = constrained_gib(ws, per_token, args.pool_share)
                    gibs["keep-all"] = gibs["window"] = gib
                    sizing.update(pool_gib=gib, pool_gib_source="unconstrained run")
                print(f"window-kv: working set {ws:,} tokens x {per_token:g} B/token x "
                      f"{args.pool_share:g} -> {gibs['keep-all']} GiB", file=sys.stderr,
                      flush=True)
    except KeyboardInterrupt:
        print("window-kv: interrupted; the running server was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result = merge(args, runs, gibs, sizing)
    result["provenance"] = provenance()
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"window-kv: wrote {out}", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/window_kv.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return 1 if run(parser.parse_args(argv)).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())

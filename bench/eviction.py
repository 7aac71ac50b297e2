"""``radixkv bench eviction``: replay a trace through the real radix tree and block pool (no
model) for each eviction policy × pool capacity, and compare token and FLOP hit rates.

Usage::

    radixkv bench eviction       # the shipped Mooncake sample, every policy, 35-70 % pools
    radixkv bench eviction --shared --policies lru,lfu,fifo,gdsf,s3fifo,cost,belady \\
        --capacity 0.02,0.05,0.1,0.2 --out /tmp/eviction-conversation
    radixkv bench eviction --format chat --source tau-bench --block-size 16 --out DIR
    radixkv bench eviction --format chat --source openhands --shared --capacity 0.05,0.1
    radixkv bench eviction --format chat --source tau-bench --shared --max-sessions 40 \
        --concurrency 40 --think-time-s exp:60 --retain-share 0.25 --capacity 0.5
    bench/results/eviction-all.sh      # every shared trace and capacity, one markdown table

With no ``--trace`` the trace is a sample shipped in the package (``radixkv/tools/data/``): the
first 400 requests of the Mooncake conversation trace (``mooncake``), or the source's sample
transcripts (``chat``). ``--shared`` reads the full data from the shared data folder instead
(``$RADIXKV_SHARED_DIR``, default ``<repo>/../shared``): ``traces/conversation_trace.jsonl``, or
the source's transcripts. ``tokens`` traces have no default.

Formats: ``mooncake`` (JSONL: ``timestamp`` ms, ``input_length``, ``hash_ids``, one id per
``--block-size`` tokens, the last partial; ``output_length``), ``tokens`` (JSONL:
``token_ids``, optional ``timestamp`` ms, ``cache_salt``, ``session``, ``output_length``),
``chat`` (agent transcripts of ``--source``: tau-bench, swe-agent, mini-swe-agent,
mini-swe-agent-gemini3, crewai, openhands; tokenized with the embedded model's chat template).
Each request carries a session key (chat: the transcript's session; Mooncake: derived from its
hash-id chain, see ``_eviction_trace``; ``--no-sessions`` drops them) and a modeled duration
(output tokens × ``--itl-ms``); the replay passes them to the cache (``session_key``, ``end_s``).
The clock is the trace's timestamps (the request's ordinal when there are none); for chat it is
modeled (``_eviction_chat``): a turn lasts its reply's tokens × ITL, the session's next turn
starts ``--tool-latency-ms`` after it ends, ``--concurrency`` sessions live. ``--think-time-s S``
or ``exp:MEAN`` adds a think time (drawn per session and turn with ``--seed``) to the gap before
each turn of a session after its first: on the modeled clock, or on the timestamps of a
Mooncake / tokens trace (every later request of the session moves by the draws so far).
Capacity is a fraction of
the trace's distinct blocks (or, ``--capacity-basis working-set``, of its peak live working set:
the most blocks the sessions live at one time hold), or ``--capacity-blocks``. Hits follow the
serving rules: the hit cap ``floor((N - 1) / B)`` blocks, full blocks only, and the blocks of the
request being served are locked while it is served.

Retention (``--retain-share F``): the sessions in a share F (spread evenly in the order of their
first request) retain every request's prompt, rounded down to a block boundary, with
``--retain-ttl`` (5m, 1h, 24h) once its blocks are published, through the real cache's retention
API (``CacheManager.retain``: pinned blocks no policy evicts, refreshed by a hit, expired on the
replay's clock, within ``--max-retained-fraction`` of the pool). Each policy × capacity then
replays twice, with retention and with nobody retaining, and each record adds
``retained_cached_over_ideal`` (the retained sessions' cached ÷ ideal tokens, the ideal being a
cache that never evicts), ``others_token_hit_rate`` (the other sessions' token hit rate), the
same two from the replay without retention (``*_no_retention``), ``others_hit_rate_ratio``
(with ÷ without), ``retention_target_met`` (retained >= 0.95 and ratio >= 0.80), the groups'
raw sums (``groups``, ``groups_no_retention``) and the cache's retention counters
(``retention_stats``); a second table prints them.

Writes ``DIR/results.json`` (one record per policy × capacity: ``policy``,
``capacity_fraction``, ``capacity_blocks``, ``token_hit_rate``, ``flop_hit_rate`` = saved
recompute FLOPs ÷ total prompt FLOPs, ``best_oracle`` (the better of belady / belady-cost by FLOP
hit at that capacity), ``fraction_of_belady`` = flop hit rate ÷ the best oracle's,
``gap_closed`` = (p − lru) ÷ (best oracle − lru) (see ``_eviction_report``),
``policy_us_per_eviction`` = the replay thread's time in the policy's hooks (synchronous
training included) ÷ evicted blocks, ``background_train_cpu_s`` apart, ``evicted_blocks``,
``wall_s``, and the raw sums; the learned ``predicted-reuse*`` policies train synchronously
with seed 0), ``DIR/results.csv`` and ``DIR/hit_rate.png``; without ``--out``, DIR is a new folder
``./radixkv-bench-results/eviction-<timestamp>/`` (named at the end).
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import csv
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _arg_types  # noqa: E402
import _eviction_replay as replay_mod  # noqa: E402
import _eviction_report as report_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402
from _provenance import provenance  # noqa: E402
from tqdm import tqdm  # noqa: E402

from radixkv.cache.retention import TTL_CLASSES as RETAIN_TTLS  # noqa: E402
from radixkv.eviction import available_policies  # noqa: E402
from radixkv.eviction.cost_model import PRESETS, get_shape  # noqa: E402
from radixkv.tools.data import (  # noqa: E402
    SHARED_DIR_ENV,
    SHARED_TRACE,
    TRACE_SAMPLE,
    default_results_dir,
    require_shared,
    sample_path,
)

DEFAULT_POLICIES = ",".join(["lru", "lfu", "fifo", "gdsf", "s3fifo", "cost", "predicted-reuse",
                             "predicted-reuse-prior", "belady", "belady-cost"])
#: Pool sizes without ``--capacity``, as fractions of the trace's distinct blocks.
DEFAULT_CAPACITY = "0.02,0.05,0.1,0.2"
#: Pool sizes without ``--capacity`` for the shipped Mooncake sample. Its 141 s hold few returns
#: (an infinite cache hits 0.137 of its tokens), so below ~35 % of its distinct blocks the
#: conversations come back only after every policy has evicted them and six policies tie;
#: from 35 % to 70 % they differ (and the oracles still reach the infinite cache).
SAMPLE_CAPACITY = "0.35,0.5,0.6,0.7"
CSV_FIELDS = ("policy", "capacity_fraction", "capacity_blocks", "token_hit_rate", "flop_hit_rate",
              "best_oracle", "best_oracle_flop_hit_rate", "fraction_of_belady", "gap_closed",
              "policy_us_per_eviction", "policy_hook_s", "sync_train_cpu_s", "train_cpu_s",
              "background_train_cpu_s", "hook_calls", "evicted_blocks", "wall_s", "requests",
              "skipped_requests", "prompt_tokens", "cached_tokens", "prompt_flops", "saved_flops")

# Worker state (inherited through fork, or set by _init in a spawned worker).
_STATE: dict = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench eviction``)."""
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--trace", default=None,
                      help="trace file (chat: transcript file/folder); default: the sample "
                           "shipped in the package (mooncake, chat)")
    data.add_argument("--shared", action="store_true",
                      help=f"read the full data under the shared data folder (${SHARED_DIR_ENV}, "
                           "default <repo>/../shared): traces/conversation_trace.jsonl, or the "
                           "source's transcripts")
    parser.add_argument("--format", default="mooncake", choices=["mooncake", "tokens", "chat"])
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block (default 512 for mooncake, 16 otherwise)")
    parser.add_argument("--source", default="tau-bench",
                        help="transcript source for --format chat (tau-bench, swe-agent, "
                             "mini-swe-agent, mini-swe-agent-gemini3, crewai, openhands)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="chat: sessions in flight, their turns interleaved")
    parser.add_argument("--itl-ms", type=float, default=trace_mod.DEFAULT_ITL_MS,
                        help="modeled inter-token latency: a request lasts output tokens x this")
    parser.add_argument("--tool-latency-ms", type=float, default=1000.0,
                        help="chat: a session's next turn starts this long after its last ended")
    parser.add_argument("--tool-latency-dist", default="fixed", choices=["fixed", "exp"],
                        help="chat: tool latency fixed, or exponential of that mean (seed 0)")
    parser.add_argument("--think-time-s", type=_arg_types.think_time, default=None,
                        metavar="S|exp:MEAN",
                        help="think time added to the gap before each turn of a session after "
                             "its first: S seconds or exponential of mean MEAN, drawn per "
                             "session and turn with --seed (chat: on top of the tool latency; "
                             "mooncake / tokens: on top of the timestamps)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --think-time-s draws")
    parser.add_argument("--retain-share", type=_arg_types.share, default=None, metavar="F",
                        help="share of the sessions (spread evenly in order of their first "
                             "request) whose every request retains its prompt with "
                             "--retain-ttl through the cache's retention API; each policy x "
                             "capacity then also replays with nobody retaining, and the report "
                             "gives the retained sessions' cached / ideal tokens and the other "
                             "sessions' hit rate against that replay")
    parser.add_argument("--retain-ttl", default="5m", choices=list(RETAIN_TTLS),
                        help="TTL class of --retain-share's retentions (default 5m)")
    parser.add_argument("--max-retained-fraction", type=_arg_types.share, default=0.5,
                        metavar="F",
                        help="share of the pool that retentions may pin (the server's flag of "
                             "the same name; default 0.5)")
    parser.add_argument("--default-output-tokens", type=int, default=128,
                        help="chat: output tokens of a turn whose reply the transcript lacks")
    parser.add_argument("--no-sessions", action="store_true",
                        help="give the cache no session keys (ablation)")
    parser.add_argument("--max-sessions", type=int, default=None,
                        help="chat: keep this many sessions, evenly spread (subsample)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="mooncake: replay only the trace's first N requests")
    parser.add_argument("--trace-cache", default=None, metavar="DIR",
                        help="chat: keep tokenized transcripts here between runs")
    parser.add_argument("--label", default=None, help="trace label in the combined tables")
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--capacity", default=None,
                        help="pool sizes as fractions of the trace's distinct blocks (default "
                             f"{DEFAULT_CAPACITY}; {SAMPLE_CAPACITY} for the shipped mooncake "
                             "sample, on which smaller pools make most policies tie)")
    parser.add_argument("--capacity-basis", default="distinct",
                        choices=["distinct", "working-set"],
                        help="what --capacity is a fraction of: the trace's distinct blocks "
                             "(default), or its peak live working set (the most blocks the "
                             "sessions live at once hold: _eviction_trace.peak_working_set)")
    parser.add_argument("--capacity-blocks", default=None,
                        help="pool sizes in blocks (comma list); overrides --capacity")
    parser.add_argument("--model-shape", default=None, choices=sorted(PRESETS),
                        help="cost-model shape (default llama3-8b; smollm2-135m for chat)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="replays run in parallel (processes)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write results here (default: a new folder "
                             "./radixkv-bench-results/eviction-<timestamp>/)")


def _out_dir(out: str | None) -> Path:
    """``--out`` (created), or a new ``./radixkv-bench-results/eviction-<timestamp>/``."""
    if out is None:
        return default_results_dir("eviction")
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"out: cannot create the folder {path}: {exc}") from exc
    return path


def _trace_path(args: argparse.Namespace) -> str:
    """The trace to read: ``--trace``, else the shipped sample or (``--shared``) the full data."""
    if args.trace:
        return args.trace
    if args.format == "chat":
        from radixkv.tools.transcripts import SHARED_ONLY_PATHS, default_path
        if args.source in SHARED_ONLY_PATHS and not args.shared:
            raise ValueError(f"trace: no sample of {args.source} is shipped; use --shared "
                             "or --trace")
        path = default_path(args.source, shared=args.shared)
        return str(require_shared(path) if args.shared else path)
    if args.format == "mooncake":
        return str(require_shared(SHARED_TRACE) if args.shared else sample_path(TRACE_SAMPLE))
    raise ValueError(f"trace: --trace is required for --format {args.format}")


def _capacity(args: argparse.Namespace) -> str:
    """``--capacity``, else the default for the trace being read (:data:`SAMPLE_CAPACITY` for
    the shipped Mooncake sample)."""
    if args.capacity is not None:
        return args.capacity
    sample = args.format == "mooncake" and not args.trace and not args.shared
    return SAMPLE_CAPACITY if sample else DEFAULT_CAPACITY


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{name}: values must be positive, got {text!r}")
    return values


def _init(state: dict) -> None:
    _STATE.update(state)


def _run_one(task: tuple) -> dict:
    policy, fraction, blocks, retention = task
    counter = _STATE.get("counter")

    def progress(n: int) -> None:
        if counter is not None:
            with counter.get_lock():
                counter.value += n

    out = replay_mod.replay(_STATE["trace"], policy, blocks, _STATE["shape"],
                            oracle=_STATE.get("oracle"), progress=progress, retention=retention)
    out["capacity_fraction"] = fraction
    return out


#: Target of a retention run (the issue's): retained sessions keep at least this share of their
#: ideal cached tokens ...
RETAINED_TARGET = 0.95
#: ... while the other sessions keep at least this share of the token hit rate they get when
#: nobody retains.
OTHERS_TARGET = 0.80
RETENTION_FIELDS = ("retain_share", "retain_ttl", "retained_sessions", "other_sessions",
                    "retained_cached_over_ideal", "retained_cached_over_ideal_no_retention",
                    "others_token_hit_rate", "others_token_hit_rate_no_retention",
                    "others_hit_rate_ratio", "token_hit_rate_no_retention",
                    "flop_hit_rate_no_retention", "retention_target_met")


def merge_retention(results: list[dict], share: float, ttl_class: str) -> list[dict]:
    """Pair each retention replay with its reference replay (same policy and capacity, nobody
    retaining) and return the retention replays with the :data:`RETENTION_FIELDS`:
    ``retained_cached_over_ideal`` (retained sessions' cached ÷ ideal tokens, also in the
    reference), ``others_token_hit_rate`` and its reference value, their ratio
    ``others_hit_rate_ratio``, the reference's overall hit rates, and
    ``retention_target_met`` (retained >= :data:`RETAINED_TARGET` and ratio >=
    :data:`OTHERS_TARGET`; None when a group is empty)."""
    ref = {(r["policy"], r["capacity_blocks"]): r for r in results if not r["retention_active"]}
    out = []
    for r in results:
        if not r["retention_active"]:
            continue
        base = ref[(r["policy"], r["capacity_blocks"])]
        kept, others = r["groups"]["retained"], r["groups"]["not_retained"]
        base_kept, base_others = base["groups"]["retained"], base["groups"]["not_retained"]
        ratio = (others["token_hit_rate"] / base_others["token_hit_rate"]
                 if others["token_hit_rate"] is not None and base_others["token_hit_rate"]
                 else None)
        met = (kept["cached_over_ideal"] >= RETAINED_TARGET and ratio >= OTHERS_TARGET
               if kept["cached_over_ideal"] is not None and ratio is not None else None)
        r.update(retain_share=share, retain_ttl=ttl_class, retained_sessions=kept["sessions"],
                 other_sessions=others["sessions"],
                 retained_cached_over_ideal=kept["cached_over_ideal"],
                 retained_cached_over_ideal_no_retention=base_kept["cached_over_ideal"],
                 others_token_hit_rate=others["token_hit_rate"],
                 others_token_hit_rate_no_retention=base_others["token_hit_rate"],
                 others_hit_rate_ratio=ratio,
                 token_hit_rate_no_retention=base["token_hit_rate"],
                 flop_hit_rate_no_retention=base["flop_hit_rate"], retention_target_met=met,
                 groups_no_retention=base["groups"])
        out.append(r)
    return out


def run(args: argparse.Namespace) -> dict:
    """Run every policy × capacity replay; print the table and write the outputs."""
    try:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in available_policies()]
        if unknown:
            raise ValueError(f"policies: unknown {unknown} (known: {available_policies()})")
        trace_path = _trace_path(args)
        block_size = (args.block_size if args.block_size is not None
                      else 512 if args.format == "mooncake" else 16)
        default_shape = "smollm2-135m" if args.format == "chat" else "llama3-8b"
        shape = get_shape(args.model_shape or default_shape)
        t0 = time.perf_counter()
        chat = ({"tool_latency_ms": args.tool_latency_ms,
                 "tool_latency_dist": args.tool_latency_dist,
                 "default_output_tokens": args.default_output_tokens,
                 "max_sessions": args.max_sessions, "cache_dir": args.trace_cache}
                if args.format == "chat" else {})
        trace = trace_mod.load_trace(args.format, trace_path, block_size, source=args.source,
                                     concurrency=args.concurrency, itl_ms=args.itl_ms,
                                     sessions=not args.no_sessions,
                                     max_requests=args.max_requests,
                                     think_time=getattr(args, "think_time_s", None),
                                     think_seed=getattr(args, "seed", 0), **chat)
        if not trace.requests:
            raise ValueError(f"trace: {trace_path} holds no requests")
        distinct = trace.distinct_blocks
        working_set = trace_mod.peak_working_set(trace)
        basis = (working_set if getattr(args, "capacity_basis", "distinct") == "working-set"
                 else distinct)
        if args.capacity_blocks:
            blocks = [int(b) for b in _floats(args.capacity_blocks, "capacity_blocks")]
            sizes = [(b / basis, b) for b in blocks]
        else:
            sizes = [(f, max(1, round(f * basis)))
                     for f in _floats(_capacity(args), "capacity")]
        share = getattr(args, "retain_share", None)
        retaining = None
        if share is not None:
            if args.no_sessions:  # a usage error: exit 2 naming the flags
                print("radixkv bench eviction: --retain-share needs session keys (drop "
                      "--no-sessions)", file=sys.stderr)
                raise SystemExit(2)
            retaining = replay_mod.retaining_sessions(trace, share)
        # Made before the replays, so that a bad --out fails before the run, not after it.
        out = _out_dir(args.out)
    except (OSError, ValueError) as exc:
        print(f"radixkv bench eviction: {exc}", file=sys.stderr)
        return {"error": str(exc)}
    load_s = time.perf_counter() - t0
    oracle = replay_mod.Oracle(trace) if any(p in replay_mod.ORACLES for p in policies) else None
    infinite = replay_mod.infinite_cache(trace, shape)
    print(f"{trace.name}: {len(trace.requests)} requests, {distinct} distinct blocks of "
          f"{block_size} tokens (peak live working set {working_set}; capacity basis "
          f"{getattr(args, 'capacity_basis', 'distinct')}), model shape {shape.name}; "
          f"infinite cache: token hit "
          f"{infinite['token_hit_rate']:.4f}, flop hit {infinite['flop_hit_rate']:.4f} "
          f"(loaded in {load_s:.1f}s)", file=sys.stderr)

    # With --retain-share each policy x capacity replays twice: with retention, and with nobody
    # retaining (the reference of the other sessions' hit rate), the same sessions grouped.
    ttl = getattr(args, "retain_ttl", "5m")
    variants = ([None] if retaining is None else
                [replay_mod.Retention(retaining, ttl, active,
                                      getattr(args, "max_retained_fraction", 0.5))
                 for active in (True, False)])
    # Slowest first (large pools, oracles) so the parallel runs finish together.
    tasks = sorted(((p, f, b, v) for p in policies for f, b in sizes for v in variants),
                   key=lambda t: -t[2])
    jobs = max(1, min(args.jobs, len(tasks)))
    total = len(tasks) * len(trace.requests)
    state = {"trace": trace, "shape": shape, "oracle": oracle}
    results = []
    with tqdm(total=total, unit="req", desc="replay", file=sys.stderr, smoothing=0.05) as bar:
        if jobs == 1:
            _init(state)
            _STATE["counter"] = None
            for task in tasks:
                results.append(replay_mod.replay(trace, task[0], task[2], shape, oracle=oracle,
                                                 progress=bar.update, retention=task[3])
                               | {"capacity_fraction": task[1]})
        else:
            ctx = multiprocessing.get_context("fork")
            counter = ctx.Value("q", 0)
            state["counter"] = counter
            with ctx.Pool(jobs, initializer=_init, initargs=(state,)) as pool:
                pending = pool.map_async(_run_one, tasks, chunksize=1)
                while not pending.ready():
                    pending.wait(0.5)
                    bar.update(counter.value - bar.n)
                results = pending.get()
                bar.update(counter.value - bar.n)

    if retaining is not None:
        results = merge_retention(results, share or 0.0, ttl)
    order = {p: i for i, p in enumerate(policies)}
    results.sort(key=lambda r: (order[r["policy"]], r["capacity_fraction"]))
    report_mod.annotate(results)
    fields = CSV_FIELDS + (RETENTION_FIELDS if retaining is not None else ())
    records = [{k: r.get(k) for k in fields} for r in results]
    print(report_mod.table(records))
    if retaining is not None:
        print(report_mod.retention_table(records, RETAINED_TARGET, OTHERS_TARGET))
        for r, rec in zip(results, records):
            rec["groups"], rec["groups_no_retention"] = r["groups"], r["groups_no_retention"]
            rec["retention_stats"] = r.get("retention_stats")
    if any(r["skipped_requests"] for r in records):
        print("skipped: requests larger than the whole pool (served without the cache, no hit)")
    sessions = len({r.session for r in trace.requests if r.session is not None})
    summary = {"provenance": provenance(), "trace": trace_path, "trace_name": trace.name, "label": args.label,
               "format": args.format, "source": args.source if args.format == "chat" else None,
               "itl_ms": args.itl_ms, "session_keys": sessions,
               "think_time_s": (None if getattr(args, "think_time_s", None) is None
                                else str(args.think_time_s)), "seed": getattr(args, "seed", 0),
               "retain_share": share, "retain_ttl": ttl if retaining is not None else None,
               "max_retained_fraction": (getattr(args, "max_retained_fraction", 0.5)
                                         if retaining is not None else None),
               "retaining_sessions": sorted(retaining) if retaining is not None else None,
               "block_size": block_size, "model_shape": shape.name,
               "requests": len(trace.requests), "distinct_blocks": distinct,
               "peak_working_set_blocks": working_set,
               "capacity_basis": getattr(args, "capacity_basis", "distinct"),
               "infinite_cache": infinite, "notes": trace.notes, "records": records}
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    replay_mod.plot(records, infinite, out / "hit_rate.png",
                    f"{trace.name} ({args.format}, block {block_size}, {shape.name})")
    print(f"wrote {out}/results.json, results.csv, hit_rate.png", file=sys.stderr)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    result = run(p.parse_args())
    raise SystemExit(1 if result.get("error") else 0)

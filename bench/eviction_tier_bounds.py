"""How far ``predicted-reuse``'s two tiers can go: each tier ordered by the true next use.

``predicted-reuse`` (regular return gaps) evicts *overdue* leaves first (ended sessions' before
active sessions' other branches, each by ``cost``'s credit), then the *live* leaf of furthest
predicted next use (its release plus the return gap over the learned reuse probability). This
replays the six traces of the eviction table with the tier orders replaced by the trace oracle's next use
(furthest first), one tier at a time and both, and prints each one's FLOP hit rate and share
of the LRU→oracle gap next to ``predicted-reuse``'s own and the best online policy's, from the
committed results (``bench/results/eviction/<trace>/results.json``).
A learned next-use predictor inside the tiers can reach at most these figures; the oracle keys
are computed when a leaf enters its tier (as the policy's own keys are), so they are a bound for
that design, not Belady's.

Needs the shared data folder (``--shared`` traces, as ``bench/results/eviction-all.sh``: the
agent sources with ``--max-sessions 40``). Usage::

    .venv/bin/python bench/eviction_tier_bounds.py [--traces crewai,openhands] \
        [--trace-cache DIR]
"""

# No ``from __future__ import annotations``: the file is run by path, like the other drivers.
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _eviction_replay as replay_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402

import eviction as eviction_cli  # noqa: E402
from radixkv.eviction.cost_model import get_shape  # noqa: E402
from radixkv.eviction.predicted_reuse import PredictedReusePolicy  # noqa: E402

TRACES = ("conversation", "tau-bench", "swe-agent", "mini-swe-agent-gemini3", "crewai",
          "openhands")
ONLINE = ("lru", "lfu", "fifo", "gdsf", "s3fifo", "cost")
RESULTS = Path(__file__).resolve().parent / "results" / "eviction"
#: Bound name -> (overdue tier by the oracle, live tier by the oracle).
BOUNDS = {"oracle-overdue": (True, False), "oracle-live": (False, True),
          "oracle-both": (True, True)}


class TierOraclePolicy(PredictedReusePolicy):
    """``predicted-reuse`` with either tier ordered by the oracle's next use, furthest first
    (the policy's own entry hooks replaced: everything else, the tiers' bookkeeping included,
    is the policy's).

    Args:
        next_use: ``node -> index of the next request that could match the node's tail``
            (``_eviction_replay.Oracle.next_use``; ``inf`` when none).
        overdue_by_oracle, live_by_oracle: Which tiers the oracle orders.
    """

    def __init__(self, model_shape, next_use, overdue_by_oracle: bool, live_by_oracle: bool):
        super().__init__(model_shape, train_mode="sync", seed=0)
        self._next_use = next_use
        self._overdue_by_oracle = overdue_by_oracle
        self._live_by_oracle = live_by_oracle

    def overdue_entry(self, uid: int, horizon: float) -> tuple:
        if self._overdue_by_oracle:  # least first: the furthest next use
            return (-self._next_use(self._leaves[uid]), uid)
        return super().overdue_entry(uid, horizon)

    def live_entry(self, node, time_key_s: float, release_s) -> tuple:
        if self._live_by_oracle:  # greatest first: the furthest next use
            return (self._next_use(node), node.uid)
        return super().live_entry(node, time_key_s, release_s)


def load(name: str, cache_dir: str) -> tuple:
    """The trace and cost shape as ``eviction-all.sh`` replays them."""
    parser = argparse.ArgumentParser()
    eviction_cli.add_arguments(parser)
    argv = ["--shared"] if name == "conversation" else [
        "--shared", "--format", "chat", "--source", name, "--block-size", "16",
        "--trace-cache", cache_dir, "--max-sessions", "40"]
    args = parser.parse_args(argv)
    chat = ({"tool_latency_ms": args.tool_latency_ms, "tool_latency_dist": args.tool_latency_dist,
             "default_output_tokens": args.default_output_tokens,
             "max_sessions": args.max_sessions, "cache_dir": args.trace_cache}
            if args.format == "chat" else {})
    block_size = 512 if args.format == "mooncake" else 16
    trace = trace_mod.load_trace(args.format, eviction_cli._trace_path(args), block_size,
                                 source=args.source, concurrency=args.concurrency,
                                 itl_ms=args.itl_ms, sessions=True, max_requests=None, **chat)
    return trace, get_shape("smollm2-135m" if args.format == "chat" else "llama3-8b")


def committed(name: str) -> dict:
    """``capacity -> {policy: FLOP hit}`` from the committed results of ``name``."""
    out: dict = {}
    for rec in json.loads((RESULTS / name / "results.json").read_text())["records"]:
        out.setdefault(round(rec["capacity_fraction"], 4), {})[rec["policy"]] = rec["flop_hit_rate"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--trace-cache", default="/tmp/radixkv-trace-cache")
    args = parser.parse_args(argv)
    names = [t for t in args.traces.split(",") if t]
    unknown = sorted(set(names) - set(TRACES))
    if unknown:
        parser.error(f"--traces: unknown {unknown} (known: {', '.join(TRACES)})")
    # The replay gives oracles their trace index by name.
    replay_mod.ORACLES = tuple(replay_mod.ORACLES) + tuple(BOUNDS)
    print("| trace | capacity | best online | predicted-reuse | "
          + " | ".join(BOUNDS) + " | oracle |")
    print("|---|---|---|---|" + "---|" * len(BOUNDS) + "---|")
    for name in names:
        trace, shape = load(name, args.trace_cache)
        for cap, hits in sorted(committed(name).items()):
            lru, oracle = hits["lru"], max(hits["belady"], hits["belady-cost"])
            blocks = max(1, round(cap * trace.distinct_blocks))
            cells = []
            for bound, (overdue, live) in BOUNDS.items():
                oracle_index = replay_mod.Oracle(trace)
                policy = TierOraclePolicy(shape, oracle_index.next_use, overdue, live)
                r = replay_with(trace, policy, bound, blocks, shape, oracle_index)
                cells.append(hit_and_gap(r["flop_hit_rate"], lru, oracle))
            best = max(hits[p] for p in ONLINE)
            own = hit_and_gap(hits["predicted-reuse"], lru, oracle)
            print(f"| {name} | {cap:.0%} | {best:.4f} | {own} | " + " | ".join(cells)
                  + f" | {oracle:.4f} |", flush=True)
    return 0


def hit_and_gap(flop_hit: float, lru: float, oracle: float) -> str:
    """``"hit (share of the LRU→oracle gap closed)"``."""
    gap = (flop_hit - lru) / (oracle - lru) if oracle - lru > 1e-9 else float("nan")
    return f"{flop_hit:.4f} ({gap:.2f})"


def replay_with(trace, policy, name: str, blocks: int, shape, oracle) -> dict:
    """``_eviction_replay.replay`` with ``policy`` (an instance) under ``name``."""
    make = replay_mod.make_policy
    replay_mod.make_policy = lambda *a, **k: policy
    try:
        return replay_mod.replay(trace, name, blocks, shape, oracle=oracle)
    finally:
        replay_mod.make_policy = make


if __name__ == "__main__":
    from radixkv.tools.data import SharedDataMissing

    try:
        raise SystemExit(main())
    except SharedDataMissing as exc:  # the CLI's contract: a missing --shared folder is exit 2
        print(f"{Path(__file__).name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

"""How much of the LRU→oracle gap on the conversation trace a ranking by what a cache can know
could close (the goal: 1/3 of the gap at 5 % and 10 %).

On the Mooncake conversation trace (block 512) ``predicted-reuse`` falls back to ``cost``'s
order (irregular returns) and closes 0.12 / 0.16 of the gap at 5 / 10 %. This script asks
whether any learned reuse probability could do much better. For every request it derives the
features a cache could have at the request's end (all from earlier requests only): prompt
blocks, modeled duration, the turn index and the gaps before it (its *parent* is the latest
earlier request whose last full block is the deepest block of its prompt seen before),
matched blocks, how often the deepest matched block and the conversation's second block (the
first is every request's) were asked for, requests and age of the conversation, new blocks
over the parent. The label is whether the conversation comes back within ``--horizon-s`` (its
first continuation's arrival).

It fits scikit-learn's ``HistGradientBoostingClassifier`` at a few sizes, cross-fitted (each
half of the requests ranked by the model fitted on the other half: no request by a model that
saw its own label) and *in-sample* (fitted on every label), and replays at each capacity
``cost`` with its ``P`` replaced by the fit's probability for the request that released the
leaf (kept until the leaf's next release), and by the label itself (P = 1 / 0.01: an oracle
told only *whether*), next to the committed ``lru``, ``cost``, ``predicted-reuse`` and oracle
FLOP hit rates (``bench/results/eviction/conversation``), each with its share of the
LRU→oracle gap.

The cross-fitted rows are what these features can predict; an in-sample fit also ranks by
labels it memorised, which no online learner has. Needs the shared data folder. Usage::

    .venv/bin/python bench/eviction_conversation_bound.py [--capacities 0.05,0.1]
"""

# No ``from __future__ import annotations``: the file is run by path, like the other drivers.
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _eviction_replay as replay_mod  # noqa: E402
from eviction_tier_bounds import committed, hit_and_gap, load, replay_with  # noqa: E402

from radixkv.eviction.cost_aware import CostAwarePolicy  # noqa: E402

FEATURES = ("prompt_blocks", "duration_s", "turn", "parent_gap_s", "grandparent_gap_s",
            "matched_blocks", "deepest_block_uses", "second_block_uses", "conversation_requests",
            "conversation_age_s", "new_blocks")


def features(trace) -> tuple[np.ndarray, np.ndarray]:
    """Per request: ``X`` (float64, ``[n, len(FEATURES)]``; −1 where a parent is missing) and
    the seconds to its conversation's next request (``inf`` when none)."""
    reqs = trace.requests
    bs = trace.block_size
    first_seen: dict[int, int] = {}
    for i, r in enumerate(reqs):
        for b in r.blocks:
            first_seen.setdefault(b, i)
    owner: dict[int, int] = {}  # last full block -> latest request ending its full blocks there
    uses: dict[int, int] = {}
    conv_count: dict[int, int] = {}
    conv_first_s: dict[int, float] = {}
    parent: dict[int, int] = {}
    child: dict[int, int] = {}
    turn = [0] * len(reqs)
    rows = []
    for j, r in enumerate(reqs):
        ids = r.blocks
        num_full = r.num_tokens // bs
        k = 0
        while k < num_full and first_seen[ids[k]] < j:
            k += 1
        p = owner.get(ids[k - 1]) if k else None
        if p is not None:
            parent[j] = p
            child.setdefault(p, j)
            turn[j] = turn[p] + 1
        # Every request starts with the same block; the second tells conversations apart.
        conv = ids[1] if len(ids) > 1 else -1
        count = conv_count.get(conv, 0)
        conv_count[conv] = count + 1
        conv_first_s.setdefault(conv, r.time_s)
        pg = r.time_s - reqs[p].time_s if p is not None else -1.0
        gp = parent.get(p) if p is not None else None
        ppg = reqs[p].time_s - reqs[gp].time_s if gp is not None else -1.0
        new = num_full - (reqs[p].num_tokens // bs) if p is not None else -1.0
        rows.append([num_full, r.duration_s, turn[j], pg, ppg, k,
                     uses.get(ids[k - 1], 0) if k else 0,
                     uses.get(ids[1], 0) if len(ids) > 1 else 0, count,
                     r.time_s - conv_first_s[conv], new])
        for b in ids[:num_full]:
            uses[b] = uses.get(b, 0) + 1
        if num_full:
            owner[ids[num_full - 1]] = j
    next_s = np.array([reqs[child[j]].time_s - r.time_s if j in child else np.inf
                       for j, r in enumerate(reqs)])
    return np.asarray(rows, dtype=np.float64), next_s


class GivenCreditPolicy(CostAwarePolicy):
    """``cost`` with ``P`` taken from ``p_by_request[i]`` for the request ``i`` that released
    the leaf last (``now()``: the replay's request index); ``cost``'s own ``P`` before a leaf's
    first release (a split head)."""

    def __init__(self, model_shape, p_by_request: np.ndarray, now) -> None:
        super().__init__(model_shape)
        self._p = p_by_request
        self._now = now
        self._p_of: dict[int, float] = {}
        self._end_of: dict[int, float] = {}
        self._given: float | None = None

    def value(self, node) -> float:
        uid = node.uid
        end = getattr(node, "request_end_s", None)
        if end is not None and self._end_of.get(uid) != end:
            self._end_of[uid] = end
            self._p_of[uid] = float(self._p[self._now()])
        self._given = self._p_of.get(uid)
        return super().value(node)

    def reuse_probability(self, h: int) -> float:
        given = self._given
        return given if given is not None else super().reuse_probability(h)

    def on_evict(self, node, num_blocks: int):
        if node.num_blocks == 0:
            self._p_of.pop(node.uid, None)
            self._end_of.pop(node.uid, None)
        return super().on_evict(node, num_blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", default="0.05,0.1")
    parser.add_argument("--horizon-s", type=float, default=600.0)
    parser.add_argument("--models", default="30x7,100x31,400x63",
                        help="gradient-boosting sizes, ITERATIONSxLEAVES, comma-separated")
    parser.add_argument("--trace-cache", default="/tmp/radixkv-trace-cache")
    args = parser.parse_args(argv)
    try:
        sizes = [(int(i), int(n)) for i, n in (m.split("x") for m in args.models.split(",") if m)]
    except ValueError:
        parser.error(f"--models: want ITERATIONSxLEAVES,..., got {args.models!r}")
    hits_by_cap = committed("conversation")
    try:
        caps = [float(c) for c in args.capacities.split(",")]
    except ValueError:
        parser.error(f"--capacities: want fractions, got {args.capacities!r}")
    missing = [c for c in caps if round(c, 4) not in hits_by_cap]
    if missing:
        parser.error(f"--capacities: no committed results at {missing} "
                     f"(have {sorted(hits_by_cap)})")
    hits_by_cap = {cap: hits_by_cap[round(cap, 4)] for cap in caps}
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import roc_auc_score

    trace, shape = load("conversation", args.trace_cache)
    X, next_s = features(trace)
    times = np.array([r.time_s for r in trace.requests])
    y = next_s <= args.horizon_s
    known = times + args.horizon_s <= times[-1]  # label not cut off by the trace's end
    idx = np.flatnonzero(known)
    half, rest = idx[: len(idx) // 2], idx[len(idx) // 2:]
    cut = rest[0]
    print(f"requests {len(y)}, labelled {len(idx)}, continued within {args.horizon_s:.0f} s: "
          f"{y[idx].mean():.3f}\n")
    credits = {}  # P source -> (per-request P, AUC on labels it was not fitted on or None)
    for iters, leaves in sizes:
        def fit(rows, iters=iters, leaves=leaves):
            model = HistGradientBoostingClassifier(max_iter=iters, max_leaf_nodes=leaves,
                                                   random_state=0)
            return model.fit(X[rows], y[rows])
        # Cross-fitted: each half ranked by the model fitted on the other half, so no request
        # is ranked by a model that saw its own label.
        cross = np.empty(len(y))
        cross[:cut] = fit(rest).predict_proba(X[:cut])[:, 1]
        cross[cut:] = fit(half).predict_proba(X[cut:])[:, 1]
        credits[f"cross-fitted {iters}x{leaves}"] = (cross, roc_auc_score(y[idx], cross[idx]))
        credits[f"in-sample {iters}x{leaves}"] = (fit(idx).predict_proba(X)[:, 1], None)
    credits["label (P = 1 / 0.01)"] = (np.where(y, 1.0, 0.01), None)
    ends = {cap: (h["lru"], max(h["belady"], h["belady-cost"])) for cap, h in hits_by_cap.items()}
    print("\n| P of a leaf | AUC | " + " | ".join(f"{c:.0%}" for c in caps) + " |")
    print("|---|---|" + "---|" * len(caps))
    for policy in ("lru", "cost", "predicted-reuse"):
        print(f"| {policy} (committed) | | " + " | ".join(
            hit_and_gap(hits_by_cap[c][policy], *ends[c]) for c in caps) + " |")
    for name, (p, auc) in credits.items():
        cells = []
        for cap in caps:
            index = replay_mod.Oracle(trace)
            policy = GivenCreditPolicy(shape, p, lambda index=index: index.current)
            blocks = max(1, round(cap * trace.distinct_blocks))
            r = replay_with(trace, policy, name, blocks, shape, index)
            cells.append(hit_and_gap(r["flop_hit_rate"], *ends[cap]))
        auc_cell = f"{auc:.3f}" if auc is not None else ""
        print(f"| {name} | {auc_cell} | " + " | ".join(cells) + " |", flush=True)
    print("| oracle (committed) | | " + " | ".join(f"{ends[c][1]:.4f}" for c in caps) + " |")
    return 0


if __name__ == "__main__":
    from radixkv.tools.data import SharedDataMissing

    try:
        raise SystemExit(main())
    except SharedDataMissing as exc:  # the CLI's contract: a missing --shared folder is exit 2
        print(f"{Path(__file__).name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

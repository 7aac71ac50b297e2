"""Replay of one trace through the real ``CacheManager`` (radix tree + block pool, no model) for
one eviction policy and pool size, the infinite-cache reference, the offline oracle's view of
the future, and the plot.

A request is served whole at its clock reading: ``begin`` (match under the hit cap, lock the
path), ``allocate`` its ``ceil(N / B)`` blocks (evicting through the policy; the request's own
path is locked, so it is never evicted while served), ``publish`` its full blocks, ``release``.
A request larger than the whole pool cannot be served from the cache: it counts with no hit.
The request's session key goes to ``begin`` and its modeled end (``time_s + duration_s``) to
``release``, where the cache takes them (``session_key`` / ``end_s``): the blocks are still
released at once (requests never overlap in the pool), ``end_s`` only stamps when the request
would have finished, the time a policy's features read. The policy's hooks are
timed (``_eviction_timing``); learned policies (``predicted-reuse*``) train synchronously with a
fixed seed, so a replay is reproducible.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from _arg_types import chosen_sessions
from _eviction_timing import HookTimer, policy_cost
from _eviction_trace import Trace  # bench/ is on sys.path (see bench/eviction.py)

from radixkv.cache.evict_path import make_ghost_list
from radixkv.cache.hashing import BlockHasher, CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.cache.retention import RetentionTable
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import make_policy
from radixkv.eviction.cost_model import CostShape, prefill_flops

ORACLES = ("belady", "belady-cost")

LEARNED_PREFIX = "predicted-reuse"
"""Policies named so train synchronously with a fixed seed in a replay (:func:`policy_kwargs`)."""


def policy_kwargs(name: str) -> dict:
    """Constructor arguments a replay gives policy ``name``: ``train_mode="sync", seed=0`` for
    the learned ones (reproducible: training happens on the replay thread, in the hooks)."""
    return {"train_mode": "sync", "seed": 0} if name.startswith(LEARNED_PREFIX) else {}


#: Ghost-list capacity of every replay, in blocks.
GHOST_BLOCKS = 1 << 16


def identity(trace: Trace, salt: str | None) -> CacheIdentity:
    """The cache identity every replayed request of ``salt`` runs under."""
    return CacheIdentity(model_revision="bench-eviction", block_size=trace.block_size,
                         kv_dtype="none", rope="none", cache_salt=salt)


class Oracle:
    """Future knowledge for ``belady`` / ``belady-cost``: which later requests could match each
    block (within their hit cap), and the tree's chained hash of every full block.

    Attributes:
        current: Index of the request being replayed (set by :func:`replay`).
    """

    def __init__(self, trace: Trace) -> None:
        bs = trace.block_size
        bb = 4 * bs
        hasher = BlockHasher("xxh3_128")
        roots: dict = {}
        accesses: dict[int, list[int]] = defaultdict(list)
        tree_hash: dict[int, bytes] = {}
        for i, req in enumerate(trace.requests):
            blocks = req.blocks
            for b in blocks[: trace.cap_blocks(req)]:
                accesses[b].append(i)
            num_full = req.num_tokens // bs
            k = 0
            while k < num_full and blocks[k] in tree_hash:
                k += 1
            if k < num_full:
                root = roots.get(req.salt)
                if root is None:
                    root = roots[req.salt] = hasher.identity_root(identity(trace, req.salt))
                parent = tree_hash[blocks[k - 1]] if k else root
                pb = trace.prompt(req)
                hashes = hasher.hash_blocks(parent, pb[k * bb : num_full * bb], bs)
                for b, h in zip(blocks[k:num_full], hashes):
                    tree_hash[b] = h
        self.accesses = dict(accesses)
        self.block_of = {h: b for b, h in tree_hash.items()}
        self.current = 0

    def next_use(self, node) -> float:
        """Index of the next request after the current one that could match ``node``'s tail."""
        b = self.block_of.get(node.end_hash) if node.num_blocks else None
        uses = self.accesses.get(b) if b is not None else None
        if not uses:
            return math.inf
        j = bisect.bisect_right(uses, self.current)
        return float(uses[j]) if j < len(uses) else math.inf

    def now(self) -> float:
        return float(self.current)


def request_flops(trace: Trace, shape: CostShape) -> list[float]:
    """Prefill FLOPs of each request's whole prompt."""
    return [prefill_flops(shape, 0, r.num_tokens) for r in trace.requests]


def ideal_cached(trace: Trace) -> list[int]:
    """Per request (trace order), the tokens a cache that never evicts hits: its longest chain
    of blocks published by earlier requests, under the hit cap (full blocks only)."""
    bs = trace.block_size
    published: set[int] = set()
    out = []
    for req in trace.requests:
        blocks = req.blocks
        cap = trace.cap_blocks(req)
        k = 0
        while k < cap and blocks[k] in published:
            k += 1
        published.update(blocks[: req.num_tokens // bs])
        out.append(k * bs)
    return out


def infinite_cache(trace: Trace, shape: CostShape) -> dict:
    """Hit rates of a cache that never evicts (same hit cap and full-blocks-only rule)."""
    cached = prompt = 0
    saved = total = 0.0
    for req, hit in zip(trace.requests, ideal_cached(trace)):
        cached += hit
        prompt += req.num_tokens
        saved += prefill_flops(shape, 0, hit)
        total += prefill_flops(shape, 0, req.num_tokens)
    return {"token_hit_rate": cached / prompt if prompt else 0.0,
            "flop_hit_rate": saved / total if total else 0.0}


GROUPS = ("retained", "not_retained")
"""Session groups of a retention replay: the sessions that retain, the rest."""


@dataclass(frozen=True)
class Retention:
    """Who retains in a replay.

    Attributes:
        sessions: Session keys whose every request retains its prompt (``GROUPS[0]``).
        ttl_class: Their TTL class (a key of ``radixkv.cache.retention.TTL_CLASSES``).
        active: False for the reference replay in which nobody retains (the same groups are
            reported, so both replays of a run compare group by group).
        max_retained_fraction: Share of the pool retentions may pin (the cache's budget).
    """

    sessions: frozenset[str]
    ttl_class: str = "5m"
    active: bool = True
    max_retained_fraction: float = 0.5


def retaining_sessions(trace: Trace, share: float) -> frozenset[str]:
    """The sessions of ``trace`` in a ``share`` of them: in order of their first request,
    spread evenly (``_arg_types.chosen_sessions``)."""
    order = list(dict.fromkeys(r.session for r in trace.requests if r.session is not None))
    return frozenset(s for s, keep in zip(order, chosen_sessions(len(order), share)) if keep)


def _group_totals() -> dict:
    return {"sessions": set(), "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
            "ideal_cached_tokens": 0, "prompt_flops": 0.0, "saved_flops": 0.0}


def _group_rates(g: dict) -> dict:
    """A group's sums with its rates: token / FLOP hit rate and cached ÷ ideal."""
    out = dict(g, sessions=len(g["sessions"]))
    out["token_hit_rate"] = g["cached_tokens"] / g["prompt_tokens"] if g["prompt_tokens"] else None
    out["flop_hit_rate"] = g["saved_flops"] / g["prompt_flops"] if g["prompt_flops"] else None
    out["cached_over_ideal"] = (g["cached_tokens"] / g["ideal_cached_tokens"]
                                if g["ideal_cached_tokens"] else None)
    return out


def retain_prompt(cache: CacheManager, request_id: str, num_tokens: int,
                  ttl_class: str | None) -> int:
    """What the engine does once the prompt of the active request ``request_id`` is cached
    (``CacheManager.retain``): refresh the live retentions its path covers (a hit on a retained
    prefix) and, with ``ttl_class``, retain its first ``num_tokens`` tokens (rounded down to a
    block boundary) for that class (None: no breakpoint, refresh only). Returns the tokens of
    the request's path under a live retention afterwards (less than asked when the budget
    refused the rest)."""
    breakpoints = [(num_tokens, ttl_class)] if ttl_class is not None else []
    return cache.retain(request_id, breakpoints, num_prompt_tokens=num_tokens).num_retained_tokens


def retention_stats(cache: CacheManager) -> dict:
    """The cache's retention gauges and counters at the end of a replay (``/stats``'s
    ``retention`` object: retained blocks, refreshes, expiries, refused tokens, ...)."""
    return cache.retention_snapshot()


def replay(trace: Trace, policy_name: str, capacity_blocks: int, shape: CostShape,
           oracle: Oracle | None = None,
           progress: Callable[[int], None] | None = None,
           retention: Retention | None = None) -> dict:
    """Replay ``trace`` with ``policy_name`` on a pool of ``capacity_blocks`` blocks.

    With ``retention`` (``active``), every request of ``retention.sessions`` retains its prompt
    (rounded down to a block boundary, :func:`retain_prompt`) with ``retention.ttl_class``
    once its blocks are published, on the cache's clock (the trace's): a retention expires
    ``TTL_CLASSES[ttl_class]`` seconds of trace time after its last retain or hit (every
    request refreshes the retentions its path covers, as in the engine).

    Returns:
        ``policy``, ``capacity_blocks``, ``token_hit_rate``, ``flop_hit_rate``,
        ``evicted_blocks``, ``wall_s``, the raw sums behind them, and the policy's own cost
        (:func:`_eviction_timing.policy_cost`: ``policy_us_per_eviction`` and the rest); with
        ``retention`` also ``retention_active`` and ``groups``: per group of :data:`GROUPS`,
        its sessions, requests, prompt / cached / ideal cached tokens (``ideal_cached``),
        prompt / saved FLOPs, token and FLOP hit rates and cached ÷ ideal, and ``retention_stats``
        (the cache's retention counters at the end; active replays only).
    """
    start = time.perf_counter()
    clock = [0.0]
    bs = trace.block_size
    # The ghost list carries the policies' eviction notes besides the miss causes (``cost``
    # inherits a returning run's reuse history through it): 65,536 blocks, as many runs as
    # ``cost`` remembered when it kept a ghost of its own, whatever the pool size.
    cache = CacheManager(capacity_blocks, bs, eviction_policy="lru", clock=lambda: clock[0],
                         ghost_capacity=GHOST_BLOCKS)
    if policy_name in ORACLES:
        if oracle is None:
            raise ValueError(f"policies: {policy_name} needs the trace oracle")
        policy = make_policy(policy_name, model_shape=shape, next_use=oracle.next_use,
                             now=oracle.now)
    else:
        policy = make_policy(policy_name, model_shape=shape, **policy_kwargs(policy_name))
    timer = HookTimer()
    timer.install(policy)  # before the tree, which may keep bound hooks
    # The tree is empty: swap in the policy instance (oracles take constructor arguments), and
    # the ghost list with it (it hands forgotten runs' notes to the policy's on_ghost_drop).
    cache.tree = RadixTree(bs, policy, lambda: clock[0])
    cache.ghost = make_ghost_list(policy, GHOST_BLOCKS)
    # The retention table pins in the tree and reads its clock: rebuilt over the new tree.
    cache.retention = RetentionTable(
        cache.tree, capacity_blocks,
        max_retained_fraction=retention.max_retained_fraction if retention is not None else 0.5)
    cache.eviction_policy = policy_name
    roots: dict[str | None, bytes] = {}
    cached = prompt = skipped = 0
    saved = total = 0.0
    step = 0
    ideal = ideal_cached(trace) if retention is not None else None
    groups = {g: _group_totals() for g in GROUPS}
    retaining = retention.sessions if retention is not None else frozenset()
    retain = retention is not None and retention.active
    for i, req in enumerate(trace.requests):
        clock[0] = req.time_s
        if oracle is not None:
            oracle.current = i
        root = roots.get(req.salt)
        if root is None:
            root = roots[req.salt] = cache.identity_root(identity(trace, req.salt))
        pb = trace.prompt(req)
        m = cache.begin("r", root, pb, session_key=req.session)
        if cache.allocate("r", req.num_tokens):
            cache.publish("r", pb, req.num_tokens)
            if retain:  # every request refreshes; the retaining sessions' also retain
                retain_prompt(cache, "r", req.num_tokens,
                              retention.ttl_class if req.session in retaining else None)  # type: ignore[union-attr]
        else:
            m = 0
            skipped += 1
        cache.release("r", end_s=req.time_s + req.duration_s)
        cached += m
        prompt += req.num_tokens
        flops = prefill_flops(shape, 0, req.num_tokens)
        hit_flops = prefill_flops(shape, 0, m) if m else 0.0
        saved += hit_flops
        total += flops
        if ideal is not None:
            g = groups[GROUPS[0] if req.session in retaining else GROUPS[1]]
            g["sessions"].add(req.session)
            g["requests"] += 1
            g["prompt_tokens"] += req.num_tokens
            g["cached_tokens"] += m
            g["ideal_cached_tokens"] += ideal[i]
            g["prompt_flops"] += flops
            g["saved_flops"] += hit_flops
        step += 1
        if progress is not None and step == 256:
            progress(step)
            step = 0
    if progress is not None and step:
        progress(step)
    close = getattr(policy, "close", None)  # a background trainer, if the policy has one
    if callable(close):
        close()
    extra: dict = {}
    if retention is not None:
        extra = {"retention_active": retention.active,
                 "groups": {g: _group_rates(t) for g, t in groups.items()}}
        if retain:
            extra["retention_stats"] = retention_stats(cache)
    return extra | {
        "policy": policy_name, "capacity_blocks": capacity_blocks,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "flop_hit_rate": saved / total if total else 0.0,
        "evicted_blocks": cache.evicted_blocks_total,
        "wall_s": round(time.perf_counter() - start, 3),
        "requests": len(trace.requests), "skipped_requests": skipped,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prompt_flops": total, "saved_flops": saved,
    } | policy_cost(timer, policy, cache.evicted_blocks_total)


def plot(records: list[dict], infinite: dict, path, title: str) -> None:
    """Token and FLOP hit rate against capacity, one line per policy (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = list(dict.fromkeys(r["policy"] for r in records))
    for ax, key, label in ((axes[0], "token_hit_rate", "token hit rate"),
                           (axes[1], "flop_hit_rate", "FLOP hit rate (saved / prompt FLOPs)")):
        for name in policies:
            rows = sorted((r for r in records if r["policy"] == name),
                          key=lambda r: r["capacity_fraction"])
            style = "--" if name in ORACLES else "-"
            ax.plot([100 * r["capacity_fraction"] for r in rows], [r[key] for r in rows],
                    style, marker="o", markersize=3, label=name,
                    linewidth=2.2 if name == "cost" else 1.3)
        ax.axhline(infinite[key], color="grey", linestyle=":", label="infinite cache")
        ax.set_xlabel("capacity (% of distinct blocks)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

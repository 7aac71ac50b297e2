"""``radixkv bench tree``: cache-index throughput against the raw-hashing floor.

Replays a generated agent-like workload through the real ``CacheManager`` (tree + pool
bookkeeping, no model): a shared system prompt (default 2,048 tokens), sessions growing turn by
turn (each turn re-sends the whole history: the previous reply, then a tool output, as agents
do), replies generated token by token (the engine publishes each block as it fills), block size
16, and a pool holding only part of the distinct blocks so that eviction runs.

Operations, each timed around the cache-manager call that does it:

* ``match``: ``begin`` (pack the prompt, walk the tree comparing tokens, lock, classify the
  miss), per prompt block (``N // B``);
* ``insert``: ``publish`` calls that insert blocks (after prefill: the new prompt blocks;
  generated blocks as the engine publishes them: every ``--publish-interval-blocks`` blocks and
  the rest when the request ends), per new block; split into ``insert_prefill`` and
  ``insert_decode``;
* ``evict``: the whole eviction work an ``allocate`` does when the free list is short, per
  evicted block, one clock pair around the cache's eviction: the tree's trim, returning the
  blocks to the pool and recording them in the ghost list; ``evict_tree`` is the tree's part
  alone (``RadixTree.evict`` and ``take_tail_block``), timed in replays of its own that
  alternate with the others, so its clocks never land inside ``evict``;
* ``hash``: ``BlockHasher.hash_blocks`` over each prompt's packed tokens, per block;
* ``pack``: packing the prompt's Python ints as uint32-LE, once per request, per block.

Every prompt arrives as a list of fresh Python ints (as a tokenizer returns them) and is packed
once; the lookup, the floor and the inserts all work on those same token bytes (an engine keeps
each request's tokens packed, appending each sampled token).

The **floor**, measured in the same run on the same token bytes (interleaved with the lookups):
per block one chained xxh3-128 (``H(h || block bytes)``) and one dict probe against the hashes
of every block seen so far (what a hash-every-block index must at least do). ``ratio_to_floor``
= time per block of the operation ÷ time per block of the floor (below 1 is faster than the
floor). ``from_token_ids`` gives the match ratio when both sides start from the int lists
(each packs first): packing touches every Python int, which no index can avoid, and it bounds
that ratio from below.

Also the tree-size scaling check (the ``--scaling-*`` flags, ``scaling`` in the JSON): evicting 1,000
single blocks and 1,000 hits on leaves in the middle of the LRU order, in trees of 5k and 50k
one-block leaves; per-operation times and the ratio.

Targets (``TARGETS``, ``ratio_to_floor`` at most): match 0.25, insert 1.2, evict 1.0; tree-size
scaling ratios below 3.
The JSON records them with ``met`` per operation, and one line says whether each is met; the
exit code stays 0 (a benchmark reports, it does not fail). They were set on the default
workload; ``default_workload`` is false when a workload flag differs, and the result is then not
comparable with them.

Every flag is checked before any work; a bad value ends the run with a one-line error naming
the flag and exit code 2. The pool holds ``--capacity-fraction`` of the distinct blocks, but
never fewer than the largest request needs (its prompt and reply blocks, plus one).

Usage::

    radixkv bench tree [--sessions 48] [--turns 10] [--json out.json]
"""

# No ``from __future__ import annotations``: the CLI loads this file by path (see bench/serve.py).
import argparse
import gc
import json
import random
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from radixkv.cache.hashing import BlockHasher, CacheIdentity, pack_tokens
from radixkv.cache.manager import CacheManager
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import get_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Flags, their checks and the targets (re-exported: the CLI calls add_arguments and run).
from _tree_args import (  # noqa: E402,F401
    DEFAULT_WORKLOAD,
    HISTORY_TOKENS,
    REPLY_TOKENS,
    SCALING_MAX_RATIO,
    TARGETS,
    TOOL_TOKENS,
    add_arguments,
    check_args,
    usage_error,
)

VOCAB = 49152
@dataclass
class Turn:
    """One request of the workload: the prompt (fresh int objects) and the reply to generate."""

    session: int
    prompt: list
    reply: list


def make_workload(sessions: int, turns: int, system_tokens: int, seed: int) -> list:
    """Interleaved agent turns: each prompt is system + the session's whole history so far."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(system_tokens)]
    history = [[rng.randrange(VOCAB) for _ in range(rng.randint(*HISTORY_TOKENS))]
               for _ in range(sessions)]
    left = [turns] * sessions
    out = []
    while any(left):
        s = rng.choice([i for i, n in enumerate(left) if n])
        left[s] -= 1
        reply = [rng.randrange(VOCAB) for _ in range(rng.randint(*REPLY_TOKENS))]
        # Fresh int objects, as a tokenizer returns them (no identity shortcuts in comparisons).
        out.append(Turn(s, array("I", system + history[s]).tolist(), reply))
        history[s] += reply + [rng.randrange(VOCAB) for _ in range(rng.randint(*TOOL_TOKENS))]
    return out


def _floor(data: bytes, block_size: int, index: dict) -> None:
    """Per block of packed tokens: one chained xxh3-128 and one dict probe (the floor)."""
    step = 4 * block_size
    fn, probe = xxhash.xxh3_128_digest, index.get
    h = b"\0" * 16
    for start in range(0, len(data) - step + 1, step):
        h = fn(h + data[start : start + step])
        probe(h)


def _floor_index_add(data: bytes, block_size: int, index: dict) -> None:
    step = 4 * block_size
    h = b"\0" * 16
    for start in range(0, len(data) - step + 1, step):
        h = xxhash.xxh3_128_digest(h + data[start : start + step])
        index[h] = True


OPS = ("pack", "floor", "match", "insert_prefill", "insert_decode", "evict", "evict_tree", "hash")


def replay(workload: list, block_size: int, num_blocks: int, policy: str,
           publish_interval: int = 16, time_tree: bool = False) -> dict:
    """Run the workload through a CacheManager; return per-operation times and block counts.

    Each prompt arrives as a list of fresh Python ints (as from a tokenizer) and is packed
    once (``pack``, timed apart); the lookup, the floor and the inserts then work on the same
    packed bytes, as an engine that keeps each request's tokens packed does. ``time_tree``:
    time the tree's eviction calls alone (``evict_tree``) instead of the cache's whole
    eviction (``evict``), so neither's clocks land inside the other.
    """
    cm = CacheManager(num_blocks, block_size, eviction_policy=policy)
    root = cm.identity_root(CacheIdentity("bench-rev", block_size, "bfloat16", "theta=1e4"))
    ns = dict.fromkeys(OPS, 0)
    blocks = dict.fromkeys(OPS, 0)
    clock = time.perf_counter_ns

    if time_tree:
        # ``evict_tree``: the tree's call alone (a replay of its own, so this wrapper's clock
        # pair and bookkeeping never land inside ``evict``).
        tree_evict, take_tail_block = cm.tree.evict, cm.tree.take_tail_block

        def timed_tree_evict(num, evicted=None, freed=None):
            t = clock()
            freed = tree_evict(num, evicted, freed)
            ns["evict_tree"] += clock() - t
            blocks["evict_tree"] += len(freed)
            return freed

        def timed_take_tail_block():
            t = clock()
            taken = take_tail_block()
            ns["evict_tree"] += clock() - t
            blocks["evict_tree"] += taken is not None
            return taken

        cm.tree.evict, cm.tree.take_tail_block = timed_tree_evict, timed_take_tail_block
    else:
        # ``evict``: one clock pair around the cache's whole eviction (the tree's trim, the
        # pool's free, the ghost-list entry, the counters), as ``allocate`` calls it.
        cache_evict = cm._evict

        def timed_evict(num):
            t = clock()
            num = cache_evict(num)
            ns["evict"] += clock() - t
            blocks["evict"] += num
            return num

        cm._evict = timed_evict
    hasher = BlockHasher()
    floor_index: dict = {}
    cached_tokens = prompt_tokens = 0
    bs = block_size
    for i, turn in enumerate(workload):
        rid = f"r{i}"
        prompt = turn.prompt
        n_blocks = len(prompt) // bs
        t = clock()
        packed = pack_tokens(prompt)
        ns["pack"] += clock() - t
        blocks["pack"] += n_blocks
        t = clock()
        _floor(packed, bs, floor_index)
        ns["floor"] += clock() - t
        blocks["floor"] += n_blocks
        t = clock()
        m = cm.begin(rid, root, packed)
        cm.record_admission(rid)
        ns["match"] += clock() - t
        blocks["match"] += n_blocks
        t = clock()
        hasher.hash_blocks(b"\0" * 16, packed[: n_blocks * 4 * bs], bs)
        ns["hash"] += clock() - t
        blocks["hash"] += n_blocks
        _floor_index_add(packed, bs, floor_index)
        cached_tokens += m
        prompt_tokens += len(prompt)
        if not cm.allocate(rid, len(prompt)):  # run() sizes the pool for the largest request
            raise RuntimeError(f"bench tree: {num_blocks} pool blocks cannot hold request {i}")
        t = clock()
        cm.publish(rid, packed, len(prompt))
        ns["insert_prefill"] += clock() - t
        blocks["insert_prefill"] += n_blocks - m // bs
        # The engine appends each sampled token to the request's packed buffer as it arrives.
        seq = packed + pack_tokens(turn.reply)
        num_seq = len(prompt) + len(turn.reply)
        # Decode: the token sampled at position p is computed by the next step. As the engine
        # does, generated blocks are published in batches of ``publish_interval`` (the step
        # that completes the last block of a batch publishes it) and the rest when the request
        # ends.
        publish_at = (len(prompt) // bs + publish_interval) * bs
        for end in range((len(prompt) // bs + 1) * bs, num_seq, bs):
            if not cm.allocate(rid, end + 1):
                raise RuntimeError(f"bench tree: {num_blocks} pool blocks cannot hold request {i}")
            blocks["insert_decode"] += 1
            if end >= publish_at:
                t = clock()
                cm.publish(rid, seq, end)
                ns["insert_decode"] += clock() - t
                publish_at = (end // bs + publish_interval) * bs
        t = clock()
        cm.publish(rid, seq, num_seq - 1)  # the request finished: publish the rest
        ns["insert_decode"] += clock() - t
        cm.release(rid)
    if time_tree:
        del cm.tree.evict, cm.tree.take_tail_block  # the methods again
    else:
        del cm._evict
    cm.check_integrity()
    return {"ns": ns, "blocks": blocks, "requests": len(workload),
            "token_hit_rate": cached_tokens / prompt_tokens,
            "evicted_blocks_total": cm.evicted_blocks_total, "miss_tokens": cm.miss_tokens}


def scaling_check(num_leaves: int, num_ops: int, seed: int = 0) -> dict:
    """Evict ``num_ops`` single blocks, then hit ``num_ops`` mid-order leaves, in an LRU tree."""
    ticks = iter(range(10**12))
    tree = RadixTree(4, get_policy("lru"), clock=lambda: float(next(ticks)))
    hasher = BlockHasher()
    root = tree.root(b"scaling")
    for i in range(num_leaves):
        tree.lock(root)
        r = tree.insert(root, [i + 1, 0, 0, 0], [i], hasher)
        tree.unlock(r.node)
    rng = random.Random(seed)
    order = sorted(tree.leaves.nodes.values(), key=lambda n: n.leaf_entry)
    middle = order[len(order) // 3 : 2 * len(order) // 3]
    targets = [bytes(n.tokens) for n in rng.sample(middle, num_ops)]
    t = time.perf_counter_ns()
    for _ in range(num_ops):
        tree.evict(1)
    evict_ns = time.perf_counter_ns() - t
    t = time.perf_counter_ns()
    for packed in targets:
        tree.match(root, packed, 1)
    hit_ns = time.perf_counter_ns() - t
    return {"num_leaves": num_leaves, "evict_us_per_op": evict_ns / num_ops / 1e3,
            "hit_us_per_op": hit_ns / num_ops / 1e3}


def pool_blocks(workload: list, block_size: int, system_tokens: int,
                capacity_fraction: float) -> tuple[int, int, int]:
    """``(pool blocks, distinct blocks, largest request's blocks)`` for a workload.

    The pool is ``capacity_fraction`` of the distinct blocks (the shared system prompt once,
    then each session's own tokens), but at least the largest request's prompt and reply blocks
    plus one: a smaller pool could not serve that request however much it evicted.
    """
    distinct = system_tokens // block_size + sum(
        (len(t.prompt) - system_tokens + len(t.reply)) // block_size
        for t in _last_turns(workload).values())
    largest = max(-(-(len(t.prompt) + len(t.reply)) // block_size) for t in workload)
    return max(int(distinct * capacity_fraction), largest + 1), distinct, largest


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark per ``args``, print a table, write ``--json``; returns the results.

    Raises:
        SystemExit: code 2 with a one-line message naming the flag when :func:`check_args`
            finds a problem (before any work).
    """
    problem = check_args(args)
    if problem is not None:
        usage_error(problem)
    bs = args.block_size
    workload = make_workload(args.sessions, args.turns, args.system_tokens, args.seed)
    num_blocks, distinct, largest = pool_blocks(workload, bs, args.system_tokens,
                                                args.capacity_fraction)
    runs, tree_runs = [], []
    for i in range(2 * args.repeat):
        gc.collect()
        gc.disable()
        try:  # alternate: every op but the tree's own eviction time, then that alone
            (tree_runs if i % 2 else runs).append(
                replay(workload, bs, num_blocks, args.policy, args.publish_interval_blocks,
                       time_tree=bool(i % 2)))
        finally:
            gc.enable()
    res = runs[0]
    ns = {op: min(r["ns"][op] for r in runs) for op in res["ns"]}
    ns["evict_tree"] = min(r["ns"]["evict_tree"] for r in tree_runs)
    blocks = res["blocks"]
    blocks["evict_tree"] = tree_runs[0]["blocks"]["evict_tree"]
    ns["insert"] = ns["insert_prefill"] + ns["insert_decode"]
    blocks["insert"] = blocks["insert_prefill"] + blocks["insert_decode"]
    per_block = {op: ns[op] / blocks[op] for op in ns if blocks[op]}
    floor_ns = per_block["floor"]
    ops = ("match", "insert", "evict", "evict_tree", "hash", "insert_prefill", "insert_decode",
           "pack")
    ratio = {op: per_block[op] / floor_ns for op in ops if op in per_block}
    workload_flags = {name: getattr(args, name) for name in DEFAULT_WORKLOAD}
    out: dict[str, Any] = {
        "workload": {"sessions": args.sessions, "turns": args.turns, "block_size": bs,
                     "system_tokens": args.system_tokens, "requests": res["requests"],
                     "distinct_blocks": distinct, "pool_blocks": num_blocks,
                     "capacity_fraction": args.capacity_fraction,
                     "largest_request_blocks": largest,
                     "policy": args.policy, "seed": args.seed, "repeat": args.repeat,
                     "publish_interval_blocks": args.publish_interval_blocks},
        "default_workload": workload_flags == DEFAULT_WORKLOAD,
        "blocks": {op: blocks[op] for op in ops},
        "blocks_per_s": {op: 1e9 / per_block[op] for op in ops if op in per_block},
        "floor_blocks_per_s": 1e9 / floor_ns,
        "ratio_to_floor": ratio,
        "targets": dict(TARGETS),
        "met": {op: ratio[op] <= target for op, target in TARGETS.items()},
        # Both sides starting from lists of Python ints (each packs the prompt first).
        "from_token_ids": {
            "match_blocks_per_s": 1e9 / (per_block["match"] + per_block["pack"]),
            "floor_blocks_per_s": 1e9 / (floor_ns + per_block["pack"]),
            "match_ratio_to_floor": (per_block["match"] + per_block["pack"])
            / (floor_ns + per_block["pack"]),
        },
        "token_hit_rate": res["token_hit_rate"],
        "evicted_blocks_total": res["evicted_blocks_total"],
        "miss_tokens": res["miss_tokens"],
    }
    if not args.skip_scaling:
        scaling_runs = []
        for n in args.scaling_sizes:  # fastest of ``repeat`` trials per size
            trials = [scaling_check(n, args.scaling_ops, args.seed) for _ in range(args.repeat)]
            scaling_runs.append({"num_leaves": n,
                             "evict_us_per_op": min(t["evict_us_per_op"] for t in trials),
                             "hit_us_per_op": min(t["hit_us_per_op"] for t in trials)})
        runs = scaling_runs
        evict_ratio = runs[-1]["evict_us_per_op"] / runs[0]["evict_us_per_op"]
        hit_ratio = runs[-1]["hit_us_per_op"] / runs[0]["hit_us_per_op"]
        out["scaling"] = {"runs": runs, "evict_ratio": evict_ratio, "hit_ratio": hit_ratio,
                      "max_ratio": SCALING_MAX_RATIO,
                      "met": {"evict": evict_ratio < SCALING_MAX_RATIO,
                              "hit": hit_ratio < SCALING_MAX_RATIO}}
    _print(out)
    if args.json:
        from _provenance import provenance

        out["provenance"] = provenance()
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


def _last_turns(workload: list) -> dict:
    last: dict = {}
    for t in workload:
        last[t.session] = t
    return last


def _print(out: dict) -> None:
    w = out["workload"]
    print(f"bench tree: {w['requests']} requests, {w['sessions']} sessions x {w['turns']} turns, "
          f"B={w['block_size']}, pool {w['pool_blocks']} of {w['distinct_blocks']} distinct "
          f"blocks, policy {w['policy']}, token hit rate {out['token_hit_rate']:.3f}, "
          f"evicted {out['evicted_blocks_total']} blocks")
    print(f"{'op':16s} {'blocks':>9s} {'blocks/s':>12s} {'ratio_to_floor':>15s}")
    print(f"{'floor':16s} {'':>9s} {out['floor_blocks_per_s']:12.0f} {1.0:15.3f}")
    for op, rate in out["blocks_per_s"].items():
        print(f"{op:16s} {out['blocks'][op]:9d} {rate:12.0f} {out['ratio_to_floor'][op]:15.3f}")
    f = out["from_token_ids"]
    print(f"from token-id lists (both pack first): match {f['match_blocks_per_s']:.0f} blocks/s, "
          f"floor {f['floor_blocks_per_s']:.0f} blocks/s, ratio {f['match_ratio_to_floor']:.3f}")
    print(f"miss tokens: {out['miss_tokens']}")
    if "scaling" in out:
        for r in out["scaling"]["runs"]:
            print(f"tree size {r['num_leaves']:>6d} leaves: evict {r['evict_us_per_op']:.2f} us/op, "
                  f"hit {r['hit_us_per_op']:.2f} us/op")
        c = out["scaling"]
        print(f"tree-size scaling, largest/smallest: evict {c['evict_ratio']:.2f} "
              f"({_met(c['met']['evict'])}), hit {c['hit_ratio']:.2f} ({_met(c['met']['hit'])}); "
              f"target < {c['max_ratio']:g}")
    print(targets_line(out))


def _met(met: bool) -> str:
    return "met" if met else "NOT met"


def targets_line(out: dict) -> str:
    """One line: each target (``ratio_to_floor`` at most), this run's ratio, met or not."""
    parts = [f"{op} {out['ratio_to_floor'][op]:.3f} (<= {target:g}) {_met(out['met'][op])}"
             for op, target in out["targets"].items()]
    line = "targets (ratio_to_floor): " + ", ".join(parts)
    if not out["default_workload"]:
        line += " (set on the default workload; this run's differs, so not comparable)"
    return line

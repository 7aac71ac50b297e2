"""Between the radix tree and the store tier: what a lookup asks the store, what a load inserts,
what a publish or an eviction writes. Functions over the manager's per-request state; the
manager's facade (``store_begin`` / ``store_ready`` / ``store_finish``) calls them.

Read: when the device match of a text prompt ends at block k below the hit cap, the chained
hashes of blocks k, k+1, … (up to the cap, at most one load's worth) are computed from block k's
hash — reusing those the ghost list recovered — and handed to the tier; it is the only place a
lookup hashes anything, and ``publish`` reuses these hashes, so each block is still hashed once.
When the load is done, the verified leading run is copied into newly allocated pool blocks and
published into the tree exactly as computed blocks are; its tokens count as cached (tier
``store``). The prompt's missed tokens are relabelled: loaded tokens leave the miss breakdown
(``evicted`` first, then ``cold``, then ``isolated``), tokens the store held but could not serve
become ``store_timeout`` or ``store_rejected``.

Multimodal prompts are not looked up or written (their extras would have to travel with the
key's inputs; they are rare in agent traffic): they compute as before.
"""

from __future__ import annotations

from typing import Callable

from radixkv.cache.request_state import RequestState
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.tree.node import Node

#: Miss causes a store hit can take tokens from, in the order a prompt's blocks fall into them
#: after the device match (``classify_miss``: evicted runs first, then cold).
_RELABEL_FROM = ("evicted", "cold", "isolated")


def start_load(tier: StoreTier, req: RequestState, request_id: str, hash_blocks: Callable,
               pb: bytes, num_prompt_tokens: int, block_size: int) -> bool:
    """Queue the store lookup of the blocks after ``req``'s device match; False: none queued.

    Args:
        hash_blocks: ``BlockHasher.hash_blocks``.
        pb: The prompt, packed (uint32-LE).
        num_prompt_tokens: N (the hit cap is ``(N - 1) // B`` blocks).
    """
    if req.mm_items or req.root is None:
        return False
    start = req.num_published_blocks
    num = min((num_prompt_tokens - 1) // block_size - start, tier.max_blocks_per_load)
    if num <= 0:
        return False
    bb = 4 * block_size
    known = req.known_hashes if req.known_start == start else []
    hashes = list(known[:num])
    if len(hashes) < num:
        parent = hashes[-1] if hashes else req.last_hash
        hashes += hash_blocks(parent, pb[(start + len(hashes)) * bb : (start + num) * bb],
                              block_size)
    # publish() reuses these for the very tokens compared here (see RequestState.known_*).
    req.known_hashes, req.known_start, req.known_tokens = hashes, start, pb
    return tier.start_load(request_id, req.root.root_hash, req.last_hash, hashes,
                           pb[start * bb : (start + num) * bb], start)


def finish_load(tier: StoreTier, req: RequestState, request_id: str,
                take_blocks: Callable[[int], list[int] | None], room: Callable[[], int],
                publish_tokens: Callable[[int], None], block_size: int) -> int:
    """Insert the request's verified store blocks into the pool and the tree.

    Args:
        take_blocks: The manager's allocator (evicts through the policy when short).
        room: Blocks free or evictable now (when short, the leading run that fits is loaded).
        publish_tokens: Publishes the request's first n tokens (``CacheManager.publish``).

    Returns:
        Tokens served from the store (0 on a timeout, an error, a miss or no room).
    """
    job = tier.finish(request_id)
    if not job.done:  # timed out: what the store held (all it was asked, if it never said)
        asked = job.num_present if job.num_present >= 0 else len(job.hashes)
        _relabel(req, asked * block_size, "store_timeout")
        return 0
    if job.num_rejected:
        _relabel(req, job.num_rejected * block_size, "store_rejected")
    num = len(job.slots)
    if num == 0:
        return 0
    ids = take_blocks(num)
    while ids is None and num > 1:  # the pool is short: load the leading part it can hold
        num = min(num - 1, room())
        ids = take_blocks(num) if num > 0 else None
    if ids is None:  # no room at all now: compute instead
        tier.discard(job)
        return 0
    tier.copy_into(job, ids)
    req.block_table.extend(ids)
    start = req.num_published_blocks
    publish_tokens((start + num) * block_size)
    num_tokens = num * block_size
    req.num_cached_tokens = (start + num) * block_size
    _relabel(req, num_tokens, None)
    return num_tokens


def _relabel(req: RequestState, num_tokens: int, cause: str | None) -> None:
    """Move ``num_tokens`` missed tokens from the causes a store lookup covers to ``cause``
    (None: they were served, no longer missed)."""
    miss = req.miss
    for source in _RELABEL_FROM:
        n = min(num_tokens, miss[source])
        miss[source] -= n
        num_tokens -= n
        if cause is not None:
            miss[cause] += n
        if not num_tokens:
            return


def write_published(tier: StoreTier, root_hash: bytes, node: Node, count: int, *,
                    defer: bool = True) -> None:
    """Write the last ``count`` blocks of ``node`` (just published) to the store."""
    bb = 4 * node.block_size
    n = len(node.block_ids)
    first = n - count
    parent = (node.block_hash(first - 1) if first
              else node.parent.end_hash)  # type: ignore[union-attr]  # a published node is no root
    tier.write(root_hash, parent, node.hash_list(first), bytes(node.tokens[first * bb :]),
               node.block_ids[first:], node.depth_tokens // node.block_size + first, defer=defer)


def write_trimmed(tier: StoreTier, node: Node, take: int) -> None:
    """The last ``take`` blocks of ``node`` are about to be evicted: write them (``evict``
    mode), or gather the ones still waiting for a write slot (``all`` mode)."""
    if tier.write_mode == "all":
        tier.on_trim(node.block_ids[-take:])
        return
    root = node
    while root.parent is not None:
        root = root.parent
    write_published(tier, root.root_hash, node, take, defer=False)

"""Why prompt tokens missed the cache: cold, evicted, isolated, unaligned tail.

For a prompt of N tokens whose lookup returned ``m`` cached tokens (a multiple of B), the
``N - m`` missed tokens are split into four causes that always add up to ``N - m``:

* ``unaligned_tail``: tokens past the hit cap ``floor((N-1)/B)*B``, which no cache could serve
  (the partial last block, or the last full block when N is a multiple of B: at least the last
  prompt token is always computed).
* ``evicted``: full blocks right after the hit that were evicted recently. The **ghost list**
  remembers each eviction (a run trimmed off a leaf's tail) under the exact hash input of its
  first block (``parent hash || packed tokens || extras``) with the run's tokens, extras and
  chained hashes, in a bounded FIFO (capacity in blocks). A lookup probes it once per evicted
  run and compares the prompt with the run in one ``memcmp``, hashing nothing; the hashes it
  recovers are handed to ``publish``, which then need not hash those blocks again.
* ``isolated``: on a complete miss (``m == 0``, not evicted) the same first block is cached
  under *another* identity (another tenant, adapter or revision): found through the tree's
  root-child key index in O(1), then the other identity's match length is measured (at most
  ``MAX_ISOLATION_ROOTS`` roots, compare only). Partial hits are never called isolated.
* ``cold``: the remaining full blocks (never seen, or evicted long enough ago to leave the
  ghost list).
* ``store_timeout`` / ``store_rejected`` (with a store tier, ``radixkv.cache.store``): blocks
  the store held that were computed instead, because the load passed its deadline or a value
  failed its header or checksum check. Blocks the store served are hits, not misses.
* ``window_evicted`` (window-bounded residency, ``radixkv.cache.window_cache``): blocks the
  token match covered whose window-layer K/V was no longer cached, so the hit ends at an
  earlier boundary and they are computed again.

The breakdown is computed at every lookup but counted once per request, at admission
(``CacheManager.record_admission``): a request waiting for blocks looks up again each step.
"""

from __future__ import annotations

from typing import Sequence

from radixkv.cache.ghost import GhostList, GhostRun
from radixkv.cache.tree.compare import matching_blocks, walk
from radixkv.cache.tree.node import HashRun, Node, child_key
from radixkv.cache.tree.radix_tree import RadixTree

__all__ = ["MISS_CAUSES", "GhostList", "GhostRun", "classify_miss", "empty_breakdown",
           "move_to_window_evicted"]

MISS_CAUSES = ("cold", "evicted", "isolated", "unaligned_tail", "store_timeout", "store_rejected",
               "window_evicted")
#: Other identities examined for an isolated miss (bounds the lookup cost with many tenants).
MAX_ISOLATION_ROOTS = 4


def empty_breakdown() -> dict[str, int]:
    """``{cause: 0}`` for every miss cause."""
    return dict.fromkeys(MISS_CAUSES, 0)


def classify_miss(tree: RadixTree, root: Node, pb: bytes, px: Sequence[bytes] | None,
                  num_prompt_tokens: int, num_matched_blocks: int, last_hash: bytes,
                  ghost: GhostList) -> tuple[dict[str, int], Sequence[bytes], list[tuple]]:
    """Split a lookup's missed tokens by cause; hashes nothing.

    Args:
        tree: The radix tree.
        root: The request's identity root.
        pb: The prompt's packed tokens (at least every full block below the hit cap).
        px: Extras per full block of the prompt, or None.
        num_prompt_tokens: N.
        num_matched_blocks: Blocks the lookup returned.
        last_hash: Chained hash of the last matched block (the root hash on a miss).
        ghost: Recently evicted blocks.

    Returns:
        ``(breakdown, hashes, notes)``: tokens per cause (summing to ``N - m``), the chained
        hashes of the evicted blocks ``num_matched_blocks, …`` found in the ghost list (for
        ``insert(known_hashes=…)``: a :class:`HashRun`, or an empty list), and ``(block
        position of its last block, note, run)`` for each evicted run (a :class:`GhostRun`) the
        prompt holds whole whose policy note is not None (for ``insert(ghost_notes=…)`` and
        :meth:`GhostList.came_back`).
    """
    bs = tree.block_size
    bb = tree.block_bytes
    cap_blocks = (num_prompt_tokens - 1) // bs
    missing = cap_blocks - num_matched_blocks
    notes: list[tuple] = []
    if missing <= 0:
        return {"cold": 0, "evicted": 0, "isolated": 0,
                "unaligned_tail": num_prompt_tokens - cap_blocks * bs, "store_timeout": 0,
                "store_rejected": 0, "window_evicted": 0}, [], notes
    i, h, bb_x = num_matched_blocks, last_hash, b""
    recovered = bytearray()  # the recovered blocks' hashes, one buffer (no object per block)
    evicted = w = 0
    while len(ghost) and i < cap_blocks:
        if px is not None:
            bb_x = px[i]
        parts = ghost.parts(h + pb[i * bb : (i + 1) * bb] + bb_x)
        if parts is None:
            break
        # Compare part by part (an entry's runs are not joined: see _Chain). The probe's key
        # proved the first part's first block; later parts' first blocks are compared too.
        for n, run in enumerate(parts):
            run_hb, w = run.hash_bytes, run.hash_size
            run_blocks = len(run_hb) // w
            j = matching_blocks(pb, i * bb, run.tokens, run.extras, px,
                                min(run_blocks, cap_blocks - i), bb, 0 if n else 1)
            recovered += run_hb if j == run_blocks else memoryview(run_hb)[: j * w]
            evicted += j
            i += j
            if j < run_blocks:
                break
            if run.note is not None:
                notes.append((i - 1, run.note, run))
        else:
            last = parts[-1]
            h = b"" + last.hash_bytes[-last.hash_size :]
            continue
        break
    hashes: Sequence[bytes] = HashRun(bytes(recovered), w) if evicted else []
    isolated = 0
    if evicted == 0 and num_matched_blocks == 0:
        key = child_key(pb[:bb], px[0] if px is not None else b"")
        for other in tree.roots_holding(key, root, MAX_ISOLATION_ROOTS):
            isolated = max(isolated, walk(other, pb, px, cap_blocks, bb)[1])
    return {"cold": (missing - evicted - isolated) * bs, "evicted": evicted * bs,
            "isolated": isolated * bs,
            "unaligned_tail": num_prompt_tokens - cap_blocks * bs, "store_timeout": 0,
            "store_rejected": 0, "window_evicted": 0}, hashes, notes


def move_to_window_evicted(breakdown: dict[str, int], num_tokens: int) -> None:
    """Relabel ``num_tokens`` missed tokens right after the hit as ``window_evicted`` (the token
    match covered them; the window layers' K/V was gone): taken from ``cold`` first, then
    ``evicted`` (a lookup classified them as if the match had stopped at the hit)."""
    for cause in ("cold", "evicted"):
        moved = min(num_tokens, breakdown[cause])
        breakdown[cause] -= moved
        breakdown["window_evicted"] += moved
        num_tokens -= moved

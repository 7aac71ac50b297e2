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

The breakdown is computed at every lookup but counted once per request, at admission
(``CacheManager.record_admission``): a request waiting for blocks looks up again each step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Sequence

from radixkv.cache.tree.compare import matching_blocks, walk
from radixkv.cache.tree.node import GhostRun, Node, child_key
from radixkv.cache.tree.node import ghost_run_from_tuple as _ghost_run
from radixkv.cache.tree.radix_tree import RadixTree

__all__ = ["MISS_CAUSES", "GhostList", "GhostRun", "classify_miss", "empty_breakdown"]

MISS_CAUSES = ("cold", "evicted", "isolated", "unaligned_tail", "store_timeout", "store_rejected")
#: Other identities examined for an isolated miss (bounds the lookup cost with many tenants).
MAX_ISOLATION_ROOTS = 4


class _Chain:
    """A ghost entry: evicted runs that continue one another.

    A leaf is evicted tail first, often one block per allocation during decode, so the runs of
    one leaf arrive in reverse token order. Each new run that ends where the entry begins is
    appended to ``newest_first`` instead of making a new entry, so eviction stays O(1) per run
    and a lookup probes the dict once per chain and compares the runs in token order
    (``parts()``), copying nothing.
    """

    __slots__ = ("parent_hash", "newest_first", "num_blocks")

    def __init__(self, parent_hash: bytes, run: GhostRun) -> None:
        self.parent_hash = parent_hash
        self.newest_first = [run]
        self.num_blocks = len(run.hashes)

    def parts(self) -> list[GhostRun]:
        """The entry's runs in token order."""
        return self.newest_first[::-1]


def _joined(parts: list[GhostRun]) -> GhostRun:
    """Runs in token order as one run (inspection; lookups compare the parts)."""
    hashes: list[bytes] = []
    for part in parts:
        hashes += part.hashes
    extras = None
    if any(part.extras is not None for part in parts):
        extras = []
        for part in parts:
            extras += part.extras if part.extras is not None else [b""] * len(part.hashes)
    return GhostRun(b"".join([part.tokens for part in parts]), hashes, extras)


class GhostList:
    """Bounded FIFO of recently evicted runs, keyed by their first block's hash input.

    The key ``parent hash || packed tokens || extras`` is exactly what ``H`` hashed for that
    block, so a lookup can tell "this very block was evicted" and recover its chained hash
    without hashing. A run evicted just before the run an entry starts with (the same leaf
    trimmed again) extends that entry instead of adding one (see :class:`_Chain`).

    Runs carrying a policy note are tracked until they come back (:meth:`came_back`) or are
    forgotten: the notes of runs forgotten for capacity without having come back go to
    ``on_drop`` (the eviction policy's ``on_ghost_drop``: a "not reused within the ghost
    horizon" label).

    Args:
        capacity: Most blocks remembered (> 0); the oldest entries are forgotten first.
        on_drop: Called as ``on_drop(notes)`` (a non-empty list, oldest first) when entries are
            forgotten for capacity holding noted runs that did not come back; None: nobody.
    """

    def __init__(self, capacity: int, on_drop: Callable[[list], None] | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"ghost_capacity: must be positive, got {capacity}")
        self.capacity = capacity
        self.on_drop = on_drop
        self.num_blocks = 0
        self._runs: OrderedDict[bytes, _Chain] = OrderedDict()
        # Parent hash of an entry's first block -> the entry's key (to extend it in front).
        self._by_parent: dict[bytes, bytes] = {}
        # id(run) -> run, for runs held here whose note is not None and that have not come
        # back (ids are stable while this dict holds the run).
        self._noted: dict[int, GhostRun] = {}

    def __len__(self) -> int:
        """Entries remembered."""
        return len(self._runs)

    def get(self, key: bytes) -> GhostRun | None:
        """The evicted run whose first block had hash input ``key``, or None."""
        chain = self._runs.get(key)
        return _joined(chain.parts()) if chain is not None else None

    def parts(self, key: bytes) -> list[GhostRun] | None:
        """The entry whose first block had hash input ``key`` as its runs in token order (each
        a whole run, the first starting at that block), or None."""
        chain = self._runs.get(key)
        return chain.parts() if chain is not None else None

    def came_back(self, runs: Iterable[GhostRun]) -> None:
        """These runs (from :meth:`parts`) were inserted into the tree again, their notes handed
        to the policy's ``on_ghost_hit``: forgetting them later is no "not reused" label."""
        noted = self._noted
        for run in runs:
            if noted.get(id(run)) is run:
                del noted[id(run)]

    def _dropped_notes(self, chain: _Chain, skip_first: bool = False) -> list:
        """Notes of the chain's runs that did not come back (the chain is being forgotten),
        oldest eviction first; ``skip_first``: its first run (in token order) is being evicted
        again, so it came back."""
        noted = self._noted
        chain_runs = chain.newest_first  # evicted oldest first; the last starts the chain
        notes = []
        for run in chain_runs[:-1] if skip_first else chain_runs:
            if noted.pop(id(run), None) is not None:
                notes.append(run.note)
        if skip_first:
            noted.pop(id(chain_runs[-1]), None)
        return notes

    def add(self, evicted: Iterable[tuple[bytes, tuple]]) -> None:
        """Remember evicted runs ``(first block's hash input, (tokens, hashes, extras[, note]))``.

        Forgets the oldest entries beyond the capacity. Every allocation that evicts calls this
        (most with one run of one block, extending the entry its leaf's previous eviction made):
        kept to a few dict operations per run.
        """
        dropped: list = []
        added = 0
        for key, run in evicted:
            if type(run) is not GhostRun:
                run = GhostRun(*run)
            hashes = run[1]
            if run[3] is not None:
                self._noted[id(run)] = run
            replaced = self._link(key, run, key[: len(hashes[0])], hashes[-1], len(hashes))
            if replaced:
                dropped += replaced
            added += len(hashes)
        self._grew(added, dropped)

    def add_block(self, parent_hash: bytes, tokens: bytearray, block_hash: bytes) -> None:
        """:meth:`add` of one evicted text block with no note (a decode step's eviction: the
        commonest), given apart: its parent's chained hash, packed tokens, chained hash."""
        run = _ghost_run((tokens, [block_hash], None, None))
        self._grew(1, self._link(parent_hash + tokens, run, parent_hash, block_hash, 1))

    def _link(self, key: bytes, run: GhostRun, parent_hash: bytes, last_hash: bytes,
              num: int) -> list | None:
        """Enter a run of ``num`` blocks under ``key``: it extends the entry that begins right
        after its last block (hash ``last_hash``) if there is one, else starts an entry. Returns
        the notes dropped when it replaces an entry (see :meth:`_replace`), else None."""
        runs, by_parent = self._runs, self._by_parent
        next_key = by_parent.pop(last_hash, None)
        if next_key is not None:  # this run ends where that entry begins: extend it
            chain = runs.pop(next_key)
            chain.newest_first.append(run)
            chain.parent_hash = parent_hash
            chain.num_blocks += num
        else:
            chain = _Chain(parent_hash, run)
        old = runs.setdefault(key, chain)
        by_parent[parent_hash] = key
        if old is not chain:  # that very block is evicted again: so it had come back
            return self._replace(key, old, chain)
        return None

    def _grew(self, num_added: int, dropped: list | None) -> None:
        """Count ``num_added`` blocks, forget the oldest entries beyond the capacity, hand the
        notes dropped on the way to ``on_drop``."""
        self.num_blocks += num_added
        if self.num_blocks > self.capacity:
            dropped = (dropped or []) + self._forget_oldest()
        if dropped and self.on_drop is not None:
            self.on_drop(dropped)

    def _replace(self, key: bytes, old: _Chain, chain: _Chain) -> list:
        """A run whose first block is ``old``'s first block was evicted again (so ``old`` had
        come back): ``chain`` takes its key, at the newest end; returns the notes of ``old``'s
        other runs, which did not come back."""
        self.num_blocks -= old.num_blocks
        dropped = self._dropped_notes(old, skip_first=True) if self._noted else []
        runs = self._runs
        del runs[key]
        runs[key] = chain
        return dropped

    def _forget_oldest(self) -> list:
        """Forget the oldest entries until at most ``capacity`` blocks are held; return the
        notes of their runs that did not come back, oldest first."""
        runs, by_parent, noted = self._runs, self._by_parent, self._noted
        dropped: list = []
        while self.num_blocks > self.capacity:
            key, chain = runs.popitem(last=False)
            self.num_blocks -= chain.num_blocks
            if by_parent.get(chain.parent_hash) == key:
                del by_parent[chain.parent_hash]
            if noted:
                dropped += self._dropped_notes(chain)
        return dropped


def empty_breakdown() -> dict[str, int]:
    """``{cause: 0}`` for every miss cause."""
    return dict.fromkeys(MISS_CAUSES, 0)


def classify_miss(tree: RadixTree, root: Node, pb: bytes, px: Sequence[bytes] | None,
                  num_prompt_tokens: int, num_matched_blocks: int, last_hash: bytes,
                  ghost: GhostList) -> tuple[dict[str, int], list[bytes], list[tuple]]:
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
        ``insert(known_hashes=…)``), and ``(block position of its last block, note, run)``
        for each evicted run (a :class:`GhostRun`) the prompt holds whole whose policy note is
        not None (for ``insert(ghost_notes=…)`` and :meth:`GhostList.came_back`).
    """
    bs = tree.block_size
    bb = tree.block_bytes
    cap_blocks = (num_prompt_tokens - 1) // bs
    missing = cap_blocks - num_matched_blocks
    hashes: list[bytes] = []
    notes: list[tuple] = []
    if missing <= 0:
        return {"cold": 0, "evicted": 0, "isolated": 0,
                "unaligned_tail": num_prompt_tokens - cap_blocks * bs, "store_timeout": 0,
                "store_rejected": 0}, hashes, notes
    i, h, bb_x = num_matched_blocks, last_hash, b""
    while len(ghost) and i < cap_blocks:
        if px is not None:
            bb_x = px[i]
        parts = ghost.parts(h + pb[i * bb : (i + 1) * bb] + bb_x)
        if parts is None:
            break
        # Compare part by part (an entry's runs are not joined: see _Chain). The probe's key
        # proved the first part's first block; later parts' first blocks are compared too.
        for n, run in enumerate(parts):
            run_hashes = run.hashes
            j = matching_blocks(pb, i * bb, run.tokens, run.extras, px,
                                min(len(run_hashes), cap_blocks - i), bb, 0 if n else 1)
            hashes += run_hashes if j == len(run_hashes) else run_hashes[:j]
            i += j
            if j < len(run_hashes):
                break
            if run.note is not None:
                notes.append((i - 1, run.note, run))
        else:
            h = parts[-1].hashes[-1]
            continue
        break
    evicted = len(hashes)
    isolated = 0
    if evicted == 0 and num_matched_blocks == 0:
        key = child_key(pb[:bb], px[0] if px is not None else b"")
        for other in tree.roots_holding(key, root, MAX_ISOLATION_ROOTS):
            isolated = max(isolated, walk(other, pb, px, cap_blocks, bb)[1])
    return {"cold": (missing - evicted - isolated) * bs, "evicted": evicted * bs,
            "isolated": isolated * bs,
            "unaligned_tail": num_prompt_tokens - cap_blocks * bs, "store_timeout": 0,
            "store_rejected": 0}, hashes, notes

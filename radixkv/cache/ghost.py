"""The ghost list: a bounded FIFO of recently evicted runs (``evicted`` misses, ghost labels).

Every eviction enters what it trimmed here (``radixkv.cache.evict_path``); a lookup probes it to
tell an ``evicted`` miss from a ``cold`` one and recovers the blocks' chained hashes without
hashing (``radixkv.cache.miss_causes.classify_miss``); a policy's notes on evicted runs come back
to it as "reused" (``on_ghost_hit``) or "forgotten unused" (``on_ghost_drop``) labels.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from radixkv.cache.tree.node import GhostRun
from radixkv.cache.tree.node import ghost_run_from_tuple as _ghost_run

__all__ = ["GhostList", "GhostRun"]


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
        self.num_blocks = len(run.hash_bytes) // run.hash_size

    def parts(self) -> list[GhostRun]:
        """The entry's runs in token order."""
        return self.newest_first[::-1]


def _joined(parts: list[GhostRun]) -> GhostRun:
    """Runs in token order as one run (inspection; lookups compare the parts)."""
    extras = None
    if any(part.extras is not None for part in parts):
        extras = []
        for part in parts:
            extras += part.extras if part.extras is not None else [b""] * part.num_blocks
    return GhostRun(b"".join([part.tokens for part in parts]),
                    b"".join([part.hash_bytes for part in parts]), extras, None,
                    parts[0].hash_size)


def as_ghost_run(run: tuple) -> GhostRun:
    """A :class:`GhostRun` from ``(tokens, hashes, extras[, note[, hash_size]])`` where
    ``hashes`` is concatenated bytes or a list of ``bytes`` (one per block, their width then
    giving ``hash_size``)."""
    if type(run) is GhostRun:
        return run
    fields = list(run) + [None] * (4 - len(run))
    hashes = fields[1]
    if isinstance(hashes, list):
        fields[1] = b"".join(hashes)
        if len(fields) < 5:
            fields.append(len(hashes[0]))
    return GhostRun(*fields)


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
        # The newest entry while text runs without a note extend it in front (a leaf is cut
        # tail first: an allocation's run, then each decode step's one block, ``add_block``):
        # its runs in plain lists, the entry out of ``_runs`` / ``_by_parent`` with its current
        # key. Entering it under each new key (pop the old, insert the new, in two dicts) and
        # making a run per eviction was most of a decode step's eviction cost. It is entered
        # (``_settle``) before anything reads the entries or adds a run it does not take, and
        # stays open only while entering it later gives what entering each run at once would
        # have: its key is in no other entry and no other entry has its parent hash (else the
        # run goes through ``_link`` at once).
        self._open_hashes: list[bytes | bytearray] = []  # chained hashes per run, newest first
        self._open_tokens: list[bytes | bytearray] = []  # packed tokens per run, newest first
        self._open_parent = self._open_key = b""  # of its first block
        self._open_num_blocks = self._open_hash_size = 0
        self._open_base: _Chain | None = None  # the entry it extends, taken out of _runs

    def __len__(self) -> int:
        """Entries remembered."""
        return len(self._runs) + bool(self._open_hashes)

    def keys(self) -> list[bytes]:
        """Every entry's key (its first block's hash input), oldest entry first."""
        if self._open_hashes:
            self._settle()
        return list(self._runs)

    def get(self, key: bytes) -> GhostRun | None:
        """The evicted run whose first block had hash input ``key``, or None."""
        if self._open_hashes:
            self._settle()
        chain = self._runs.get(key)
        return _joined(chain.parts()) if chain is not None else None

    def parts(self, key: bytes) -> list[GhostRun] | None:
        """The entry whose first block had hash input ``key`` as its runs in token order (each
        a whole run, the first starting at that block), or None."""
        if self._open_hashes:
            self._settle()
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
        """Remember evicted runs ``(first block's hash input, run)``, each ``run`` a
        :class:`GhostRun` or a tuple :func:`as_ghost_run` takes.

        Forgets the oldest entries beyond the capacity. Every allocation that evicts calls this
        (most runs extend the entry their leaf's previous eviction made): kept to a few dict
        operations per run, none for a text run without a note that extends the open entry.
        """
        dropped: list = []
        added = 0
        for key, run in evicted:
            if type(run) is not GhostRun:
                run = as_ghost_run(run)
            hashes, w = run[1], run[4]
            num = len(hashes) // w
            if run[3] is None and run[2] is None:  # text, no note: it may stay open
                replaced = self._defer(key, key[:w], run[0], hashes, b"" + hashes[-w:], num, w)
            else:
                if self._open_hashes:
                    self._settle()
                if run[3] is not None:
                    self._noted[id(run)] = run
                replaced = self._link(key, run, key[:w], b"" + hashes[-w:], num)
            if replaced:
                dropped += replaced
            added += num
        self._grew(added, dropped)

    def add_block(self, parent_hash: bytes, tokens: bytearray, block_hash: bytes | bytearray) -> None:
        """:meth:`add` of one evicted text block with no note (a decode step's eviction: the
        commonest), given apart: its parent's chained hash (``bytes``), packed tokens, chained
        hash (``bytes`` or a ``bytearray`` cut). Extending the open entry in front is inlined:
        a few list appends, no dict entered, no run made."""
        key = parent_hash + tokens
        if (self._open_hashes and self._open_parent == block_hash and key not in self._runs
                and parent_hash not in self._by_parent):
            self._open_hashes.append(block_hash)
            self._open_tokens.append(tokens)
            self._open_parent, self._open_key = parent_hash, key
            self._open_num_blocks += 1
            self.num_blocks += 1
            if self.num_blocks > self.capacity:
                self._grew(0, None)
            return
        self._grew(1, self._defer(key, parent_hash, tokens, block_hash, b"" + block_hash, 1,
                                  len(block_hash)))

    def _defer(self, key: bytes, parent_hash: bytes, tokens: bytes | bytearray,
               hashes: bytes | bytearray, last_hash: bytes, num: int, hash_size: int) -> list | None:
        """Enter a text run without a note the open way (see ``_open_hashes``): it extends the
        open entry in front, or opens an entry (taking out the one it extends, if any); through
        :meth:`_link` where deferring would differ. The caller counts the blocks. Returns the
        notes ``_link`` dropped, else None."""
        runs, by_parent = self._runs, self._by_parent
        if self._open_hashes:
            if self._open_parent == last_hash and key not in runs and parent_hash not in by_parent:
                self._open_hashes.append(hashes)
                self._open_tokens.append(tokens)
                self._open_parent, self._open_key = parent_hash, key
                self._open_num_blocks += num
                return None
            self._settle()
        if key in runs or parent_hash in by_parent:  # entering it later would differ
            return self._link(key, _ghost_run((tokens, hashes, None, None, hash_size)),
                              parent_hash, last_hash, num)
        next_key = by_parent.pop(last_hash, None)
        # It ends where that entry begins: that entry is taken out to be extended.
        self._open_base = runs.pop(next_key) if next_key is not None else None
        self._open_hashes.append(hashes)
        self._open_tokens.append(tokens)
        self._open_parent, self._open_key = parent_hash, key
        self._open_num_blocks, self._open_hash_size = num, hash_size
        return None

    def _settle(self) -> None:
        """Enter the open entry under its key (the newest entry: nothing was entered since it
        was opened) with its open runs as one, as ``_link`` of each would have (one run where
        ``_link`` would have kept one per eviction: the same blocks, none with a note)."""
        hashes, tokens = self._open_hashes, self._open_tokens
        hashes.reverse()
        tokens.reverse()
        run = _ghost_run((b"".join(tokens), b"".join(hashes), None, None, self._open_hash_size))
        self._open_hashes, self._open_tokens = [], []
        chain, parent_hash, key = self._open_base, self._open_parent, self._open_key
        if chain is None:
            chain = _Chain(parent_hash, run)
        else:
            chain.newest_first.append(run)
            chain.parent_hash = parent_hash
            chain.num_blocks += self._open_num_blocks
        self._open_base = None
        self._runs[key] = chain
        self._by_parent[parent_hash] = key

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
            if not runs:  # only the open entry is left (the newest): it goes last
                self._settle()
            key, chain = runs.popitem(last=False)
            self.num_blocks -= chain.num_blocks
            if by_parent.get(chain.parent_hash) == key:
                del by_parent[chain.parent_hash]
            if noted:
                dropped += self._dropped_notes(chain)
        return dropped



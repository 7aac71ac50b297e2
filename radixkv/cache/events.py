"""KV cache events: what the tree stored and removed, in the order it applied them.

A KV-aware router (vllm-router ``kv_aware``) keeps an index of which replica holds which
blocks, fed by events in vLLM's format (``radixkv.engine.kv_events`` encodes and publishes
them). This module only records them, torch- and wire-free, from the cache manager's two
mutation points: ``publish`` (blocks entering the tree) and eviction (blocks leaving it), plus
``reset_prefix_cache``.

What is recorded, and what is not:

* ``("stored", hashes, parent_hash, token_bytes, lora_name)``: one entry per contiguous run of
  newly inserted blocks: their chained hashes, the hash of the block before the run (None when
  the run starts at the identity root) and the run's packed tokens.
* ``("removed", hashes)``: the published blocks an eviction dropped.
* ``("cleared",)``: everything was dropped (``reset_prefix_cache``); blocks that survive the
  reset (held by running requests) are stored again right after it, so the subscriber's view
  stays the set of published blocks in the tree.

Entries hold the tree's own hashes and packed tokens: the engine thread only slices and
appends; the publisher thread turns them into event ids (:func:`event_block_id`, a uint64)
and token lists (:func:`decode_event`).

Only identities :meth:`KVEventLog.allow_root` names are published: the engine allows unsalted
ones (the base model and each LoRA adapter, as its ``lora_name``). Salted identities (a client
``cache_salt``, ``--api-keys`` tenants) are never published: a router cannot scope its index
by salt, so it would credit those blocks to unsalted requests. Blocks with multimodal extras
are not published either (a router keys blocks by tokens only). A run is published only when
its parent block was, so the published set stays prefix-closed like the tree itself.
"""

from __future__ import annotations

import sys
from array import array

from radixkv.cache.tree.node import Node, split_hashes

_U32_CODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
_MISSING = object()
#: The ``medium`` of blocks in the device pool (the tree): vLLM's name for its primary pool on
#: any device ("CPU" would earn the router's host-tier discount, which the host store tier's
#: blocks get).
DEVICE_MEDIUM = "GPU"

#: Recorded event: ``("stored", hashes, parent_hash | None, token_bytes, lora_name | None)``,
#: ``("removed", hashes)`` or ``("cleared",)``.
Event = tuple


def event_block_id(block_hash: bytes) -> int:
    """The uint64 a block is published as: the last 8 bytes of its chained hash, big-endian.

    This is how vLLM turns its hash into an event id (``int.from_bytes(h, "big") & (2**64-1)``,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); the hash is chained, so the id covers the
    identity and every token before the block.
    """
    return int.from_bytes(block_hash[-8:], "big")


def _tokens(packed: bytes | bytearray) -> list[int]:
    tokens = array(_U32_CODE)
    tokens.frombytes(packed)
    if _BIG_ENDIAN:  # pragma: no cover - packed tokens are little-endian everywhere
        tokens.byteswap()
    return tokens.tolist()


def decode_event(event: Event) -> Event:
    """An entry with event ids and token ids: ``("stored", ids, parent_id | None, token_ids,
    lora_name, medium)``, ``("removed", ids, medium)`` or ``("cleared",)``; ``medium`` is
    ``"GPU"`` for the device pool (entries recorded without one) or the store tier's."""
    if event[0] == "stored":
        _, hashes, parent, tb, lora_name, *medium = event
        return ("stored", [event_block_id(h) for h in hashes],
                None if parent is None else event_block_id(parent), _tokens(tb), lora_name,
                medium[0] if medium else DEVICE_MEDIUM)
    if event[0] == "removed":
        return ("removed", [event_block_id(h) for h in event[1]],
                event[2] if len(event) > 2 else DEVICE_MEDIUM)
    return event


class KVEventLog:
    """Records the tree's stored / removed blocks between two :meth:`drain` calls.

    Engine thread only (like the cache). Memory: a reference to the hash of each published
    block in the tree (at most the pool's block count) plus the pending events of one step.

    Args:
        block_size: Tokens per block (the tree's B).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._roots: dict[bytes, str | None] = {}  # publishable identity root -> lora_name
        self._published: set[bytes] = set()  # hashes of the blocks a subscriber holds now
        self._published_tier: set[bytes] = set()  # ... in the store tier (``tier_stored``)
        self._pending: list[Event] = []

    def allow_root(self, root_hash: bytes, lora_name: str | None) -> None:
        """Publish blocks under the identity root ``root_hash`` (an unsalted identity),
        labelled with ``lora_name`` (None: the base model)."""
        self._roots[root_hash] = lora_name

    @property
    def num_published_blocks(self) -> int:
        """Blocks a subscriber that saw every event would hold for this replica now."""
        return len(self._published)

    def stored(self, root_hash: bytes, node: Node, count: int) -> None:
        """The last ``count`` blocks of ``node`` were just inserted under ``root_hash``."""
        lora_name = self._roots.get(root_hash, _MISSING)
        if lora_name is _MISSING or count <= 0:
            return
        start = node.num_blocks - count  # the run is node blocks [start, len)
        if node.extras is not None:  # a router keys blocks by tokens alone: stop at media
            count = next((j for j, x in enumerate(node.extras[start:]) if x), count)
            if not count:
                return
        # The run's hashes, with its parent's in front when that is in this node.
        hashes = node.hash_list(start - 1 if start else 0)[: count + (start > 0)]
        if start:
            parent: bytes | None = hashes[0]
        elif node.parent is not None and node.parent.parent is not None:
            parent = node.parent.end_hash
        else:
            parent = None
        if parent is not None and parent not in self._published:
            return  # its chain is not published (a multimodal block above it)
        run = hashes[-count:]
        self._published.update(run)
        bb = self.block_size * 4
        # (a bytearray slice is a copy: the node's tokens may be trimmed before it is sent)
        self._pending.append(("stored", run, parent, node.tokens[start * bb : (start + count) * bb],
                              lora_name))

    def removed(self, evicted_runs: list) -> None:
        """Eviction dropped these runs: ``(key, GhostRun)`` entries, as ``RadixTree.evict``
        reports them."""
        published = self._published
        dropped: list[bytes] = []
        for _key, run in evicted_runs:
            # in any order: a removal is a set
            hit = published.intersection(split_hashes(run.hash_bytes, run.hash_size))
            if hit:
                published.difference_update(hit)
                dropped += hit
        if dropped:
            self._pending.append(("removed", dropped))

    def tier_stored(self, root_hash: bytes, parent_hash: bytes, hashes: list[bytes],
                    token_bytes: bytes, medium: str) -> None:
        """The store tier (a per-replica one: ``host``) now holds this run (chained from
        ``parent_hash``, the root hash at depth 0): published with ``medium`` when its identity
        is published and its parent is (in the pool or the tier)."""
        lora_name = self._roots.get(root_hash, _MISSING)
        if lora_name is _MISSING or not hashes:
            return
        parent = None if parent_hash == root_hash else parent_hash
        if parent is not None and parent not in self._published and \
                parent not in self._published_tier:
            return
        self._published_tier.update(hashes)
        self._pending.append(("stored", list(hashes), parent, token_bytes, lora_name, medium))

    def tier_removed(self, hashes: list[bytes], medium: str) -> None:
        """The store tier dropped these blocks (its own eviction)."""
        dropped = self._published_tier.intersection(hashes)
        if dropped:
            self._published_tier.difference_update(dropped)
            self._pending.append(("removed", list(dropped), medium))

    def mark(self) -> int:
        """A position in the pending events, for :meth:`cleared`."""
        return len(self._pending)

    def cleared(self, roots: dict[bytes, Node], since: int) -> None:
        """``reset_prefix_cache`` dropped every unlocked block: record one ``cleared`` (it
        replaces the removals recorded since ``since``), then store again the blocks still
        in the tree (held by running requests), parents first."""
        self._pending[since:] = [e for e in self._pending[since:] if e[0] != "removed"]
        self._published.clear()
        self._published_tier.clear()  # a subscriber drops every claim of this replica
        self._pending.append(("cleared",))
        for root_hash, root in roots.items():
            if root_hash not in self._roots:
                continue
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self.stored(root_hash, node, node.num_blocks)
                stack.extend(node.children.values())

    def drain(self) -> list[Event]:
        """Return the events recorded since the last call, oldest first, and forget them."""
        pending, self._pending = self._pending, []
        return pending

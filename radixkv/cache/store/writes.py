"""A store write, run by the tier's writer thread: the value's header and checksum, the keys
already stored skipped, the rest put, and the host tier's newly stored runs kept for KV events.

The engine thread has already copied each block's K/V into its staging slot (``slot``), so the
pool block may have been evicted and reused since; the slot goes back once the put returns.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from radixkv.cache.store.backend import PutEntry
from radixkv.cache.store.value import encode_header, payload_checksum, store_key
from radixkv.errors import StoreError


class WriteItem(NamedTuple):
    """One block to write.

    Attributes:
        key: Its store key.
        root: Identity root hash.
        block_hash: Its chained hash.
        parent_hash: The previous block's (the root at depth 0).
        tokens: Its B tokens, packed (4·B bytes).
        slot: The write-staging slot holding its payload (-1 until gathered).
        depth_blocks: Blocks before it.
    """

    key: str
    root: bytes
    block_hash: bytes
    parent_hash: bytes
    tokens: bytes
    slot: int
    depth_blocks: int


def run_write(tier: Any, items: list[WriteItem]) -> None:
    """Build the values of ``items`` in their slots and put the ones not stored yet (writer
    thread; ``tier``: the ``StoreTier``, not imported here: it imports this module)."""
    layout, arena, hb, vb = tier.layout, tier.write_arena, tier.header_bytes, tier.value_bytes
    entries = []
    for item in items:
        view = arena.slot_view(item.slot, vb)
        view[:hb] = encode_header(layout, item.root, item.block_hash, item.parent_hash,
                                  item.tokens, payload_checksum(view[hb:]))
        parent_key = store_key(layout, item.root, item.parent_hash) if item.depth_blocks else None
        entries.append(PutEntry(item.key, parent_key, item.depth_blocks * layout.block_size,
                                arena.ptr(item.slot), vb))
    try:
        if tier.down:
            tier.forget(entries, dropped=True)
            return
        present = tier.backend.exists([e.key for e in entries])
        todo = [e for e, p in zip(entries, present) if not p]
        stored = tier.backend.put(todo) if todo else []
        with tier.lock:
            n = sum(stored)
            tier.counters["skipped_existing_blocks_total"] += len(entries) - len(todo)
            tier.counters["written_blocks_total"] += n
            tier.counters["refused_write_blocks_total"] += len(todo) - n
            tier.counters["written_bytes_total"] += n * vb
        tier.forget([e for e, ok in zip(todo, stored) if not ok], dropped=False)
        if tier.backend.kv_event_medium is not None:
            tier.stored_runs.extend(stored_runs(items, {e.key for e, ok in zip(todo, stored)
                                                        if ok}))
    except StoreError as exc:
        tier.mark_down("write", exc)
        tier.forget(entries, dropped=True)
    finally:
        arena.give([item.slot for item in items])


def stored_runs(items: list[WriteItem], stored: set[str]) -> list[tuple]:
    """The newly stored blocks of a write as contiguous runs ``(root, parent hash, hashes,
    tokens)`` (a run breaks where a block was not stored or does not chain on)."""
    runs: list[tuple] = []
    run: list[WriteItem] = []
    for item in (*items, None):
        if run and (item is None or item.key not in stored
                    or item.parent_hash != run[-1].block_hash):
            runs.append((run[0].root, run[0].parent_hash, [it.block_hash for it in run],
                         b"".join(it.tokens for it in run)))
            run = []
        if item is not None and item.key in stored:
            run.append(item)
    return runs


def drain_kv_events(tier: Any, log: Any) -> None:
    """Hand what the tier stored (``tier.stored_runs``) and its backend evicted since the last
    call to the engine's ``KVEventLog`` with the backend's medium (engine thread); nothing for
    a backend whose blocks are not published (Mooncake: a shared pool)."""
    medium = tier.backend.kv_event_medium
    if medium is None:
        return
    while tier.stored_runs:
        root, parent, hashes, tb = tier.stored_runs.popleft()
        log.tier_stored(root, parent, hashes, tb, medium)
    drain = getattr(tier.backend, "drain_evicted", None)
    evicted = drain() if drain is not None else []
    if evicted:  # keys end in the block's chained hash (value.store_key)
        log.tier_removed([bytes.fromhex(k.rsplit(":", 1)[1]) for k in evicted], medium)

"""A block queued for the store (``StoreTier.write`` gathers it, ``StoreTier._run_write``
puts it) and the runs a write stored, for KV events."""

from __future__ import annotations

from typing import NamedTuple


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

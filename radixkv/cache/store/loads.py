"""A store load, run by the tier's loader thread: which blocks the store holds, fetching them
into staging slots, and the header + checksum check that decides which of them are served.

The run served is the longest prefix of the candidate blocks that is present, fetched whole and
verified; the first value that fails its check ends it (a chain past a bad block is useless),
and its reason is counted (``header``: stale, colliding or foreign entry; ``size``; ``checksum``:
corrupt payload).
"""

from __future__ import annotations

import time
from typing import Any

from radixkv.cache.store.value import CHECKSUM_BYTES, check_value, encode_header, store_key
from radixkv.errors import StoreError
from radixkv.log import get_logger

log = get_logger(__name__)
_ZERO_CHECKSUM = bytes(CHECKSUM_BYTES)


class LoadJob:
    """One request's store lookup (see the module docstring); engine-thread fields are plain,
    ``done`` / ``abandoned`` change under the tier's lock."""

    __slots__ = ("request_id", "root", "parent_hash", "hashes", "token_bytes", "depth_blocks",
                 "deadline_s", "done", "abandoned", "slots", "num_present", "num_rejected",
                 "error")

    def __init__(self, request_id: str, root: bytes, parent_hash: bytes, hashes: list[bytes],
                 token_bytes: bytes, depth_blocks: int, deadline_s: float) -> None:
        self.request_id = request_id
        self.root = root
        self.parent_hash = parent_hash
        self.hashes = hashes
        self.token_bytes = token_bytes
        self.depth_blocks = depth_blocks
        self.deadline_s = deadline_s
        self.done = False
        self.abandoned = False
        self.slots: list[int] = []
        self.num_present = -1  # blocks the store held (-1: not known yet)
        self.num_rejected = 0  # present blocks not served: a value failed its check
        self.error = False


def run_load(tier: Any, job: LoadJob) -> None:
    """Look ``job``'s keys up, fetch the present run into staging slots and keep the verified
    leading blocks in ``job.slots`` (loader thread; ``tier``: the ``StoreTier``, not imported
    here: it imports this module)."""
    layout, vb = tier.layout, tier.value_bytes
    keys = [store_key(layout, job.root, h) for h in job.hashes]
    started = time.perf_counter()
    slots: list[int] = []
    tier.wait_written(keys, job.deadline_s)
    try:
        present = tier.backend.exists(keys)
        run = 0
        while run < len(keys) and present[run]:
            run += 1
        job.num_present = run
        tier.count("lookup_blocks_total", len(keys))
        tier.count("miss_blocks_total", len(keys) - run)
        slots = tier.read_arena.take(run)
        got = tier.backend.get_into(keys[: len(slots)],
                                    [tier.read_arena.ptr(s) for s in slots],
                                    [vb] * len(slots)) if slots else []
    except StoreError as exc:
        tier.read_arena.give(slots)
        job.error = True
        tier.mark_down("load", exc)
        return
    if tier.on_fetch_latency is not None:
        tier.on_fetch_latency(time.perf_counter() - started)
    bb = 4 * layout.block_size
    verified = 0
    parent = job.parent_hash
    for i, slot in enumerate(slots):
        if got[i] < 0:  # gone since exists(): a plain miss from here on
            break
        expected = encode_header(layout, job.root, job.hashes[i], parent,
                                 job.token_bytes[i * bb : (i + 1) * bb], _ZERO_CHECKSUM)
        reason = "size" if got[i] != vb else check_value(
            expected, tier.read_arena.slot_view(slot, vb))
        if reason is not None:
            with tier.lock:
                tier.counters["rejected_blocks_total"] += 1
                tier.rejected_by_reason[reason] += 1
            log.warning("kv_store_value_rejected", reason=reason,
                        block_hash=job.hashes[i].hex(), request_id=job.request_id)
            job.num_rejected = run - i
            break
        verified += 1
        parent = job.hashes[i]
    tier.read_arena.give(slots[verified:])
    job.slots = slots[:verified]
    with tier.lock:
        tier.counters["hit_blocks_total"] += verified
        tier.counters["read_bytes_total"] += verified * vb


"""The store tier under the radix tree: asynchronous block loads and writes through a backend.

The engine thread calls :class:`StoreTier` (through the cache manager) and never waits on the
backend. Two daemon threads do the backend calls:

* **loader**: for a request whose device match ended early, ``exists`` on the next blocks' keys
  (the longest run present), ``get_into`` staging slots, then the header and checksum check of
  every value (``value.check_value``; a value in another KV format is refused as ``format``);
  the first block that fails ends the run. The engine thread copies the verified blocks into
  pool blocks and inserts them into the tree; a load still running at its deadline is
  abandoned (the request computes instead; the slots come back when the backend call returns).
* **writer**: the engine thread gathers a block's K/V (and scales, for a quantized KV format)
  out of the pool into a staging slot at once (the block may be evicted and reused right
  after); the writer builds the header and checksum, skips keys already present, and puts the
  rest. No free slot → the block waits for one (or its eviction), then is dropped, counted:
  back-pressure never blocks a step.

A backend call that raises ``StoreError`` marks the tier *down* (so does a backend reporting
itself unhealthy): loads are skipped (counted) and the writer tries ``reconnect`` once per
``reconnect_interval_s``. A load past its deadline skips later loads until its call returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, NamedTuple, Sequence

from radixkv.cache.events import KVEventLog
from radixkv.cache.store.backend import WRITE_MODES, PutEntry, StoreBackend
from radixkv.cache.store.loads import LoadJob
from radixkv.cache.store.staging import StagingArena, gather_block, scatter_block
from radixkv.cache.store.value import (
    CHECKSUM_BYTES,
    BlockLayout,
    check_value,
    encode_header,
    payload_checksum,
    store_key,
)
from radixkv.cache.store.writes import WriteItem, stored_runs
from radixkv.errors import StoreError
from radixkv.log import get_logger

log = get_logger(__name__)

#: Seconds between the writer's ``backend.healthy()`` checks while the tier is up.
HEALTH_CHECK_INTERVAL_S = 2.0
#: Published blocks that may wait for a write slot (beyond: dropped, counted).
MAX_DEFERRED_BLOCKS = 1 << 14
#: Keys remembered as stored (the engine thread skips gathering them again).
PRESENT_MEMO_SIZE = 1 << 16
#: Seconds ``reset`` waits for the writes queued before it (host puts: memory copies).
RESET_WRITES_TIMEOUT_S = 5.0
#: The checksum field as ``encode_header`` expects it when only the header is compared.
_ZERO_CHECKSUM = bytes(CHECKSUM_BYTES)


class RetainJob(NamedTuple):
    """For the writer thread: ``backend.mark_retained(keys, until_s)`` (``-inf``: clear)."""

    keys: list[str]
    until_s: float


class StoreTier:
    """Asynchronous loads and writes of block values between the KV pool and a backend.

    Args:
        backend: Where values live.
        layout: The pool's block layout.
        digest_bytes: Length of chained hashes (16 for xxh3-128).
        write_mode: ``"all"`` (every published block once) or ``"evict"`` (what the device pool
            evicts).
        timeout_s: A load not answered within this many seconds is abandoned.
        read_slots / write_slots: Staging slots (one block value each) for loads / writes;
            also the most blocks one load fetches.
        clock: Time source (seconds).
        on_fetch_latency: Called with each load's backend time (seconds) from the loader thread.

    Raises:
        ValueError: naming ``write_mode`` or ``timeout_s``.
        StoreError: the backend refused the staging registration.
    """

    def __init__(self, backend: StoreBackend, layout: BlockLayout, *, digest_bytes: int = 16,
                 write_mode: str = "all", timeout_s: float = 2.0, read_slots: int = 128,
                 write_slots: int = 256, clock: Callable[[], float] = time.monotonic,
                 on_fetch_latency: Callable[[float], None] | None = None,
                 reconnect_interval_s: float = 1.0) -> None:
        if write_mode not in WRITE_MODES:
            raise ValueError(f"kv_store_write: must be one of {WRITE_MODES}, got {write_mode!r}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < 3600):
            raise ValueError(f"kv_store_timeout_s: must be in (0, 3600), got {timeout_s!r}")
        self.backend = backend
        self.layout = layout
        self.write_mode = write_mode
        self.timeout_s = float(timeout_s)
        self.header_bytes = layout.header_bytes(digest_bytes)
        self.value_bytes = layout.value_bytes(digest_bytes)
        self._clock = clock
        self.on_fetch_latency = on_fetch_latency
        self._reconnect_interval_s = reconnect_interval_s
        self.read_arena = StagingArena(self.value_bytes, read_slots)
        self.write_arena = StagingArena(self.value_bytes, write_slots)
        backend.register_buffer(self.read_arena.base_ptr, self.read_arena.nbytes)
        backend.register_buffer(self.write_arena.base_ptr, self.write_arena.nbytes)
        self.max_blocks_per_load = read_slots
        self._bases: list[tuple[int, int]] | None = None  # (address, bytes per block)
        self._jobs: dict[str, LoadJob] = {}  # engine thread only
        self._present: OrderedDict[str, None] = OrderedDict()
        self._deferred: dict[int, WriteItem] = {}  # block id -> its write (engine thread)
        self.lock = threading.Lock()
        self._done = threading.Event()
        self._idle = threading.Condition()
        self._pending_writes = 0
        self._inflight: set[str] = set()  # keys queued for writing, not yet put
        self._stuck = False  # the loader is still inside a load that was abandoned
        # Resets so far: a load or write begun before a reset must not mark its keys as stored
        # (or announce them) after the reset emptied the backend.
        self._reset_epoch = 0
        self._down_since: float | None = None
        self.counters = dict.fromkeys((
            "lookup_blocks_total", "hit_blocks_total", "miss_blocks_total", "read_bytes_total",
            "written_blocks_total", "written_bytes_total", "skipped_existing_blocks_total",
            "rejected_blocks_total", "dropped_write_blocks_total", "refused_write_blocks_total",
            "errors_total",
            "load_timeouts_total", "loads_skipped_down_total", "reconnects_total",
            "reset_blocks_total"), 0)
        self.rejected_by_reason = {"header": 0, "checksum": 0, "size": 0, "format": 0}
        #: Runs the tier stored, for KV events (a per-replica backend only): ``(root, parent
        #: hash, hashes, token bytes)``; appended by the writer, drained by the engine thread.
        self.stored_runs: deque = deque(maxlen=1 << 16)
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._load_loop, name="radixkv-store-loader",
                                          daemon=True),
                         threading.Thread(target=self._write_loop, name="radixkv-store-writer",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    # ---- set-up ---------------------------------------------------------------------------
    def attach_pool(self, segments: Sequence[tuple[int, int] | int]) -> None:
        """Tell the tier where the pool's segments are: ``runner.kv_segments()``, ``(host
        address, bytes per block)`` of K0, V0, K1, …, then for a quantized format the scale
        pools Ks0, Vs0, … (``layout.segment_sizes``); or, for unquantized K/V, only the 2·L
        addresses (``runner.kv_segment_bases()``).

        Raises:
            ValueError: naming ``segments`` when their number or sizes are not the layout's,
                or addresses alone are given for a quantized layout.
        """
        sizes = self.layout.segment_sizes
        if len(segments) != len(sizes):
            raise ValueError(f"segments: the layout {self.layout.tag} has {len(sizes)} pool "
                             f"segments per block, got {len(segments)}")
        if self.layout.scale_itemsize and any(isinstance(s, int) for s in segments):
            raise ValueError(f"segments: the layout {self.layout.tag} has scale segments; give "
                             f"(address, bytes per block) pairs (runner.kv_segments())")
        pairs: list[tuple[int, int]] = []
        for seg, size in zip(segments, sizes):
            if isinstance(seg, int):
                pairs.append((seg, size))
            else:
                base, nbytes = seg
                pairs.append((int(base), int(nbytes)))
        got = tuple(size for _, size in pairs)
        if got != sizes:
            raise ValueError(f"segments: bytes per block {list(got)} are not the layout "
                             f"{self.layout.tag}'s {list(sizes)}")
        self._bases = pairs

    @property
    def down(self) -> bool:
        """The last backend call failed and no reconnect succeeded since."""
        return self._down_since is not None

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def mark_down(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.counters["errors_total"] += 1
            first = self._down_since is None
            if first:
                self._down_since = self._clock()
        if first:
            log.warning("kv_store_down", backend=self.backend.name, during=what, error=str(exc))

    # ---- loads (engine thread) -----------------------------------------------------------
    def start_load(self, request_id: str, root: bytes, parent_hash: bytes, hashes: list[bytes],
                   token_bytes: bytes, depth_blocks: int) -> bool:
        """Queue a lookup of ``hashes`` (the blocks after the device match, token order).

        Args:
            request_id: The request (one load at a time each).
            root: Its identity root hash.
            parent_hash: Chained hash of the block before ``hashes[0]`` (the root at depth 0).
            hashes: Chained hashes of the candidate blocks.
            token_bytes: Their packed tokens (4·B bytes per block).
            depth_blocks: Blocks before ``hashes[0]``.

        Returns:
            False when nothing was queued (tier down, or nothing to look up).
        """
        if not hashes or self._bases is None:
            return False
        if self._down_since is not None or self._stuck:
            # (stuck: the store did not answer a load in time; the loader is still waiting on
            # it, and a new load would only queue behind it until its own deadline)
            self.count("loads_skipped_down_total")
            return False
        job = LoadJob(request_id, root, parent_hash, hashes[: self.max_blocks_per_load],
                      token_bytes, depth_blocks, self._clock() + self.timeout_s)
        job.reset_epoch = self._reset_epoch
        self._jobs[request_id] = job
        self._loads.put(job)
        return True

    def is_ready(self, request_id: str) -> bool:
        """The request's load finished or passed its deadline."""
        job = self._jobs[request_id]
        return job.done or self._clock() >= job.deadline_s

    def loaded_blocks(self, request_id: str) -> int:
        """Verified blocks of the request's load, once it is done (else 0)."""
        job = self._jobs.get(request_id)
        return len(job.slots) if job is not None and job.done else 0

    def wait(self, timeout_s: float) -> None:
        """Block the engine thread until some load finishes (only when nothing else can run)."""
        self._done.wait(timeout_s)
        self._done.clear()

    def finish(self, request_id: str, *, timed_out: bool = True) -> LoadJob:
        """Take the request's load: finished, or abandoned now (``done`` False; counted as a
        timeout unless ``timed_out`` is False: the request went away).

        The caller copies ``job.slots`` into blocks with :meth:`copy_into` or drops them with
        :meth:`discard`.
        """
        job = self._jobs.pop(request_id)
        with self.lock:
            if not job.done:
                job.abandoned = True
                self._stuck = self._stuck or timed_out
                self.counters["load_timeouts_total"] += timed_out
        return job

    def cancel(self, request_id: str) -> None:
        """Forget the request's load, if any (aborted while loading)."""
        if request_id in self._jobs:
            self.discard(self.finish(request_id, timed_out=False))

    def discard(self, job: LoadJob) -> None:
        """Give back a finished job's slots unused."""
        if job.done:
            self.read_arena.give(job.slots)
            job.slots = []

    def copy_into(self, job: LoadJob, block_ids: Sequence[int]) -> None:
        """Copy the job's first ``len(block_ids)`` verified values into pool blocks (one per
        slot, in order); every slot goes back and the copied keys are remembered as stored."""
        segments, arena = self._bases, self.read_arena
        assert segments is not None and len(block_ids) <= len(job.slots)
        for slot, block_id in zip(job.slots, block_ids):
            scatter_block(arena.ptr(slot) + self.header_bytes, segments, block_id)
        arena.give(job.slots)
        with self.lock:
            if job.reset_epoch == self._reset_epoch:  # else a reset emptied the store since
                for h in job.hashes[: len(block_ids)]:
                    self._remember(store_key(self.layout, job.root, h))
        job.slots = []

    # ---- loads (loader thread) -----------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is None:
                return
            if not job.abandoned:
                self._run_load(job)
            with self.lock:
                job.done = True
                abandoned = job.abandoned
                self._stuck = False
            if abandoned:
                self.read_arena.give(job.slots)
                job.slots = []
            self._done.set()

    def _run_load(self, job: LoadJob) -> None:
        """Look ``job``'s keys up, fetch the present run into staging slots and keep the
        verified leading blocks in ``job.slots`` (loader thread).

        The run served is the longest prefix of the candidate blocks that is present, fetched
        whole and verified; the first value that fails its check ends it (a chain past a bad
        block is useless), and its reason is counted (``header``: stale, colliding or foreign
        entry; ``format``: the block's layout in another KV format, written by a replica with
        another ``--kv-cache-dtype``; ``size``: another length, or larger than the room;
        ``checksum``: corrupt payload).
        """
        layout, vb = self.layout, self.value_bytes
        keys = [store_key(layout, job.root, h) for h in job.hashes]
        started = time.perf_counter()
        slots: list[int] = []
        self.wait_written(keys, job.deadline_s)
        try:
            present = self.backend.exists(keys)
            run = 0
            while run < len(keys) and present[run]:
                run += 1
            job.num_present = run
            self.count("lookup_blocks_total", len(keys))
            self.count("miss_blocks_total", len(keys) - run)
            slots = self.read_arena.take(run)
            got = self.backend.get_into(keys[: len(slots)],
                                        [self.read_arena.ptr(s) for s in slots],
                                        [vb] * len(slots)) if slots else []
        except StoreError as exc:
            self.read_arena.give(slots)
            job.error = True
            self.mark_down("load", exc)
            return
        if self.on_fetch_latency is not None:
            self.on_fetch_latency(time.perf_counter() - started)
        bb = 4 * layout.block_size
        verified = 0
        parent = job.parent_hash
        too_large = self.backend.too_small_result
        for i, slot in enumerate(slots):
            if got[i] < 0 and got[i] != too_large:  # gone since exists(): a plain miss from here on
                break
            if got[i] < 0:  # larger than this layout's values: never the block wanted
                reason: str | None = "size"
            else:
                expected = encode_header(layout, job.root, job.hashes[i], parent,
                                         job.token_bytes[i * bb : (i + 1) * bb], _ZERO_CHECKSUM)
                # (a value of another length is checked as read: one of another KV format
                # is told apart by its header)
                reason = check_value(expected, self.read_arena.slot_view(slot, min(got[i], vb)))
            if reason is not None:
                with self.lock:
                    self.counters["rejected_blocks_total"] += 1
                    self.rejected_by_reason[reason] += 1
                    # Forget it was stored, so the block computed again is written afresh.
                    self._present.pop(keys[i], None)
                log.warning("kv_store_value_rejected", reason=reason,
                            block_hash=job.hashes[i].hex(), request_id=job.request_id)
                try:  # a backend that keeps values may drop it (the block is written afresh)
                    self.backend.on_rejected(keys[i], reason)
                except StoreError as exc:
                    self.mark_down("on_rejected", exc)
                job.num_rejected = run - i
                break
            verified += 1
            parent = job.hashes[i]
        self.read_arena.give(slots[verified:])
        job.slots = slots[:verified]
        with self.lock:
            self.counters["hit_blocks_total"] += verified
            self.counters["read_bytes_total"] += verified * vb

    # ---- writes --------------------------------------------------------------------------
    def _remember(self, key: str) -> None:
        """(Under the lock.) ``key`` is stored: skip it next time."""
        self._present[key] = None
        self._present.move_to_end(key)
        if len(self._present) > PRESENT_MEMO_SIZE:
            self._present.popitem(last=False)

    def write(self, root: bytes, parent_hash: bytes, hashes: Sequence[bytes],
              token_bytes: bytes | memoryview, block_ids: Sequence[int], depth_blocks: int, *,
              defer: bool = True) -> int:
        """Gather a run of published blocks into staging slots and queue their write.

        Blocks that find no free slot wait (``defer``, at most ``MAX_DEFERRED_BLOCKS``) for
        :meth:`pump` — the engine calls it every step — or for their eviction
        (:meth:`on_trim`), whichever comes first; the rest are dropped and counted.

        Args:
            root: Identity root hash.
            parent_hash: Chained hash before ``hashes[0]`` (the root at depth 0).
            hashes: The run's chained hashes, token order.
            token_bytes: The run's packed tokens.
            block_ids: The pool blocks holding them (published: unchanged until evicted).
            depth_blocks: Blocks before the run.
            defer: False when the blocks are about to be freed (gather now or drop).

        Returns:
            Blocks gathered now (keys known stored are skipped).
        """
        if self._bases is None or self._down_since is not None:
            if self._down_since is not None:
                self.count("dropped_write_blocks_total", len(hashes))
            return 0
        bb = 4 * self.layout.block_size
        items: list[WriteItem] = []
        parent = parent_hash
        skipped = dropped = 0
        for i, h in enumerate(hashes):
            key = store_key(self.layout, root, h)
            with self.lock:
                known = key in self._present
                if not known:
                    self._remember(key)
            if known:
                skipped += 1
            else:
                item = WriteItem(key, root, h, parent, bytes(token_bytes[i * bb : (i + 1) * bb]),
                                 -1, depth_blocks + i)
                if self._deferred or not self._gather(item, block_ids[i], items):
                    if defer and len(self._deferred) < MAX_DEFERRED_BLOCKS:
                        self._deferred[block_ids[i]] = item
                    else:
                        dropped += 1
                        with self.lock:
                            self._present.pop(key, None)
            parent = h
        with self.lock:
            self.counters["skipped_existing_blocks_total"] += skipped
            self.counters["dropped_write_blocks_total"] += dropped
        self._queue(items)
        return len(items)

    def _gather(self, item: WriteItem, block_id: int, items: list[WriteItem]) -> bool:
        """Copy block ``block_id`` into a free write slot for ``item``; False: no free slot."""
        slots = self.write_arena.take(1)
        if not slots:
            return False
        gather_block(self.write_arena.ptr(slots[0]) + self.header_bytes, self._bases,  # type: ignore[arg-type]  # set: write() queued it
                     block_id)
        items.append(item._replace(slot=slots[0]))
        return True

    def _queue(self, items: list[WriteItem]) -> None:
        if items:
            with self._idle:
                self._pending_writes += 1
                self._inflight.update(item.key for item in items)
            self._writes.put(items)

    def wait_written(self, keys: list[str], deadline_s: float) -> None:
        """(Loader thread.) Wait, until ``deadline_s`` at most, for queued writes of ``keys``
        to finish: a block evicted (and queued for writing) just before its lookup is found."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight.isdisjoint(keys),
                                max(0.0, deadline_s - self._clock()))

    @property
    def keeps_retained(self) -> bool:
        """The backend ranks retained blocks apart (``StoreBackend.mark_retained`` does
        something: the disk tier, a stack holding one)."""
        return type(self.backend).mark_retained is not StoreBackend.mark_retained

    def mark_retained(self, root: bytes, hashes: Sequence[bytes], until_s: float) -> None:
        """Blocks of a retention (their chained hashes under identity ``root``) are to be
        kept longest by the backend until ``until_s`` (the cache clock, ``time.monotonic`` in
        a server). Queued behind the writes already queued, for the writer thread (never a
        backend call on the engine thread); nothing for a backend without the notion."""
        if not hashes or not self.keeps_retained:
            return
        with self._idle:  # flush() waits for it like a write
            self._pending_writes += 1
        self._writes.put(RetainJob([store_key(self.layout, root, h) for h in hashes], until_s))

    def unmark_retained(self, root: bytes, hashes: Sequence[bytes]) -> None:
        """No retention holds these blocks any more (released, dropped or expired early):
        the backend ranks them as ordinary blocks again (``mark_retained`` with an end in the
        past, ``-inf``, which clears). Queued like :meth:`mark_retained`, behind it."""
        self.mark_retained(root, hashes, float("-inf"))

    def pump(self) -> int:
        """Gather deferred blocks into the slots freed since (engine thread, every step);
        returns how many were gathered."""
        items: list[WriteItem] = []
        while self._deferred:
            block_id, item = next(iter(self._deferred.items()))
            if not self._gather(item, block_id, items):
                break
            del self._deferred[block_id]
        self._queue(items)
        return len(items)

    def on_trim(self, block_ids: Sequence[int]) -> None:
        """These blocks are being evicted: gather the deferred ones among them now, or drop
        them (counted)."""
        if not self._deferred:
            return
        items: list[WriteItem] = []
        for block_id in block_ids:
            item = self._deferred.pop(block_id, None)
            if item is not None and not self._gather(item, block_id, items):
                self.count("dropped_write_blocks_total")
                with self.lock:
                    self._present.pop(item.key, None)
        self._queue(items)

    @property
    def num_deferred_blocks(self) -> int:
        """Published blocks waiting for a write slot."""
        return len(self._deferred)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write was tried and none is deferred (tests, benchmarks;
        deferred blocks move on at the engine's next step); False on timeout."""
        with self._idle:
            return self._idle.wait_for(
                lambda: self._pending_writes == 0 and not self._deferred, timeout_s)

    def _write_loop(self) -> None:
        next_check_s = self._clock() + HEALTH_CHECK_INTERVAL_S
        while True:
            try:
                job = self._writes.get(timeout=self._reconnect_interval_s)
            except queue.Empty:
                job = ()
            if job is None:
                return
            now = self._clock()
            if self._down_since is None and now >= next_check_s:
                # A store can lose this client without any call failing (a restarted
                # Mooncake master): ask the backend itself now and then.
                next_check_s = now + HEALTH_CHECK_INTERVAL_S
                if not self.backend.healthy():
                    self.mark_down("health check", StoreError("backend reports unhealthy"))
            if self._down_since is not None and now - self._down_since >= \
                    self._reconnect_interval_s:
                self._try_reconnect()
            if isinstance(job, RetainJob):
                try:
                    self.backend.mark_retained(job.keys, job.until_s)
                except StoreError as exc:
                    self.mark_down("mark_retained", exc)
                finally:
                    with self._idle:
                        self._pending_writes -= 1
                        self._idle.notify_all()
                continue
            if job:
                try:
                    self._run_write(job)
                finally:
                    with self._idle:
                        self._pending_writes -= 1
                        self._inflight.difference_update(item.key for item in job)
                        self._idle.notify_all()

    def _run_write(self, items: list[WriteItem]) -> None:
        """Build the values of ``items`` in their slots (header and checksum) and put the ones
        not stored yet (writer thread). The engine thread copied each block's K/V into its slot
        already, so the pool block may have been reused since; the slots go back once the put
        returns. A per-replica backend's newly stored runs are kept for KV events."""
        layout, arena, hb, vb = self.layout, self.write_arena, self.header_bytes, self.value_bytes
        entries = []
        for item in items:
            view = arena.slot_view(item.slot, vb)
            view[:hb] = encode_header(layout, item.root, item.block_hash, item.parent_hash,
                                      item.tokens, payload_checksum(view[hb:]))
            parent_key = store_key(layout, item.root, item.parent_hash) if item.depth_blocks else None
            entries.append(PutEntry(item.key, parent_key, item.depth_blocks * layout.block_size,
                                    arena.ptr(item.slot), vb))
        with self.lock:
            epoch = self._reset_epoch
        try:
            if self.down:
                self.forget(entries, dropped=True)
                return
            present = self.backend.exists([e.key for e in entries])
            todo = [e for e, p in zip(entries, present) if not p]
            stored = self.backend.put(todo) if todo else []
            with self.lock:
                n = sum(stored)
                self.counters["skipped_existing_blocks_total"] += len(entries) - len(todo)
                self.counters["written_blocks_total"] += n
                self.counters["refused_write_blocks_total"] += len(todo) - n
                self.counters["written_bytes_total"] += n * vb
            self.forget([e for e, ok in zip(todo, stored) if not ok], dropped=False)
            with self.lock:
                # A reset since this write began may have dropped what it put: announcing
                # it could name a block the store no longer holds (a missed announcement of
                # one that landed after the reset is the safe side).
                announce = self.backend.kv_event_medium is not None and epoch == self._reset_epoch
            if announce:
                self.stored_runs.extend(stored_runs(items, {e.key for e, ok in zip(todo, stored)
                                                            if ok}))
        except StoreError as exc:
            self.mark_down("write", exc)
            self.forget(entries, dropped=True)
        finally:
            arena.give([item.slot for item in items])

    def _try_reconnect(self) -> None:
        try:
            ok = self.backend.reconnect()
        except StoreError:
            ok = False
        with self.lock:
            if ok:  # the store may have lost everything (a restarted master): ask again
                self.counters["reconnects_total"] += 1
                self._down_since = None
                self._present.clear()
            else:
                self._down_since = self._clock()
        if ok:
            log.info("kv_store_reconnected", backend=self.backend.name)

    def reset(self, timeout_s: float = RESET_WRITES_TIMEOUT_S) -> int:
        """``reset_prefix_cache`` (engine thread): empty a per-replica backend (``host``), so
        that the reset's ``AllBlocksCleared`` is true of this tier too and the next request
        is cold in every tier. The writes queued so far land first (the device eviction just
        queued some, in ``evict`` mode all it evicted); then every value goes, with the stored
        runs and evictions not yet published. Blocks still deferred belong to running
        requests and are written later, announced after the reset.

        A shared backend (Mooncake: every replica's cache) is left as it is; its blocks are
        never announced as this replica's (``kv_event_medium`` None).

        Args:
            timeout_s: Longest wait for the queued writes (logged when it passes). A write or
                load begun before the reset neither announces its blocks nor marks them
                stored after it (the reset count each one started under says so); a store
                fault during the clear marks the tier down and is not raised.

        Returns:
            Values dropped (0 for a shared backend).
        """
        if self.backend.kv_event_medium is None:
            return 0
        with self._idle:
            drained = self._idle.wait_for(lambda: self._pending_writes == 0, timeout_s)
        if not drained:
            log.warning("kv_store_reset_writes_pending", timeout_s=timeout_s,
                        pending_writes=self._pending_writes)
        with self.lock:
            self._reset_epoch += 1
        try:
            dropped = self.backend.clear()
        except StoreError as exc:  # a store fault is counted, never fatal to the engine
            self.mark_down("reset", exc)
            dropped = 0
        self.stored_runs.clear()
        with self.lock:
            self._present.clear()
            self.counters["reset_blocks_total"] += dropped
        log.info("kv_store_reset", backend=self.backend.name, dropped_blocks=dropped)
        return dropped

    def drain_kv_events(self, event_log: KVEventLog) -> None:
        """Hand what the tier stored (``stored_runs``) and its backend evicted since the last
        call to the engine's ``KVEventLog`` with the backend's medium (engine thread); nothing
        for a backend whose blocks are not published (Mooncake: a shared pool)."""
        medium = self.backend.kv_event_medium
        if medium is None:
            return
        while self.stored_runs:
            root, parent, hashes, tb = self.stored_runs.popleft()
            event_log.tier_stored(root, parent, hashes, tb, medium)
        drain = getattr(self.backend, "drain_evicted", None)
        evicted = drain() if drain is not None else []
        if evicted:  # keys end in the block's chained hash (value.store_key)
            event_log.tier_removed([bytes.fromhex(k.rsplit(":", 1)[1]) for k in evicted], medium)

    def forget(self, entries: list[PutEntry], *, dropped: bool) -> None:
        """These keys are not stored after all (``dropped``: counted as dropped writes)."""
        with self.lock:
            for e in entries:
                self._present.pop(e.key, None)
            if dropped:
                self.counters["dropped_write_blocks_total"] += len(entries)

    # ---- gauges / shutdown ---------------------------------------------------------------
    def snapshot(self) -> dict:
        """The ``store`` object of ``/stats`` (counters in blocks and bytes)."""
        with self.lock:
            out: dict[str, object] = dict(self.counters)
            out["rejected_blocks_by_reason"] = dict(self.rejected_by_reason)
        out.update(backend=self.backend.name, write_mode=self.write_mode, down=self.down,
                   value_bytes=self.value_bytes, timeout_s=self.timeout_s)
        out.update(self.backend.stats())
        return out

    def close(self) -> None:
        """Stop both threads (after their current call) and close the backend."""
        self._loads.put(None)
        self._writes.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self.backend.close()

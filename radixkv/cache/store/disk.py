"""``disk`` store backend: block values as files in a private directory, found again after a
restart.

**Layout.** One file per value, ``PATH/<last two hex digits of the key>/<key>.d<depth
tokens>.h<header digest>``: the store key (``value.store_key``), the block's depth in tokens
(for the eviction order) and the xxh3-64 of the value's header (16 hex digits). The file names
are the index: at start the directory is scanned and every well-named file is taken as stored
(no separate index to lose or to fall out of step); leftover temporary files of writes that
never finished (``.tmp-*``, a process killed mid-write) are deleted. ``PATH/.lock`` holds an
exclusive ``flock`` while a store is open: a second process on the same directory is refused.

**Atomic writes.** A value is written to a temporary file in its final directory, flushed with
``fdatasync``, then renamed over its final name, and the directories renamed into are
``fsync``-ed before ``put`` returns: a reader (this process or the next one, after ``kill -9`` or
a power loss) sees a value whole or not at all. Files are created ``0600``, directories
``0700``; an existing ``PATH`` must be a directory owned by the service user and closed to
others (group and other mode bits clear), else the store refuses to open.

**Checked on every read.** ``get_into`` reads the file into the caller's buffer and checks it
against itself and its key before reporting it: the header parses (``value.read_header``), names
this key (layout tag, identity root — model revision, adapter, salt — and block hash), its
digest matches the file name's (so a flipped bit in the tokens or the parent hash shows), the
length is the header's plus its payload's, and the payload's checksum matches. A value that
fails is reported missing, its file deleted, and counted by reason: ``size`` (truncated or
extended), ``header`` (not a header of this format, or not the one the name records),
``foreign`` (a well-formed value of another key), ``format`` (the key's layout in another KV
format: written under another ``--kv-cache-dtype``) or ``checksum`` (corrupt payload). The tier
above then checks what it expects (parent hash and tokens) as for any backend.

**Capacity.** The sum of the stored files' sizes stays within ``capacity_bytes``; a put that
needs room evicts the value accessed longest ago first (a read or a write is an access; a
batch gets one time, its deeper blocks go first, so a chain is trimmed from its tail). Blocks
marked retained (:meth:`DiskStore.mark_retained`) go only after every block not retained, until
their retention ends. Access times are the files' modification times, set on each write and
hit, so the order survives a restart. Evicted keys are queued for KV events (medium ``DISK``)
like the host tier's.

**Thread safety.** One ``threading.Lock`` guards the index; file reads and writes run outside it
(a file being read stays readable when it is evicted meanwhile: Linux keeps an open file).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import itertools
import os
import re
import secrets
import shutil
import stat
import threading
import time
from typing import Callable, Sequence

import xxhash
from sortedcontainers import SortedList

from radixkv.cache.store.backend import PutEntry, StoreBackend
from radixkv.cache.store.value import foreign_reason, payload_checksum, read_header
from radixkv.errors import StoreError
from radixkv.log import get_logger

log = get_logger(__name__)

#: ``get_into`` results besides a byte count (as the host tier's).
MISSING = -1
TOO_SMALL = -2
#: Reasons a value read back is refused (``disk_rejected_blocks_by_reason``).
REJECT_REASONS = ("size", "header", "foreign", "format", "checksum", "io")
#: Default capacity: the bytes found at start plus this share of the file system's free space.
DEFAULT_FREE_SHARE = 0.9
#: Retentions remembered for keys not stored yet (oldest dropped beyond).
MAX_PENDING_RETAINED = 1 << 16
_KEY_RE = re.compile(r"rkv[0-9]+:[A-Za-z0-9._+-]+:[0-9a-f]{2,510}:[0-9a-f]{2,510}")
_NAME_RE = re.compile(r"(?P<key>rkv[0-9]+:[A-Za-z0-9._+-]+:[0-9a-f]+:[0-9a-f]+)"
                      r"\.d(?P<depth>[0-9]{1,12})\.h(?P<digest>[0-9a-f]{16})")
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"


def header_digest(header: bytes | memoryview) -> str:
    """The 16-hex-digit xxh3-64 of a value's header, as recorded in its file name."""
    return xxhash.xxh3_64_hexdigest(header)


def file_name(key: str, depth_tokens: int, digest: str) -> str:
    """The file name of a value: ``<key>.d<depth_tokens>.h<digest>``."""
    return f"{key}.d{depth_tokens}.h{digest}"


class _DiskEntry:
    """One stored value: its file and its place in the eviction order."""

    __slots__ = ("key", "name", "nbytes", "depth_tokens", "access_s", "retained_until_s",
                 "order")

    def __init__(self, key: str, name: str, nbytes: int, depth_tokens: int,
                 access_s: float) -> None:
        self.key = key
        self.name = name
        self.nbytes = nbytes
        self.depth_tokens = depth_tokens
        self.access_s = access_s
        self.retained_until_s: float | None = None
        self.order: tuple = ()


class DiskStore(StoreBackend):
    """A bounded key → value store of files under one private directory (thread-safe).

    Args:
        path: The directory (created ``0700`` with its missing parents; an existing one must be
            owned by this user with no group or other access).
        capacity_bytes: Most value bytes held at once; 0: what is found at start plus 90 % of
            the file system's free space then.
        clock: Wall-clock seconds (``time.time``): access times, comparable with the files'
            modification times after a restart.
        monotonic: The clock retention ends are given on (``time.monotonic``, the engine's).
        fsync: Flush each value and the directories renamed into before ``put`` returns
            (tests on a throwaway directory may turn it off; a killed process never leaves
            a half value either way, a power loss could without it).
        max_pending_evicted: Keys :meth:`drain_evicted` can return at most (oldest dropped).

    Raises:
        ValueError: naming ``kv_store`` when ``path`` cannot be created, is not a directory,
            belongs to another user or is open to others, or ``capacity_bytes`` is negative.
        StoreError: another process has the directory open.
    """

    name = "disk"
    kv_event_medium = "DISK"
    too_small_result = TOO_SMALL

    def __init__(self, path: str, capacity_bytes: int = 0, *,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, fsync: bool = True,
                 max_pending_evicted: int = 65536) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"kv_store: disk capacity must be a non-negative number of bytes, "
                             f"got {capacity_bytes!r}")
        self.path = os.path.abspath(path)
        self._clock = clock
        self._monotonic = monotonic
        self._fsync = fsync
        self._lock = threading.Lock()
        self._entries: dict[str, _DiskEntry] = {}
        self._order: SortedList = SortedList()
        self._seq = itertools.count(1)
        self._writing: set[str] = set()
        self._retained: dict[str, float] = {}  # stored keys under retention -> until
        self._next_expiry_s = float("inf")
        self._pending_retained: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._pending_evicted: collections.deque[str] = collections.deque()
        self._max_pending = max_pending_evicted
        self._used_bytes = 0  # stored values
        self._reserved_bytes = 0  # values being written
        self.counters = dict.fromkeys((
            "evicted_blocks_total", "refused_puts_total", "invalid_puts_total",
            "rejected_blocks_total", "missing_files_total", "evicted_dropped_total",
            "written_blocks_total", "hit_blocks_total"), 0)
        self.rejected_by_reason = dict.fromkeys(REJECT_REASONS, 0)
        self._open_directory()
        self._lock_fd = self._take_lock()
        try:
            found_bytes, self.found_blocks_at_start, self.removed_temp_files_at_start = \
                self._scan()
            if capacity_bytes == 0:
                free = shutil.disk_usage(self.path).free
                capacity_bytes = max(1, found_bytes + int(DEFAULT_FREE_SHARE * free))
            self.capacity_bytes = capacity_bytes
            with self._lock:
                self._make_room(0)  # a smaller capacity than last time: trim now
        except BaseException:
            os.close(self._lock_fd)
            raise
        log.info("kv_store_disk_open", path=self.path, capacity_bytes=self.capacity_bytes,
                 found_blocks=self.found_blocks_at_start, used_bytes=self._used_bytes,
                 removed_temp_files=self.removed_temp_files_at_start)

    # ---- opening ------------------------------------------------------------------------
    def _open_directory(self) -> None:
        try:
            if not os.path.lexists(self.path):
                os.makedirs(self.path, mode=0o700)
                os.chmod(self.path, 0o700)
            st = os.stat(self.path)
        except OSError as exc:
            raise ValueError(f"kv_store: cannot use disk directory {self.path}: "
                             f"{exc.strerror or exc}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"kv_store: disk path {self.path} is not a directory")
        if st.st_uid != os.geteuid():
            raise ValueError(f"kv_store: disk directory {self.path} belongs to uid {st.st_uid}, "
                             f"not to the service user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise ValueError(f"kv_store: disk directory {self.path} is open to other users "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); it must be private to "
                             f"the service user: chmod 700 {self.path}")

    def _take_lock(self) -> int:
        lock_path = os.path.join(self.path, _LOCK_NAME)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreError(f"kv_store disk: {self.path} is in use by another store "
                                 f"(pid {holder} holds {lock_path})") from None
            raise StoreError(f"kv_store disk: cannot lock {lock_path}: {exc}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _scan(self) -> tuple[int, int, int]:
        """Index every well-named value file; delete unfinished temporary files. Returns
        (bytes found, values found, temporary files removed)."""
        found: list[_DiskEntry] = []
        by_key: dict[str, _DiskEntry] = {}
        removed_tmp = 0
        for shard in os.scandir(self.path):
            if not (shard.is_dir(follow_symlinks=False) and len(shard.name) == 2
                    and all(c in "0123456789abcdef" for c in shard.name)):
                continue
            for item in os.scandir(shard.path):
                if item.name.startswith(_TMP_PREFIX):
                    try:
                        os.unlink(item.path)
                        removed_tmp += 1
                    except OSError:
                        pass
                    continue
                match = _NAME_RE.fullmatch(item.name)
                if match is None or not item.is_file(follow_symlinks=False):
                    continue
                key = match["key"]
                if key[-2:] != shard.name:
                    continue
                st = item.stat(follow_symlinks=False)
                entry = _DiskEntry(key, item.name, st.st_size, int(match["depth"]), st.st_mtime)
                other = by_key.get(key)
                if other is not None:  # two files for one key: keep the newer
                    older, entry = (other, entry) if other.access_s <= entry.access_s else \
                        (entry, other)
                    self._unlink(older)
                    found.remove(older)
                by_key[key] = entry
                found.append(entry)
        with self._lock:
            for entry in found:
                self._add(entry)
        return sum(e.nbytes for e in found), len(found), removed_tmp

    # ---- index (under the lock) ------------------------------------------------------------
    def _file(self, entry: _DiskEntry) -> str:
        return os.path.join(self.path, entry.key[-2:], entry.name)

    def _add(self, entry: _DiskEntry) -> None:
        self._entries[entry.key] = entry
        self._used_bytes += entry.nbytes
        until = self._pending_retained.pop(entry.key, None)
        if until is not None and until > self._monotonic():
            entry.retained_until_s = until
            self._retained[entry.key] = until
            self._next_expiry_s = min(self._next_expiry_s, until)
        self._rank(entry)

    def _rank(self, entry: _DiskEntry) -> None:
        """(Re-)place ``entry`` in the eviction order: retained last, then oldest access
        first, deeper first within one access time."""
        if entry.order:
            self._order.remove(entry.order)
        entry.order = (entry.retained_until_s is not None, entry.access_s, -entry.depth_tokens,
                       next(self._seq), entry.key)
        self._order.add(entry.order)

    def _forget(self, entry: _DiskEntry) -> None:
        """Drop ``entry`` from the index (its bytes no longer counted)."""
        del self._entries[entry.key]
        self._order.remove(entry.order)
        entry.order = ()
        self._used_bytes -= entry.nbytes
        self._retained.pop(entry.key, None)

    def _unlink(self, entry: _DiskEntry) -> None:
        try:
            os.unlink(self._file(entry))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kv_store_disk_unlink_failed", path=self._file(entry), error=str(exc))

    def _expire(self) -> None:
        """Retentions that ended make their blocks ordinary (placed by their access time)."""
        now = self._monotonic()
        if now < self._next_expiry_s:
            return
        for key, until in list(self._retained.items()):
            if until <= now:
                del self._retained[key]
                entry = self._entries[key]
                entry.retained_until_s = None
                self._rank(entry)
        self._next_expiry_s = min(self._retained.values(), default=float("inf"))

    def _make_room(self, nbytes: int) -> bool:
        """Evict until ``nbytes`` more fit; False (nothing more evicted) when they cannot."""
        if nbytes > self.capacity_bytes:
            return False
        while self._used_bytes + self._reserved_bytes + nbytes > self.capacity_bytes:
            self._expire()
            if not self._order:
                return False  # the rest is being written
            victim = self._entries[self._order[0][-1]]
            self._forget(victim)
            self._unlink(victim)
            self.counters["evicted_blocks_total"] += 1
            if len(self._pending_evicted) >= self._max_pending:
                self._pending_evicted.popleft()
                self.counters["evicted_dropped_total"] += 1
            self._pending_evicted.append(victim.key)
        return True

    # ---- reads -----------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value now (the index; files are checked when read)."""
        with self._lock:
            entries = self._entries
            return [k in entries for k in keys]

    def depth_tokens(self, key: str) -> int:
        """The stored block's depth in tokens (0 when not stored)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.depth_tokens if entry is not None else 0

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[int]:
        """Read each key's file into ``ptrs[i]`` (room for ``sizes[i]`` bytes) and check it
        (see the module doc); a value that passes counts as an access.

        Returns:
            Per key the bytes written, ``-1`` (:data:`MISSING`: not stored, its file gone, or
            refused by the check: the file is deleted and the reason counted) or ``-2``
            (:data:`TOO_SMALL`: the file is larger than the room; nothing usable written).

        Raises:
            ValueError: naming ``ptrs`` / ``sizes`` when their lengths differ from ``keys``.
        """
        if not len(keys) == len(ptrs) == len(sizes):
            raise ValueError(f"ptrs / sizes: expected {len(keys)} each, got {len(ptrs)} / "
                             f"{len(sizes)}")
        out: list[int] = []
        hits: list[_DiskEntry] = []
        for key, ptr, size in zip(keys, ptrs, sizes):
            with self._lock:
                entry = self._entries.get(key)
            if entry is None:
                out.append(MISSING)
                continue
            result = self._read_one(entry, ptr, size)
            out.append(result)
            if result >= 0:
                hits.append(entry)
        if hits:
            now = self._clock()
            with self._lock:
                for entry in hits:
                    if self._entries.get(entry.key) is entry:
                        entry.access_s = now
                        self._rank(entry)
                self.counters["hit_blocks_total"] += len(hits)
            ns = int(now * 1e9)
            for entry in hits:  # the access order outlives the process
                try:
                    os.utime(self._file(entry), ns=(ns, ns))
                except OSError:
                    pass
        return out

    def _read_one(self, entry: _DiskEntry, ptr: int, size: int) -> int:
        path = self._file(entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            self._drop(entry, None)
            return MISSING
        except OSError as exc:
            self._drop(entry, "io", str(exc))
            return MISSING
        try:
            nbytes = os.fstat(fd).st_size
            if nbytes > size:
                return TOO_SMALL
            view = memoryview((ctypes.c_char * max(nbytes, 1)).from_address(ptr)).cast("B")
            view = view[:nbytes]
            got = 0
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], got)
                if n <= 0:
                    break
                got += n
        except OSError as exc:
            self._drop(entry, "io", str(exc))
            return MISSING
        finally:
            os.close(fd)
        reason = self._check(entry, view[:got])
        if reason is not None:
            self._drop(entry, reason)
            return MISSING
        return got

    def _check(self, entry: _DiskEntry, value: memoryview) -> str | None:
        header = read_header(value)
        if isinstance(header, str):
            return header
        if header.key != entry.key:
            return foreign_reason(entry.key, header)
        if header_digest(value[: header.header_bytes]) != entry.name.rsplit(".h", 1)[1]:
            return "header"
        if len(value) != header.header_bytes + header.payload_bytes:
            return "size"
        if payload_checksum(value[header.header_bytes:]) != header.checksum:
            return "checksum"
        return None

    def _drop(self, entry: _DiskEntry, reason: str | None, detail: str = "") -> None:
        """Forget a value whose file is gone (``reason`` None) or refused (deleted, counted)."""
        with self._lock:
            current = self._entries.get(entry.key) is entry
            if current:
                self._forget(entry)
                if reason is not None:
                    self._unlink(entry)
            if reason is None:
                self.counters["missing_files_total"] += 1
            else:
                self.counters["rejected_blocks_total"] += 1
                self.rejected_by_reason[reason] += 1
        if reason is not None:
            log.warning("kv_store_disk_value_rejected", reason=reason, file=self._file(entry),
                        detail=detail or None)

    def on_rejected(self, key: str, reason: str) -> None:
        """The tier refused the value read under ``key``: delete its file (counted under
        ``reason``), so that the block, computed again, is written afresh."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            self._drop(entry, reason if reason in self.rejected_by_reason else "header")

    # ---- writes ----------------------------------------------------------------------------
    def put(self, entries: Sequence[PutEntry]) -> list[bool]:
        """Write each entry's value to its own file atomically (see the module doc).

        A key already stored (or being written by another thread) is left as it is (True).
        Refused (False, counted in ``disk_refused_puts_total``): a value larger than the
        capacity, one that cannot be made room for, or a full file system; refused as invalid
        (False, ``disk_invalid_puts_total``): a key that is not a store key, or a value whose
        header does not parse, name the key or give its length.

        Raises:
            StoreError: the directory cannot be written (gone, read-only, an I/O error).
        """
        out: list[bool] = []
        dirs: set[str] = set()
        try:
            for e in entries:
                out.append(self._put_one(e, dirs))
        finally:
            if self._fsync:
                for d in dirs:
                    _fsync_dir(d)
        return out

    def _put_one(self, e: PutEntry, dirs: set[str]) -> bool:
        with self._lock:
            if e.key in self._entries or e.key in self._writing:
                return True
        view = memoryview((ctypes.c_char * max(e.nbytes, 1)).from_address(e.ptr)).cast("B")
        view = view[: e.nbytes]
        header = read_header(view) if _KEY_RE.fullmatch(e.key) else "key"
        if isinstance(header, str) or header.key != e.key or \
                header.header_bytes + header.payload_bytes != e.nbytes:
            with self._lock:
                self.counters["invalid_puts_total"] += 1
            return False
        name = file_name(e.key, max(0, e.depth_tokens),
                         header_digest(view[: header.header_bytes]))
        with self._lock:
            if e.key in self._entries or e.key in self._writing:
                return True
            if not self._make_room(e.nbytes):
                self.counters["refused_puts_total"] += 1
                return False
            self._reserved_bytes += e.nbytes
            self._writing.add(e.key)
        now = self._clock()
        shard = os.path.join(self.path, e.key[-2:])
        stored = False
        try:
            self._write_file(shard, name, view, now)
            stored = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise StoreError(f"kv_store disk: cannot write {shard}/{name}: "
                                 f"{exc.strerror or exc}") from exc
            log.warning("kv_store_disk_full", path=self.path, error=str(exc))
        finally:
            with self._lock:
                self._writing.discard(e.key)
                self._reserved_bytes -= e.nbytes
                if stored:
                    self._add(_DiskEntry(e.key, name, e.nbytes, max(0, e.depth_tokens), now))
                    self.counters["written_blocks_total"] += 1
                else:
                    self.counters["refused_puts_total"] += 1
        if stored:
            dirs.add(shard)
        return stored

    def _write_file(self, shard: str, name: str, view: memoryview, now: float) -> None:
        """Temporary file in ``shard`` → data flushed → renamed to ``name``."""
        try:
            os.mkdir(shard, 0o700)
            if self._fsync:
                _fsync_dir(self.path)
        except FileExistsError:
            pass
        tmp = os.path.join(shard, _TMP_PREFIX + secrets.token_hex(8))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            try:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                if self._fsync:
                    os.fdatasync(fd)
                ns = int(now * 1e9)
                os.utime(fd, ns=(ns, ns))
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(shard, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    # ---- retention ---------------------------------------------------------------------------
    def mark_retained(self, keys: Sequence[str], until_s: float) -> None:
        """Keep ``keys`` out of eviction while any key not retained is left, until ``until_s``
        (``time.monotonic`` seconds, or the injected ``monotonic``); a later end extends an
        earlier one, never the reverse. Keys not stored yet are remembered (the latest
        ``MAX_PENDING_RETAINED``) and retained when they are written. ``until_s`` at or before
        now (``-inf``: ``StoreTier.unmark_retained``) clears the keys' marks instead, stored or
        remembered: they rank by their access time again."""
        with self._lock:
            if until_s <= self._monotonic():
                for key in keys:
                    self._pending_retained.pop(key, None)
                    entry = self._entries.get(key)
                    if entry is not None and entry.retained_until_s is not None:
                        entry.retained_until_s = None
                        self._retained.pop(key, None)
                        self._rank(entry)
                return
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    until = max(until_s, self._pending_retained.pop(key, until_s))
                    self._pending_retained[key] = until
                    if len(self._pending_retained) > MAX_PENDING_RETAINED:
                        self._pending_retained.popitem(last=False)
                    continue
                if entry.retained_until_s is not None and entry.retained_until_s >= until_s:
                    continue
                entry.retained_until_s = until_s
                self._retained[key] = until_s
                self._next_expiry_s = min(self._next_expiry_s, until_s)
                self._rank(entry)

    # ---- removal, events, gauges, lifecycle --------------------------------------------------
    def remove(self, keys: Sequence[str]) -> int:
        """Delete keys' files (tests, ``reset``); returns how many were stored. Removed keys
        are not reported by :meth:`drain_evicted`."""
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._forget(entry)
                    self._unlink(entry)
                    removed += 1
        return removed

    def clear(self) -> int:
        """Delete every value file (``reset_prefix_cache``) and forget the evictions not
        drained yet; returns how many values were held."""
        with self._lock:
            entries = list(self._entries.values())
            for entry in entries:
                self._forget(entry)
                self._unlink(entry)
            self._pending_evicted.clear()
            self._pending_retained.clear()
        return len(entries)

    def drain_evicted(self) -> list[str]:
        """Keys evicted for room since the last call (oldest first), for ``BlockRemoved`` KV
        events with medium ``"DISK"``; at most ``max_pending_evicted`` are kept between calls
        (older ones dropped, counted in ``disk_evicted_dropped_total``)."""
        with self._lock:
            keys = list(self._pending_evicted)
            self._pending_evicted.clear()
        return keys

    def healthy(self) -> bool:
        """The directory is still there and writable."""
        return os.path.isdir(self.path) and os.access(self.path, os.W_OK | os.X_OK)

    def stats(self) -> dict:
        """Gauges, all named ``disk_*``: ``disk_path``, ``disk_capacity_bytes``,
        ``disk_used_bytes`` (stored value bytes), ``disk_num_blocks`` (stored values),
        ``disk_retained_blocks``, ``disk_found_blocks_at_start``,
        ``disk_removed_temp_files_at_start``, ``disk_written_blocks_total``,
        ``disk_hit_blocks_total``, ``disk_evicted_blocks_total`` (evicted for room),
        ``disk_refused_puts_total`` (no room), ``disk_invalid_puts_total``,
        ``disk_missing_files_total`` (indexed files found gone), ``disk_rejected_blocks_total``
        and ``disk_rejected_blocks_by_reason`` (values refused when read: ``size``,
        ``header``, ``foreign``, ``format``, ``checksum``, ``io``), ``disk_evicted_dropped_total``."""
        with self._lock:
            out: dict[str, object] = {
                "disk_path": self.path,
                "disk_capacity_bytes": self.capacity_bytes,
                "disk_used_bytes": self._used_bytes,
                "disk_num_blocks": len(self._entries),
                "disk_retained_blocks": len(self._retained),
                "disk_found_blocks_at_start": self.found_blocks_at_start,
                "disk_removed_temp_files_at_start": self.removed_temp_files_at_start,
            }
            out.update((f"disk_{k}", v) for k, v in self.counters.items())
            out["disk_rejected_blocks_by_reason"] = dict(self.rejected_by_reason)
        return out

    def close(self) -> None:
        """Release the directory (its lock); the files stay for the next process. No call
        may follow."""
        with self._lock:
            fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

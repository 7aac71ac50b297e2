"""The ``mooncake`` backend: a Mooncake Store client shared by every replica on one master.

``MooncakeStore`` wraps ``mooncake.store.MooncakeDistributedStore`` (pip
``mooncake-transfer-engine-non-cuda``, the CPU build; it needs the Debian packages
``libibverbs1`` and ``libnuma1`` even over TCP). Each client contributes ``segment_bytes`` of
its own memory to the shared pool and moves values with the zero-copy batch calls
(``batch_put_from`` / ``batch_get_into``) straight from / into the tier's staging buffers. The
master keeps only metadata: when it restarts, every earlier object is gone.

Return codes, measured on 0.3.13.post1 over TCP loopback (``ErrorCode`` in Mooncake's
``mooncake-store/include/types.h``):

* ``batch_is_exist``: 1 present, 0 absent, -900 (``RPC_FAIL``) master unreachable.
* ``batch_put_from``: 0 stored — also for a key that already holds a value, which is left as
  it was (values are immutable; a duplicate key inside one batch is 0 twice); -200
  (``NO_AVAILABLE_HANDLE``) no space, or no segment mounted yet right after a master restart;
  -600 (``INVALID_PARAMS``) a zero size; -900 master unreachable. -705
  (``OBJECT_ALREADY_EXISTS``) is read as stored too, should a release return it.
* ``batch_get_into``: the value's size in bytes; -704 (``OBJECT_NOT_FOUND``) missing; -600 the
  buffer is smaller than the value (nothing copied); -707 (``LEASE_EXPIRED``) / -800
  (``TRANSFER_FAIL``) the copy failed; -900 master unreachable.
* ``batch_remove(force=True)``: 0 removed, -704 missing. Without ``force`` a value read or
  written in the last ``--default_kv_lease_ttl`` (10 s) is refused with -706
  (``OBJECT_HAS_LEASE``), so ``remove`` forces.
* ``health_check``: 0 healthy, 1 closed, 2 master unreachable. It reflects the client's
  heartbeat, so it still says 0 for up to ~6 s after the master died.

Any -9xx code (RPC errors: the master is unreachable) raises :class:`StoreError`; other negative
codes are per-key answers (not stored / not fetched). TCP transfers work from unregistered
memory too, but RDMA needs the registration, so the tier registers its buffers.

Timing with the master dead (measured): a call returns -900 at once or after ~4.4 s (the
client's own reconnect attempt); a new client's ``setup`` blocks ~4.4 s with an explicit
``local=HOST:PORT``, ~90 s without a port (it retries 20 ports); ``close`` takes 1–2 s with the
master up and 6–16 s with it down. So after a -9xx answer this backend fails every call at once
for ``PROBE_INTERVAL_S``, then lets a call through only when a TCP connect to the master's RPC
port succeeds (``PROBE_TIMEOUT_S``); ``reconnect`` probes first and never calls ``setup``
against a dead master. The tier's loader keeps its own timeout on top.

At start (``connect_timeout_s``; ``radixkv serve --kv-store-connect-timeout``) the backend
waits for a master that is not up yet, looking every ``CONNECT_POLL_S`` until its RPC port
accepts a connection and its HTTP metadata server answers: a replica started right after
``mooncake_master … &`` comes up once the master has bound its ports (~1–2 s), and one with
no master fails after the bound with the same "master unreachable" error.

Calls run concurrently (the client is thread-safe: a 64-value put takes ~60 ms and must not hold
up a fetch); ``reconnect`` and ``close`` wait for the calls in flight and hold new ones back.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixkv.cache.store.backend import KVStoreSpec, PutEntry, StoreBackend
from radixkv.errors import StoreError
from radixkv.log import get_logger

log = get_logger(__name__)

#: What makes the backend importable (named in every "not installed" error).
MOONCAKE_PIP_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
MOONCAKE_DEBIAN_PACKAGES = ("libibverbs1", "libnuma1")
INSTALL_HINT = (f"pip install '{MOONCAKE_PIP_PACKAGE}' (the radixkv[mooncake] extra) and "
                f"apt-get install {' '.join(MOONCAKE_DEBIAN_PACKAGES)}")

# Mooncake ErrorCode values this module reasons about (see the module docstring).
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
# health_check() answers.
HEALTHY, CLOSED, MASTER_UNREACHABLE = 0, 1, 2

#: After the master failed a call, calls fail at once for this long before a probe is tried.
PROBE_INTERVAL_S = 1.0
#: Bound on the TCP connect that tells whether the master's RPC port is up.
PROBE_TIMEOUT_S = 0.5
#: Seconds between looks at a master not up yet, while the start-up wait lasts.
CONNECT_POLL_S = 0.25


def _unreachable(code: int) -> bool:
    """Mooncake's RPC error range (-900..-999): the master did not answer."""
    return -999 <= code <= -900


def _fresh_local(local: str) -> str:
    """``local`` with a free port on the same host (unchanged when it names no port: Mooncake
    picks one itself then)."""
    host, sep, port = local.rpartition(":")
    if not sep or not port.isdigit() or host.count(":") and not host.endswith("]"):
        return local
    with socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET) as sock:
        sock.bind((host.strip("[]"), 0))
        return f"{host}:{sock.getsockname()[1]}"


def import_client_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``.

    Raises:
        StoreError: naming the pip and Debian packages when it cannot be imported (not
            installed, or ``libibverbs.so.1`` / ``libnuma.so.1`` missing).
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as exc:
        raise StoreError(f"kv_store mooncake: cannot import mooncake.store ({exc}); install it: "
                         f"{INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def split_host_port(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port).

    Raises:
        ValueError: no numeric port.
    """
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


class _SharedLock:
    """Many shared holders (client calls) or one exclusive holder (swap / close of the client);
    a waiting exclusive holder keeps new shared holders out, so a reconnect is not starved."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def acquire_shared(self, blocking: bool = True) -> bool:
        with self._cond:
            if self._exclusive and not blocking:
                return False
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
            return True

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared:
                self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class MooncakeStore(StoreBackend):
    """A Mooncake Store client for one replica (thread-safe).

    Args:
        spec: A ``mooncake://`` ``KVStoreSpec``: ``master``, ``metadata_url``,
            ``local_hostname`` (give each replica on a host its own ``HOST:PORT``),
            ``segment_bytes`` (memory this client adds to the shared pool, allocated at
            connect), ``buffer_bytes`` (the client's own transfer buffer), ``protocol``.

    Raises:
        StoreError: mooncake is not installed (naming the packages), the master's RPC port does
            not accept a connection, or ``setup`` failed (naming the master and metadata URL).
        ValueError: ``spec`` is not a mooncake spec.
    """

    name = "mooncake"
    kv_event_medium = None
    too_small_result = INVALID_PARAMS  # batch_get_into: the buffer is too small

    def __init__(self, spec: KVStoreSpec, *, connect_timeout_s: float = 0.0) -> None:
        if spec.kind != "mooncake":
            raise ValueError(f"kv_store: MooncakeStore needs a mooncake:// spec, got {spec.kind!r}")
        self._spec = spec
        self._master_host, self._master_port = split_host_port(spec.master)
        self._client_class = import_client_class()
        self._lock = _SharedLock()
        self._state_lock = threading.Lock()  # guards the counters and the down state below
        self._buffers: dict[int, int] = {}  # ptr -> bytes, re-registered on a new client
        self._down = False  # the master failed a call; fail fast until a probe succeeds
        self._next_probe_s = 0.0
        self._reconnects_total = 0
        self.last_put_error: int | None = None
        self._last_healthy = True  # what healthy() last found (stats() must not block)
        self._unreachable_total = 0
        self._closed = False
        self._local = spec.local_hostname  # this client's transfer-engine address
        self._client: Any = self._new_client(wait_s=connect_timeout_s)

    # -- connection ----------------------------------------------------------------------------

    def _metadata_reachable(self) -> bool:
        """Whether the HTTP metadata server answers at all (any status; True for other
        metadata services: nothing to ask)."""
        url = self._spec.metadata_url
        if not url.startswith(("http://", "https://")):
            return True
        try:
            with urllib.request.urlopen(f"{url}?key=radixkv-probe", timeout=PROBE_TIMEOUT_S):
                return True
        except urllib.error.HTTPError:  # a missing key is a 404: the server is up
            return True
        except OSError:
            return False

    def _wait_for_master(self, wait_s: float) -> bool:
        """Look at the master until its RPC port and metadata server are both up, for at most
        ``wait_s`` seconds (0: look once); True when they are."""
        deadline = time.monotonic() + wait_s
        logged = False
        while not (self._master_reachable() and self._metadata_reachable()):
            if time.monotonic() >= deadline:
                return False
            if not logged:  # why serve sits still; once
                log.info("kv_store_waiting_for_master", master=self._spec.master,
                         metadata=self._spec.metadata_url, up_to_s=wait_s)
                logged = True
            time.sleep(CONNECT_POLL_S)
        return True

    def _master_reachable(self) -> bool:
        """Whether the master's RPC port accepts a TCP connection within PROBE_TIMEOUT_S."""
        try:
            with socket.create_connection((self._master_host, self._master_port), PROBE_TIMEOUT_S):
                return True
        except OSError:
            return False

    def _new_client(self, wait_s: float = 0.0) -> Any:
        """A set-up client with every known buffer registered (caller holds no shared lock);
        ``wait_s``: how long a master not up yet is waited for (start-up only)."""
        spec = self._spec
        where = f"master {spec.master}, metadata {spec.metadata_url}, local {self._local}"
        if wait_s > 0 and not self._wait_for_master(wait_s):
            raise StoreError(f"kv_store mooncake: master unreachable after {wait_s:g} s "
                             f"({where})")
        # setup() against a dead master blocks 4–90 s: probe first.
        if not self._master_reachable():
            raise StoreError(f"kv_store mooncake: master unreachable ({where})")
        client = self._client_class()
        rc = client.setup(self._local, spec.metadata_url, spec.segment_bytes,
                          spec.buffer_bytes, spec.protocol, "", spec.master)
        if rc != 0:
            raise StoreError(f"kv_store mooncake: setup failed with {rc} ({where})")
        for ptr, nbytes in self._buffers.items():
            rc = client.register_buffer(ptr, nbytes)
            if rc != 0:
                client.close()
                raise StoreError(f"kv_store mooncake: register_buffer({nbytes} bytes) failed "
                                 f"with {rc} on a new client ({where})")
        return client

    def _mark_down(self) -> None:
        with self._state_lock:
            self._unreachable_total += 1
            self._down = True
            self._next_probe_s = time.monotonic() + PROBE_INTERVAL_S

    def _check_up(self, what: str) -> None:
        """Raise at once while the master is known down (a probe at most every
        PROBE_INTERVAL_S lets calls through again when its port answers)."""
        with self._state_lock:
            if not self._down:
                return
            now = time.monotonic()
            if now < self._next_probe_s:
                raise StoreError(f"kv_store mooncake {what}: master {self._spec.master} unreachable")
            self._next_probe_s = now + PROBE_INTERVAL_S
        if not self._master_reachable():
            raise StoreError(f"kv_store mooncake {what}: master {self._spec.master} unreachable")
        with self._state_lock:
            self._down = False

    def _call(self, what: str, fn: Callable[[Any], list[int]]) -> list[int]:
        """Run ``fn(client)`` under the shared lock; -9xx codes and exceptions → StoreError."""
        with self._lock.shared():
            client = self._client
            if client is None:
                raise StoreError(f"kv_store mooncake {what}: no client (closed, or the last "
                                 f"reconnect to {self._spec.master} failed)")
            self._check_up(what)
            try:
                codes = fn(client)
            except Exception as exc:  # pybind11 raises RuntimeError & co. from C++
                raise StoreError(f"kv_store mooncake {what}: {type(exc).__name__}: {exc}") from exc
        bad = next((code for code in codes if _unreachable(code)), None)
        if bad is not None:
            self._mark_down()
            raise StoreError(f"kv_store mooncake {what}: master {self._spec.master} unreachable "
                             f"(error {bad})")
        return codes

    # -- StoreBackend --------------------------------------------------------------------------

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr`` with the client (and with every client a reconnect
        makes). Without a live client it is only remembered.

        Raises:
            StoreError: the client refused it (its return code in the message).
        """
        with self._lock.shared():
            self._buffers[ptr] = nbytes
            if self._client is None:
                return
            rc = self._client.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StoreError(f"kv_store mooncake: register_buffer({nbytes} bytes) failed with {rc}")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value (``batch_is_exist``).

        Raises:
            StoreError: master unreachable, or the client answered -1 (error) for a key.
        """
        if not keys:
            return []
        codes = self._call("exists", lambda c: c.batch_is_exist(list(keys)))
        if any(code < 0 for code in codes):
            raise StoreError(f"kv_store mooncake exists: batch_is_exist returned {codes}")
        return [code == 1 for code in codes]

    def put(self, entries: Sequence[PutEntry]) -> list[bool]:
        """``batch_put_from`` the entries' values (copied before it returns). A key that already
        holds a value counts as stored and keeps its old value.

        Returns:
            Per entry whether the key holds a value now (False: no space, bad size, transfer
            failed).

        Raises:
            StoreError: master unreachable.
        """
        if not entries:
            return []
        keys = [e.key for e in entries]
        ptrs = [e.ptr for e in entries]
        sizes = [e.nbytes for e in entries]
        codes = self._call("put", lambda c: c.batch_put_from(keys, ptrs, sizes))
        refused = [code for code in codes if code not in (0, OBJECT_ALREADY_EXISTS)]
        if refused:
            self.last_put_error = refused[-1]
        return [code in (0, OBJECT_ALREADY_EXISTS) for code in codes]

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[int]:
        """``batch_get_into``: per key the bytes written, or Mooncake's negative code (-704
        missing, -600 buffer too small, -707 / -800 transfer failed).

        Raises:
            StoreError: master unreachable.
            ValueError: the three sequences differ in length.
        """
        if not len(keys) == len(ptrs) == len(sizes):
            raise ValueError(f"get_into: {len(keys)} keys, {len(ptrs)} ptrs, {len(sizes)} sizes")
        if not keys:
            return []
        return self._call("get", lambda c: c.batch_get_into(list(keys), list(ptrs), list(sizes)))

    def remove(self, keys: Sequence[str]) -> int:
        """Force-remove keys (ignoring read leases); returns how many were present.

        Raises:
            StoreError: master unreachable.
        """
        if not keys:
            return 0
        codes = self._call("remove", lambda c: c.batch_remove(list(keys), True))
        return sum(1 for code in codes if code == 0)

    def healthy(self) -> bool:
        """Not known down, the client's heartbeat reaches the master, and the metadata server
        still has this client's transfer-engine registration; False while a reconnect or close
        is under way (never blocks on one). Up to ``PROBE_TIMEOUT_S`` (a local HTTP GET): the
        tier calls it from its writer thread, never from the engine's.

        Why the registration: a restarted master forgets every client; an old client re-mounts
        its segment and re-publishes its ``ram`` entry by itself, but not its ``rpc_meta``, so
        transfers to or from its segment fail ("metadata not found") while it reports healthy.
        """
        if not self._lock.acquire_shared(blocking=False):
            return False
        try:
            with self._state_lock:
                down = self._down
            ok = (not down and self._client is not None
                  and self._client.health_check() == HEALTHY and self._registered())
        finally:
            self._lock.release_shared()
        self._last_healthy = ok
        return ok

    def _registered(self) -> bool:
        """Whether the HTTP metadata server knows this client's ``rpc_meta`` (True for other
        metadata services: nothing to ask)."""
        url = self._spec.metadata_url
        if not url.startswith(("http://", "https://")):
            return True
        key = urllib.parse.quote(f"mooncake/rpc_meta/{self._client.get_hostname()}", safe="")
        try:
            with urllib.request.urlopen(f"{url}?key={key}", timeout=PROBE_TIMEOUT_S):
                return True
        except urllib.error.HTTPError as exc:
            return exc.code != 404
        except OSError:
            return False

    def reconnect(self) -> bool:
        """Make the backend usable again: when it is not healthy, close the client and set up a
        new one with every buffer registered again (the old client would re-mount by itself
        after a master restart, but its ``health_check`` says 0 for seconds before it has, and
        its puts fail meanwhile). Returns at once with False while the master's port is closed.

        Returns:
            True when calls may go through again.
        """
        if self._closed:
            return False
        if self.healthy():
            return True
        if not self._master_reachable():
            self._mark_down()
            return False
        with self._lock.exclusive():
            if self._closed:
                return False
            old, self._client = self._client, None
            if old is not None:
                with contextlib.suppress(Exception):  # the old one is being dropped anyway
                    old.close()
            # A new address: peers cache a segment's transport endpoint by its name, so a new
            # client under the old name would be unreachable to them ("connection refused").
            self._local = _fresh_local(self._local)
            try:
                self._client = self._new_client()
            except StoreError:
                self._mark_down()
                return False
            with self._state_lock:
                self._reconnects_total += 1
                self._down = False
        return True

    def stats(self) -> dict:
        """``master``, ``healthy``, ``clients_replaced_total``,
        ``unreachable_errors_total`` (calls the master did not answer),
        ``registered_buffer_bytes``, ``segment_bytes`` (memory this client adds to the pool),
        ``last_put_error`` (the last Mooncake code a put was refused with, or None)."""
        with self._state_lock:
            return {"master": self._spec.master, "healthy": self._last_healthy,
                    "clients_replaced_total": self._reconnects_total,
                    "unreachable_errors_total": self._unreachable_total,
                    "registered_buffer_bytes": sum(self._buffers.values()),
                    "segment_bytes": self._spec.segment_bytes,
                    "last_put_error": self.last_put_error}

    def close(self) -> None:
        """Close the client after the calls in flight. Blocks 1–2 s (6–16 s with the master
        down: the client tries to unmount its segment)."""
        with self._lock.exclusive():
            self._closed = True
            client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()

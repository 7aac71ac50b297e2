"""A real ``mooncake_master`` for tests: free loopback ports, a bounded readiness wait, stop by
PID, restart on the same ports.

The master comes from the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``, which puts
``mooncake_master`` next to the venv's python) and needs the Debian packages ``libibverbs1`` and
``libnuma1``. Without them a test calling :func:`require_mooncake` skips naming what to install,
unless ``RADIXKV_REQUIRE_MOONCAKE=1`` (``.ci/run`` sets it): then it fails.

Every port is bound on 127.0.0.1: RPC (``--rpc_address``), HTTP metadata server and metrics.
(0.3.13.post1 logs its metadata server on 127.0.0.1 but listens on 0.0.0.0 all the same.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixkv.cache.store.mooncake import INSTALL_HINT

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
REQUIRE_ENV = "RADIXKV_REQUIRE_MOONCAKE"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_hostname() -> str:
    """A transfer-engine address for one client (replica): ``127.0.0.1:<free port>``."""
    return f"127.0.0.1:{free_port()}"


def master_binary() -> str | None:
    """``mooncake_master`` next to the running python, else on ``$PATH``."""
    local = Path(sys.executable).parent / "mooncake_master"
    return str(local) if local.exists() else shutil.which("mooncake_master")


def mooncake_available() -> str | None:
    """None when the client imports and the master binary exists, else why not (with what to
    install)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mooncake not usable ({exc}): {INSTALL_HINT}"
    if master_binary() is None:
        return f"mooncake_master not found next to {sys.executable} or on PATH: {INSTALL_HINT}"
    return None


def require_mooncake() -> None:
    """Skip the test when Mooncake is not usable (fail instead under RADIXKV_REQUIRE_MOONCAKE=1,
    so CI cannot pass with the Mooncake tests silently skipped)."""
    reason = mooncake_available()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


def _die_with_parent() -> None:
    """In the master's child process: SIGTERM it when pytest dies without its teardown, so no
    master is left holding ports. Linux only (prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class MooncakeMaster:
    """One ``mooncake_master`` process on loopback with an HTTP metadata server.

    Args:
        log_path: Where its stdout and stderr go (appended across restarts).
        extra_args: More master flags (e.g. ``--default_kv_lease_ttl=1000``).
    """

    def __init__(self, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.log_path = Path(log_path)
        self.extra_args = tuple(extra_args)
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def master_addr(self) -> str:
        """``127.0.0.1:<rpc port>``."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """``http://127.0.0.1:<port>/metadata``."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def kv_store_url(self, local: str | None = None, segment_gib: float = 0.25) -> str:
        """A ``--kv-store`` value for this master (``parse_kv_store`` accepts it).

        Args:
            local: The client's transfer-engine ``HOST:PORT``; None: a fresh free port.
            segment_gib: Memory the client adds to the pool.
        """
        local = local or local_hostname()
        return (f"mooncake://{self.master_addr}?metadata={self.metadata_url}&local={local}"
                f"&segment_gib={segment_gib:g}")

    def argv(self) -> list[str]:
        binary = master_binary()
        if binary is None:
            raise RuntimeError(f"mooncake_master not found: {INSTALL_HINT}")
        return [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", *self.extra_args]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"<no master log: {exc}>"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> MooncakeMaster:
        """Start the process (on this object's ports) and wait until it serves.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout_s`` (with its log tail).
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"mooncake_master already running (pid {self.proc.pid})")
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the metadata server answers HTTP and the RPC port accepts a connection (the RPC
        server comes up ~1.2 s after the metadata server).

        Raises:
            RuntimeError: as for ``start``.
        """
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"mooncake_master exited with {code} before it was ready:\n"
                                   f"{self.log_tail()}")
            try:
                # Any HTTP answer (a missing key is 404) means the metadata server is up.
                urllib.request.urlopen(self.metadata_url + "?key=radixkv-probe", timeout=1).close()
                http_up = True
            except urllib.error.HTTPError:
                http_up = True
            except OSError as exc:
                http_up, last = False, exc
            if http_up:
                try:
                    socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1).close()
                    return
                except OSError as exc:
                    last = exc
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master not ready after {timeout_s} s (last: {last!r}):\n"
                           f"{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM by PID, then SIGKILL after ``STOP_TIMEOUT_S``; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
        return proc.returncode

    def kill(self) -> int | None:
        """SIGKILL by PID (a crash: no clean shutdown); returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        return proc.returncode

    def restart(self, timeout_s: float = READY_TIMEOUT_S) -> MooncakeMaster:
        """Stop, then start again on the same ports (earlier objects are gone: the master kept
        their metadata only in memory)."""
        self.stop()
        return self.start(timeout_s)


@contextlib.contextmanager
def run_master(log_dir: Path, extra_args: tuple[str, ...] = ()) -> Iterator[MooncakeMaster]:
    """A started master (skips or fails per :func:`require_mooncake`), stopped on exit."""
    require_mooncake()
    master = MooncakeMaster(Path(log_dir) / "mooncake_master.log", extra_args)
    master.start()
    try:
        yield master
    finally:
        master.stop()

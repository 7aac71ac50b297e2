"""Real routers in front of real radixkv replicas: the processes and their bounded waits.

A router is started from its PyPI wheel's console script (``vllm-router``, ``sglang-router
launch``) as a separate process on a free 127.0.0.1 port, with its stdout and stderr in a log
file; it is ready once its ``GET /readiness`` reports every worker healthy, and it is stopped by
PID (SIGTERM, then SIGKILL). Replicas are in-process tiny-model servers
(``tests.server.conftest.run_server_in_thread``), each with its own copy of the weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from radixkv.engine.async_engine import AsyncEngine
from radixkv.model.loader import LoadedModel, load_model
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread

# Console script -> (arguments before the router flags, platforms its PyPI wheel exists for as
# (sys.platform, machine) pairs; None: every platform).
ROUTERS: dict[str, tuple[tuple[str, ...], set[tuple[str, str]] | None]] = {
    "vllm-router": ((), {("linux", "x86_64"), ("linux", "aarch64")}),
    "sglang-router": (("launch",), None),
}
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_binary(name: str) -> str:
    """Path of the router's console script: the running venv's first, then ``$PATH``.

    Skips the test when the wheel has no build for this platform; fails when it has one but
    the script is missing (the dev extra installs it, so that is a broken environment).
    """
    _, platforms = ROUTERS[name]
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found:
        return found
    here = (sys.platform, platform.machine().lower())
    if platforms is not None and here not in platforms:
        pytest.skip(f"{name}: no PyPI wheel for {here[0]}/{here[1]}, so the binary is not installed")
    pytest.fail(f"{name} not found next to {sys.executable} or on PATH: install the dev extra "
                "(.venv/bin/pip install -e '.[dev]')")


@dataclass
class RouterProcess:
    """A running router: its process, where it listens, and where its output goes."""

    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    worker_urls: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        """The router's whole output so far, colour codes removed (its debug lines colour
        field names, so a raw ``source=...`` never matches)."""
        return _ANSI.sub("", self.log_path.read_text(errors="replace"))

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the router's output, colour codes removed."""
        try:
            text = self.log_text()
        except OSError as exc:
            return f"<no router log: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode


def router_command(name: str, port: int, worker_urls: Sequence[str], policy: str,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The argv that starts router ``name`` on 127.0.0.1:``port`` over ``worker_urls``.

    Its Prometheus exporter gets a free port of its own: both routers default to 29000 (and
    sglang-router to 0.0.0.0), which two routers or two test runs would fight over.
    """
    prefix, _ = ROUTERS[name]
    return [router_binary(name), *prefix, "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *extra_args]


def wait_ready(router: RouterProcess, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
    """Poll ``GET /readiness`` until every worker is healthy; returns that body.

    Raises:
        RuntimeError: the process exited, or ``timeout_s`` passed; the message holds the
            router's last output.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"{router.name} exited with {router.proc.returncode} before it was "
                               f"ready:\n{router.log_tail()}")
        try:
            resp = requests.get(router.url + "/readiness", timeout=2)
            last = (resp.status_code, resp.text[:300])
            if resp.status_code == 200:
                body = resp.json()
                if body.get("healthy_workers") == len(router.worker_urls):
                    return body
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{router.name} not ready after {timeout_s} s (last /readiness: {last!r}):"
                       f"\n{router.log_tail()}")


def _die_with_parent() -> None:
    """In the router's child process: SIGTERM it when pytest dies without its teardown (killed
    by a CI timeout), so no router is left holding a port. Linux only (prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextlib.contextmanager
def run_router(name: str, worker_urls: Sequence[str], log_dir: Path, *,
               policy: str = "round_robin", extra_args: Sequence[str] = (),
               ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[RouterProcess]:
    """Start router ``name`` as a process, wait until it is ready, stop it on exit.

    Args:
        name: a key of ``ROUTERS``.
        worker_urls: the replicas' base URLs (``http://127.0.0.1:PORT``).
        log_dir: where ``<name>.log`` (stdout and stderr together) is written.
        policy: the router's ``--policy``.
        extra_args: more router flags (e.g. ``--kv-event-source ...`` for ``kv_aware``).
        ready_timeout_s: bound on the wait for ``/readiness``.

    Raises:
        RuntimeError: as for ``wait_ready`` (the process is stopped first).
    """
    port = free_port()
    argv = router_command(name, port, worker_urls, policy, extra_args)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    router = RouterProcess(name, proc, port, log_path, tuple(worker_urls))
    try:
        wait_ready(router, ready_timeout_s)
        yield router
    finally:
        router.stop()


@contextlib.contextmanager
def run_replicas(model_dir: Path, count: int = 2, *, block_size: int = 16, num_blocks: int = 512,
                 engine_for: Callable[[int, LoadedModel], AsyncEngine] | None = None,
                 **serve_kwargs: Any) -> Iterator[list[RunningServer]]:
    """``count`` tiny-model radixkv servers on free ports, each with its own engine and weights.

    Args:
        model_dir: the model every replica loads (same weights: a greedy request gets the same
            answer from each).
        count: how many replicas.
        block_size, num_blocks: the default engine's KV blocks.
        engine_for: builds replica ``i``'s (unstarted) engine from its model instead of the
            default, for per-replica settings.
        **serve_kwargs: to ``run_server_in_thread`` (``api_keys``, ...).
    """
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(count):
            model = load_model(str(model_dir))
            engine = (engine_for(i, model) if engine_for is not None else
                      make_async_engine(model, block_size=block_size, num_blocks=num_blocks))
            gen = run_server_in_thread(engine, **serve_kwargs)
            servers.append(next(gen))
            # Resuming the generator stops that server (and checks its engine did not fail).
            stack.callback(lambda g=gen: next(g, None))
        yield servers


def requests_total(server: RunningServer) -> int:
    """The replica's ``/stats`` ``requests_total``."""
    resp = requests.get(server.url + "/stats", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["requests_total"]

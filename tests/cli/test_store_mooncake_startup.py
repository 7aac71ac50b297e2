"""``radixkv serve --kv-store mooncake://…`` started before its ``mooncake_master`` (as a pasted
``mooncake_master … &`` then ``radixkv serve`` does): serve waits for the master, up to
``--kv-store-connect-timeout``, then starts; with no master at all it exits 2 after that bound
with the same clear error. Real processes: a ``mooncake_master`` (tests/mooncake_harness.py)
and ``radixkv serve``, on free loopback ports, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.mooncake_harness import MooncakeMaster, free_port, require_mooncake

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
WAITING = "kv_store_waiting_for_master"


def serve(model_dir: Path, kv_store: str, log_path: Path, port: int, *flags: str
          ) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(model_dir),
             "--device", "cpu", "--port", str(port), "--block-size", "16", "--num-blocks", "64",
             "--kv-store", kv_store, "--log-level", "info", *flags],
            stdout=log, stderr=subprocess.STDOUT, env=ENV)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_line(proc: subprocess.Popen, log_path: Path, needle: str, timeout_s: float) -> None:
    """Until ``needle`` is in the log; fail if the process exits first or the bound passes."""
    deadline = time.monotonic() + timeout_s
    while needle not in log_path.read_text(errors="replace"):
        assert proc.poll() is None, (f"serve exited with {proc.returncode} before waiting:\n"
                                     + log_path.read_text(errors="replace")[-3000:])
        assert time.monotonic() < deadline, f"no {needle!r} in the log"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


def test_serve_started_before_its_master_waits_for_it_and_serves(model_dir, tmp_path):
    require_mooncake()
    master = MooncakeMaster(tmp_path / "master.log")  # its ports are chosen, nothing runs yet
    port = free_port()
    log_path = tmp_path / "serve.log"
    # The default wait: the README's block passes no flag.
    proc = serve(model_dir, master.kv_store_url(), log_path, port)
    try:
        # Serve has found no master and is waiting (before the fix it exited 2 here).
        wait_for_line(proc, log_path, WAITING, timeout_s=120)
        time.sleep(1.0)  # a master that comes up a moment later, on the same ports
        master.start()
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        resp = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "prompt": list(range(3, 40)), "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        store = requests.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()["store"]
        assert (store["backend"], store["down"]) == ("mooncake", False)
    finally:
        stop(proc)
        master.stop()


def test_serve_with_no_master_exits_2_after_the_bound(model_dir, tmp_path):
    require_mooncake()
    master = MooncakeMaster(tmp_path / "master.log")  # never started
    log_path = tmp_path / "serve.log"
    proc = serve(model_dir, master.kv_store_url(), log_path, free_port(),
                 "--kv-store-connect-timeout", "1.5")
    try:
        wait_for_line(proc, log_path, WAITING, timeout_s=120)
        waiting_since = time.monotonic()
        assert proc.wait(60) == 2
        waited_s = time.monotonic() - waiting_since
    finally:
        stop(proc)
    last = log_path.read_text(errors="replace").strip().splitlines()[-1]
    assert last.startswith("radixkv serve: kv_store mooncake: master unreachable after 1.5 s")
    assert master.master_addr in last and master.metadata_url in last
    assert "--kv-store-connect-timeout" in last
    assert 0.5 < waited_s < 30


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf"])
def test_a_bad_connect_timeout_is_exit_2_naming_the_flag(value, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(tmp_path / "none"),
         "--kv-store", "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata",
         f"--kv-store-connect-timeout={value}"],
        capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2
    assert "--kv-store-connect-timeout" in proc.stderr.splitlines()[-1]

"""``radixkv serve --kv-store disk:PATH`` across restarts, as real processes (tiny model, B = 4):
what one server wrote is read by the next after a SIGTERM and after a SIGKILL, with exact cached
tokens and the outputs computed cold; a truncated and a bit-flipped file are refused, counted and
computed with the same output; a second store on a directory in use is refused, naming the
server that holds it; a directory open to other users and malformed specs exit 2 naming the
store or the flag."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from radixkv.cache.store.disk import DiskStore
from radixkv.cache.store.value import read_header
from radixkv.cli import build_parser
from radixkv.errors import StoreError
from tests.mooncake_harness import free_port

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
B = 4
MAX_TOKENS = 6
P = [(37 * i) % 400 + 5 for i in range(64)]  # 16 blocks; hit cap 15 (60 tokens)
Q = [(53 * i) % 700 + 1000 for i in range(64)]
R = [(71 * i) % 900 + 3000 for i in range(64)]
TAIL = [20000 + i for i in range(8)]


class Server:
    """One ``radixkv serve`` process on a free port, its output in a log file."""

    def __init__(self, model_dir: Path, kv_dir: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(model_dir),
                 "--device", "cpu", "--port", str(self.port), "--block-size", str(B),
                 "--num-blocks", "256", "--kv-store", f"disk:{kv_dir}", "--log-level",
                 "warning", *extra], stdout=out, stderr=subprocess.STDOUT, env=ENV)

    def wait_up(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)

    def complete(self, prompt: list[int]) -> tuple[int, str]:
        """(cached tokens, text) of a greedy completion of ``prompt`` (token ids)."""
        body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
        assert out["usage"]["prompt_tokens"] == len(prompt)
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]

    def store(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=10) as resp:
            return json.loads(resp.read())["store"]

    def wait_stored(self, num_blocks: int, timeout_s: float = 30.0) -> dict:
        """Poll ``/stats`` until the disk tier holds ``num_blocks`` values (writes are
        asynchronous); fail if it holds more or never gets there."""
        deadline = time.monotonic() + timeout_s
        while True:
            store = self.store()
            assert store["disk_num_blocks"] <= num_blocks, store
            if store["disk_num_blocks"] == num_blocks:
                return store
            assert time.monotonic() < deadline, store
            time.sleep(0.05)

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def blocks_written(prompt_tokens: int) -> int:
    """Full blocks of a request's prompt and output that have KV (the last token has none)."""
    return (prompt_tokens + MAX_TOKENS - 1) // B


def block_file(kv_dir: Path, prompt: list[int], block: int) -> Path:
    """The file of ``prompt``'s block ``block`` (found by its depth and its header's tokens)."""
    tokens = struct.pack(f"<{B}I", *prompt[block * B : (block + 1) * B])
    found = []
    for f in kv_dir.glob(f"*/rkv*.d{block * B}.h*"):
        header = read_header(f.read_bytes()[:4096])
        if not isinstance(header, str) and header.token_bytes == tokens:
            found.append(f)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_what_one_server_wrote_is_read_by_the_next_after_sigterm_and_sigkill(tiny_model_dir,
                                                                             tmp_path):
    kv = tmp_path / "kv"
    servers: list[Server] = []

    def start(name: str) -> Server:
        server = Server(tiny_model_dir, kv, tmp_path / f"{name}.log")
        servers.append(server)
        server.wait_up()
        return server

    try:
        a = start("a")
        cached, text_p = a.complete(P)
        assert cached == 0
        a.wait_stored(blocks_written(len(P)))  # 17
        assert a.stop(signal.SIGTERM) == 0

        b = start("b")
        assert b.complete(P) == (60, text_p)  # hit cap: the last prompt token is computed
        assert b.store()["disk_found_blocks_at_start"] == 17
        cached, _ = b.complete(P + TAIL)
        assert cached == 64  # all of P: the tail differs from P's output
        cached, text_q = b.complete(Q)
        assert cached == 0
        cached, text_r = b.complete(R)
        assert cached == 0
        # P + TAIL added blocks 16..18 (19 written, 16 shared with P), Q and R 17 each.
        b.wait_stored(17 + 3 + 17 + 17)
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL

        # While no server runs: R's block 2 truncated, a payload bit of P's block 5 flipped.
        truncated = block_file(kv, R, 2)
        truncated.write_bytes(truncated.read_bytes()[:-10])
        flipped = block_file(kv, P, 5)
        data = bytearray(flipped.read_bytes())
        data[-100] ^= 0x04
        flipped.write_bytes(bytes(data))

        c = start("c")
        assert c.complete(Q) == (60, text_q)  # written before the SIGKILL, read whole
        store = c.store()
        assert (store["backend"], store["disk_found_blocks_at_start"]) == ("disk", 54)
        assert store["disk_removed_temp_files_at_start"] == 0
        assert c.complete(R) == (8, text_r)  # blocks 0, 1; block 2 refused, computed
        assert c.complete(P) == (20, text_p)  # blocks 0..4; block 5 refused, computed
        store = c.store()
        assert store["disk_rejected_blocks_by_reason"] == {
            "size": 1, "header": 0, "foreign": 0, "checksum": 1, "io": 0, "format": 0}
        assert store["disk_rejected_blocks_total"] == 1 + 1
        assert store["hit_blocks_total"] == 15 + 2 + 5
        store = c.wait_stored(54)  # both refused blocks computed and written afresh
        assert truncated.stat().st_size == flipped.stat().st_size == store["value_bytes"]
        assert flipped.read_bytes() != bytes(data)
        # The directory is this server's: another store on it is refused, naming the holder.
        with pytest.raises(StoreError, match=f"kv_store disk: {kv} is in use by another store "
                                             rf"\(pid {c.proc.pid} holds {kv}/.lock\)"):
            DiskStore(str(kv))
        assert c.stop(signal.SIGTERM) == 0
    finally:
        for server in servers:
            server.kill()


def test_a_directory_open_to_other_users_exits_2(tiny_model_dir, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    server = Server(tiny_model_dir, shared, tmp_path / "shared.log")
    try:
        assert server.proc.wait(120) == 2
    finally:
        server.kill()
    assert f"radixkv serve: kv_store: disk directory {shared} is open to other users (mode " \
        f"0755); it must be private to the service user: chmod 700 {shared}" \
        in server.log.read_text()
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("value,message", [
    ("disk:", "argument --kv-store: kv_store: disk needs a directory, disk:PATH[?gib=N], got "
              "'disk:'"),
    ("disk:/x?gib=-1", "argument --kv-store: kv_store (disk capacity gib): must be a positive "
                       "number, got '-1'"),
    ("disk:/x?gb=1", "argument --kv-store: kv_store: unknown option 'gb' (known: gib)"),
    ("disk:/x,host:1", "argument --kv-store: kv_store: a stack of tiers is host:GIB,disk:PATH"),
    ("host:1,disk:/x?policy=lru", "argument --kv-store: kv_store: unknown option 'policy' "
                                  "(known: gib)"),
    ("host:1?policy=bogus,disk:/x", "argument --kv-store: kv_store: host tier policy: unknown "
                                    "policy 'bogus'"),
])
def test_malformed_disk_specs_exit_2_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--kv-store", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

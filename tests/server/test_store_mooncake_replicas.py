"""Replicas sharing a Mooncake store: two ``radixkv serve`` processes on one real
``mooncake_master``, each with its own transfer-engine address, plus in-process engines where a
test needs the cache's internals. Nothing is mocked.

Block size 16; prompts of 161 token ids (hit cap 160 tokens = 10 blocks), greedy, 4 tokens out.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from radixkv.cache.store.backend import PutEntry
from radixkv.model.loader import load_model
from tests.conftest import make_tiny_model_dir
from tests.factories import make_engine
from tests.mooncake_harness import MooncakeMaster, free_port, run_master

B = 16
NUM_PROMPT_TOKENS = 161
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
_fresh = itertools.count(1)


def fresh_prompt() -> list[int]:
    """161 token ids no other test of the module sent (a distinct first token)."""
    k = next(_fresh)
    return [4000 + k] + [(200 + 37 * k + 7 * i) % 4000 + 3 for i in range(NUM_PROMPT_TOKENS - 1)]


class Replica:
    """One ``radixkv serve`` process with ``--kv-store mooncake://…``."""

    def __init__(self, model_dir: Path, kv_store: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(model_dir),
             "--device", "cpu", "--port", str(self.port), "--block-size", str(B),
             "--num-blocks", "256", "--kv-store", kv_store, "--kv-store-timeout", "10",
             "--log-level", "warning"], stdout=self._log, stderr=subprocess.STDOUT, env=ENV)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log_tail()
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            assert time.monotonic() < deadline, "replica did not start:\n" + self.log_tail()
            time.sleep(0.2)

    def complete(self, prompt: list[int], **body) -> dict:
        resp = requests.post(self.url + "/v1/completions", timeout=120, json={
            "model": "unknown", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, **body})
        assert resp.status_code == 200, resp.text + "\n" + self.log_tail()
        return resp.json()

    def stats(self) -> dict:
        return requests.get(self.url + "/stats", timeout=10).json()

    def wait_written(self, num_blocks: int, timeout_s: float = 30.0) -> dict:
        """Wait until the replica wrote at least ``num_blocks`` blocks to the store."""
        deadline = time.monotonic() + timeout_s
        while (store := self.stats()["store"])["written_blocks_total"] < num_blocks:
            assert time.monotonic() < deadline, f"writes did not land: {store}"
            time.sleep(0.1)
        return store

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def master(tmp_path_factory) -> Iterator[MooncakeMaster]:
    with run_master(tmp_path_factory.mktemp("mooncake")) as m:
        yield m


@pytest.fixture(scope="module")
def replicas(master, tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Replica, Replica]]:
    logs = tmp_path_factory.mktemp("replicas")
    pair = [Replica(tiny_model_dir, master.kv_store_url(), logs / f"replica-{i}.log")
            for i in range(2)]
    try:
        for r in pair:
            r.wait_healthy()
        yield pair[0], pair[1]
    finally:
        for r in pair:
            r.stop()


def test_replica_b_serves_a_prefix_only_replica_a_computed(replicas):
    a, b = replicas
    prompt = fresh_prompt()
    first = a.complete(prompt)
    assert cached(first) == 0
    a.wait_written(10)
    second = b.complete(prompt)
    assert cached(second) == 160  # the hit cap: every full block below the last token
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    stats = b.stats()
    assert stats["cached_prompt_tokens_by_tier"] == {"device": 0, "store": 160}
    assert stats["store"]["hit_blocks_total"] == 10 and stats["store"]["rejected_blocks_total"] == 0
    assert b.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    assert b.stats()["cached_prompt_tokens_by_tier"] == {"device": 160, "store": 160}


def test_salts_stay_apart_through_the_shared_store(replicas):
    a, b = replicas
    prompt = fresh_prompt()
    written = a.stats()["store"]["written_blocks_total"]
    a.complete(prompt, cache_salt="tenant-1")
    a.wait_written(written + 10)
    assert cached(b.complete(prompt, cache_salt="tenant-2")) == 0
    assert cached(b.complete(prompt)) == 0  # unsalted is another identity too
    control = b.complete(prompt, cache_salt="tenant-1")
    assert cached(control) == 160


def test_another_model_revision_gets_nothing_from_the_store(master, tiny_model_dir, tmp_path):
    same = make_engine(load_model(str(tiny_model_dir)), block_size=B,
                       kv_store=master.kv_store_url())
    other = make_engine(load_model(str(make_tiny_model_dir(tmp_path / "other", seed=11))),
                        block_size=B, kv_store=master.kv_store_url())
    from radixkv.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = fresh_prompt()
    try:
        same.generate([prompt], greedy)
        assert same.store.flush()
        (req,) = other.generate([prompt], greedy)
        assert req.num_cached_tokens == 0
        assert other.stats_snapshot()["store"]["hit_blocks_total"] == 0
        same.cache.evict(same.num_blocks)
        (control,) = same.generate([prompt], greedy)
        assert (control.num_cached_tokens, control.num_store_tokens) == (160, 160)
    finally:
        same.store.close()
        other.store.close()


def test_a_corrupted_value_is_rejected_and_the_output_equals_the_cold_one(master, replicas,
                                                                          tiny_model_dir):
    a, b = replicas
    engine = make_engine(load_model(str(tiny_model_dir)), block_size=B,
                         kv_store=master.kv_store_url())
    tier = engine.store
    try:
        prompt = fresh_prompt()
        written = a.stats()["store"]["written_blocks_total"]
        cold = a.complete(prompt)
        a.wait_written(written + 10)
        root = engine.cache_root(None)
        hashes = engine.cache.hasher.chain(root, prompt[:64], B)
        from radixkv.cache.store.value import store_key

        key = store_key(tier.layout, root, hashes[3])
        size = tier.value_bytes
        buf = ctypes.create_string_buffer(size)
        tier.backend.register_buffer(ctypes.addressof(buf), size)
        deadline = time.monotonic() + 30
        while tier.backend.get_into([key], [ctypes.addressof(buf)], [size]) != [size]:
            assert time.monotonic() < deadline, "block 3 never reached the store"
            time.sleep(0.2)
        buf[size - 1] = bytes([buf.raw[size - 1] ^ 0x01])  # one payload byte
        assert tier.backend.remove([key]) == 1
        parent = store_key(tier.layout, root, hashes[2])
        assert tier.backend.put([PutEntry(key, parent, 48, ctypes.addressof(buf), size)]) \
            == [True]
        again = b.complete(prompt)
        assert cached(again) == 48  # blocks 0-2; block 3 refused, so 3-9 are computed
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        stats = b.stats()
        assert stats["store"]["rejected_blocks_by_reason"]["checksum"] == 1
        assert stats["miss_tokens"]["store_rejected"] == 112
    finally:
        tier.close()


def test_master_killed_mid_run_then_restarted(master, replicas):
    a, b = replicas
    master.kill()
    prompt = fresh_prompt()
    started = time.monotonic()
    down = a.complete(prompt)  # computed: the store is gone
    assert cached(down) == 0 and time.monotonic() - started < 60
    second = a.complete(fresh_prompt())
    assert cached(second) == 0
    stats = a.stats()
    assert stats["store"]["errors_total"] >= 1 and stats["store"]["down"] is True
    assert requests.get(a.url + "/health", timeout=5).status_code == 200
    master.start()
    # Both tiers reconnect on their own (the writer retries once a second).
    deadline = time.monotonic() + 60
    while True:
        a.complete(fresh_prompt())
        b.complete(fresh_prompt())
        if not a.stats()["store"]["down"] and not b.stats()["store"]["down"]:
            break
        assert time.monotonic() < deadline, (a.stats()["store"], b.stats()["store"])
        time.sleep(0.5)
    after = fresh_prompt()
    written = a.stats()["store"]["written_blocks_total"]
    a.complete(after)
    a.wait_written(written + 10)
    again = b.complete(after)
    assert cached(again) == 160
    assert b.stats()["store"]["reconnects_total"] + a.stats()["store"]["reconnects_total"] >= 1

"""The allocator settings that keep a step's activation buffers mapped (kernels.host_memory):
minor page faults of repeated SmolLM2 prefills on a worker thread (as the engine thread runs
them), counted in a fresh process with the settings on and off."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from radixkv.kernels import host_memory

_PROBE = r"""
import resource, sys, threading, torch
from radixkv.kernels import host_memory
applied = host_memory.keep_step_buffers_mapped()  # first, as radixkv serve does
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner
tokens, block_size = 1024, 16
model = load_model(None, dtype=torch.float32)
runner = ModelRunner(model, num_blocks=tokens // block_size, block_size=block_size, device="cpu")
batch = runner.build_batch([(list(range(100, 100 + tokens)), 0, list(range(tokens // block_size)))])
faults = []
def steps():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        runner.forward(batch)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start(); thread.join()
print(applied, runner.forward_model._prefill is not None, *faults)
"""


def _faults(keep: str) -> tuple[bool, bool, list[int]]:
    env = {**os.environ, host_memory.DISABLE_ENV: keep}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.splitlines()[-1].split()
    return out[0] == "True", out[1] == "True", [int(n) for n in out[2:]]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="the settings are glibc's mallopt")
def test_prefill_buffers_stay_mapped_between_steps() -> None:
    # A 1,024-token SmolLM2 prefill allocates ~12 MB per projection output per layer. The
    # first step faults in the heap and the KV pool; later steps reuse both with the settings
    # on (measured 0-1,000 faults), and fault buffers in again without them: ~52,000 a step
    # with oneDNN projections, 0-40,000 a step (36,000-94,000 over steps 2-4) with the C GEMM,
    # whose fewer large allocations let glibc's adaptive mmap threshold settle on some steps.
    applied_on, prefill_path, faults_on = _faults("1")
    if not prefill_path:
        pytest.skip("no native prefill kernels here (the torch path allocates differently)")
    applied_off, _, faults_off = _faults("0")
    assert applied_on and not applied_off
    assert max(faults_on[2:]) <= 5_000, faults_on
    assert sum(faults_off[1:]) >= 20_000, faults_off


def test_keep_step_buffers_mapped_is_idempotent() -> None:
    first = host_memory.keep_step_buffers_mapped()
    assert host_memory.keep_step_buffers_mapped() is first


@pytest.mark.parametrize(("width", "itemsize", "rows"), [(3072, 4, 1365), (3072, 2, 2730), (1 << 30, 4, 1)])
def test_max_rows_per_buffer(width: int, itemsize: int, rows: int) -> None:
    assert host_memory.max_rows_per_buffer(width, itemsize) == rows
    assert rows == 1 or rows * width * itemsize <= host_memory.MAX_STEP_BUFFER_BYTES


@pytest.mark.parametrize(("width", "itemsize", "field"), [(0, 4, "width"), (8, -1, "itemsize")])
def test_max_rows_per_buffer_rejects(width: int, itemsize: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        host_memory.max_rows_per_buffer(width, itemsize)


# ---- the KV pool's pages mapped in the background ---------------------------------------

_MADVISE_POPULATE = platform.system() == "Linux" and tuple(
    int(p) for p in platform.release().split(".")[:2] if p.isdigit()) >= (5, 14)


def _minor_faults() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not _MADVISE_POPULATE, reason="MADV_POPULATE_WRITE needs Linux >= 5.14")
def test_populator_maps_every_block_of_every_region() -> None:
    import mmap

    import numpy

    # Two "pool tensors" of 256 blocks with different block sizes (values and scales), in fresh
    # anonymous mappings (lazily mapped, as a large calloc'd pool is), plus a control buffer.
    num_blocks, value_bytes, scale_bytes = 256, 49_152, 192
    maps = [mmap.mmap(-1, num_blocks * n) for n in (value_bytes, scale_bytes, value_bytes)]
    values, scales, control = (numpy.frombuffer(m, dtype=numpy.uint8) for m in maps)
    populator = host_memory.PoolPopulator(
        [(values.ctypes.data, value_bytes), (scales.ctypes.data, scale_bytes)], num_blocks,
        reserve_heap_bytes=0).start()
    assert populator.wait(60)
    snap = populator.snapshot()
    assert snap["state"] == "done", snap
    assert snap["populated_bytes"] == snap["total_bytes"] == num_blocks * (value_bytes + scale_bytes)
    assert snap["seconds"] is not None and snap["seconds"] >= 0
    assert not values.any() and not scales.any()  # populated, never written
    # Writing every page of the populated buffer takes (almost) no faults; the lazy one takes
    # one per 4 KiB page: 12 MiB = 3,072 pages.
    before = _minor_faults()
    values[::4096] = 1
    populated_faults = _minor_faults() - before
    before = _minor_faults()
    control[::4096] = 1
    lazy_faults = _minor_faults() - before
    assert populated_faults <= 100, populated_faults
    assert lazy_faults >= 3_000, lazy_faults


def test_populator_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="^num_blocks:"):
        host_memory.PoolPopulator([(0, 16)], 0)


@pytest.mark.skipif(not _MADVISE_POPULATE, reason="MADV_POPULATE_WRITE needs Linux >= 5.14")
def test_engine_reports_its_pool_populated(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.factories import make_engine

    monkeypatch.setenv(host_memory.POPULATE_ENV, "1")
    monkeypatch.setattr(host_memory, "_populate_enabled", False)
    assert host_memory.enable_pool_populate() is True
    try:
        engine = make_engine(tiny_model, num_blocks=64, block_size=4)
    finally:
        monkeypatch.setattr(host_memory, "_populate_enabled", False)
    populate = engine.runner.pool_populate
    assert populate is not None and populate.wait(60)
    snap = engine.stats_snapshot()["pool"]["populate"]
    assert snap["state"] == "done"
    assert snap["total_bytes"] == snap["populated_bytes"] == engine.runner.bytes_per_block * 64


def test_populate_is_off_unless_enabled(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.factories import make_engine

    monkeypatch.setenv(host_memory.POPULATE_ENV, "0")
    assert host_memory.enable_pool_populate() is False
    engine = make_engine(tiny_model, num_blocks=16, block_size=4)
    assert engine.runner.pool_populate is None
    assert "populate" not in engine.stats_snapshot()["pool"]


def test_populator_skips_a_pool_larger_than_the_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool the machine could not hold stays lazy: committing it would wake the OOM killer.
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda: 10 << 20)
    populator = host_memory.PoolPopulator([(4096, 1 << 20)], 16, reserve_heap_bytes=0).start()
    assert populator.wait(10)
    snap = populator.snapshot()
    assert snap["state"] == "skipped" and snap["populated_bytes"] == 0
    assert snap["total_bytes"] == 16 << 20 and "MemAvailable" in snap["error"]


def test_mem_available_is_read_from_meminfo() -> None:
    available = host_memory.mem_available_bytes()
    if platform.system() == "Linux":
        assert available is not None and available > 0
    else:
        assert available is None

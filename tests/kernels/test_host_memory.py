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
    # on (measured 0-1,000 faults), and fault every buffer in again without them (~52,000).
    applied_on, prefill_path, faults_on = _faults("1")
    if not prefill_path:
        pytest.skip("no native prefill kernels here (the torch path allocates differently)")
    applied_off, _, faults_off = _faults("0")
    assert applied_on and not applied_off
    assert max(faults_on[2:]) <= 5_000, faults_on
    assert min(faults_off[1:]) >= 20_000, faults_off


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

"""``radixkv.kernels.cpu_peak`` (``csrc/cpu_peak.c``): argument checks, positive rates from every
ISA build this CPU runs, the bf16 peak only where the CPU has AVX512_BF16, and the compiled
loop really holds one FMA per chain (identical chains once got merged by the compiler)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from radixkv.kernels import cpu_peak, native

ISAS = native.cpu_isas()
CHAINS = {"avx512": 24, "avx2": 12}


def _cpu_has_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"^flags\s*:.*\bavx512_bf16\b", text, re.M) is not None


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan, math.inf, "1"])
def test_bad_seconds_raise_naming_it(seconds) -> None:
    with pytest.raises(ValueError, match="^seconds:"):
        cpu_peak.fma_peak_gflops(seconds)
    with pytest.raises(ValueError, match="^seconds:"):
        cpu_peak.bf16_dot_peak_gflops(seconds)


@pytest.mark.parametrize("threads", [0, -2, 1.5])
def test_bad_threads_raise_naming_it(threads) -> None:
    with pytest.raises(ValueError, match="^num_threads:"):
        cpu_peak.fma_peak_gflops(0.01, threads)


def test_bad_isa_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="^isa:"):
        cpu_peak.fma_peak_gflops(0.01, 1, isa="sse2")


@pytest.mark.skipif(not ISAS, reason="no native ISA build runs on this CPU (needs x86-64 AVX2+FMA)")
@pytest.mark.parametrize("isa", ISAS)
def test_every_runnable_build_reports_a_positive_rate(isa: str) -> None:
    value = cpu_peak.fma_peak_gflops(0.03, 1, isa=isa)
    assert value is not None and math.isfinite(value) and value > 0
    assert cpu_peak.peak_chains(isa) == CHAINS[isa]


@pytest.mark.skipif(not ISAS, reason="no native ISA build runs on this CPU (needs x86-64 AVX2+FMA)")
def test_bf16_peak_only_with_avx512_bf16() -> None:
    value = cpu_peak.bf16_dot_peak_gflops(0.03, 1, isa=ISAS[-1])
    if _cpu_has_bf16():
        assert value is not None and math.isfinite(value) and value > 0
    else:
        assert value is None


@pytest.mark.skipif(not ISAS or shutil.which("objdump") is None,
                    reason="needs a native build and objdump")
@pytest.mark.parametrize("isa", ISAS)
def test_the_peak_loop_keeps_one_fma_per_chain(isa: str) -> None:
    kernels = native.load(isa)
    assert kernels is not None
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(kernels.path)],
                         capture_output=True, text=True, check=True).stdout
    # The chains function (inlined into the OpenMP region's outlined body or not): find the
    # loop with the most vfmadd and count its distinct destination registers.
    reg = "zmm" if isa == "avx512" else "ymm"
    best = 0
    for block in re.split(r"\n\n", asm):
        if "rk_fma" not in block.split("\n", 1)[0]:
            continue
        dests = re.findall(rf"vfmadd\w+\s+%{reg}\d+,%{reg}\d+,%({reg}\d+)", block)
        best = max(best, len(set(dests)))
    assert best >= CHAINS[isa]

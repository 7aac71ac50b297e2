"""``bench/kernels.py`` check path, on tiny shapes under the Triton interpreter.

Runs in a subprocess with ``radixkv`` made unimportable, as on the GPU machine where only torch
and triton exist and the script runs from the source tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_DRIVER = """
import runpy, sys
sys.modules["radixkv"] = None  # any `import radixkv...` now raises ImportError
sys.argv = ["bench/kernels.py", "--cpu-interpret-smoke", "--sweep", "--json", sys.argv[1]]
try:
    runpy.run_path("bench/kernels.py", run_name="__main__")
finally:
    assert "kernels" not in sys.modules, "kernels/ must not be imported as a top-level package"
"""


def test_bench_kernels_smoke_runs_without_radixkv(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["all_checks_ok"] is True
    names = [c["check"].split()[0] for c in result["checks"]]
    assert {"extend", "decode", "paged_kv_write"} <= set(names)
    assert [c["kind"] for c in result["cases"]] == ["extend", "extend", "decode", "kv_write"]
    assert all("error" not in c and c["ms"] > 0 for c in result["cases"]), result["cases"]
    # Unmasked-work FLOPs: P=0, L=20, N=1, Hq=4, D=64 -> 4 * 64 * 4 * 1 * (20 * 21 / 2).
    first = result["cases"][0]
    assert abs(first["tflops"] * first["ms"] * 1e9 - 4 * 64 * 4 * 210) < 1e-3
    assert {"matmul", "copy"} <= set(result["roofs"])
    assert "checks (kernel vs torch reference" in proc.stdout
    assert len(result["sweep"]) == 4 and all("error" not in r for r in result["sweep"]), result["sweep"]

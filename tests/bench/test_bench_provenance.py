"""What a benchmark result records about its own making (``bench/_provenance.py``): the commit
and whether the tree differed from it, the UTC date, the CPU (model, cores, ISA flags) and the
command; and a driver writing it into its result JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

from radixkv.cli import load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _provenance as prov  # noqa: E402

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 sha_ni
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 sha_ni
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_machine_reads_model_and_the_isa_flags_that_matter() -> None:
    m = prov.machine(CPUINFO)
    assert m["cpu"] == "AMD EPYC 9R14 96-Core Processor"
    assert m["flags"] == ["avx2", "fma", "avx512f", "avx512_bf16"]  # ISA_FLAGS order, no others
    assert isinstance(m["cores"], int) and m["cores"] >= 1
    amx = prov.machine("model name: Xeon\nflags: avx2 amx_bf16 amx_tile avx512f\n")
    assert (amx["cpu"], amx["flags"]) == ("Xeon", ["avx2", "avx512f", "amx_tile", "amx_bf16"])


def test_git_commit_and_dirty_state(tmp_path: Path) -> None:
    assert prov.git_commit(tmp_path) == {"commit": None, "dirty": None}  # not a checkout
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "HEAD")
    assert prov.git_commit(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "untracked.txt").write_text("x\n")  # untracked files do not count
    assert prov.git_commit(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("2\n")
    assert prov.git_commit(tmp_path) == {"commit": head, "dirty": True}


def test_provenance_fields() -> None:
    before = datetime.now(timezone.utc).replace(microsecond=0)
    p = prov.provenance(["radixkv", "bench", "tree", "--json", "out dir/tree.json"])
    assert p["command"] == "radixkv bench tree --json 'out dir/tree.json'"
    date = datetime.fromisoformat(p["date"])
    assert date.tzinfo is not None and timedelta(0) <= date - before <= timedelta(seconds=60)
    assert {"commit", "dirty", "machine", "python"} <= set(p)
    assert p["machine"]["cpu"] and p["commit"] == prov.git_commit()["commit"]


def test_a_driver_writes_its_provenance(tmp_path: Path, monkeypatch) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"token_ids": [1] * 40 + [i], "timestamp": 1000 * i}) + "\n"
                             for i in range(4)))
    argv = ["radixkv", "bench", "eviction", "--format", "tokens", "--trace", str(trace),
            "--block-size", "16", "--policies", "lru", "--capacity-blocks", "4", "--jobs", "1",
            "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    bench = load_bench("eviction")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert not bench.run(parser.parse_args(argv[3:])).get("error")
    written = json.loads((tmp_path / "out" / "results.json").read_text())["provenance"]
    assert written["command"] == " ".join(argv)
    assert written["machine"] == prov.machine()
    assert written["commit"] == prov.git_commit()["commit"]

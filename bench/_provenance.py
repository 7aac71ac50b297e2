"""Where a benchmark result came from: the commit, the date, the machine and the command.

Every driver that writes result JSON (``bench serve``, ``fleet``, ``store``, ``step``,
``eviction``, ``tree``, ``kernels``) stores :func:`provenance` under the key ``"provenance"``, so
a result file says how to reproduce it without the text that cites it (the rule of
``bench/results/README.md``).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

#: Repository root of this checkout (``bench/..``).
REPO = Path(__file__).resolve().parent.parent

#: CPU flags that decide which kernels and dtypes are fast (bf16 GEMMs are emulated without
#: ``avx512_bf16`` or AMX), in the order they are reported.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def git_commit(root: Path = REPO) -> dict:
    """The checkout's commit and whether tracked files differ from it.

    Returns:
        ``{"commit": 40 hex digits or None, "dirty": bool or None}``; both None when ``root``
        is not a git checkout or git is not installed (a wheel, a tarball).
    """
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    head = git("rev-parse", "--verify", "HEAD")
    if head is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head.strip(), "dirty": None if status is None else bool(status.strip())}


def machine(cpuinfo: str | None = None) -> dict:
    """The CPU this process runs on.

    Args:
        cpuinfo: Text of ``/proc/cpuinfo``; read from the system when None (empty off Linux).

    Returns:
        ``{"cpu": model name, "cores": logical CPUs this process may use, "flags": the
        :data:`ISA_FLAGS` the CPU has, in that order, "os": platform string}``.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 0
    return {"cpu": model or platform.processor() or platform.machine(), "cores": cores,
            "flags": [f for f in ISA_FLAGS if f in flags], "os": platform.platform(terse=True)}


def provenance(argv: list[str] | None = None) -> dict:
    """Commit, UTC date, machine and command line of this run.

    Args:
        argv: The command line; ``sys.argv`` when None (``radixkv bench serve ...`` as typed,
            with the launcher's own path).

    Returns:
        ``{"commit", "dirty", "date": ISO 8601 UTC to the second, "machine": :func:`machine`,
        "command": the argv joined as a shell would read it, "python": version}``.
    """
    argv = sys.argv if argv is None else argv
    return {**git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "command": shlex.join(argv),
            "python": platform.python_version()}

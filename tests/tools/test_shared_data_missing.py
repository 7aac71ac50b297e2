"""``--shared`` without the shared data folder: one clear error (``require_shared``) naming the
flag, ``$RADIXKV_SHARED_DIR``, the missing path, what the folder holds and what to do; the
``radixkv bench`` CLI prints it and exits 2 (real subprocesses, an empty or absent folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.tools import data
from radixkv.tools.data import SHARED_TRACE, SharedDataMissing, require_shared

KEY_PHRASES = (
    "does not exist",
    "--shared reads the full public data from the shared data folder, which is not part of the "
    "repository: it holds agent-transcripts/ and traces/",
    "SOURCES.md",
    "Set RADIXKV_SHARED_DIR to a folder holding them, or drop --shared to use the samples "
    "shipped in radixkv/tools/data/.",
)


def test_an_existing_path_is_returned(tmp_path, monkeypatch):
    monkeypatch.setenv(data.SHARED_DIR_ENV, str(tmp_path))
    (tmp_path / "traces").mkdir()
    (tmp_path / SHARED_TRACE).write_text("{}\n")
    assert require_shared(SHARED_TRACE) == tmp_path / SHARED_TRACE
    # A path already under the folder (what shared_path returns) is taken as is.
    assert require_shared(tmp_path / "traces") == tmp_path / "traces"


def test_a_missing_path_in_an_existing_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(data.SHARED_DIR_ENV, str(tmp_path))
    with pytest.raises(SharedDataMissing) as info:
        require_shared(SHARED_TRACE)
    message = str(info.value)
    assert not isinstance(info.value, (OSError, ValueError))  # drivers' handlers let it through
    assert message.startswith(f"--shared: {tmp_path / SHARED_TRACE} does not exist "
                              f"($RADIXKV_SHARED_DIR = {tmp_path}; that folder lacks this path). ")
    for phrase in KEY_PHRASES:
        assert phrase in message


def test_an_absent_folder_and_the_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv(data.SHARED_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(SharedDataMissing, match=r"\(\$RADIXKV_SHARED_DIR = .*nowhere; that folder "
                                                r"does not exist\)"):
        require_shared("agent-transcripts/swe-agent")
    monkeypatch.delenv(data.SHARED_DIR_ENV)
    monkeypatch.setattr(data, "REPO_ROOT", tmp_path / "repo")
    with pytest.raises(SharedDataMissing) as info:
        require_shared("traces")
    assert (f"--shared: {tmp_path / 'shared' / 'traces'} does not exist ($RADIXKV_SHARED_DIR is "
            f"not set, so the default <repo>/../shared = {tmp_path / 'shared'}; that folder does "
            f"not exist)") in str(info.value)


@pytest.mark.parametrize("argv,missing", [
    (["serve", "--shared", "--url", "http://127.0.0.1:9"],
     "agent-transcripts/tau-bench/historical_trajectories/gpt-4o-airline.json"),
    (["eviction", "--shared"], "traces/conversation_trace.jsonl"),
    (["eviction", "--shared", "--format", "chat", "--source", "swe-agent"],
     "agent-transcripts/swe-agent"),
    (["fleet", "--shared"], "agent-transcripts/tau-bench/historical_trajectories/gpt-4o-airline.json"),
], ids=["serve", "eviction-mooncake", "eviction-chat", "fleet"])
def test_bench_with_shared_and_an_empty_folder_exits_2(tmp_path, argv, missing):
    env = {**os.environ, data.SHARED_DIR_ENV: str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "radixkv.cli", "bench", *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"radixkv bench {argv[0]}: --shared: {tmp_path / missing} "
                                  f"does not exist ($RADIXKV_SHARED_DIR = {tmp_path}; "), proc.stderr
    for phrase in KEY_PHRASES:
        assert phrase in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(Path(tmp_path).iterdir()) == []  # no results folder left behind

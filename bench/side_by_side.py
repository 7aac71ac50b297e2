"""``radixkv bench side-by-side``: radixkv against vLLM-CPU (and llama.cpp) on this machine.

One server at a time: for each ``--concurrency`` value, for each target in order (radixkv,
vllm-cpu, llama.cpp; ``--targets`` picks some), it starts only that server on 127.0.0.1
(ports ``--port-base`` for radixkv, ``+1`` for vLLM-CPU, ``+2`` for llama.cpp's
``llama-server``, the latter only with ``--llama-server``), waits until it lists its model,
lets it settle (``--settle-seconds``), measures it alone, and stops it (SIGTERM to its
process group, so vLLM's worker processes go too; SIGKILL after 60 s) before the next starts.
No server sits in memory, or spends its start-up CPU, while another is measured:

1. (first concurrency only) cold prefill: ``radixkv bench cold-prefill`` on that server,
   prompts of exactly ``--cold-tokens`` never-seen token ids, ``max_tokens`` 1, best of
   ``--cold-repeats`` → ``OUT/parts/cold-prefill-DTYPE-LABEL.json``.
2. the agent replay: ``radixkv bench serve --source tau-bench --sessions N --concurrency C
   --max-tokens M --cache-salt none`` on that server (vLLM's block 128, llama.cpp's 1; the
   later targets get the first one's ``--max-model-len``, so every target skips the same
   requests) → ``OUT/parts/serve-tau-bench-N-cC-DTYPE-LABEL.json``.

Then each concurrency's parts are merged into one comparison, the same JSON and printed table
``--compare-url`` gives (``cold_prefill.compare`` / ``format_report``; ``_serve_report``'s
table and TTFT plot): ``OUT/cold-prefill-DTYPE.json`` and
``OUT/serve-tau-bench-N-cC-DTYPE.json`` (+ its PNG), each with ``"one_server_at_a_time":
true``.

radixkv and vLLM-CPU serve the same weights, ``--hf-dir`` (``radixkv export-hf --out DIR``;
exported there first when the folder does not exist), both at ``--dtype``; vLLM with prefix
caching, prompt-token details, an 8,192-token context, a 4 GiB KV cache and its OpenMP threads
bound to this process's CPUs. llama.cpp serves a GGUF (``--llama-gguf``, default the embedded
SmolLM2 Q4_1: its weights differ, the dtype does not apply) with one 8,192-token slot per
concurrent session. Server logs go to ``OUT/logs``. ``OUT/side-by-side-DTYPE.json`` records
the machine (provenance), every command, its exit status and the result files; the run exits
1 if any step failed. Ctrl-C (or SIGTERM) stops the server that is running before the driver
exits.

Nothing else should run on the machine meanwhile. What is missing (the vLLM venv, the
llama-server binary, the shared tau-bench data, a free port) is reported before any server
starts, naming the flag, with exit status 2. ``--dry-run`` prints the plan and starts nothing.

Usage::

    radixkv bench side-by-side --vllm-venv /work/vllm-cpu-venv --hf-dir /work/smollm2-hf \\
        --dtype float32 --out side-by-side-fp32 [--llama-server PATH/llama-server]
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arg_types import sizes as _sizes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VLLM_BLOCK = 128
CONTEXT = 8192
VLLM_KV_BYTES = 4 << 30
TARGETS = ("radixkv", "vllm-cpu", "llama.cpp")  # measured in this order


class Missing(Exception):
    """A prerequisite that is not there; the message names the flag."""


def _env_default(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _nonneg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _targets(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in TARGETS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names among {','.join(TARGETS)}, "
                                         f"got {text!r}")
    return [t for t in TARGETS if t in names]


def _port(text: str) -> int:
    (value,) = _sizes(text) if "," not in text else (0,)
    if not 1 <= value <= 65533:
        raise argparse.ArgumentTypeError(f"expected a port 1..65533, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench side-by-side``)."""
    parser.add_argument("--vllm-venv", default=None, metavar="DIR",
                        help="virtual environment with vllm-cpu installed (its bin/python runs "
                             "the server; env VLLM_VENV)")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama.cpp's llama-server binary; omitted: no llama.cpp target "
                             "(env LLAMA_SERVER)")
    parser.add_argument("--llama-gguf", default=None, metavar="PATH",
                        help="the GGUF llama-server serves (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--hf-dir", default=None, metavar="DIR",
                        help="HF weights both radixkv and vLLM serve (radixkv export-hf --out DIR; "
                             "exported there when the folder does not exist; env HF_DIR)")
    parser.add_argument("--targets", type=_targets, default=None, metavar="LIST",
                        help="comma-separated servers to measure, always in the order "
                             "radixkv,vllm-cpu,llama.cpp (default: radixkv and vllm-cpu, plus "
                             "llama.cpp with --llama-server)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="radixkv's and vLLM's --dtype")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for the result JSONs, plots and server logs (created)")
    parser.add_argument("--concurrency", type=_sizes, default=[1, 4],
                        help="comma-separated concurrent sessions, a fresh server per target "
                             "for each (default 1,4)")
    parser.add_argument("--sessions", type=int, default=5, help="tau-bench sessions replayed")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per replayed turn")
    parser.add_argument("--data", default="shared", choices=["shared", "sample"],
                        help="tau-bench transcripts: the full shared data ($RADIXKV_SHARED_DIR) "
                             "or the sample shipped in the package")
    parser.add_argument("--cold-tokens", type=_sizes, default=[2048, 8191],
                        help="cold-prefill prompt lengths (default 2048,8191: 8,192 context "
                             "minus the generated token)")
    parser.add_argument("--cold-repeats", type=int, default=3, help="cold-prefill runs per length")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-prefill step")
    parser.add_argument("--no-replay", action="store_true", help="skip the tau-bench replay")
    parser.add_argument("--port-base", type=_port, default=8100,
                        help="radixkv's port; vLLM +1, llama.cpp +2 (default 8100)")
    parser.add_argument("--settle-seconds", type=_nonneg, default=20.0,
                        help="idle wait after each server is up, before it is measured (vLLM's "
                             "warm-up threads)")
    parser.add_argument("--start-timeout", type=_nonneg, default=1200.0,
                        help="seconds to wait for a server to list its model")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")


def _cpu_list() -> str:
    """This process's CPUs as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` wants them (``0-1``, ``0,2``)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check(args: argparse.Namespace) -> dict:
    """Resolve and check every prerequisite before anything starts.

    Returns:
        ``{"targets": [label, ...] in measuring order, "vllm_python" (or None without the
        vllm-cpu target), "llama_server" (or None), "gguf" (or None), "hf_dir", "export":
        bool, "out"}``.

    Raises:
        Missing: naming the flag (``--targets``, ``--vllm-venv``, ``--llama-server``,
            ``--llama-gguf``, ``--hf-dir``, ``--data``, ``--port-base``).
    """
    # The environment is read here, not as argparse defaults, so the generated flag reference
    # never shows one machine's paths.
    for attr, env in (("vllm_venv", "VLLM_VENV"), ("llama_server", "LLAMA_SERVER"), ("hf_dir", "HF_DIR")):
        if getattr(args, attr) is None:
            setattr(args, attr, _env_default(env))
    targets = getattr(args, "targets", None) or [
        t for t in TARGETS if t != "llama.cpp" or args.llama_server]
    if "llama.cpp" in targets and not args.llama_server:
        raise Missing("--targets: llama.cpp needs --llama-server (or LLAMA_SERVER)")
    vllm_python = None
    if "vllm-cpu" in targets:
        if not args.vllm_venv:
            raise Missing("--vllm-venv: not given (or set VLLM_VENV): a venv with vllm-cpu installed")
        vllm_python = Path(args.vllm_venv) / "bin" / "python"
        if not os.access(vllm_python, os.X_OK):
            raise Missing(f"--vllm-venv: {vllm_python} is not an executable")
    llama = gguf = None
    if args.llama_server and "llama.cpp" in targets:
        llama = Path(args.llama_server)
        if not (llama.is_file() and os.access(llama, os.X_OK)):
            raise Missing(f"--llama-server: {llama} is not an executable file")
        if args.llama_gguf:
            gguf = Path(args.llama_gguf)
        else:
            from radixkv.model.loader import embedded_gguf_path

            gguf = Path(embedded_gguf_path())
        if not gguf.is_file():
            raise Missing(f"--llama-gguf: {gguf} does not exist")
    if not args.hf_dir:
        raise Missing("--hf-dir: not given (or set HF_DIR): the folder radixkv export-hf writes")
    hf = Path(args.hf_dir)
    export = not hf.exists()
    if export and not hf.parent.is_dir():
        raise Missing(f"--hf-dir: cannot export into {hf}: {hf.parent} does not exist")
    if not export and not (hf / "config.json").is_file():
        raise Missing(f"--hf-dir: {hf} has no config.json (not an HF model folder)")
    if not args.no_replay and args.data == "shared":
        from radixkv.tools.data import SHARED_DIR_ENV
        from radixkv.tools.transcripts import default_path

        data = default_path("tau-bench", shared=True)
        if not data.exists():
            raise Missing(f"--data: shared tau-bench transcripts not found at {data} (set "
                          f"{SHARED_DIR_ENV}, or --data sample for the shipped sample)")
    ports = [args.port_base + TARGETS.index(t) for t in targets]
    busy = [p for p in ports if not _port_free(p)]
    if busy and not args.dry_run:
        raise Missing(f"--port-base: port(s) {', '.join(map(str, busy))} on 127.0.0.1 are in use "
                      "(another server? stop it or pick another --port-base)")
    return {"targets": targets, "vllm_python": str(vllm_python) if vllm_python else None,
            "llama_server": str(llama) if llama else None,
            "gguf": str(gguf) if gguf else None, "hf_dir": str(hf), "export": export,
            "out": str(Path(args.out))}


def radixkv_cmd(*argv: str) -> list[str]:
    """``radixkv ARGV`` with this interpreter (the checkout's venv)."""
    return [sys.executable, "-m", "radixkv.cli", *argv]


def server_specs(args: argparse.Namespace, paths: dict, concurrency: int) -> list[dict]:
    """The servers of one concurrency, in measuring order: ``{"label", "port", "cmd", "env"}``
    each (env: additions to this process's environment)."""
    base = args.port_base
    targets = paths.get("targets") or [t for t in TARGETS if t != "llama.cpp" or paths["llama_server"]]
    specs = []
    if "radixkv" in targets:
        specs.append({"label": "radixkv", "port": base, "env": {},
                      "cmd": radixkv_cmd("serve", "--model", paths["hf_dir"], "--dtype", args.dtype,
                                         "--host", "127.0.0.1", "--port", str(base),
                                         "--log-level", "warning")})
    if "vllm-cpu" in targets:
        specs.append({"label": "vllm-cpu", "port": base + 1,
                      "env": {"VLLM_CPU_OMP_THREADS_BIND": _cpu_list(),
                              "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                      "cmd": [paths["vllm_python"], "-m", "vllm.entrypoints.openai.api_server",
                              "--model", paths["hf_dir"], "--dtype", args.dtype,
                              "--enable-prefix-caching", "--enable-prompt-tokens-details",
                              "--max-model-len", str(CONTEXT), "--kv-cache-memory-bytes",
                              str(VLLM_KV_BYTES), "--host", "127.0.0.1", "--port", str(base + 1)]})
    if "llama.cpp" in targets and paths["llama_server"]:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # llama-server splits --ctx-size over its slots: one full context per session.
        specs.append({"label": "llama.cpp", "port": base + 2, "env": {},
                      "cmd": [paths["llama_server"], "-m", paths["gguf"], "--threads", str(threads),
                              "--parallel", str(concurrency), "--ctx-size", str(CONTEXT * concurrency),
                              "--host", "127.0.0.1", "--port", str(base + 2)]})
    return specs


def _url(spec: dict) -> str:
    return f"http://127.0.0.1:{spec['port']}"


def cold_name(args: argparse.Namespace) -> str:
    return f"cold-prefill-{args.dtype}.json"


def serve_name(args: argparse.Namespace, concurrency: int) -> str:
    return f"serve-tau-bench-{args.sessions}-c{concurrency}-{args.dtype}.json"


def _part(out: Path, name: str, label: str) -> Path:
    """Where one target's own result goes before the merge (``OUT/parts/NAME-LABEL.json``)."""
    return out / "parts" / f"{Path(name).stem}-{label}.json"


def cold_cmd(args: argparse.Namespace, spec: dict, out: Path) -> list[str]:
    """``bench cold-prefill`` on the one server ``spec``, into its part file."""
    return radixkv_cmd("bench", "cold-prefill", "--url", _url(spec), "--label", spec["label"],
                       "--tokens", ",".join(map(str, args.cold_tokens)), "--repeats",
                       str(args.cold_repeats), "--json",
                       str(_part(out, cold_name(args), spec["label"])))


def serve_cmd(args: argparse.Namespace, spec: dict, out: Path, concurrency: int,
              max_model_len: int | None = None) -> list[str]:
    """``bench serve`` on the one server ``spec``, into its part file; ``max_model_len``: the
    first target's, so that every target skips the same requests."""
    cmd = radixkv_cmd("bench", "serve", "--source", "tau-bench", "--sessions", str(args.sessions),
                      "--concurrency", str(concurrency), "--max-tokens", str(args.max_tokens),
                      "--cache-salt", "none", "--url", _url(spec), "--label", spec["label"],
                      "--json", str(_part(out, serve_name(args, concurrency), spec["label"])))
    if args.data == "shared":
        cmd.insert(cmd.index("--source"), "--shared")
    if spec["label"] == "vllm-cpu":
        cmd += ["--block-size", f"vllm-cpu={VLLM_BLOCK}"]
    elif spec["label"] == "llama.cpp":
        cmd += ["--block-size", "llama.cpp=1"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def merge_cold(parts: list[tuple[str, Path]], path: Path) -> dict:
    """One ``bench cold-prefill --compare-url`` report from per-target parts (in order): each
    part's target, ``vs_first`` recomputed, a missing part a failed target; printed and written
    to ``path``."""
    import cold_prefill
    from _provenance import provenance

    loaded = [(label, part, _load(part)) for label, part in parts]
    head = next((d for _, _, d in loaded if d), {})
    targets = [d["targets"][0] if d and d.get("targets") else
               {"label": label, "url": None, "error": f"no result in {part}"}
               for label, part, d in loaded]
    result = {k: head[k] for k in ("tokens", "repeats", "warmup", "id_range", "max_tokens") if k in head}
    result.update(targets=targets, one_server_at_a_time=True,
                  parts=[str(part) for _, part in parts])
    cold_prefill.compare(targets)
    failed = [t["label"] for t in targets if "error" in t]
    if failed:
        result["error"] = f"failed targets: {', '.join(failed)}"
    result["provenance"] = provenance()
    print(cold_prefill.format_report(result), flush=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def merge_serve(parts: list[tuple[str, Path]], path: Path, title: str) -> dict:
    """One ``bench serve --compare-url`` report from per-target parts (in order): the first
    present part's run with ``targets`` (every part's), ``compare`` and ``ttft_ms_p50_ratio``;
    the table printed, written to ``path`` and its PNG. ``error`` names missing parts."""
    import _serve_report
    from _provenance import provenance

    loaded = [(label, _load(part)) for label, part in parts]
    shown = [{k: v for k, v in d.items() if k not in ("targets", "compare", "provenance")}
             for _, d in loaded if d]
    missing = [label for label, d in loaded if not d]
    if not shown:
        return {"error": f"no serve results: {', '.join(missing)}"}
    result = dict(shown[0])
    result.update(targets=shown, one_server_at_a_time=True, parts=[str(p) for _, p in parts])
    if len(shown) > 1:
        compare = result["compare"] = shown[1]
        on, off = result["ttft_ms_p50"], compare["ttft_ms_p50"]
        result["ttft_ms_p50_ratio"] = off / on if on and off else None
    if missing:
        result["error"] = f"failed targets: {', '.join(missing)}"
    print(_serve_report.format_table(shown))
    for other in shown[1:]:
        if other["ttft_ms_p50"] and result["ttft_ms_p50"]:
            print(f"TTFT p50 {_serve_report.label(other)} / {_serve_report.label(result)}: "
                  f"{other['ttft_ms_p50'] / result['ttft_ms_p50']:.2f}x", flush=True)
    result["provenance"] = provenance()
    path.write_text(json.dumps(result, indent=2) + "\n")
    try:
        _serve_report.plot_ttft(shown, path.with_suffix(".png"), title)
    except Exception as exc:  # noqa: BLE001 - the JSON is kept; the plot is extra
        print(f"side-by-side: warning: no plot {path.with_suffix('.png')}: {exc}", file=sys.stderr)
    return result


def _listed(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
            return bool(json.loads(resp.read()).get("data"))
    except (OSError, ValueError):
        return False


def start(spec: dict, logs: Path, tag: str) -> subprocess.Popen:
    """Start one server in its own session (its own process group: ``stop`` signals the whole
    group, vLLM's worker processes included; a terminal's Ctrl-C does not reach it)."""
    log = open(logs / f"{spec['label']}-{tag}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(spec["cmd"], stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **spec["env"]},
                            start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def wait_up(spec: dict, proc: subprocess.Popen, timeout: float) -> str | None:
    """None once the server lists a model; else why not (exited, timed out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"{spec['label']} exited with status {proc.returncode} before it was up"
        if _listed(_url(spec)):
            return None
        time.sleep(1.0)
    return f"{spec['label']} not up after {timeout:g} s"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop(procs: list[subprocess.Popen], grace: float = 60.0) -> None:
    """SIGTERM each server's process group, wait for the server's PID and for every other
    process of its group (vLLM's engine and workers outlive a killed parent otherwise);
    SIGKILL the group after ``grace`` seconds."""
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    for proc in procs:
        deadline = time.monotonic() + grace
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(proc.pid):
            _signal_group(proc.pid, signal.SIGKILL)
            while _group_alive(proc.pid) and time.monotonic() < deadline + 10:
                time.sleep(0.2)
        proc.log.close()  # type: ignore[attr-defined]


def _step(record: list, name: str, cmd: list[str], dry_run: bool) -> int:
    print(f"side-by-side: {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    if dry_run:
        record.append({"step": name, "command": shlex.join(cmd), "rc": None})
        return 0
    started = time.time()
    rc = subprocess.run(cmd, cwd=str(REPO), env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    record.append({"step": name, "command": shlex.join(cmd), "rc": rc,
                   "seconds": round(time.time() - started, 1)})
    return rc


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through ``run``'s finally: the running server is stopped


def _measure(args: argparse.Namespace, spec: dict, out: Path, logs: Path, tag: str,
             cold: bool, concurrency: int, max_model_len: int | None, steps: list,
             failures: list[str]) -> bool:
    """Start ``spec``'s server alone, settle, measure, stop it; False if it did not come up."""
    label = spec["label"]
    env = " ".join(f"{k}={v}" for k, v in spec["env"].items())
    print(f"side-by-side: server {label} {tag}: {env + ' ' if env else ''}"
          f"{shlex.join(spec['cmd'])}", file=sys.stderr, flush=True)
    procs: list[subprocess.Popen] = []
    if not args.dry_run:  # a part left by an earlier run into OUT must not pass for this one's
        for name in [cold_name(args)] * cold + [serve_name(args, concurrency)]:
            for stale in (_part(out, name, label), _part(out, name, label).with_suffix(".png")):
                stale.unlink(missing_ok=True)
    try:
        if not args.dry_run:
            procs.append(start(spec, logs, tag))
            why = wait_up(spec, procs[0], args.start_timeout)
            if why:
                failures.append(f"server {why} (log: {logs / f'{label}-{tag}.log'})")
                return False
            time.sleep(args.settle_seconds)
        # A failed measurement is recorded and the run goes on: the other results stand.
        if cold and _step(steps, f"cold-prefill {tag} {label}", cold_cmd(args, spec, out),
                          args.dry_run):
            failures.append(f"cold-prefill {tag} {label} failed")
        if not args.no_replay and _step(steps, f"serve {tag} {label}",
                                        serve_cmd(args, spec, out, concurrency, max_model_len),
                                        args.dry_run):
            failures.append(f"serve {tag} {label} failed")
    finally:
        if procs:
            print(f"side-by-side: stopping {label} {tag}", file=sys.stderr, flush=True)
        stop(procs)
    return True


def run(args: argparse.Namespace) -> dict:
    """Check, then every concurrency per the module doc; write ``OUT/side-by-side-DTYPE.json``."""
    from _provenance import provenance

    try:
        paths = check(args)
    except Missing as exc:
        print(f"radixkv bench side-by-side: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    out = Path(paths["out"])
    logs = out / "logs"
    steps: list[dict] = []
    result: dict = {"dtype": args.dtype, "concurrency": args.concurrency, "sessions": args.sessions,
                    "max_tokens": args.max_tokens, "data": args.data, "paths": paths,
                    "targets": paths["targets"], "one_server_at_a_time": True,
                    "cold_tokens": args.cold_tokens, "dry_run": args.dry_run, "steps": steps,
                    "servers": {}, "results": []}
    if not args.dry_run:
        (out / "parts").mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
    if paths["export"]:
        if _step(steps, "export-hf", radixkv_cmd("export-hf", "--out", paths["hf_dir"]), args.dry_run):
            result["error"] = "server weights: export-hf failed"
    failures: list[str] = [] if not result.get("error") else [result["error"]]
    previous = None
    if threading_main():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for i, concurrency in enumerate(args.concurrency):
            if failures and failures[0].startswith("server weights"):
                break
            specs = server_specs(args, paths, concurrency)
            tag = f"c{concurrency}-{args.dtype}"
            cold = i == 0 and not args.no_cold
            max_model_len = None
            for spec in specs:
                result["servers"].setdefault(spec["label"], {"command": shlex.join(spec["cmd"]),
                                                             "env": spec["env"], "url": _url(spec)})
                _measure(args, spec, out, logs, tag, cold, concurrency, max_model_len, steps,
                         failures)
                if max_model_len is None and not args.dry_run and not args.no_replay:
                    first = _load(_part(out, serve_name(args, concurrency), spec["label"]))
                    max_model_len = (first or {}).get("max_model_len")
            labels = [s["label"] for s in specs]
            merges = []
            if cold:
                merges.append(("cold-prefill", out / cold_name(args)))
            if not args.no_replay:
                merges.append(("serve", out / serve_name(args, concurrency)))
            for kind, path in merges:
                print(f"side-by-side: merge {kind} {tag}: {', '.join(labels)} -> {path}",
                      file=sys.stderr, flush=True)
                if args.dry_run:
                    continue
                parts = [(label, _part(out, path.name, label)) for label in labels]
                merged = (merge_cold(parts, path) if kind == "cold-prefill" else merge_serve(
                    parts, path, f"tau-bench: {args.sessions} sessions, concurrency "
                                 f"{concurrency}, max_tokens {args.max_tokens}, one server at a time"))
                result["results"].append(str(path))
                if merged.get("error") and not any(f.startswith(kind) for f in failures):
                    failures.append(f"{kind} {tag}: {merged['error']}")
    except KeyboardInterrupt:
        print("side-by-side: interrupted; the running server was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failures:
        result["error"] = "; ".join(failures)
    result["provenance"] = provenance()
    if not args.dry_run:
        path = out / f"side-by-side-{args.dtype}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"side-by-side: wrote {path}", file=sys.stderr)
    for s in steps:
        print(f"{s['step']:<34} rc {s['rc']}  {s['command']}")
    return result


def threading_main() -> bool:
    """Whether this is the main thread (only it may install signal handlers)."""
    import threading

    return threading.current_thread() is threading.main_thread()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/side_by_side.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return 1 if run(parser.parse_args(argv)).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())

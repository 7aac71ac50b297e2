"""``radixkv bench restart``: a session's next turn after ``radixkv serve`` restarts, with the
disk tier, against the same turn computed cold.

One server at a time, each ``radixkv serve`` on 127.0.0.1 (``--model``, default the embedded
SmolLM2-135M-Instruct), every one given one untimed 1-token warm-up request first (first-call
costs: thread pools, page faults):

1. **write**: ``--kv-store disk:DIR`` (``--kv-dir``, default a new private temporary folder).
   Turn 1 of a chat session: one user message of about ``--tokens`` tokens (a document of
   words drawn by a seeded generator, sized with ``POST /tokenize``), ``--reply-tokens``
   generated. The driver waits until the disk tier holds every full block of turn 1 (prompt
   and reply; ``/stats``), then stops the server with SIGTERM.
2. **restarted**: a new server on the same DIR. Turn 2 (turn 1, its reply, a short question),
   ``--next-tokens`` generated, streamed: its TTFT, cached tokens and text.
3. **cold**: a new server without ``--kv-store``: the same turn 2, never seen before.
4. **damaged-flip**, **damaged-truncate** (``--damage``): one of turn 1's block files on DIR
   bit-flipped (block N/4 of turn 1's N) or truncated (block N/2), then a new server on DIR:
   turn 2 must be computed from that block on (cached tokens = the blocks before it,
   exactly), the file refused and counted by its reason (``checksum``, ``size``), with the
   cold output.

``ttft_ratio`` = restarted TTFT ÷ cold TTFT (the target: at most ``--max-ratio``, 0.1);
``checks`` lists each condition and ``all_checks_ok`` their conjunction (the CLI exits 1 when
one fails). The JSON (``--json``) has every server's numbers, the store's ``/stats`` after
turn 2 and ``provenance``. Server logs go to ``--log-dir`` (default a temporary folder, removed
after a run whose checks all passed), DIR is removed unless given.

Usage::

    radixkv bench restart --json bench/results/restart-smollm2.json
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parent.parent
WORDS = ("cache", "block", "token", "server", "session", "agent", "prefix", "memory", "disk",
         "model", "layer", "value", "request", "reply", "turn", "restart", "file", "write",
         "read", "check", "table", "index", "chain", "hash", "store", "tier", "policy", "time",
         "number", "answer", "question", "document", "section", "paragraph", "river", "mountain",
         "garden", "window", "letter", "market", "engine", "signal", "harbor", "planet")
QUESTION = "List three facts the document states, one per line."


class BenchError(Exception):
    """A server that could not be started or answered wrongly."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench restart``)."""
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf each server serves (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=7000,
                        help="turn 1's prompt size in tokens, about (default 7000)")
    parser.add_argument("--reply-tokens", type=int, default=32,
                        help="tokens generated in turn 1 (default 32)")
    parser.add_argument("--next-tokens", type=int, default=16,
                        help="tokens generated in turn 2, the timed turn (default 16)")
    parser.add_argument("--block-size", type=int, default=16, help="every server's --block-size")
    parser.add_argument("--kv-dir", default=None,
                        help="the disk tier's folder (default: a new temporary one, removed "
                             "after)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every radixkv serve (repeatable, e.g. "
                             "--serve-arg=--dtype=bfloat16)")
    parser.add_argument("--max-ratio", type=float, default=0.1,
                        help="the check on restarted TTFT ÷ cold TTFT (default 0.1)")
    parser.add_argument("--damage", type=_damages, default=_damages("flip,truncate"),
                        help="damaged-file runs after the cold one, comma-separated: flip (a "
                             "payload bit of block N/4), truncate (block N/2); 'none': skip "
                             "(default flip,truncate)")
    parser.add_argument("--seed", type=int, default=0, help="the document's word generator seed")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per request, and to wait for a server to start")
    parser.add_argument("--log-dir", default=None, help="server logs (default: temporary)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON here")


def _damages(text: str) -> list[str]:
    names = [] if text == "none" else [t for t in text.split(",") if t]
    bad = [n for n in names if n not in ("flip", "truncate")]
    if bad:
        raise argparse.ArgumentTypeError(f"expected flip, truncate or none, got {text!r}")
    return names


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise BenchError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") \
            from exc
    except (OSError, ValueError) as exc:
        raise BenchError(f"{url}: {exc}") from exc


class Server:
    """One ``radixkv serve`` process (its own process group), its output in a log file."""

    def __init__(self, name: str, args: argparse.Namespace, logs: Path, kv_dir: str | None):
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"{name}.log"
        cmd = [sys.executable, "-m", "radixkv.cli", "serve", "--port", str(self.port),
               "--block-size", str(args.block_size), "--log-level", "warning"]
        if args.model:
            cmd += ["--model", args.model]
        if kv_dir is not None:
            cmd += ["--kv-store", f"disk:{kv_dir}"]
        self.cmd = cmd + list(args.serve_arg)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(REPO), env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     start_new_session=True)
        self.started_s = time.monotonic()

    def wait_up(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200 (raises BenchError if it exits first)."""
        deadline = self.started_s + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name}: exited with {self.proc.returncode}: "
                                 f"{self.log_path.read_text(errors='replace')[-1500:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started_s
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        raise BenchError(f"{self.name}: not up after {timeout:g} s")

    def store(self) -> dict:
        return _http(f"{self.url}/stats").get("store") or {}

    def stop(self) -> int | None:
        """SIGTERM (then SIGKILL after 60 s) to the process group; its exit status."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


def chat(url: str, messages: list, max_tokens: int, timeout: float) -> dict:
    """A streamed greedy chat completion: ``{"ttft_s", "total_s", "text", "prompt_tokens",
    "cached_tokens", "completion_tokens"}`` (TTFT: request sent → first content)."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    ttft, usage, text = None, None, []
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise BenchError(f"{url}: error event {event['error']}")
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece or choice.get("finish_reason"):
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        text.append(piece or "")
                if event.get("usage"):
                    usage = event["usage"]
    except urllib.error.HTTPError as exc:
        raise BenchError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") \
            from exc
    except (OSError, ValueError) as exc:
        raise BenchError(f"{url}/v1/chat/completions: {exc}") from exc
    if ttft is None or usage is None:
        raise BenchError(f"{url}: the stream carried no content or no usage")
    return {"ttft_s": ttft, "total_s": time.perf_counter() - started, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": usage["completion_tokens"]}


def warm_up(server: Server, timeout: float) -> None:
    """One 1-token completion of 16 token ids drawn per server (seeded by its name): no chat
    prompt starts with them (a chat warm-up would cache the template's system prompt, which
    turn 2 starts with) and no other server's warm-up wrote them to the disk tier."""
    rng = random.Random(server.name)
    _http(f"{server.url}/v1/completions", {"prompt": [rng.randrange(1000, 30000) for _ in range(16)],
                                            "max_tokens": 1, "temperature": 0}, timeout)


def wait_populated(server: Server, timeout: float) -> dict | None:
    """Wait until the server finished mapping its KV pool's pages (``/stats`` ``pool.populate``,
    the start-up work ``radixkv serve`` does in the background); its snapshot, or None when
    the server does not populate (``RADIXKV_POPULATE_KV_POOL=0``)."""
    deadline = time.monotonic() + timeout
    while True:
        populate = (_http(f"{server.url}/stats").get("pool") or {}).get("populate")
        if populate is None or populate.get("state") not in ("pending", "running"):
            return populate
        if time.monotonic() > deadline:
            raise BenchError(f"{server.name}: KV pool not populated after {timeout:g} s: {populate}")
        time.sleep(0.2)


def make_document(url: str, tokens: int, seed: int) -> tuple[str, list[int]]:
    """A document of seeded words whose turn-1 prompt is about ``tokens`` tokens long (sized
    with ``/tokenize``: a probe for the tokens per word, then one correction); returns it and
    the prompt's token ids."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(400)]

    def count(n: int) -> list[int]:
        return _http(f"{url}/tokenize", {"messages": _turn1(" ".join(words[:n]))})["tokens"]

    overhead = len(count(0))
    per_word = (len(count(400)) - overhead) / 400
    n = max(1, round((tokens - overhead) / per_word))
    for _ in range(2):
        while len(words) < n:
            words.append(rng.choice(WORDS))
        ids = count(n)
        n = max(1, round(n * (tokens - overhead) / max(1, len(ids) - overhead)))
    return " ".join(words[:n]), count(n)


def _turn1(document: str) -> list[dict]:
    return [{"role": "user", "content": f"{document}\n\nSummarize the document above."}]


def _turn2(document: str, reply: str) -> list[dict]:
    return _turn1(document) + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": QUESTION}]


def wait_stored(server: Server, num_blocks: int, timeout: float) -> dict:
    """Poll ``/stats`` until the disk tier holds at least ``num_blocks`` values and no more
    arrive for a second."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        store = server.store()
        held = store.get("disk_num_blocks", 0)
        if held != last:
            last, since = held, time.monotonic()
        elif held >= num_blocks and time.monotonic() - since >= 1.0:
            return store
        time.sleep(0.1)
    raise BenchError(f"{server.name}: the disk tier holds {last} blocks, expected {num_blocks}")


def block_file(kv_dir: Path, prompt_ids: list[int], block: int, block_size: int) -> Path:
    """The file of the prompt's block ``block`` (its depth in the name, its tokens in the
    header)."""
    from radixkv.cache.store.value import read_header

    tokens = struct.pack(f"<{block_size}I", *prompt_ids[block * block_size:(block + 1) * block_size])
    for f in kv_dir.glob(f"*/rkv*.d{block * block_size}.h*"):
        header = read_header(f.read_bytes()[:1 << 16])
        if not isinstance(header, str) and header.token_bytes == tokens:
            return f
    raise BenchError(f"no file of block {block} in {kv_dir}")


def run(args: argparse.Namespace) -> dict:
    """The four servers of the module doc, one at a time; prints the report, writes
    ``--json``, returns the result (``error`` / ``all_checks_ok`` false: the CLI exits 1)."""
    from _provenance import provenance

    own_kv = args.kv_dir is None
    kv_dir = Path(args.kv_dir or tempfile.mkdtemp(prefix="radixkv-restart-kv-"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="radixkv-restart-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": args.model or "embedded SmolLM2-135M-Instruct",
                    "block_size": args.block_size, "reply_tokens": args.reply_tokens,
                    "next_tokens": args.next_tokens, "serve_args": list(args.serve_arg),
                    "kv_dir": str(kv_dir), "servers": {}}
    checks: dict = {}
    server = None
    try:
        server = Server("write", args, logs, str(kv_dir))
        startup = server.wait_up(args.timeout)
        warm_up(server, args.timeout)
        document, prompt_ids = make_document(server.url, args.tokens, args.seed)
        turn1 = chat(server.url, _turn1(document), args.reply_tokens, args.timeout)
        blocks = (turn1["prompt_tokens"] + turn1["completion_tokens"] - 1) // args.block_size
        store = wait_stored(server, blocks, args.timeout)
        result["turn1"] = {**turn1, "blocks": blocks}
        result["servers"]["write"] = {"startup_s": startup, "exit_status": server.stop(),
                                      "disk_num_blocks": store.get("disk_num_blocks"),
                                      "disk_used_bytes": store.get("disk_used_bytes")}
        messages = _turn2(document, turn1["text"])
        print(f"bench restart: turn 1: {turn1['prompt_tokens']} prompt tokens, "
              f"{blocks} blocks on disk", file=sys.stderr, flush=True)

        for name, kv in (("restarted", str(kv_dir)), ("cold", None)):
            server = Server(name, args, logs, kv)
            startup = server.wait_up(args.timeout)
            warm_up(server, args.timeout)
            populate = wait_populated(server, args.timeout)
            turn2 = chat(server.url, messages, args.next_tokens, args.timeout)
            result["servers"][name] = {"startup_s": startup, "populate": populate, "turn2": turn2,
                                       "store": server.store() if kv else None}
            result["servers"][name]["exit_status"] = server.stop()
            print(f"bench restart: {name}: TTFT {turn2['ttft_s']:.3f} s, "
                  f"{turn2['cached_tokens']}/{turn2['prompt_tokens']} cached",
                  file=sys.stderr, flush=True)
        warm, cold = result["servers"]["restarted"]["turn2"], result["servers"]["cold"]["turn2"]
        result["ttft_restarted_s"], result["ttft_cold_s"] = warm["ttft_s"], cold["ttft_s"]
        result["ttft_ratio"] = warm["ttft_s"] / cold["ttft_s"]
        checks["restarted_reads_turn1_from_disk"] = \
            warm["cached_tokens"] >= (len(prompt_ids) // args.block_size) * args.block_size
        checks["cold_reads_nothing"] = cold["cached_tokens"] == 0
        checks["same_output_restarted_and_cold"] = warm["text"] == cold["text"]
        checks["ttft_ratio_at_most_max"] = result["ttft_ratio"] <= args.max_ratio

        nb = len(prompt_ids) // args.block_size
        damages = {"flip": max(1, nb // 4), "truncate": max(2, nb // 2)}
        for damage in args.damage:
            # One damaged file per restart: a load stops at the first bad block of a chain,
            # and the server writes the block it computed instead afresh (the next run finds
            # only its own damage).
            block = damages[damage]
            f = block_file(kv_dir, prompt_ids, block, args.block_size)
            data = bytearray(f.read_bytes())
            if damage == "flip":
                data[-17] ^= 0x01
            else:
                del data[-1000:]
            f.write_bytes(bytes(data))
            name = f"damaged-{damage}"
            server = Server(name, args, logs, str(kv_dir))
            startup = server.wait_up(args.timeout)
            warm_up(server, args.timeout)
            turn2 = chat(server.url, messages, args.next_tokens, args.timeout)
            store = server.store()
            result["servers"][name] = {"startup_s": startup, "damaged_block": block,
                                       "turn2": turn2, "store": store,
                                       "exit_status": server.stop()}
            rejected = store.get("disk_rejected_blocks_by_reason", {})
            reason = "checksum" if damage == "flip" else "size"
            checks[f"{name}_computed_from_the_damaged_block"] = \
                turn2["cached_tokens"] == block * args.block_size
            checks[f"{name}_same_output_as_cold"] = turn2["text"] == cold["text"]
            checks[f"{name}_refused_and_counted"] = \
                rejected.get(reason) == 1 and store.get("disk_rejected_blocks_total") == 1
            print(f"bench restart: {name}: {turn2['cached_tokens']} cached (block {block} "
                  f"damaged), rejected {rejected}", file=sys.stderr, flush=True)
        server = None
    except BenchError as exc:
        result["error"] = str(exc)
        print(f"bench restart: {exc}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    result["checks"] = checks
    result["all_checks_ok"] = bool(checks) and all(checks.values()) and "error" not in result
    keep_logs = bool(args.log_dir) or not result["all_checks_ok"]
    result["log_dir"] = str(logs) if keep_logs else None
    result["provenance"] = provenance()
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if own_kv:
        shutil.rmtree(kv_dir, ignore_errors=True)
    if not keep_logs:
        shutil.rmtree(logs, ignore_errors=True)
    return result


def format_report(result: dict) -> str:
    """The TTFT of turn 2 per server, the ratio and each check."""
    lines = []
    for name in ("restarted", "cold", "damaged-flip", "damaged-truncate"):
        server = result["servers"].get(name)
        if server and "turn2" in server:
            t = server["turn2"]
            lines.append(f"{name:<10} TTFT {t['ttft_s']:8.3f} s  cached {t['cached_tokens']:>6}"
                         f" / {t['prompt_tokens']} prompt tokens")
    if "ttft_ratio" in result:
        lines.append(f"restarted / cold TTFT: {result['ttft_ratio']:.4f} "
                     f"({1 / result['ttft_ratio']:.1f}x faster)")
    for name, ok in result.get("checks", {}).items():
        lines.append(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if "error" in result:
        lines.append(f"error: {result['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/restart.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return 0 if run(parser.parse_args(argv)).get("all_checks_ok") else 1


if __name__ == "__main__":
    sys.exit(main())

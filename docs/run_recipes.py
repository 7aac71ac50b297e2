"""Run the shell recipes of README.md and docs/operations.md as a user would paste them.

A recipe is a fenced ```bash (or ```python) block with a marker on the line before it::

    <!-- recipe: NAME [server=PORT] [ports=P1,P2,...] [timeout=SECONDS] -->

- ``ports``: every TCP port the block uses. Each is moved by one common offset to ports that are
  free here (so a recipe never collides with a server already running, e.g. ``make serve`` on
  8000); the block must spell its ports literally.
- ``server=PORT``: the block expects a radixkv server on PORT (the README's ``make serve``); the
  runner starts ``.venv/bin/radixkv serve`` on the moved port first, waits for ``/health``, and
  stops it after the block.
- ``timeout``: seconds the block may run (default 120).

Each block runs with bash ``-e -o pipefail`` (python blocks with ``.venv/bin/python``) from the
repository root, in its own process group; whatever it started in the background is stopped by
that group id (SIGTERM, then SIGKILL) when it ends, fails or times out. ``--set OLD=NEW``
replaces text in every block before it runs (e.g. a smaller ``--sessions``).

Usage::

    .venv/bin/python docs/run_recipes.py --list
    .venv/bin/python docs/run_recipes.py first-request openai-sdk
    .venv/bin/python docs/run_recipes.py --all

Exit status 0 when every recipe run passed, 1 otherwise (each failure printed with the tail of
its output).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs/operations.md")
DEFAULT_TIMEOUT_S = 120.0
SERVER_START_TIMEOUT_S = 120.0
_MARKER = re.compile(r"<!--\s*recipe:\s*(?P<name>[\w.-]+)(?P<opts>[^>]*?)\s*-->")
_FENCE = re.compile(r"^```(?P<lang>bash|python)\s*$")


@dataclass
class Recipe:
    """One runnable block: where it is, its code and the marker's options."""

    name: str
    source: str
    line: int
    lang: str
    code: str
    ports: list[int] = field(default_factory=list)
    server_port: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S


def parse(text: str, source: str) -> list[Recipe]:
    """Return the recipes of one markdown text, in order.

    Raises:
        ValueError: a marker not followed by a bash/python fence, an unclosed fence, or a bad
            option (named with its file and line).
    """
    lines = text.splitlines()
    recipes = []
    for i, line in enumerate(lines):
        m = _MARKER.search(line)
        if not m:
            continue
        where = f"{source}:{i + 1}"
        if i + 1 >= len(lines) or not _FENCE.match(lines[i + 1]):
            raise ValueError(f"{where}: recipe marker not followed by a ```bash or ```python block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{where}: recipe block never closed")
        recipe = Recipe(m["name"], source, i + 1, _FENCE.match(lines[i + 1])["lang"],
                        "\n".join(lines[i + 2:end]) + "\n")
        for opt in m["opts"].split():
            key, _, value = opt.partition("=")
            try:
                if key == "ports":
                    recipe.ports = [int(p) for p in value.split(",")]
                elif key == "server":
                    recipe.server_port = int(value)
                elif key == "timeout":
                    recipe.timeout_s = float(value)
                else:
                    raise ValueError(f"unknown option {key!r}")
            except ValueError as exc:
                raise ValueError(f"{where}: recipe option {opt!r}: {exc}") from None
        if recipe.server_port is not None and recipe.server_port not in recipe.ports:
            recipe.ports.append(recipe.server_port)
        recipes.append(recipe)
    return recipes


def all_recipes(repo: Path = REPO) -> list[Recipe]:
    out: list[Recipe] = []
    for source in SOURCES:
        path = repo / source
        if path.exists():
            out += parse(path.read_text(encoding="utf-8"), source)
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_offset(ports: list[int], rng: random.Random | None = None) -> int:
    """An offset that moves every port in ``ports`` to one free here (0 for no ports)."""
    if not ports:
        return 0
    rng = rng or random.Random()
    low, high = 1024 - min(ports), 65000 - max(ports)
    for _ in range(200):
        offset = rng.randint(low, high)
        if offset != 0 and all(_port_free(p + offset) for p in ports):
            return offset
    raise RuntimeError(f"no free port range for {ports}")


def move_ports(code: str, ports: list[int], offset: int) -> str:
    """Replace each declared port (as a whole number) by ``port + offset``."""
    if not offset:
        return code
    mapping = {str(p): str(p + offset) for p in ports}
    pattern = re.compile(r"(?<![\d.])(" + "|".join(map(re.escape, mapping)) + r")(?![\d.])")
    return pattern.sub(lambda m: mapping[m[1]], code)


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the process group ``proc`` leads (it and what it started in the background)."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a member of its group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            continue
        break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    output: str


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run(recipe: Recipe, replacements: dict[str, str] | None = None, repo: Path = REPO,
        env: dict[str, str] | None = None) -> Result:
    """Run one recipe and stop everything it started. Never raises for a failing recipe."""
    offset = port_offset(recipe.ports)
    code = move_ports(recipe.code, recipe.ports, offset)
    for old, new in (replacements or {}).items():
        code = code.replace(old, new)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    t0 = time.monotonic()
    server = None
    with tempfile.TemporaryDirectory(prefix=f"recipe-{recipe.name}-") as tmp:
        server_log = Path(tmp) / "server.log"
        try:
            if recipe.server_port is not None:
                port = recipe.server_port + offset
                with open(server_log, "wb") as log:
                    server = subprocess.Popen(
                        [str(repo / ".venv/bin/radixkv"), "serve", "--port", str(port)],
                        cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True)
                deadline = time.monotonic() + SERVER_START_TIMEOUT_S
                while not _healthy(port):
                    if server.poll() is not None or time.monotonic() > deadline:
                        why = ("exited" if server.poll() is not None else "never answered /health")
                        return Result(recipe.name, False, time.monotonic() - t0,
                                      f"server for the recipe {why}:\n"
                                      + _tail(server_log.read_text(errors="replace")))
                    time.sleep(0.5)
            if recipe.lang == "bash":
                argv = ["bash", "-e", "-o", "pipefail", "-c", code]
            else:
                argv = [str(repo / ".venv/bin/python"), "-c", code]
            # Output goes to a file, not a pipe: a process the block left in the background
            # would hold a pipe open, and the block's end must not wait for it.
            out_path = Path(tmp) / "output.txt"
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=recipe.timeout_s)
                ok = proc.returncode == 0
                note = "" if ok else f"\n[exit status {proc.returncode}]"
            except subprocess.TimeoutExpired:
                ok = False
                note = f"\n[timed out after {recipe.timeout_s:.0f} s]"
            finally:
                _stop_group(proc)
            text = out_path.read_text(errors="replace") + note
            return Result(recipe.name, ok, time.monotonic() - t0, text)
        finally:
            if server is not None:
                _stop_group(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="recipes to run, in this order")
    parser.add_argument("--all", action="store_true", help="run every recipe, one at a time")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--set", action="append", default=[], metavar="OLD=NEW",
                        help="replace text in each block before it runs (repeatable)")
    args = parser.parse_args(argv)
    recipes = all_recipes()
    by_name = {r.name: r for r in recipes}
    if args.list:
        for r in recipes:
            print(f"{r.name:24s} {r.source}:{r.line}  ports={r.ports} server={r.server_port} "
                  f"timeout={r.timeout_s:.0f}s")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown recipe(s) {', '.join(unknown)}; --list shows them")
    chosen = recipes if args.all else [by_name[n] for n in args.names]
    if not chosen:
        parser.error("name recipes to run, or --all")
    replacements = {}
    for item in args.set:
        old, sep, new = item.partition("=")
        if not sep or not old:
            parser.error(f"--set {shlex.quote(item)}: expected OLD=NEW")
        replacements[old] = new
    failed = 0
    for recipe in chosen:
        result = run(recipe, replacements)
        status = "ok" if result.ok else "FAILED"
        print(f"{status:6s} {recipe.name} ({recipe.source}:{recipe.line}) {result.seconds:.1f} s",
              flush=True)
        if not result.ok:
            failed += 1
            print(_tail(result.output), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

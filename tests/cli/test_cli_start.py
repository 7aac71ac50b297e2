"""The CLI starts without torch, transformers or aiohttp: each subcommand
imports what it needs when it runs, and ``--device auto`` is resolved then, not at parsing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixkv.cli import build_parser, engine_config_from_args, resolve_device

HEAVY = ("torch", "transformers", "aiohttp")
PROBE = f"""
import sys
sys.argv = ["radixkv", *sys.argv[1:]]
from radixkv.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = "returned"
print("EXIT", code, "LOADED", sorted(m for m in {HEAVY!r} if m in sys.modules))
"""


@pytest.mark.parametrize("argv,usage", [
    (["--help"], "usage: radixkv [-h] {serve,chat,export-hf,verify,plan,bench} ..."),
    (["plan", "--help"], "usage: radixkv plan [-h] (--config PATH | --gguf PATH | --model NAME)"),
    (["export-hf", "--help"], "usage: radixkv export-hf [-h] --out DIR [--model MODEL] [--force]"),
    (["chat", "--help"], "usage: radixkv chat [-h] [--url URL]"),
    (["bench", "eviction", "--help"], "usage: radixkv bench eviction [-h]"),
    (["serve", "--help"], "usage: radixkv serve [-h] [--model MODEL]"),
])
def test_help_imports_no_heavy_module(argv, usage):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(usage), proc.stdout[:300]
    assert proc.stdout.splitlines()[-1] == "EXIT 0 LOADED []"


def test_device_defaults_to_auto_resolved_when_serving():
    assert build_parser().parse_args(["serve"]).device == "auto"
    assert build_parser().parse_args(["serve", "--device", "cpu"]).device == "cpu"
    assert [resolve_device(d) for d in ("cpu", "cuda:1")] == ["cpu", "cuda:1"]
    import torch

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_pool_flags():
    args = build_parser().parse_args(["serve", "--tokenizer-workers", "3",
                                      "--max-tokenize-queue", "9"])
    assert (args.tokenizer_workers, args.max_tokenize_queue) == (3, 9)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.tokenizer_workers, defaults.max_tokenize_queue) == (None, 256)
    for bad in (["--tokenizer-workers", "0"], ["--max-tokenize-queue", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


@pytest.mark.parametrize("flags, message", [
    (["--sliding-window-kv", "tombstones"], "argument --sliding-window-kv: invalid choice"),
    (["--window-kv-fraction", "0"], "argument --window-kv-fraction: expected a number in (0, 1), got '0'"),
    (["--window-kv-fraction", "1"], "argument --window-kv-fraction: expected a number in (0, 1), got '1'"),
    (["--window-kv-fraction", "nan"], "argument --window-kv-fraction: expected a number in (0, 1)"),
    (["--window-num-blocks", "1"], "argument --window-num-blocks: must be an int in [2, "),
])
def test_window_kv_flags_exit_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_window_kv_flags_reach_the_cache_config():
    args = build_parser().parse_args(["serve", "--sliding-window-kv", "window",
                                      "--window-kv-fraction", "0.4", "--window-num-blocks", "90"])
    cache = engine_config_from_args(args).cache
    assert (cache.sliding_window_kv, cache.window_kv_fraction, cache.window_num_blocks) == (
        "window", 0.4, 90)
    assert engine_config_from_args(build_parser().parse_args(["serve"])).cache.sliding_window_kv \
        == "keep-all"

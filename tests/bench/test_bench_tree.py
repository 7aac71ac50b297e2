"""``radixkv bench tree``: flag checks before any work, the pool floor, the eviction timing and
the targets in the results."""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import pytest

from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.cli import load_bench, main

bt = load_bench("tree")
USABLE = "cost, fifo, gdsf, lfu, lru, predicted-reuse, predicted-reuse-prior, s3fifo"
SMALL = ["--sessions", "4", "--turns", "2", "--repeat", "1", "--skip-scaling"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv bench tree")
    bt.add_arguments(parser)
    return parser.parse_args(list(argv))


def cli_error(capsys, *argv: str) -> str:
    """Run ``radixkv bench tree ARGV``; assert exit code 2 and return the last stderr line."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "tree", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--sessions", "0"], "argument --sessions: must be an int >= 1, got 0"),
    (["--sessions", "-3"], "argument --sessions: must be an int >= 1, got -3"),
    (["--sessions", "x"], "argument --sessions: expected an int >= 1, got 'x'"),
    (["--turns", "0"], "argument --turns: must be an int >= 1, got 0"),
    (["--block-size", "0"], "argument --block-size: must be an int >= 1, got 0"),
    (["--block-size", "-4"], "argument --block-size: must be an int >= 1, got -4"),
    (["--repeat", "0"], "argument --repeat: must be an int >= 1, got 0"),
    (["--scaling-ops", "0"], "argument --scaling-ops: must be an int >= 1, got 0"),
    (["--publish-interval-blocks", "0"], "argument --publish-interval-blocks: must be an int >= 1, got 0"),
    (["--publish-interval-blocks", "-2"],
     "argument --publish-interval-blocks: must be an int >= 1, got -2"),
    (["--system-tokens", "-5"], "argument --system-tokens: must be an int >= 0, got -5"),
    (["--capacity-fraction", "nan"],
     "argument --capacity-fraction: must be a finite number in (0, 1], got nan"),
    (["--capacity-fraction", "inf"],
     "argument --capacity-fraction: must be a finite number in (0, 1], got inf"),
    (["--capacity-fraction", "0"],
     "argument --capacity-fraction: must be a finite number in (0, 1], got 0"),
    (["--capacity-fraction", "1.5"],
     "argument --capacity-fraction: must be a finite number in (0, 1], got 1.5"),
    (["--capacity-fraction", "half"],
     "argument --capacity-fraction: expected a number in (0, 1], got 'half'"),
    (["--policy", "nope"], f"argument --policy: unknown policy 'nope'; usable: {USABLE}"),
    (["--policy", "belady"],
     "argument --policy: 'belady' is an offline oracle that needs the trace's future "
     f"(bench eviction only); usable: {USABLE}"),
    (["--scaling-sizes", "abc"],
     "argument --scaling-sizes: expected a comma list of ints, e.g. 5000,50000, got 'abc'"),
    (["--scaling-sizes", "5000,0"], "argument --scaling-sizes: every size must be >= 1, got '5000,0'"),
])
def test_flag_errors_are_one_line_exit_2(capsys, argv: list, message: str) -> None:
    assert cli_error(capsys, *argv) == f"radixkv bench tree: error: {message}"


@pytest.mark.parametrize(("argv", "message"), [
    (["--scaling-sizes", "10,20", "--scaling-ops", "5"],
     "--scaling-sizes 10 is too small for --scaling-ops 5: each size must be >= 3 x --scaling-ops (15)"),
    (["--scaling-sizes", "5000", "--scaling-ops", "6000"],
     "--scaling-sizes 5000 is too small for --scaling-ops 6000: each size must be >= 3 x --scaling-ops "
     "(18000)"),
    (["--block-size", "117", "--system-tokens", "16"],
     "--block-size 117 is longer than the shortest prompt (116 tokens: --system-tokens 16 + "
     "100); every prompt must hold a full block"),
])
def test_cross_flag_errors_before_any_work(capsys, monkeypatch, argv: list, message: str) -> None:
    def no_work(*args, **kwargs):
        raise AssertionError("the workload was generated before the flags were checked")

    monkeypatch.setattr(bt, "make_workload", no_work)
    monkeypatch.setattr("radixkv.cli.load_bench", lambda name: bt)
    assert cli_error(capsys, "--sessions", "8", *argv) == f"radixkv bench tree: error: {message}"


def test_scaling_size_of_three_times_the_ops_is_accepted() -> None:
    args = parse("--scaling-sizes", "15,30", "--scaling-ops", "5")
    assert args.scaling_sizes == [15, 30] and bt.check_args(args) is None
    assert parse().scaling_sizes == [5000, 50000]  # the default string goes through the type too
    assert bt.check_args(parse("--scaling-sizes", "14", "--scaling-ops", "5", "--skip-scaling")) is None
    run = bt.scaling_check(15, 5)
    assert run["num_leaves"] == 15


def test_json_folder_is_made_or_refused_before_the_run(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out.json"
    assert bt.check_args(parse("--json", str(target))) is None
    assert target.parent.is_dir() and not target.exists()
    assert bt.check_args(parse("--json", str(tmp_path))) == (
        f"--json {tmp_path} is a folder; give a file path")
    blocker = tmp_path / "file"
    blocker.write_text("")
    problem = bt.check_args(parse("--json", str(blocker / "out.json")))
    assert problem.startswith(f"--json {blocker / 'out.json'}: cannot create its folder: ")


def test_pool_holds_the_largest_request_whatever_the_fraction() -> None:
    small = bt.make_workload(4, 2, 2048, 0)
    # 35 % of 463 distinct blocks (162) cannot hold the largest request (228 blocks).
    assert bt.pool_blocks(small, 16, 2048, 0.35) == (229, 463, 228)
    assert bt.pool_blocks(small, 16, 2048, 1.0) == (463, 463, 228)
    default = bt.make_workload(48, 10, 2048, 0)
    assert bt.pool_blocks(default, 16, 2048, 0.35) == (10128, 28939, 889)


def test_evict_is_one_clock_pair_per_cache_eviction(monkeypatch) -> None:
    from radixkv.cache import manager as cache_manager

    # A clock advancing one per read: ``evict`` reads it twice per cache eviction (its start
    # and end, spanning the tree, the pool and the ghost list), so it counts 1 ns per call;
    # the tree-timed replay counts 1 ns per tree call the same way.
    monkeypatch.setattr(bt, "time", types.SimpleNamespace(perf_counter_ns=lambda: next(ticks)))
    ticks = iter(range(10**9))
    calls = {"cache": 0, "tree": 0, "tail": 0}
    real_evict = cache_manager.CacheManager._evict
    real_tree_evict = RadixTree.evict
    real_take = RadixTree.take_tail_block

    def count(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)
        return wrapped

    monkeypatch.setattr(cache_manager.CacheManager, "_evict", count("cache", real_evict))
    monkeypatch.setattr(RadixTree, "evict", count("tree", real_tree_evict))
    monkeypatch.setattr(RadixTree, "take_tail_block", count("tail", real_take))
    workload = bt.make_workload(4, 2, 2048, 0)
    res = bt.replay(workload, 16, 229, "lru", 16)
    assert res["blocks"]["evict"] == res["evicted_blocks_total"] == 267
    assert res["ns"]["evict"] == calls["cache"] == 51 and res["ns"]["evict_tree"] == 0
    # 44 of the 51 take one block off a longer leaf (decode: take_tail_block), 7 more (223
    # blocks) go through the tree's evict.
    assert (calls["tail"], calls["tree"]) == (44, 7)
    calls.update(cache=0, tree=0, tail=0)
    res = bt.replay(workload, 16, 229, "lru", 16, time_tree=True)
    assert res["blocks"]["evict_tree"] == res["evicted_blocks_total"] == 267
    assert res["ns"]["evict_tree"] == calls["tree"] + calls["tail"] and res["ns"]["evict"] == 0


def test_replay_restores_the_cache_manager_methods(monkeypatch) -> None:
    from radixkv.cache import manager as cache_manager

    seen = []
    real = cache_manager.CacheManager.check_integrity

    def check(self, *args, **kwargs):
        seen.append(("evict" in vars(self.tree), "take_tail_block" in vars(self.tree),
                     "_evict" in vars(self)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cache_manager.CacheManager, "check_integrity", check)
    workload = bt.make_workload(4, 2, 2048, 0)
    bt.replay(workload, 16, 229, "lru", 16)
    bt.replay(workload, 16, 229, "lru", 16, time_tree=True)
    assert seen == [(False, False, False)] * 2


def test_small_run_reports_targets_and_keeps_exit_0(tmp_path: Path, capsys) -> None:
    out_path = tmp_path / "new" / "tree.json"
    assert main(["bench", "tree", *SMALL, "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    assert out["targets"] == {"match": 0.25, "insert": 1.2, "evict": 1.0}
    assert out["met"] == {op: out["ratio_to_floor"][op] <= target
                          for op, target in out["targets"].items()}
    assert out["default_workload"] is False
    assert (out["workload"]["pool_blocks"], out["workload"]["largest_request_blocks"]) == (229, 228)
    assert out["blocks"]["evict"] == out["blocks"]["evict_tree"] == 267
    assert set(out["ratio_to_floor"]) == {"match", "insert", "evict", "evict_tree", "hash",
                                          "insert_prefill", "insert_decode", "pack"}
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == bt.targets_line(out)
    assert last.startswith("targets (ratio_to_floor): match ")
    assert last.endswith(" (set on the default workload; this run's differs, so not comparable)")


def test_targets_line_exact() -> None:
    out = {"ratio_to_floor": {"match": 0.2114, "insert": 1.3, "evict": 0.987},
           "targets": dict(bt.TARGETS), "met": {"match": True, "insert": False, "evict": True},
           "default_workload": True}
    assert bt.targets_line(out) == ("targets (ratio_to_floor): match 0.211 (<= 0.25) met, "
                                    "insert 1.300 (<= 1.2) NOT met, evict 0.987 (<= 1) met")


def test_default_workload_matches_the_flag_defaults() -> None:
    args = parse()
    assert {name: getattr(args, name) for name in bt.DEFAULT_WORKLOAD} == bt.DEFAULT_WORKLOAD

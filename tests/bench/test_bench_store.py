"""``radixkv bench store`` on the tiny model with the host tier: every run's cached tokens are
checked inside the bench (device and store), so a pass means each store run loaded exactly k
blocks and each recompute run computed them; here the outputs' shape and files."""

from __future__ import annotations

import json

from radixkv.cli import load_bench


def test_bench_store_host_tiny(tiny_model_dir, tmp_path, capsys):
    bench = load_bench("store")
    out = tmp_path / "store.json"
    assert bench.main(["--model", str(tiny_model_dir), "--backends", "host", "--blocks", "1,3",
                       "--depth", "64", "--reps", "2", "--host-gib", "0.05",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["depth_tokens"], data["block_size_tokens"], data["reps"]) == (64, 16, 2)
    assert [(r["backend"], r["blocks"]) for r in data["rows"]] == [("host", 1), ("host", 3)]
    assert data["skipped"] == {}
    for k in ("1", "3"):
        assert all(len(v) == 2 for v in data["raw_seconds"]["host"][k].values())
        assert all(len(v) == 2 for v in data["raw_seconds"]["recompute"][k].values())
    table = out.with_suffix(".md").read_text()
    assert "| host | 1 |" in table and "| host | 3 |" in table
    assert "| host | 3 |" in capsys.readouterr().out

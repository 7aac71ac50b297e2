"""``radixkv bench serve`` through real routers over two fresh tiny-model replicas, exact numbers.

vllm-router forwards ``POST /tokenize`` and ``GET /stats`` to one worker, so ``--url ROUTER``
alone works; sglang-router answers 404 to both, so the run needs ``--tokenize-url REPLICA`` and
fails with a message naming that flag without it. Cached tokens come from each routed response's
``usage.prompt_tokens_details.cached_tokens``.

The run is the shipped tau-bench sample's first 2 sessions x 2 turns, one request at a time,
``--cache-salt none`` (sglang-router drops a chat ``cache_salt`` anyway), so ``round_robin``
alternates the replicas: requests 0 and 2 land on one, 1 and 3 on the other. Each replica is
fresh, so request 2 reuses what it shares with request 0 (the policy prompt) and request 3 what
it shares with request 1, and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixkv.cli import load_bench
from radixkv.cli import main as cli_main
from radixkv.tools.transcripts import ideal_cached_tokens, load_tau_bench
from tests.routers.harness import ROUTERS, RouterProcess, requests_total, run_replicas, run_router
from tests.server.conftest import BLOCK_SIZE, RunningServer
from tests.server.helpers import capped, lcp
from tests.server.test_bench_serve import KEYS, _server_tokens

pytestmark = pytest.mark.shared_data  # reads the shipped samples


@pytest.fixture(params=sorted(ROUTERS))
def routed(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path
           ) -> Iterator[tuple[RouterProcess, list[RunningServer]]]:
    """Fresh replicas (nothing cached) and a ``round_robin`` router over them, per test."""
    with run_replicas(tiny_model_dir, 2) as servers:
        with run_router(request.param, [s.url for s in servers], tmp_path) as router:
            yield router, servers


def test_bench_serve_through_a_router(routed, tmp_path):
    router, replicas = routed
    bench = load_bench("serve")
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    tokens = _server_tokens(replicas[0].url, requests)
    flags = ["--url", router.url, "--sessions", "2", "--max-turns", "2", "--concurrency", "1",
             "--cache-salt", "none", "--max-tokens", "4", "--plot", str(tmp_path / "p.png")]
    if router.name == "sglang-router":
        with pytest.raises(SystemExit) as info:
            bench.main([*flags, "--json", str(tmp_path / "no.json")])
        assert str(info.value) == (
            f"bench serve: {router.url} answered 404 to POST /tokenize: a router that does not "
            "forward /tokenize and /stats to its replicas (sglang-router) needs --tokenize-url "
            "REPLICA_URL, one replica behind it (token ids, block size and model id come from "
            "there; the requests still go through the router)")
        assert not (tmp_path / "no.json").exists()
        flags += ["--tokenize-url", replicas[0].url]
    assert [requests_total(s) for s in replicas] == [0, 0]
    out = tmp_path / "routed.json"
    assert bench.main([*flags, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert KEYS | {"server_requests", "per_request"} <= set(data)
    assert (data["url"], data["model"], data["cache_salt"]) == (
        router.url, replicas[0].engine.model_name, None)
    assert data["tokenize_url"] == (replicas[0].url if router.name == "sglang-router" else None)
    assert (data["requests"], data["skipped_requests"], data["failed_requests"]) == (4, 0, 0)
    assert [requests_total(s) for s in replicas] == [2, 2]
    rows = data["per_request"]
    assert [(r["session_id"], r["turn"]) for r in rows] == [
        (r["session_id"], r["turn"]) for r in requests]
    assert [r["prompt_tokens"] for r in rows] == [len(t) for t in tokens]
    assert data["prompt_tokens"] == sum(len(t) for t in tokens)
    ideal = ideal_cached_tokens(tokens, BLOCK_SIZE)
    assert [r["ideal_cached_tokens"] for r in rows] == ideal
    # Alternating replicas: each request finds only the one earlier request of its replica.
    expected = [0, 0, *(capped(lcp(tokens[i], tokens[i - 2]), len(tokens[i]), BLOCK_SIZE)
                        for i in (2, 3))]
    assert expected[2] > 1000 and expected[3] > 1000  # the shared policy prompt
    assert ideal[1] > expected[1] == 0  # turn 1 left its session's replica
    assert [r["cached_tokens"] for r in rows] == expected
    assert data["cached_tokens"] == sum(expected)
    assert data["cached_over_ideal"] == pytest.approx(sum(expected) / sum(ideal))
    # /stats of one replica saw half the run, so its cached counter is not the run's.
    assert data["server_cached_prompt_tokens"] is None
    if router.name == "sglang-router":
        assert data["server_requests"] == 2


def test_bench_fleet_smoke_two_replicas_round_robin(tiny_model_dir, tmp_path, capsys,
                                                    monkeypatch):
    """``radixkv bench fleet`` with 2 replica processes and one policy, exact numbers."""
    monkeypatch.setattr("radixkv.log.configure_logging", lambda *a, **k: None)
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    with run_replicas(tiny_model_dir, 1) as (server,):
        tokens = _server_tokens(server.url, requests)
    out = tmp_path / "fleet.json"
    assert cli_main(["bench", "fleet", "--replicas", "2", "--policies", "round_robin",
                     "--pools", "large", "--model", str(tiny_model_dir), "--sessions", "2",
                     "--max-turns", "2", "--concurrency", "1", "--max-tokens", "4",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    distinct = {tuple(t[:k]) for t in tokens for k in range(BLOCK_SIZE, len(t) + 1, BLOCK_SIZE)}
    assert (data["working_set_blocks"], data["runnable_requests"]) == (len(distinct), 4)
    assert data["max_request_blocks"] == max(-(-(len(t) + 4) // BLOCK_SIZE) for t in tokens)
    [phase] = data["phases"]
    # Room for every prompt block plus each request's output blocks (4 tokens: 2 blocks).
    assert (phase["pool"], phase["num_blocks"]) == ("large", len(distinct) + 4 * 2 + 16)
    [run] = phase["runs"]
    expected = [0, 0, *(capped(lcp(tokens[i], tokens[i - 2]), len(tokens[i]), BLOCK_SIZE)
                        for i in (2, 3))]
    assert run["policy"] == "round_robin"
    assert (run["requests"], run["failed_requests"], run["skipped_requests"]) == (4, 0, 0)
    assert (run["replica_requests"], run["evicted_blocks"]) == ([2, 2], 0)
    assert run["cached_tokens"] == sum(expected) == sum(run["replica_cached_tokens"])
    assert run["ideal_cached_tokens"] == sum(ideal_cached_tokens(tokens, BLOCK_SIZE))
    bench_run = json.loads(Path(run["bench_json"]).read_text())
    assert [r["cached_tokens"] for r in bench_run["per_request"]] == expected
    assert bench_run["tokenize_url"] is not None and bench_run["cache_salt"] is None
    printed = capsys.readouterr().out
    assert f"pool large: {phase['num_blocks']} blocks per replica" in printed
    assert "round_robin" in printed and "[2, 2]" in printed
    logs = sorted(p.name for p in (tmp_path / "fleet-runs" / "large-round_robin").iterdir())
    assert logs == ["replica0.log", "replica1.log", "router-round_robin.log", "serve.json",
                    "serve.png"]


def test_bench_fleet_bad_flags_exit_before_starting_anything(tmp_path):
    fleet = load_bench("fleet")
    for flags, message in [(["--pools", "0"], "--pools: expected 'large' or a fraction"),
                           (["--pools", "big"], "--pools: expected 'large' or a fraction"),
                           (["--policies", "random"], "--policies: expected some of"),
                           (["--replicas", "0"], "--replicas must be >= 1")]:
        with pytest.raises(SystemExit, match=message):
            fleet.main([*flags, "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "x-runs").exists()

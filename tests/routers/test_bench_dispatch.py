"""``radixkv bench serve --url A --url B --dispatch {alternate,session}``: turns spread over two
fresh tiny-model replicas with no router, exact numbers.

The run is the shipped tau-bench sample's first 2 sessions x 3 turns, one session at a time,
``--cache-salt none``. ``alternate`` sends turn i of a session to replica i mod 2 (turns 0 and 2
to A, turn 1 to B), so a turn finds only what earlier requests left on its own replica;
``session`` keeps each session on the replica its id hashes to (CRC-32 mod 2).
"""

from __future__ import annotations

import json
import zlib

import pytest

from radixkv.cli import load_bench
from radixkv.tools.transcripts import ideal_cached_tokens, load_tau_bench
from tests.routers.harness import requests_total, run_replicas
from tests.server.conftest import BLOCK_SIZE
from tests.server.helpers import capped, lcp
from tests.server.test_bench_serve import _server_tokens

pytestmark = pytest.mark.shared_data  # reads the shipped samples


def _expected_cached(tokens: list[list[int]], where: list[int]) -> list[int]:
    """Per request: the longest prefix shared with an earlier request on the same replica,
    capped as the engine caps hits (no eviction: the pools are large)."""
    return [max([capped(lcp(t, tokens[j]), len(t), BLOCK_SIZE)
                 for j in range(i) if where[j] == where[i]], default=0)
            for i, t in enumerate(tokens)]


@pytest.mark.parametrize("dispatch", ["alternate", "session"])
def test_bench_serve_dispatch_over_two_replicas(dispatch, tiny_model_dir, tmp_path):
    bench = load_bench("serve")
    sessions = [s[:3] for s in load_tau_bench()[:2]]
    requests = [r for s in sessions for r in s]
    with run_replicas(tiny_model_dir, 2) as replicas:
        urls = [s.url for s in replicas]
        tokens = _server_tokens(urls[0], requests)
        out = tmp_path / "dispatch.json"
        assert bench.main(["--url", urls[0], "--url", urls[1], "--dispatch", dispatch,
                           "--sessions", "2", "--max-turns", "3", "--concurrency", "1",
                           "--cache-salt", "none", "--max-tokens", "4",
                           "--json", str(out)]) == 0
        counts = [requests_total(s) for s in replicas]
    data = json.loads(out.read_text())
    if dispatch == "alternate":
        where = [i for s in sessions for i in (0, 1, 0)[: len(s)]]
    else:
        where = [zlib.crc32(r["session_id"].encode()) % 2 for r in requests]
    expected = _expected_cached(tokens, where)
    rows = data["per_request"]
    assert (data["urls"], data["dispatch"], data["requests"]) == (urls, dispatch, 6)
    assert [r["url"] for r in rows] == [urls[w] for w in where]
    assert counts == [where.count(0), where.count(1)]
    assert [r["cached_tokens"] for r in rows] == expected
    ideal = ideal_cached_tokens(tokens, BLOCK_SIZE)
    assert data["ideal_cached_tokens"] == sum(ideal)
    assert data["server_requests"] == 6
    assert data["server_cached_prompt_tokens"] == sum(expected)
    for k, url in enumerate(urls):
        mine = [i for i, w in enumerate(where) if w == k]
        per = data["per_url"][url]
        assert (per["requests"], per["failed_requests"]) == (len(mine), 0)
        assert per["cached_tokens"] == sum(expected[i] for i in mine)
        assert per["prompt_tokens"] == sum(len(tokens[i]) for i in mine)
        assert per["ideal_cached_tokens"] == sum(ideal[i] for i in mine)
        assert per["server"]["requests_total"] == len(mine)
        assert per["server"]["cached_prompt_tokens_total"] == per["cached_tokens"]
    if dispatch == "alternate":
        # Turn 1 left its session's replica: it finds at most the other session's prefix.
        assert expected[1] < ideal[1]


def test_dispatch_rejects_the_same_url_twice(tmp_path):
    bench = load_bench("serve")
    with pytest.raises(SystemExit, match="the same --url twice"):
        bench.main(["--url", "http://127.0.0.1:1", "--url", "http://127.0.0.1:1",
                    "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()

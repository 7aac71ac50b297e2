"""``bench serve`` with think time and retention against a real tiny-model server: the gaps it
waits, the groups it reports (retained sessions vs the rest) with exact cached, ideal and
cache-creation tokens, the Messages API route (``--retention anthropic-*``) and
``prompt_cache_retention`` (``openai-24h``), and the flag errors."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from radixkv.cli import load_bench
from radixkv.cli import main as cli_main
from radixkv.model.loader import LoadedModel
from radixkv.tools.transcripts import ideal_cached_tokens, load_tau_bench
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _arg_types  # noqa: E402
import _serve_tokens  # noqa: E402

pytestmark = pytest.mark.shared_data  # reads the shipped samples

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    """One tiny-model server for the module (context 2048, B = 16, 512 blocks: room for every
    prompt of the runs below, so cached tokens equal the ideal)."""
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=BLOCK_SIZE,
                                                      num_blocks=512))


@pytest.fixture(autouse=True)
def _release_retentions(request) -> Iterator[None]:
    """Each test starts with no live retention: the runs use fresh salts, but what an earlier
    test retained would still count against the pool's retention budget."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        asyncio.run_coroutine_threadsafe(srv.engine.release_retentions(None, all_tenants=True),
                                         srv.loop).result(30)


def _server_tokens(url: str, requests: list[dict]) -> list[list[int]]:
    async def go():
        async with aiohttp.ClientSession() as http:
            out = []
            for req in requests:
                async with http.post(f"{url}/tokenize", json={"messages": req["messages"]}) as r:
                    out.append((await r.json())["tokens"])
            return out
    return asyncio.run(go())


def _tau_tokens(url: str, sessions: int, turns: int) -> dict[tuple[str, int], list[int]]:
    requests = [r for s in load_tau_bench()[:sessions] for r in s[:turns]]
    tokens = _server_tokens(url, requests)
    return {(r["session_id"], r["turn"]): t for r, t in zip(requests, tokens)}


# ---- pure helpers -----------------------------------------------------------------------------

def test_sse_events_yield_data_objects_up_to_done() -> None:
    async def body():
        for line in (b"event: message_start\n", b'data: {"a": 1}\n', b"\n", b": keep-alive\n",
                     b'data:{"b": [2]}\r\n', b"data: [DONE]\n", b'data: {"after": 3}\n'):
            yield line

    async def collect(lines):
        return [event async for event in _serve_tokens.sse_events(lines)]

    assert asyncio.run(collect(body())) == [{"a": 1}, {"b": [2]}]


def test_anthropic_messages_puts_cache_control_on_the_last_block() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert _serve_tokens.anthropic_messages(messages, "1h") == {
        "system": [{"type": "text", "text": "S"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "u1"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
                     {"role": "user", "content": [{"type": "text", "text": "u2", "cache_control":
                                                   {"type": "ephemeral", "ttl": "1h"}}]}]}
    plain = _serve_tokens.anthropic_messages(messages[1:2])
    assert plain == {"messages": [{"role": "user", "content": [{"type": "text", "text": "u1"}]}]}
    with pytest.raises(ValueError, match="system message after the first turn"):
        _serve_tokens.anthropic_messages(messages[1:2] + messages[:1])
    with pytest.raises(ValueError, match="only system messages"):
        _serve_tokens.anthropic_messages(messages[:1])


def test_read_anthropic_usage_adds_the_three_input_counts() -> None:
    start = {"type": "message_start", "message": {"usage": {
        "input_tokens": 5, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 16,
        "output_tokens": 1}}}
    assert _serve_tokens.read_anthropic_usage(start) == {
        "prompt_tokens": 53, "completion_tokens": 1, "cached_tokens": 32,
        "cache_creation_tokens": 16}
    delta = {"type": "message_delta", "usage": {"output_tokens": 7}}
    assert _serve_tokens.read_anthropic_usage(delta) == {
        "prompt_tokens": None, "completion_tokens": 7, "cached_tokens": None,
        "cache_creation_tokens": None}
    assert _serve_tokens.read_anthropic_usage({"type": "ping"}) is None


# ---- against the server ---------------------------------------------------------------------------

def test_think_time_is_waited_between_a_sessions_turns(server, tmp_path) -> None:
    bench = load_bench("serve")
    by_turn = _tau_tokens(server.url, 2, 2)
    out = tmp_path / "think.json"
    assert bench.main(["--url", server.url, "--sessions", "2", "--max-turns", "2",
                       "--concurrency", "1", "--max-tokens", "2", "--think-time-s", "exp:0.3",
                       "--seed", "7", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["think_time_s"], data["seed"], data["requests"]) == ("exp:0.3", 7, 4)
    spec = _arg_types.ThinkTime("exp", 0.3)
    rows = data["per_request"]
    for row in rows:  # each session's first turn goes at once, its second after a draw
        expected = spec.draw_s(7, row["session_id"], row["turn"]) if row["turn"] else 0.0
        assert row["think_s"] == round(expected, 6)
    # Concurrency 1: a thinking session keeps the only slot, so the gaps add up.
    assert [r["turn"] for r in rows] == [0, 1, 0, 1]
    assert data["wall_s"] >= sum(r["think_s"] for r in rows) > 0
    ideal = ideal_cached_tokens([by_turn[r["session_id"], r["turn"]] for r in rows], BLOCK_SIZE)
    assert [r["cached_tokens"] for r in rows] == [r["ideal_cached_tokens"] for r in rows] == ideal
    assert "groups" not in data and data["retention"] is None


def test_openai_24h_retains_for_the_chosen_share(server, tmp_path, capsys) -> None:
    bench = load_bench("serve")
    by_turn = _tau_tokens(server.url, 2, 2)
    out = tmp_path / "oai.json"
    assert bench.main(["--url", server.url, "--sessions", "2", "--max-turns", "2",
                       "--concurrency", "1", "--max-tokens", "2", "--retention", "openai-24h",
                       "--retain-share", "0.5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    second = load_tau_bench()[1][0]["session_id"]
    assert (data["retention"], data["retain_share"], data["retained_sessions"]) == (
        "openai-24h", 0.5, [second])
    rows = data["per_request"]
    assert [r["retained"] for r in rows] == [False, False, True, True]  # concurrency 1: file order
    ideal = ideal_cached_tokens([by_turn[r["session_id"], r["turn"]] for r in rows], BLOCK_SIZE)
    assert [r["cached_tokens"] for r in rows] == ideal
    kept, rest = data["groups"]["retained"], data["groups"]["not_retained"]
    assert (kept["sessions"], kept["requests"], rest["sessions"], rest["requests"]) == (1, 2, 1, 2)
    assert kept["cached_tokens"] == kept["ideal_cached_tokens"] == ideal[2] + ideal[3]
    assert rest["cached_tokens"] == rest["ideal_cached_tokens"] == ideal[0] + ideal[1]
    assert kept["cached_over_ideal"] == rest["cached_over_ideal"] == 1.0
    # Only the retained requests report what they retained (the radixkv extension): the
    # prompt past its cache hit, up to the published blocks of prompt and reply.
    assert [r["cache_creation_tokens"] for r in rows[:2]] == [None, None]
    for r in rows[2:]:
        full = r["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert full - r["cached_tokens"] <= r["cache_creation_tokens"] <= r["prompt_tokens"] - r["cached_tokens"]
    assert rest["cache_creation_tokens"] is None
    printed = capsys.readouterr().out
    assert "retention openai-24h, share 0.5" in printed and "radixkv: not retained" in printed


@pytest.mark.parametrize("mode, ttl", [("anthropic-5m", "5m"), ("anthropic-1h", "1h")])
def test_anthropic_route_sends_cache_control_for_the_chosen_share(server, tmp_path, mode, ttl) -> None:
    bench = load_bench("serve")
    by_turn = _tau_tokens(server.url, 2, 2)
    out = tmp_path / "anth.json"
    assert bench.main(["--url", server.url, "--sessions", "2", "--max-turns", "2",
                       "--concurrency", "1", "--max-tokens", "2", "--retention", mode,
                       "--retain-share", "0.5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["per_request"]
    assert (data["requests"], data["failed_requests"]) == (4, 0)
    assert [r["retained"] for r in rows] == [False, False, True, True]
    # The Messages API renders the same tokens as the chat route: same prompt, same ideal.
    assert [r["prompt_tokens"] for r in rows] == [len(by_turn[r["session_id"], r["turn"]])
                                                   for r in rows]
    ideal = ideal_cached_tokens([by_turn[r["session_id"], r["turn"]] for r in rows], BLOCK_SIZE)
    assert [r["cached_tokens"] for r in rows] == ideal
    # A breakpoint on the last block retains the prompt's full blocks; created = those past
    # the hit. Requests without cache_control create nothing.
    assert [r["cache_creation_tokens"] for r in rows] == [0, 0] + [
        r["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE - r["cached_tokens"] for r in rows[2:]]
    kept = data["groups"]["retained"]
    assert kept["cache_creation_tokens"] == sum(r["cache_creation_tokens"] for r in rows[2:])
    assert kept["cached_over_ideal"] == data["groups"]["not_retained"]["cached_over_ideal"] == 1.0


@pytest.mark.parametrize("flags, message", [
    (["--retain-share", "0.5"], "--retain-share needs --retention"),
    (["--retention", "openai-1h"], "--retention"),
    (["--retention", "openai-24h", "--retain-share", "1.5"], "--retain-share"),
    (["--think-time-s", "exp:abc"], "--think-time-s"),
])
def test_bad_retention_flags_exit_2_naming_the_flag(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "serve", "--url", "http://127.0.0.1:1", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_open_loop_turn_is_ready_only_after_its_think_time(server, tmp_path) -> None:
    bench = load_bench("serve")
    out = tmp_path / "open.json"
    assert bench.main(["--url", server.url, "--sessions", "2", "--max-turns", "2",
                       "--request-rate", "1000", "--concurrency", "1", "--max-tokens", "2",
                       "--think-time-s", "0.4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["per_request"]
    assert (data["mode"], data["requests"], data["failed_requests"]) == ("poisson", 4, 0)
    # Both first turns are ready at once; each second turn 0.4 s after its first reply.
    assert [(r["turn"], r["think_s"]) for r in rows] == [(0, 0.0), (0, 0.0), (1, 0.4), (1, 0.4)]
    assert data["wall_s"] >= 0.4

"""Transcript loaders (normalisation, the shipped samples and the full shared data) and the ideal
prefix-reuse reference.

Data tests run on the samples shipped in the package (always) and on the full data in the shared
data folder (skipped, naming the missing path, when it is absent), each with its exact counts.
"""

from __future__ import annotations

import json
import time

import pytest

from radixkv.tools.transcripts import (
    SOURCE_PATHS,
    TAU_BENCH_AIRLINE,
    TRANSCRIPTS,
    default_path,
    ideal_cached_tokens,
    load_source,
    load_tau_bench,
    normalise_message,
    requests_from_history,
)
from tests.shared_data import sample_path, shared_path

TAU_RELATIVE = str(TRANSCRIPTS / TAU_BENCH_AIRLINE)
# Sessions, requests, (shortest, longest) session: SOURCES.md for the full file; the sample is
# its first three records.
TAU_COUNTS = {"sample": (3, 31, (5, 15)), "shared": (200, 2454, (2, 30))}
# (sessions, requests) per source; "shared" as in the shared folder's SOURCES.md.
COUNTS = {"sample": {"tau-bench": (3, 31), "swe-agent": (2, 9), "mini-swe-agent": (2, 12),
                     "crewai": (3, 9)},
          "shared": {"tau-bench": (200, 2454), "swe-agent": (22, 230), "mini-swe-agent": (2, 12),
                     "crewai": (204, 737)}}


def _data_path(data: str, relative: str):
    return sample_path(relative) if data == "sample" else shared_path(relative)


@pytest.fixture(scope="module", params=["sample", "shared"])
def tau(request):
    """``(data, file, sessions)`` for the shipped sample and the full shared file."""
    file = _data_path(request.param, TAU_RELATIVE)
    return request.param, file, load_tau_bench(file)


@pytest.fixture(scope="module")
def tau_sessions(tau):
    return tau[2]


@pytest.mark.shared_data
def test_tau_bench_counts_match_sources_md(tau):
    data, _, tau_sessions = tau
    sessions, requests, (shortest, longest) = TAU_COUNTS[data]
    assert len(tau_sessions) == sessions
    assert sum(len(s) for s in tau_sessions) == requests
    lengths = sorted(len(s) for s in tau_sessions)
    assert (lengths[0], lengths[-1]) == (shortest, longest)
    assert tau_sessions[0][0]["session_id"] == "gpt-4o-airline/task0/trial0"
    assert [r["turn"] for r in tau_sessions[0]] == list(range(len(tau_sessions[0])))


@pytest.mark.shared_data
def test_tau_bench_session_ids_follow_file_order(tau):
    data, file, tau_sessions = tau
    records = json.loads(file.read_bytes())
    expected = [f"gpt-4o-airline/task{r['task_id']}/trial{r['trial']}" for r in records]
    assert [s[0]["session_id"] for s in tau_sessions] == expected
    assert len(set(expected)) == TAU_COUNTS[data][0]


@pytest.mark.shared_data
def test_consecutive_requests_are_strict_prefix_extensions(tau):
    data, _, tau_sessions = tau
    pairs = 0
    for session in tau_sessions:
        for prev, cur in zip(session, session[1:]):
            assert len(cur["messages"]) > len(prev["messages"])
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]
            pairs += 1
    sessions, requests, _ = TAU_COUNTS[data]
    assert pairs == requests - sessions  # SOURCES.md: 2254/2254 strict-prefix pairs (full file)


@pytest.mark.shared_data
def test_messages_are_normalised(tau_sessions):
    allowed = {"system": {"role", "content"}, "user": {"role", "content"},
               "assistant": {"role", "content", "tool_calls"},
               "tool": {"role", "content", "tool_call_id", "name"}}
    for session in tau_sessions:
        for req in session:
            assert req["messages"][0]["role"] == "system"
            for m in req["messages"]:
                assert set(m) <= allowed[m["role"]]
                assert isinstance(m["content"], str)  # null content became ""
    last = tau_sessions[0][-1]["messages"]
    calls = [m for m in last if m.get("tool_calls")]
    assert calls and calls[0]["content"] == ""
    assert calls[0]["tool_calls"][0]["function"]["name"] == "get_user_details"


def test_normalise_message_rules():
    assert normalise_message({"role": "function", "content": "x"}) is None
    assert normalise_message({"role": "assistant", "content": None, "extra": 1,
                              "tool_calls": [{"id": "a"}]}) == {
        "role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}
    assert normalise_message({"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        "name": "bob"}) == {"role": "user", "content": "a\n[image_url]\nb"}
    assert normalise_message({"role": "tool", "content": "r", "tool_call_id": "c", "name": "f",
                              "thought": "t"}) == {
        "role": "tool", "content": "r", "tool_call_id": "c", "name": "f"}


def test_requests_from_history_one_per_assistant_after_index_0():
    h = [{"role": "assistant", "content": "0"}, {"role": "user", "content": "1"},
         {"role": "assistant", "content": "2"}, {"role": "tool", "content": "3"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "5"}]
    reqs = requests_from_history("s", h)
    assert [(r["turn"], len(r["messages"])) for r in reqs] == [(0, 2), (1, 4)]
    assert reqs[1]["messages"] == h[:4]


def test_load_source_unknown_name():
    with pytest.raises(ValueError, match="source"):
        load_source("nope")


def test_ideal_cached_tokens_exact_values():
    b = 4
    prompts = [
        [1, 2, 3, 4, 5, 6, 7, 8, 9],        # nothing earlier -> 0
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],    # lcp 9 -> floor(9/4)*4 = 8
        [1, 2, 3, 4, 5, 6, 7, 8],           # lcp 8, capped by N-1 = 7 -> 4
        [9, 9, 9, 9, 9],                    # no common prefix -> 0
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # lcp 10 with #1 -> 8
        [9, 9, 9, 9, 9, 1],                 # lcp 5 with #3 -> 4
        [1, 2, 3, 7],                       # lcp 3 -> 0
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # identical to #4: min(13, 12) -> 12
        [2],                                # single token -> 0
    ]
    assert ideal_cached_tokens(prompts, b) == [0, 8, 4, 0, 8, 4, 0, 12, 0]
    assert ideal_cached_tokens(prompts, 1) == [0, 9, 7, 0, 10, 5, 3, 12, 0]
    # Large token ids (beyond one byte) order and compare correctly.
    assert ideal_cached_tokens([[70000, 1, 2], [70000, 1, 3], [256, 1]], 1) == [0, 2, 0]
    with pytest.raises(ValueError, match="block_size"):
        ideal_cached_tokens(prompts, 0)


def test_ideal_cached_tokens_matches_brute_force():
    import random

    import numpy as np
    rng = random.Random(0)
    base = [rng.randrange(50000) for _ in range(2000)]
    prompts = []
    for _ in range(200):
        cut = rng.randrange(1, 2000)
        prompts.append(base[:cut] + [rng.randrange(50000) for _ in range(rng.randrange(0, 50))])

    def lcp(a, b):  # vectorised, independent of the sorted-neighbour search under test
        n = min(len(a), len(b))
        diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
        return int(diff[0]) if len(diff) else n

    brute = []
    for k, p in enumerate(prompts):
        best = max((lcp(p, q) for q in prompts[:k]), default=0)
        brute.append(max(0, min(best, len(p) - 1)) // 16 * 16)
    assert ideal_cached_tokens(prompts, 16) == brute


def test_ideal_cached_tokens_is_fast_for_thousands_of_requests():
    # tau-bench scale: 2,454 requests of a few thousand tokens each.
    prompts = [list(range(k % 200 * 10)) + [k] * 3000 for k in range(2500)]
    t0 = time.perf_counter()
    ideal = ideal_cached_tokens(prompts, 16)
    assert time.perf_counter() - t0 < 5.0
    assert ideal[0] == 0 and ideal[200] == 0 and ideal[201] == 10 // 16 * 16


@pytest.mark.shared_data
@pytest.mark.parametrize("data", ["sample", "shared"])
def test_mini_swe_agent_test_files_bare_lists(data):
    # The sample holds both files of the shared folder's mini-swe-agent, unchanged.
    sessions = load_source("mini-swe-agent", _data_path(data, "agent-transcripts/mini-swe-agent"))
    assert [s[0]["session_id"] for s in sessions] == [
        "tests/test_data/github_issue.traj.json", "tests/test_data/local.traj.json"]
    assert [len(s) for s in sessions] == [10, 2]  # SOURCES.md: 12 requests, 2 sessions
    local = sessions[1]
    assert [len(r["messages"]) for r in local] == [2, 4]
    assert [m["role"] for m in local[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for s in sessions for r in s for m in r["messages"])


def test_mini_swe_agent_record_format_drops_extra(tmp_path):
    record = {"info": {}, "instance_id": "x", "trajectory_format": "mini-swe-agent-1", "messages": [
        {"role": "system", "content": "s", "extra": {}},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "extra": {"response": {"usage": {}}}},
        {"role": "user", "content": "o"},
        {"role": "assistant", "content": "b", "extra": {}},
        {"role": "user", "content": "last"}]}
    (tmp_path / "x.traj.json").write_text(json.dumps(record))
    (sessions,) = load_source("mini-swe-agent", tmp_path)
    assert sessions == [
        {"session_id": "x.traj.json", "turn": 0, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
        {"session_id": "x.traj.json", "turn": 1, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "o"}]}]
    (tmp_path / "bad.traj.json").write_text('{"messages": 3}')
    with pytest.raises(ValueError, match="path"):
        load_source("mini-swe-agent", tmp_path)
    with pytest.raises(FileNotFoundError, match="path"):
        load_source("mini-swe-agent", tmp_path / "empty")


# VCR stores some request bodies as bytes: the third body is base64 of the JSON of a user
# message, an assistant tool call with null content, a tool result and a "function" message.
CASSETTE = """\
interactions:
- request:
    body: '{"input": ["x"], "model": "text-embedding-3-small"}'
    method: POST
    uri: https://api.openai.com/v1/embeddings
  response: {body: {string: '{}'}, status: {code: 200}}
- request:
    body: '{"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content":
      [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]}],
      "model": "gpt-4o", "tools": [{"type": "function", "function": {"name": "f"}}]}'
    method: POST
    uri: https://api.openai.com/v1/chat/completions
  response: {body: {string: '{}'}, status: {code: 200}}
- request:
    body: !!binary |
      eyJtZXNzYWdlcyI6IFt7InJvbGUiOiAidXNlciIsICJjb250ZW50IjogImhpIn0sIHsicm9sZSI6
      ICJhc3Npc3RhbnQiLCAiY29udGVudCI6IG51bGwsICJ0b29sX2NhbGxzIjogW3siaWQiOiAiYyJ9
      XX0sIHsicm9sZSI6ICJ0b29sIiwgImNvbnRlbnQiOiAiNDIiLCAidG9vbF9jYWxsX2lkIjogImMi
      fSwgeyJyb2xlIjogImZ1bmN0aW9uIiwgImNvbnRlbnQiOiAieCJ9XX0=
    method: POST
    uri: https://example.openai.azure.com/openai/deployments/d/chat/completions?api-version=1
  response: {body: {string: '{}'}, status: {code: 200}}
- request:
    body: '{"model": "gpt-4o"}'
    method: POST
    uri: https://api.openai.com/v1/chat/completions
  response: {body: {string: '{}'}, status: {code: 200}}
"""


def test_crewai_cassette_requests_as_recorded(tmp_path):
    (tmp_path / "c.yaml").write_text(CASSETTE)
    (session,) = load_source("crewai", tmp_path)
    assert session == [
        {"session_id": "c.yaml", "turn": 0, "messages": [
            {"role": "system", "content": "sys"}, {"role": "user", "content": "look\n[image_url]"}],
         "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"session_id": "c.yaml", "turn": 1, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
            {"role": "tool", "content": "42", "tool_call_id": "c"}]}]
    (tmp_path / "d.yaml").write_text("just: text\n")
    with pytest.raises(ValueError, match="cassette"):
        load_source("crewai", tmp_path)


@pytest.mark.shared_data
@pytest.mark.parametrize("data", ["sample", "shared"])
@pytest.mark.parametrize("source", sorted(SOURCE_PATHS))
def test_counts_match_sources_md(source, data):
    sessions = load_source(source, _data_path(data, str(TRANSCRIPTS / SOURCE_PATHS[source])))
    assert (len(sessions), sum(len(s) for s in sessions)) == COUNTS[data][source]


@pytest.mark.shared_data
def test_no_path_reads_the_shipped_sample():
    # A clone or an install alone has data to run on: the loaders' default is in the package.
    for source in SOURCE_PATHS:
        assert default_path(source) == sample_path(str(TRANSCRIPTS / SOURCE_PATHS[source]))
        assert default_path(source).exists()
        sessions = load_source(source)
        assert (len(sessions), sum(len(s) for s in sessions)) == COUNTS["sample"][source]
    assert [s[0]["session_id"] for s in load_source("swe-agent")] == [
        "trajectories/demonstrations/ctf/misc/networking_1.traj",
        "trajectories/demonstrations/function_calling_simple.traj"]
    crewai = load_source("crewai")
    assert [(s[0]["session_id"].rsplit("/", 1)[1], len(s), sum("tools" in r for r in s))
            for s in crewai] == [("test_agent_execution_with_tools.yaml", 2, 2),
                                 ("test_lite_agent_with_tools.yaml", 4, 4),
                                 ("test_custom_llm_within_crew.yaml", 3, 0)]


@pytest.mark.shared_data
def test_samples_are_cut_from_the_shared_data():
    """Each sample file is its shared counterpart unchanged, or (tau-bench) its first records."""
    sample_root = sample_path("agent-transcripts")
    shared_root = shared_path("agent-transcripts")
    files = sorted(p for p in sample_root.rglob("*") if p.is_file())
    assert len(files) == 8
    for file in files:
        relative = file.relative_to(sample_root)
        original = shared_root / relative
        if relative == TAU_BENCH_AIRLINE:
            records = json.loads(original.read_bytes())
            assert file.read_text() == json.dumps(records[:3], indent=2) + "\n"
        else:
            assert file.read_bytes() == original.read_bytes(), relative


def test_default_path_names_unknown_sources():
    with pytest.raises(ValueError, match="source"):
        default_path("nope")
    assert default_path("crewai", shared=True).parts[-2:] == ("agent-transcripts", "crewai-cassettes")


@pytest.mark.parametrize("source", ["tau-bench", "swe-agent", "mini-swe-agent", "crewai"])
def test_missing_path_says_it_does_not_exist(source, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^path: .*/nope does not exist$"):
        load_source(source, tmp_path / "nope")


def test_wrong_kind_of_path_names_the_path_and_what_the_source_expects(tmp_path):
    (tmp_path / "c.yaml").write_text("interactions: [\n")  # not even YAML
    with pytest.raises(IsADirectoryError, match=f"^path: {tmp_path} is a folder; the tau-bench "
                                                "source reads one file, a tau-bench"):
        load_source("tau-bench", tmp_path)
    with pytest.raises(ValueError, match=f"^path: {tmp_path / 'c.yaml'} is not JSON "
                                         r"\(a tau-bench trajectories JSON file"):
        load_source("tau-bench", tmp_path / "c.yaml")
    with pytest.raises(ValueError, match=f"^path: {tmp_path / 'c.yaml'} is not YAML"):
        load_source("crewai", tmp_path)
    (tmp_path / "t.traj").write_text("{")
    with pytest.raises(ValueError, match=r"t\.traj is not JSON \(a SWE-agent .traj file"):
        load_source("swe-agent", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*\.traj\.json file under"):
        load_source("mini-swe-agent", tmp_path)

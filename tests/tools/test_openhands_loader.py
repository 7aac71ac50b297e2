"""The OpenHands mock-prompt loader (SOURCES.md rule 5): a hand-made fixture with exact sessions,
roles and replies, and the shared folder's counts when it is present."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from radixkv.tools.openhands import load_openhands
from radixkv.tools.transcripts import SOURCES, default_path, load_source
from tests.shared_data import shared_path

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "openhands"


def test_fixture_sessions_roles_and_replies() -> None:
    sessions = load_source("openhands", FIXTURE, replies=True)
    assert [len(s) for s in sessions] == [2, 2]
    assert [[(r["session_id"], r["turn"]) for r in s] for s in sessions] == [
        [("AgentA/test_one", 0), ("AgentA/test_one", 1)],
        [("AgentB/test_two", 0), ("AgentB/test_two", 1)]]
    a0, a1 = sessions[0]
    assert a0["messages"] == [{"role": "system", "content": "SYS A"},
                              {"role": "user", "content": "Task one"}]
    # A chunk is the assistant's when its first 60 non-whitespace characters are a response's.
    assert [m["role"] for m in a1["messages"]] == ["system", "user", "assistant", "user"]
    assert a1["messages"][3]["content"] == "OBSERVATION: a.txt"
    assert (a0["reply"], a1["reply"]) == ({"role": "assistant", "content": "I will run ls"},
                                          {"role": "assistant", "content": "Done"})
    b0, b1 = sessions[1]
    # The whitespace-only chunk is dropped; "  Hi   there" matches the response "Hi there".
    assert [m["content"] for m in b0["messages"]] == ["SYS B", "Hello"]
    assert [m["role"] for m in b1["messages"]] == ["system", "user", "assistant", "user"]
    assert b0["reply"] == {"role": "assistant", "content": "Hi there"}
    assert b1["reply"] is None  # no response_002.log
    # Without replies the requests have the normalised keys only.
    plain = load_source("openhands", FIXTURE)
    assert all(set(r) == {"session_id", "turn", "messages"} for s in plain for r in s)


def test_one_session_folder_and_errors(tmp_path: Path) -> None:
    (one,) = load_openhands(FIXTURE / "AgentB" / "test_two")
    assert [r["session_id"] for r in one] == ["test_two", "test_two"]
    with pytest.raises(FileNotFoundError, match="no prompt_"):
        load_openhands(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_source("openhands", tmp_path / "missing")
    assert "openhands" in SOURCES and "mini-swe-agent-gemini3" in SOURCES
    with pytest.raises(FileNotFoundError, match="no sample of openhands is shipped"):
        load_source("openhands")
    assert default_path("openhands", shared=True).parts[-2:] == ("agent-transcripts",
                                                                 "openhands-mock-prompts")


@pytest.mark.shared_data
def test_shared_openhands_counts() -> None:
    sessions = load_source("openhands", shared_path("agent-transcripts/openhands-mock-prompts"),
                           replies=True)
    # SOURCES.md: 18 sessions (one per <Agent>/<test> folder), 93 requests.
    assert (len(sessions), sum(len(s) for s in sessions)) == (18, 93)
    roles = Counter(m["role"] for s in sessions for r in s for m in r["messages"])
    assert roles == {"system": 93, "user": 151, "assistant": 89}
    assert all(r["reply"] is not None for s in sessions for r in s)

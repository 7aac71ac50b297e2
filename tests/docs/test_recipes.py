"""The doc-recipe runner (docs/run_recipes.py), and the README's Quickstart recipes run end to
end as a user pastes them: a real ``radixkv serve`` on a free port, a first request, ``/stats``,
and the ``openai`` SDK's two turns."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("docs_run_recipes", REPO / "docs" / "run_recipes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_parse_reads_markers_and_options() -> None:
    rr = _runner()
    text = ("intro\n<!-- recipe: one server=8000 timeout=30 -->\n```bash\necho hi\n```\n"
            "```bash\nnot a recipe\n```\n"
            "<!-- recipe: two ports=8100,5570 -->\n```python\nprint(1)\n```\n")
    one, two = rr.parse(text, "X.md")
    assert (one.name, one.lang, one.code, one.server_port, one.ports, one.timeout_s, one.line) == \
        ("one", "bash", "echo hi\n", 8000, [8000], 30.0, 2)
    assert (two.name, two.lang, two.code, two.server_port, two.ports) == \
        ("two", "python", "print(1)\n", None, [8100, 5570])


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- recipe: a -->\ntext\n", "X.md:1: recipe marker not followed by"),
    ("<!-- recipe: a -->\n```bash\necho\n", "X.md:1: recipe block never closed"),
    ("<!-- recipe: a port=1 -->\n```bash\necho\n```\n", "X.md:1: recipe option 'port=1'"),
    ("<!-- recipe: a ports=x -->\n```bash\necho\n```\n", "X.md:1: recipe option 'ports=x'"),
])
def test_parse_names_a_bad_marker(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _runner().parse(text, "X.md")


def test_move_ports_moves_whole_port_numbers_only() -> None:
    rr = _runner()
    code = "curl 127.0.0.1:8100/x; serve --port 8101; tcp://*:18100; ids=(8100 8101)\n"
    assert rr.move_ports(code, [8100, 8101], 7) == \
        "curl 127.0.0.1:8107/x; serve --port 8108; tcp://*:18100; ids=(8107 8108)\n"
    assert rr.move_ports(code, [8100], 0) == code


def test_every_recipe_in_the_docs_parses() -> None:
    names = [r.name for r in _runner().all_recipes()]
    assert names[:2] == ["first-request", "openai-sdk"]
    assert len(names) == len(set(names))


def test_a_failing_recipe_fails_and_its_background_processes_stop(tmp_path: Path) -> None:
    rr = _runner()
    pid_file = tmp_path / "pid"
    recipe = rr.Recipe("bad", "X.md", 1, "bash",
                       f"sleep 300 &\necho $! > {pid_file}\necho BEFORE\nfalse\necho AFTER\n",
                       timeout_s=30)
    result = rr.run(recipe)
    assert not result.ok
    assert "BEFORE" in result.output and "AFTER" not in result.output
    assert "[exit status 1]" in result.output and result.seconds < 25
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.smollm2
def test_readme_quickstart_recipes_run_as_pasted() -> None:
    rr = _runner()
    recipes = {r.name: r for r in rr.all_recipes()}

    first = rr.run(recipes["first-request"])
    assert first.ok, first.output
    decoder, docs, text = json.JSONDecoder(), [], first.output.strip()
    while text:
        doc, end = decoder.raw_decode(text)
        docs.append(doc)
        text = text[end:].strip()
    completion, stats = docs
    assert completion["object"] == "chat.completion"
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stats["requests_total"] == 1
    assert stats["prompt_tokens_total"] == completion["usage"]["prompt_tokens"]

    sdk = rr.run(recipes["openai-sdk"])
    assert sdk.ok, sdk.output
    turns = [(int(p), int(c)) for p, c in
             re.findall(r"prompt (\d+) tokens, cached (\d+)", sdk.output)]
    assert len(turns) == 2, sdk.output
    (prompt1, cached1), (prompt2, cached2) = turns
    assert cached1 == 0
    # The second turn re-sends the first prompt and reply: at least the first prompt's full
    # blocks (16 tokens each) hit.
    assert cached2 % 16 == 0 and cached2 >= prompt1 // 16 * 16 and prompt2 > prompt1


@pytest.mark.smollm2
@pytest.mark.slow
def test_store_tier_recipe_serves_evicted_blocks_from_the_host_store() -> None:
    """docs/operations.md's host store recipe: a 24-block pool, three ~120-token prompts, the
    first again; its evicted blocks come back from the store, as the page says."""
    rr = _runner()
    recipe = {r.name: r for r in rr.all_recipes()}["store-host"]
    result = rr.run(recipe)
    assert result.ok, result.output
    by_tier, hit_blocks = result.output.strip().splitlines()[-1].rsplit("} ", 1)
    assert by_tier + "}" == "{'device': 16, 'store': 96}"
    assert int(hit_blocks) == 6

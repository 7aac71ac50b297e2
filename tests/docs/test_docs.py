"""The README and docs/: short README, every page linked, links that resolve, generated
references that match the code, and no pointers outside the repository."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 250
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8")))}


def _links(path: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", path.read_text(encoding="utf-8")))


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (cap {README_MAX_LINES})"


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / target.split("#")[0]).resolve() for target in _links(README)
              if not target.startswith(("http://", "https://", "#"))}
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    missing = sorted(str(p.relative_to(REPO)) for p in pages - linked)
    assert missing == [], f"README.md does not link {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert broken == [], f"{page.relative_to(REPO)}: broken links {broken}"


def test_generated_references_are_current() -> None:
    assert _load("gen_reference").stale_pages() == [], (
        "docs/reference/ is stale: run .venv/bin/python docs/gen_reference.py")


def test_gen_reference_check_names_a_stale_page(tmp_path: Path, monkeypatch, capsys) -> None:
    gen = _load("gen_reference")
    for name, build in gen.PAGES.items():
        (tmp_path / name).write_text(build(), encoding="utf-8")
    monkeypatch.setattr(gen, "REFERENCE_DIR", tmp_path)
    assert gen.main(["--check"]) == 0
    page = tmp_path / "serve-flags.md"
    page.write_text(page.read_text(encoding="utf-8").replace("| `--port` | `8000` |", "| `--port` | `9` |"),
                    encoding="utf-8")
    assert gen.stale_pages() == ["serve-flags.md"]
    assert gen.main(["--check"]) == 1
    assert "docs/reference/serve-flags.md is stale" in capsys.readouterr().err


def test_serve_flags_reference_lists_every_flag() -> None:
    gen = _load("gen_reference")
    text = gen.serve_flags_page()
    flags = [opt for action in gen._serve_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and opt != "--help"]
    assert len(flags) >= 30
    assert [f for f in flags if f"`{f}" not in text] == []
    assert "| `--port` | `8000` |" in text


def test_commands_reference_has_every_subcommand_and_clone_independent_defaults() -> None:
    from radixkv.cli import BENCHES

    text = _load("gen_reference").commands_page()
    headings = re.findall(r"^## `(radixkv [a-z -]+)`$", text, re.M)
    assert headings == ["radixkv chat", "radixkv export-hf", "radixkv verify", "radixkv plan"] + [
        f"radixkv bench {b}" for b in BENCHES]
    assert "| `--temperature` | `0.0` |" in text  # chat's greedy default
    assert "| `--out DIR` | none | required; output directory (new or empty) |" in text
    # A default under the checkout is written relative to it, so every clone generates the
    # same page.
    assert str(REPO) not in text
    assert "| `--json PATH` | `<repo>/bench/results/store-hit-cost.json` |" in text


def test_parameters_reference_lists_every_field() -> None:
    from radixkv.server.param_table import (
        CHAT_PARAMS,
        COMPLETION_PARAMS,
        COUNT_TOKENS_PARAMS,
        MESSAGES_PARAMS,
        MESSAGES_REFUSED_BLOCKS,
        TOKENIZE_PARAMS,
    )

    text = _load("gen_reference").parameters_page()
    names = (set(CHAT_PARAMS) | set(COMPLETION_PARAMS) | set(TOKENIZE_PARAMS) | set(MESSAGES_PARAMS)
             | set(COUNT_TOKENS_PARAMS) | set(MESSAGES_REFUSED_BLOCKS))
    assert [n for n in sorted(names) if f"| `{n}` |" not in text] == []
    assert "| `logit_bias` | neutral value only | null or {} |" in text
    assert "| `image` | refused | images are not supported (text only) |" in text


_WORK_ITEM = re.compile(r"\b(issues?|stops?)\s+#?\d+", re.I)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_name_mechanisms_not_work_items(page: Path) -> None:
    hits = [line.strip() for line in page.read_text(encoding="utf-8").splitlines()
            if _WORK_ITEM.search(line)]
    assert hits == []


def test_nothing_points_at_the_design_outside_the_repository() -> None:
    pattern = re.compile(r"shared/(DESIGN\.md|ref/)")
    hits = []
    for folder in ("radixkv", "eviction", "kernels", "bench", "docs", "tests"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in {".py", ".md", ".toml", ".sh", ".txt"} and path.is_file() \
                    and "results" not in path.relative_to(REPO).parts:
                text = path.read_text(encoding="utf-8", errors="replace")
                hits += [f"{path.relative_to(REPO)}" for _ in pattern.finditer(text)]
    hits += [f"{name}" for name in ("README.md", "Makefile", "pyproject.toml")
             if pattern.search((REPO / name).read_text(encoding="utf-8"))]
    assert hits == []

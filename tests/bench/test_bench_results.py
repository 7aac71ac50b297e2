"""The results rule of ``bench/results/README.md``: every file there is a result some doc page
cites by its path, with a ``MANIFEST.toml`` entry naming its commit, date, machine and command,
within the size caps."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: Not results: the rule, the provenance and the suites that produce the results.
NOT_RESULTS = {"README.md", "MANIFEST.toml"}
SUITE_SUFFIX = ".sh"
MAX_FILE_BYTES = 300 * 1024
MAX_TOTAL_BYTES = 1536 * 1024
FIELDS = ("path", "commit", "date", "machine", "command")


def manifest() -> dict:
    with open(RESULTS / "MANIFEST.toml", "rb") as f:
        return tomllib.load(f)


def result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                  if p.is_file() and p.name not in NOT_RESULTS and p.suffix != SUITE_SUFFIX)


def doc_text() -> str:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages if p.is_file())


def test_every_result_has_one_complete_manifest_entry() -> None:
    data = manifest()
    entries = data["result"]
    paths = [e["path"] for e in entries]
    assert len(paths) == len(set(paths)), "a path listed twice"
    assert sorted(paths) == result_files()
    for e in entries:
        missing = [k for k in FIELDS if not str(e.get(k, "")).strip()]
        assert not missing, f"{e['path']}: no {missing}"
        assert re.fullmatch(r"[0-9a-f]{40}", e["commit"]), e["path"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", e["date"]), e["path"]
        assert e["machine"] in data["machines"], f"{e['path']}: unknown machine {e['machine']}"
    assert all(m.get("description", "").strip() for m in data["machines"].values())


def test_every_result_is_cited_by_a_doc_page() -> None:
    text = doc_text()
    uncited = [p for p in result_files() if f"bench/results/{p}" not in text]
    assert not uncited, f"not cited by README.md or docs/*.md: {uncited}"


def test_size_caps() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    big = {p.relative_to(RESULTS).as_posix(): p.stat().st_size for p in files
           if p.stat().st_size > MAX_FILE_BYTES}
    assert not big, f"over {MAX_FILE_BYTES} bytes: {big}"
    assert sum(p.stat().st_size for p in files) <= MAX_TOTAL_BYTES


@pytest.mark.parametrize("suite", sorted(p.name for p in RESULTS.glob("*.sh")))
def test_suites_write_no_stdout_tables_into_results(suite: str) -> None:
    # Per-run stdout goes to $LOGS: a re-run must not leave files the manifest does not list.
    text = (RESULTS / suite).read_text()
    assert not re.search(r'>\s*"?\$OUT/[^ ]*\.txt', text), suite

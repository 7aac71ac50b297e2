"""What an install carries: every package listed in pyproject.toml, the benchmark samples declared
as package data, and where the data and the results are looked for (``radixkv.tools.data``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.tools import data

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dirs() -> dict[str, Path]:
    """Dotted name -> folder, for every folder with an ``__init__.py`` under each source root
    (``radixkv/`` and the folders pyproject's package-dir maps into it)."""
    roots = {name: REPO / folder for name, folder in SETUPTOOLS["package-dir"].items()}
    found = {}
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            dotted = ".".join([name, *rel.parts])
            # A folder under radixkv/ that package-dir maps elsewhere is not this root's.
            if not any(dotted.startswith(other + ".") or dotted == other
                       for other in roots if other != name and other.startswith(name + ".")):
                found[dotted] = init.parent
    return found


def test_every_package_folder_is_listed_in_pyproject():
    dirs = _package_dirs()
    assert {"radixkv", "radixkv.tools", "radixkv.tools.data", "radixkv.kernels",
            "radixkv.eviction"} <= set(dirs)
    missing = sorted(set(dirs) - set(SETUPTOOLS["packages"]))
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"
    # A data-only package (no __init__.py: the C sources in radixkv/kernels/csrc/) is listed so
    # setuptools does not warn that it would be left out; it must exist and declare its files.
    data_only = {"radixkv.kernels.csrc": REPO / "kernels" / "csrc"}
    for name, folder in data_only.items():
        assert name in SETUPTOOLS["packages"], name
        patterns = SETUPTOOLS["package-data"][name]
        # Every C source and header the native build compiles (kernels/native.py builds all
        # csrc/*.c with -I csrc): a wheel missing rk_vec.h would fail to build at first use.
        declared = sorted(p.name for pattern in patterns for p in folder.glob(pattern))
        assert declared == sorted(p.name for p in folder.iterdir() if p.suffix in (".c", ".h"))
        assert {"cpu_decode.c", "cpu_extend.c", "cpu_prefill.c", "cpu_peak.c", "rk_vec.h"} <= set(declared)
    gone = sorted(set(SETUPTOOLS["packages"]) - set(dirs) - set(data_only))
    assert not gone, f"pyproject.toml lists packages with no folder: {gone}"


def test_the_shipped_samples_are_declared_as_package_data():
    patterns = SETUPTOOLS["package-data"]["radixkv.tools.data"]
    root = data.SAMPLES_DIR
    declared = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    for pattern in patterns:  # no stale pattern
        assert any(root.glob(pattern)), pattern
    files = {p for p in root.rglob("*") if p.is_file() and p.suffix != ".pyc"
             and p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert not sorted(files - declared), "sample files not declared as package data"
    # What the benchmarks read by default is among them.
    from radixkv.tools.transcripts import SOURCE_PATHS, default_path
    assert sorted(SOURCE_PATHS) == ["crewai", "mini-swe-agent", "swe-agent", "tau-bench"]
    for source in SOURCE_PATHS:
        sample = default_path(source)
        assert sample.is_relative_to(root)
        assert any(f.is_relative_to(sample) for f in declared), source
    assert data.sample_path(data.TRACE_SAMPLE) in declared


def test_the_samples_stay_small():
    total = sum(p.stat().st_size for p in data.SAMPLES_DIR.rglob("*") if p.is_file()
                and "__pycache__" not in p.parts)
    assert total < 400_000


def test_shared_dir_is_the_env_var_else_beside_the_repo(monkeypatch, tmp_path):
    monkeypatch.delenv(data.SHARED_DIR_ENV, raising=False)
    assert data.shared_dir() == REPO.parent / "shared"
    assert data.shared_path("traces/x.jsonl") == REPO.parent / "shared" / "traces" / "x.jsonl"
    monkeypatch.setenv(data.SHARED_DIR_ENV, str(tmp_path))
    assert data.shared_dir() == tmp_path
    assert data.shared_path(data.SHARED_TRACE) == tmp_path / "traces" / "conversation_trace.jsonl"
    monkeypatch.setenv(data.SHARED_DIR_ENV, "")  # empty means unset
    assert data.shared_dir() == REPO.parent / "shared"


def test_default_results_dir_is_new_under_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    first, second = data.default_results_dir("x"), data.default_results_dir("x")
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == second.parent == Path("radixkv-bench-results")
    assert first.name.startswith("x-") and not any(first.iterdir())


def test_the_defaults_name_no_path_outside_the_package(monkeypatch):
    # With no shared data folder at all, the defaults still resolve inside the package.
    monkeypatch.setenv(data.SHARED_DIR_ENV, "/nonexistent/shared")
    from radixkv.tools.transcripts import SOURCE_PATHS, default_path
    assert sorted(SOURCE_PATHS) == ["crewai", "mini-swe-agent", "swe-agent", "tau-bench"]
    for source in SOURCE_PATHS:
        assert default_path(source).is_relative_to(data.SAMPLES_DIR)
        assert default_path(source, shared=True).is_relative_to("/nonexistent/shared")

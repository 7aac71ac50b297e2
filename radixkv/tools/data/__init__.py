"""Where radixkv's benchmarks and tests find their data, and where the benchmarks write results.

Two places hold data:

- the **samples** shipped in this package (``radixkv/tools/data/``, declared as package data):
  a few sessions of each agent-transcript source and the first 400 requests of the Mooncake
  conversation trace, cut from public data (sources, licences and cuts in ``README.md`` here).
  ``radixkv bench serve`` and ``radixkv bench eviction`` read them when no path is given, so the
  benchmarks run from a clone or an install alone;
- the **shared data folder** with the full public data (``agent-transcripts/``, ``traces/``):
  ``$RADIXKV_SHARED_DIR``, default the ``shared`` folder beside the repository root
  (``<repo>/../shared``). :func:`shared_dir` is the one place that resolves it; the benchmarks
  read it with ``--shared`` through :func:`require_shared` (a clear error when it is missing)
  and the tests that need the full data skip without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHARED_DIR_ENV = "RADIXKV_SHARED_DIR"
"""Environment variable naming the shared data folder."""

SAMPLES_DIR = Path(__file__).resolve().parent
"""This package's folder: the shipped samples."""

REPO_ROOT = SAMPLES_DIR.parents[2]
"""The repository root in a source checkout (in an installed copy: the folder that holds the
``radixkv`` package, e.g. site-packages, so set ``RADIXKV_SHARED_DIR`` there)."""

RESULTS_DIR = Path("radixkv-bench-results")
"""Benchmark results go under this folder (relative to the working directory) by default."""

TRACE_SAMPLE = Path("request-traces") / "conversation_trace.first400.jsonl"
"""The shipped Mooncake sample, relative to :data:`SAMPLES_DIR`."""

SHARED_TRACE = Path("traces") / "conversation_trace.jsonl"
"""The full Mooncake conversation trace, relative to :func:`shared_dir`."""


def shared_dir() -> Path:
    """The shared data folder: ``$RADIXKV_SHARED_DIR`` if set (and not empty), else
    ``<repo>/../shared``. It need not exist; callers check the paths they need."""
    value = os.environ.get(SHARED_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else REPO_ROOT.parent / "shared"


def shared_path(relative: str | os.PathLike[str]) -> Path:
    """``relative`` (e.g. ``"agent-transcripts/swe-agent"``) under :func:`shared_dir`."""
    return shared_dir() / relative


class SharedDataMissing(Exception):
    """``--shared`` names data the shared data folder does not hold (or the folder is missing).

    The message says which path is missing, what the folder is and what to do; ``radixkv bench``
    prints it and exits 2. Not an ``OSError``/``ValueError``, so a driver's handler for a bad
    file or argument does not turn it into a plain failure.
    """


def require_shared(relative: str | os.PathLike[str]) -> Path:
    """``relative`` under :func:`shared_dir`, for ``--shared``: it must exist.

    Args:
        relative: a path in the shared data folder, e.g. ``"traces/conversation_trace.jsonl"``;
            a path already under it (as :func:`shared_path` returns one) is taken as is.

    Returns:
        The existing path.

    Raises:
        SharedDataMissing: the path (or the whole folder) does not exist; the message names
            ``--shared``, ``$RADIXKV_SHARED_DIR``, the missing path, what the folder holds and
            the two ways on (set the variable, or drop ``--shared`` for the shipped samples).
    """
    path = shared_path(relative)
    if path.exists():
        return path
    folder = shared_dir()
    value = os.environ.get(SHARED_DIR_ENV, "").strip()
    where = (f"${SHARED_DIR_ENV} = {folder}" if value
             else f"${SHARED_DIR_ENV} is not set, so the default <repo>/../shared = {folder}")
    state = "that folder does not exist" if not folder.is_dir() else "that folder lacks this path"
    raise SharedDataMissing(
        f"--shared: {path} does not exist ({where}; {state}). --shared reads the full public "
        f"data from the shared data folder, which is not part of the repository: it holds "
        f"agent-transcripts/ and traces/ (public agent transcripts and the Mooncake conversation "
        f"trace, each listed with its source and licence in a SOURCES.md). Set {SHARED_DIR_ENV} "
        f"to a folder holding them, or drop --shared to use the samples shipped in "
        f"radixkv/tools/data/.")


def sample_path(relative: str | os.PathLike[str]) -> Path:
    """``relative`` (e.g. ``"agent-transcripts/swe-agent"``) under the shipped samples."""
    return SAMPLES_DIR / relative


def default_results_dir(bench: str) -> Path:
    """A new folder ``./radixkv-bench-results/<bench>-<YYYYmmdd-HHMMSS>[-k]/``, created now.

    Used when a benchmark is given no output path; ``-k`` is added when the name is taken.
    """
    stem = RESULTS_DIR / f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = stem, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            k += 1
            path = stem.with_name(f"{stem.name}-{k}")

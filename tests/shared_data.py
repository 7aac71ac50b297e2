"""Test data: the full public data in the shared data folder, and the samples shipped in the package.

Tests that need the full data call :func:`shared_path`, which skips the test (naming the missing
path) when the shared data folder does not hold it: a clone alone runs the sample-based tests,
CI with the shared folder runs both. Mark such tests, and those reading the samples,
``@pytest.mark.shared_data`` (.ci/run runs them a second time against an empty shared folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.tools.data import SHARED_DIR_ENV, sample_path, shared_dir
from radixkv.tools.data import shared_path as _shared_path

__all__ = ["sample_path", "shared_path"]


def shared_path(relative: str) -> Path:
    """``relative`` (e.g. ``"agent-transcripts/swe-agent"``) under the shared data folder;
    skips the calling test when it does not exist."""
    path = _shared_path(relative)
    if not path.exists():
        pytest.skip(f"{path} not present (shared data folder {shared_dir()}; set "
                    f"{SHARED_DIR_ENV} to the folder holding the full data)")
    return path

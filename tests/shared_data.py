"""Test data: the full public data in the shared data folder, and the samples shipped in the package.

Tests that need the full data call :func:`shared_path`, which skips the test (with the message
``--shared`` gives: the missing path, what the folder holds, how to point at it) when the shared
data folder does not hold it: a clone alone runs the sample-based tests, CI with the shared
folder runs both. Mark such tests, and those reading the samples, ``@pytest.mark.shared_data``
(.ci/run runs them a second time against an empty shared folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.tools.data import SharedDataMissing, require_shared, sample_path

__all__ = ["sample_path", "shared_path"]


def shared_path(relative: str) -> Path:
    """``relative`` (e.g. ``"agent-transcripts/swe-agent"``) under the shared data folder;
    skips the calling test when it does not exist."""
    try:
        return require_shared(relative)
    except SharedDataMissing as exc:
        pytest.skip(str(exc))

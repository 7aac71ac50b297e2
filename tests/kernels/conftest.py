"""Kernel tests: Triton interpreter on CPU-only machines (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before any test module imports triton), and the per-ISA native kernels.

On a CUDA machine the variable is left alone and the same tests run compiled kernels on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import native
from radixkv.model.loader import LoadedModel, load_model
from tests.conftest import make_tiny_model_dir


@pytest.fixture(scope="module", params=native.ISAS)
def kernels(request: pytest.FixtureRequest) -> native.NativeKernels:
    """The native C kernels of one ISA build (``avx512``, ``avx2``), a test per build this CPU
    runs; skipped, naming the missing CPU features, for the others. A build the CPU can run but
    that does not load (compiler, build errors) fails the test. (``test_native.py`` overrides it
    with the build ``native.load()`` picks.)"""
    isa = request.param
    missing = native._missing_features(isa)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} for the {isa} build")
    lib = native.load(isa)
    assert lib is not None, f"the {isa} build did not load (see the log: compiler, build errors)"
    assert lib.isa == isa
    return lib


@pytest.fixture(scope="session")
def tiny_d32(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny random model with head_dim 32 (the native decode kernel's smallest; 16 it does
    not take), fp32."""
    return load_model(str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-d32"), head_dim=32)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

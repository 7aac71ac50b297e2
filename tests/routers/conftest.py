"""Fixtures: two tiny-model replicas per module, and each router in front of them once.

``router`` is parametrized over the installed routers with ``round_robin``; a module that wants
another policy or more flags (``kv_aware`` in ``test_kv_aware.py``) builds its own fixture from
``tests.routers.harness.run_router`` the same way. A failed test gets the router's last output
as a report section.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.routers.harness import ROUTERS, RouterProcess, run_replicas, run_router
from tests.server.conftest import RunningServer


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> Iterator[list[RunningServer]]:
    """Two radixkv servers on the same tiny model (B = 16, 512 blocks each)."""
    with run_replicas(tiny_model_dir, 2) as servers:
        yield servers


@pytest.fixture(scope="module")
def model_id(replicas: list[RunningServer]) -> str:
    """The served model's id (what every routed request sends as ``model``)."""
    return replicas[0].engine.model_name


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def router(request: pytest.FixtureRequest, replicas: list[RunningServer],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """One router process (``round_robin``) over ``replicas``, per module and router."""
    log_dir = tmp_path_factory.mktemp(f"{request.param}-log")
    with run_router(request.param, [s.url for s in replicas], log_dir) as proc:
        yield proc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Add the log tail of every router a failed test used (any fixture) to its report."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for arg in getattr(item, "funcargs", {}).values():
        # (a fleet fixture may hand its routers over in a dict)
        for value in arg.values() if isinstance(arg, dict) else (arg,):
            if isinstance(value, RouterProcess):
                report.sections.append((f"{value.name} log tail ({value.log_path})",
                                        value.log_tail()))

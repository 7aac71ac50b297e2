"""The import direction of docs/design.md §1, no import cycles, torch-free cache/eviction; long
modules are reported (a warning), not failed.

The checker lives in tests/layering.py; its self-tests feed it a fake upward import and a fake
cycle (both hidden the way real ones hide: inside a function and under TYPE_CHECKING).
"""

from __future__ import annotations

import warnings

from tests.layering import (
    REVIEW_MODULE_LINES,
    Violation,
    check,
    component,
    imports_of,
    long_modules,
    read_sources,
    unexplained_ignores,
)


def added_violations(extra: dict[str, str]) -> list[Violation]:
    """Violations that ``extra`` modules add to the real tree (so self-tests stand alone)."""
    sources = read_sources()
    before = check(sources)
    sources.update(extra)
    return sorted((v for v in check(sources) if v not in before), key=lambda v: v.module)


def test_the_source_tree_keeps_the_import_direction_and_has_no_cycles():
    sources = read_sources()
    # The packages the layout promises exist (a rename that empties one would pass vacuously).
    comps = {component(m) for m in sources}
    assert {"cache", "engine", "model", "server", "tools", "eviction", "kernels", "cli",
            "bench", "base"} <= comps
    assert len(sources) > 60
    assert check(sources) == []


def test_every_type_ignore_names_its_error_code_and_why():
    assert unexplained_ignores(read_sources()) == []
    sources = {
        "radixkv.cache.a": ("x = f()  # type: ignore\n"
                            "y = g()  # type: ignore[attr-defined]\n"
                            "z = h()  # type: ignore[attr-defined]  # the stubs lack h's result\n"),
        "radixkv.kernels.b": "w = k()  # type: ignore[arg-type, union-attr]  # set by bind()\n",
        "bench.c": "v = 1  # type: ignore\n",  # bench/ is not type-checked
    }
    assert unexplained_ignores(sources) == ["radixkv.cache.a:1", "radixkv.cache.a:2"]


def test_long_modules_are_a_warning_for_review_not_a_failure():
    long = long_modules(read_sources())
    if long:
        warnings.warn(f"modules over {REVIEW_MODULE_LINES} lines (review whether each holds one "
                      "thing; do not split a class to get under it): "
                      + ", ".join(f"{m} ({n})" for m, n in long), stacklevel=1)
    sources = {"radixkv.engine.a": "x = 1\n" * 401, "radixkv.engine.b": "x = 1\n" * 400,
               "radixkv.cache.c": "x = 1\n" * 900}
    assert long_modules(sources) == [("radixkv.cache.c", 900), ("radixkv.engine.a", 401)]
    assert check(sources) == []


def test_function_local_type_only_and_importlib_imports_count():
    sources = {"radixkv.cache.a": "", "radixkv.cache.b": "", "radixkv.engine.b": "",
               "radixkv.engine.c": "", "radixkv.kernels.d": ""}
    text = ("from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from radixkv.cache.a import X\n"
            "def f():\n    from . import b\n    import importlib\n"
            "    importlib.import_module('radixkv.kernels.d')\n")
    assert imports_of("radixkv.engine.c", text, sources) >= {
        "radixkv.cache.a", "radixkv.engine.b", "radixkv.kernels.d", "typing"}
    assert "radixkv.cache.b" in imports_of("radixkv.cache.a", "from . import b\n", sources)


def test_dynamic_and_aliased_imports_count():
    sources = {"radixkv.cache.a": "", "radixkv.engine.b": "", "radixkv.engine.c": ""}
    text = ("from importlib import import_module as im\n"
            "def f():\n    __import__('radixkv.engine.b')\n    im('torch')\n"
            "    import_module('..engine.c', 'radixkv.cache')\n    import bench\n")
    assert imports_of("radixkv.cache.a", text, sources) >= {
        "radixkv.engine.b", "torch", "radixkv.engine.c", "bench"}
    assert added_violations({"radixkv.cache.fake_dynamic": text.replace(
        "radixkv.engine.b", "radixkv.engine.scheduler").replace("..engine.c", "..engine.request")}) == [
        Violation("upward", "radixkv.cache.fake_dynamic", "imports bench (cache -> bench)"),
        Violation("upward", "radixkv.cache.fake_dynamic",
                  "imports radixkv.engine.request (cache -> engine)"),
        Violation("upward", "radixkv.cache.fake_dynamic",
                  "imports radixkv.engine.scheduler (cache -> engine)"),
        Violation("torch", "radixkv.cache.fake_dynamic", "imports torch"),
    ]


def test_self_test_an_upward_import_inside_a_function_fails():
    assert added_violations({"radixkv.cache.fake_upward": (
        "def admit():\n    from radixkv.engine.scheduler import Scheduler\n    return Scheduler\n")
    }) == [Violation(
        "upward", "radixkv.cache.fake_upward",
        "imports radixkv.engine.scheduler (cache -> engine)")]


def test_self_test_a_type_only_cycle_fails():
    assert added_violations({
        "radixkv.cache.fake_a": "from radixkv.cache.fake_b import B\n",
        "radixkv.cache.fake_b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from radixkv.cache.fake_a import A\n"),
    }) == [Violation(
        "cycle", "radixkv.cache.fake_a", "radixkv.cache.fake_a -> radixkv.cache.fake_b")]


def test_self_test_other_rules():
    assert added_violations({
        "radixkv.cache.fake_torch": "import torch\n",
        "radixkv.engine.fake_server": "from radixkv.server import app\n",
        "radixkv.model.fake_evict": "from radixkv.eviction.lru import LRUPolicy\n",
        "radixkv.engine.fake_bench": "import bench.tree\n",
    }) == [
        Violation("torch", "radixkv.cache.fake_torch", "imports torch"),
        Violation("upward", "radixkv.engine.fake_bench", "imports bench.tree (engine -> bench)"),
        # `from pkg import sub` imports both the package and its submodule.
        Violation("upward", "radixkv.engine.fake_server",
                  "imports radixkv.server (engine -> server)"),
        Violation("upward", "radixkv.engine.fake_server",
                  "imports radixkv.server.app (engine -> server)"),
        Violation("upward", "radixkv.model.fake_evict",
                  "imports radixkv.eviction.lru (model -> eviction)"),
    ]
    # The one allowed exception for model, and a base module everyone may import.
    assert added_violations({"radixkv.model.fake_cost": (
        "from radixkv.eviction.cost_model import prefill_flops\n"
        "from radixkv.config import EngineConfig\n")}) == []

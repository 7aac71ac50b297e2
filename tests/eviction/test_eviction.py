"""Eviction policy registry, LRU priority, and import isolation of radixkv.eviction."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from radixkv.eviction import (
    NodeView,
    PriorityPolicy,
    available_policies,
    get_policy,
    register,
)
from radixkv.eviction import base as eviction_base
from radixkv.eviction.fifo import FIFOPolicy
from radixkv.eviction.lfu import LFUPolicy
from radixkv.eviction.lru import LRUPolicy


@dataclass
class FakeNode:
    uid: int = 0
    last_access_s: float = 0.0
    hit_count: int = 0
    created_s: float = 0.0
    depth_tokens: int = 0
    num_blocks: int = 1
    num_tokens: int = 4
    lock_ref: int = 0
    hashes: tuple = ()


def test_registry_lru() -> None:
    policy = get_policy("lru")
    assert isinstance(policy, LRUPolicy)
    assert policy.name == "lru" and policy.kind == "priority"
    assert "lru" in available_policies()
    assert get_policy("lru") is not policy  # fresh instance per tree


def test_unknown_policy_names_field() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        get_policy("nope")


def test_duplicate_registration_rejected() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register("lru")(LRUPolicy)


def test_lru_order_older_then_deeper_then_older_created() -> None:
    policy = get_policy("lru")
    nodes = [
        FakeNode(uid=0, last_access_s=5.0, depth_tokens=0, created_s=1.0),
        FakeNode(uid=1, last_access_s=3.0, depth_tokens=0, created_s=2.0),
        FakeNode(uid=2, last_access_s=5.0, depth_tokens=8, created_s=3.0),
        FakeNode(uid=3, last_access_s=5.0, depth_tokens=8, created_s=0.5),
    ]
    assert all(isinstance(n, NodeView) for n in nodes)
    order = sorted(nodes, key=policy.priority)
    assert [n.uid for n in order] == [1, 3, 2, 0]


def test_custom_priority_policy_registers() -> None:
    try:
        @register("test-mru")
        class MRU(PriorityPolicy):
            def priority(self, node: NodeView) -> float:
                return -node.last_access_s

        assert isinstance(get_policy("test-mru"), MRU)
        assert "test-mru" in available_policies()
    finally:
        # The registry is process-wide: a test policy left in it shows up in the CLI's list of
        # choices that later tests assert.
        eviction_base._REGISTRY.pop("test-mru", None)
    assert "test-mru" not in available_policies()


def test_eviction_imports_neither_torch_nor_radixkv_modules() -> None:
    script = (
        "import sys, radixkv.eviction\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') or "
        "(m.startswith('radixkv.') and not m.startswith('radixkv.eviction') "
        # the bare package's stdlib-only import-name guard (radixkv/_kernels_name.py)
        "and m != 'radixkv._kernels_name')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "[]"


def test_registry_lists_lru_lfu_fifo() -> None:
    assert {"lru", "lfu", "fifo"} <= set(available_policies())
    assert isinstance(get_policy("lfu"), LFUPolicy) and isinstance(get_policy("fifo"), FIFOPolicy)


def test_lfu_order_fewest_hits_then_lru() -> None:
    policy = get_policy("lfu")
    nodes = [
        FakeNode(uid=0, hit_count=3, last_access_s=1.0),
        FakeNode(uid=1, hit_count=1, last_access_s=9.0),
        FakeNode(uid=2, hit_count=1, last_access_s=2.0),
        FakeNode(uid=3, hit_count=1, last_access_s=2.0, depth_tokens=8),
    ]
    assert [n.uid for n in sorted(nodes, key=policy.priority)] == [3, 2, 1, 0]


def test_fifo_order_oldest_then_deeper_ignoring_hits() -> None:
    policy = get_policy("fifo")
    nodes = [
        FakeNode(uid=0, created_s=2.0, hit_count=0),
        FakeNode(uid=1, created_s=1.0, hit_count=50, last_access_s=99.0),
        FakeNode(uid=2, created_s=2.0, depth_tokens=16),
    ]
    assert [n.uid for n in sorted(nodes, key=policy.priority)] == [1, 2, 0]

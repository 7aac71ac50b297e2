"""Retention (client TTL pins) in the cache manager: pinned blocks survive eviction until they
expire, hits refresh them, the pool-wide and per-tenant budgets clip them, running requests can
always take blocks (retentions unpinned under pressure), operator listing/release by tenant,
and a property test keeping ``check_integrity`` green over random retain/evict/expire runs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.cache.hashing import CacheIdentity, pack_tokens
from radixkv.cache.manager import CacheManager
from radixkv.cache.retention import (
    TTL_CLASSES,
    RetentionBreakpoint,
    RetentionTable,
    check_breakpoints,
    clamp_created,
    retention_id,
)

B = 4
ROPE = "theta=100000.0;scaling=None"


class Clock:
    """A clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 8, **kwargs) -> tuple[CacheManager, bytes, Clock]:
    clock = Clock()
    cm = CacheManager(num_blocks, B, clock=clock, **kwargs)
    return cm, cm.identity_root(CacheIdentity("r1", B, "float32", ROPE)), clock


def run(cm: CacheManager, root: bytes, rid: str, tokens: list[int],
        breakpoints: Sequence[tuple[int, str]] = (), tenant: str | None = None
        ) -> tuple[int, dict[str, int], int]:
    """Begin, allocate, publish, retain, release; returns (m, created, num_retained_tokens)."""
    m = cm.begin(rid, root, tokens, tenant=tenant)
    assert cm.allocate(rid, len(tokens))
    cm.publish(rid, tokens, len(tokens))
    created, retained, _ = cm.retain(rid, breakpoints, num_prompt_tokens=len(tokens))
    cm.check_integrity()
    cm.release(rid)
    cm.check_integrity()
    return m, created, retained


P = list(range(1, 13))  # 12 tokens: 3 full blocks


def test_retained_blocks_survive_pressure_and_expire_into_ordinary_cache() -> None:
    cm, root, clock = make(8, max_retained_fraction=1.0)
    assert run(cm, root, "a", P, [(8, "5m")]) == (0, {"5m": 8}, 8)
    assert cm.block_states() == ["cached_locked"] * 2 + ["cached_evictable"] + ["free"] * 5
    assert cm.num_retained_blocks == 2
    # A 24-token request needs 6 blocks: the 5 free ones and the unretained block 2.
    q = [100 + i for i in range(24)]
    cm.begin("b", root, q)
    assert cm.allocate("b", 24) and cm.block_table("b") == [3, 4, 5, 6, 7, 2]
    cm.release("b")
    assert cm.peek(root, P) == 8  # the retained prefix is still matchable
    clock.t = 299.0
    assert cm.expire_retentions() == 0
    clock.t = 300.0
    assert cm.expire_retentions() == 1
    assert cm.num_retained_blocks == 0 and cm.list_retentions(None) == []
    snap = cm.retention_snapshot()
    assert (snap["expired_total"], snap["by_ttl"]["5m"]["expired_total"]) == (1, 1)
    assert cm.block_states()[:2] == ["cached_evictable"] * 2  # ordinary cached blocks now
    cm.check_integrity()


def test_hit_refreshes_expiry_and_counts_cache_creation_past_the_hit() -> None:
    cm, root, clock = make(16)
    run(cm, root, "a", P, [(12, "5m")])
    clock.t = 200.0
    # The same prefix + 4 tokens: hit of 12 refreshes the 5m retention; a 1h breakpoint on the
    # whole 16 tokens creates only the 4 tokens past the hit.
    m, created, retained = run(cm, root, "b", P + [20, 21, 22, 23], [(16, "1h")])
    assert (m, created, retained) == (12, {"1h": 4}, 16)
    (info_5m,) = [r for r in cm.list_retentions(None) if r.ttl_class == "5m"]
    assert (info_5m.num_tokens, info_5m.expires_in_s, info_5m.num_refreshes) == (12, 300.0, 1)
    clock.t = 499.0
    assert len(cm.list_retentions(None)) == 2
    clock.t = 500.0
    assert [(r.ttl_class, r.num_tokens) for r in cm.list_retentions(None)] == [("1h", 16)]
    assert cm.retention_snapshot()["refreshes_total"] == 1


def test_repeated_retain_refreshes_and_creates_nothing() -> None:
    cm, root, clock = make(16)
    assert run(cm, root, "a", P, [(12, "5m")])[1:] == ({"5m": 12}, 12)
    clock.t = 100.0
    # Hit cap: m = 8 (the last prompt token is always computed); the 12-token prefix was
    # retained already, so nothing is newly retained.
    assert run(cm, root, "b", P, [(12, "5m")]) == (8, {}, 12)
    (info,) = cm.list_retentions(None)
    assert (info.num_refreshes, info.expires_in_s) == (1, 300.0)  # once per request


def test_breakpoints_split_creation_by_ttl_and_round_down_to_blocks() -> None:
    cm, root, _ = make(16)
    tokens = list(range(1, 21))  # 5 blocks
    m, created, retained = run(cm, root, "a", tokens, [(10, "1h"), (7, "5m"), (20, "5m")])
    # 7 -> 4 tokens (5m), 10 -> 8 (1h: 4 more), 20 -> 20 (5m: 12 more)
    assert (m, created, retained) == (0, {"5m": 16, "1h": 4}, 20)
    assert sorted((r.ttl_class, r.num_tokens) for r in cm.list_retentions(None)) == [
        ("1h", 8), ("5m", 4), ("5m", 20)]
    assert cm.num_retained_blocks == 5


def test_retention_ids_in_breakpoint_order_and_listed() -> None:
    cm, root, _ = make(16)
    tokens = list(range(1, 21))
    cm.begin("a", root, tokens, tenant="t")
    assert cm.allocate("a", 20)
    cm.publish("a", tokens, 20)
    result = cm.retain("a", [(20, "1h"), (2, "5m"), (8, "5m")], num_prompt_tokens=20)
    cm.release("a")
    listed = {(r.num_tokens, r.ttl_class): r.retention_id for r in cm.list_retentions("t")}
    assert result.retention_ids == (listed[(20, "1h")], listed[(8, "5m")])  # 2 -> 0: none
    assert result.created == {"5m": 8, "1h": 12} and result.num_retained_tokens == 20


def test_pool_budget_clips_to_a_shorter_prefix_and_counts_refused_tokens() -> None:
    cm, root, _ = make(8, max_retained_fraction=0.25)  # 2 blocks
    assert run(cm, root, "a", P, [(12, "5m")]) == (0, {"5m": 8}, 8)
    (info,) = cm.list_retentions(None)
    assert info.num_tokens == 8
    snap = cm.retention_snapshot()
    assert (snap["retained_blocks"], snap["max_retained_blocks"], snap["refused_tokens_total"]) \
        == (2, 2, 4)
    # A second prefix finds the budget spent: nothing retained, all refused.
    assert run(cm, root, "b", [50 + i for i in range(8)], [(8, "1h")]) == (0, {}, 0)
    assert cm.retention_snapshot()["refused_tokens_total"] == 12


def test_fraction_zero_retains_nothing() -> None:
    cm, root, _ = make(8, max_retained_fraction=0.0)
    assert run(cm, root, "a", P, [(12, "5m")]) == (0, {}, 0)
    assert cm.list_retentions(None) == []


def test_tenant_budget_counts_shared_prefix_once() -> None:
    cm, root, _ = make(16, tenant_max_retained_tokens={"t1": 8})
    assert run(cm, root, "a", P, [(12, "5m")], tenant="t1") == (0, {"5m": 8}, 8)
    # Same 8-token prefix, another class: no new blocks, fits; the rest is refused.
    assert run(cm, root, "b", P, [(12, "1h")], tenant="t1") == (8, {}, 8)
    assert cm.retention.tree.retained_blocks_by_tenant == {"t1": 2}
    snap = cm.retention_snapshot()
    assert snap["by_tenant"]["t1"] == {"retentions": 2, "retained_blocks": 2,
                                       "retained_tokens": 8, "max_retained_tokens": 8,
                                       "refused_tokens_total": 8}
    # Another tenant has only the pool-wide bound (8 blocks here).
    assert run(cm, root, "c", P, [(12, "5m")], tenant="t2") == (8, {"5m": 4}, 12)


def test_tenants_see_and_release_only_their_own() -> None:
    cm, root, _ = make(16)
    run(cm, root, "a", P, [(8, "5m")], tenant="t1")
    run(cm, root, "b", [60 + i for i in range(8)], [(8, "1h")], tenant="t2")
    (mine,) = cm.list_retentions("t1")
    assert (mine.tenant, mine.num_tokens, mine.ttl_class) == ("t1", 8, "5m")
    assert len(cm.list_retentions(None, all_tenants=True)) == 2
    (theirs,) = cm.list_retentions("t2")
    assert cm.release_retentions("t1", theirs.retention_id) == 0  # invisible to t1
    assert cm.release_retentions("t1") == 1
    assert [r.tenant for r in cm.list_retentions(None, all_tenants=True)] == ["t2"]
    assert cm.release_retentions(None, theirs.retention_id, all_tenants=True) == 1
    assert cm.num_retained_blocks == 0 and cm.retention_snapshot()["released_total"] == 2
    cm.check_integrity()


def test_retention_is_keyed_by_identity_root() -> None:
    cm, root, _ = make(16)
    salted = cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt="s"))
    run(cm, root, "a", P, [(8, "5m")])
    run(cm, salted, "b", P, [(8, "5m")])
    ids = {r.retention_id for r in cm.list_retentions(None)}
    assert len(ids) == 2  # same tokens, two roots: two retentions, four blocks
    assert cm.num_retained_blocks == 4
    assert cm.peek(salted, P) == 8 and cm.peek(root, P) == 8


def test_running_requests_always_get_blocks_without_a_store() -> None:
    cm, root, _ = make(6, max_retained_fraction=1.0)
    run(cm, root, "a", P, [(12, "5m")])  # 3 of 6 blocks pinned
    q = [100 + i for i in range(24)]  # needs all 6 blocks
    cm.begin("b", root, q)
    assert cm.allocate("b", 24)
    assert sorted(cm.block_table("b")) == list(range(6))
    assert cm.list_retentions(None) == []
    assert cm.retention_snapshot()["preempted_tokens_total"] == 12
    cm.check_integrity()
    cm.release("b")


def test_unpinning_is_all_or_nothing() -> None:
    cm, root, _ = make(6, max_retained_fraction=1.0)
    run(cm, root, "a", P, [(12, "5m")])
    cm.begin("hold", root, [200 + i for i in range(8)])
    assert cm.allocate("hold", 8)  # 2 private blocks; 1 free, 3 pinned
    cm.begin("big", root, [300 + i for i in range(24)])
    assert not cm.allocate("big", 24)  # 6 blocks can never come: nothing unpinned
    assert len(cm.list_retentions(None)) == 1
    cm.release("big")
    cm.release("hold")
    cm.check_integrity()


def test_release_of_retained_request_keeps_pin_and_lock_counts() -> None:
    cm, root, _ = make(8)
    cm.begin("a", root, P)
    assert cm.allocate("a", 12)
    cm.publish("a", P, 12)
    cm.retain("a", [(8, "5m")])
    cm.begin("b", root, P)  # holds the same path while the retention pins part of it
    cm.check_integrity()
    cm.release("a")
    cm.release("b")
    cm.check_integrity()
    assert cm.block_states()[:3] == ["cached_locked", "cached_locked", "cached_evictable"]


def test_breakpoint_validation_names_the_field() -> None:
    ok = (RetentionBreakpoint(4, "5m"), RetentionBreakpoint(-1, "24h"))
    assert check_breakpoints(list(ok), 10) == ok
    assert check_breakpoints((), 10) == ()
    bad = [
        ("nope", "retention: must be a sequence"),
        ([(4, "5m")], "retention[0]: must be a RetentionBreakpoint"),
        ([RetentionBreakpoint(11, "5m")], "retention[0].num_tokens: must be an int in [1, 10]"),
        ([RetentionBreakpoint(0, "5m")], "retention[0].num_tokens"),
        ([RetentionBreakpoint(2, "2h")], "retention[0].ttl_class: must be one of 5m, 1h, 24h"),
        ([RetentionBreakpoint(i, "5m") for i in range(1, 6)],
         "retention: at most 4 prompt breakpoints, got 5"),
        ([RetentionBreakpoint(-1, "5m")] * 2, "retention: at most one whole-sequence"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError) as err:
            check_breakpoints(value, 10)
        assert str(err.value).startswith(message), str(err.value)


def test_budget_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="^max_retained_fraction: must be a number in"):
        make(8, max_retained_fraction=1.5)
    with pytest.raises(ValueError, match="^max_retained_tokens: tenant 't': must be an int"):
        make(8, tenant_max_retained_tokens={"t": -1})
    cm, root, _ = make(8)
    cm.begin("a", root, P)
    with pytest.raises(ValueError, match="^ttl_class: must be one of"):
        cm.retain("a", [(8, "2h")])
    assert cm.list_retentions(None) == []
    cm.release("a")


def test_retention_id_is_stable_and_distinct() -> None:
    h = bytes(range(16))
    assert retention_id(h, "5m", None) == retention_id(h, "5m", None)
    assert len({retention_id(h, c, t) for c in TTL_CLASSES for t in (None, "a", "b")}) == 9
    assert retention_id(h, "5m", None).startswith("ret_") and len(retention_id(h, "5m", None)) == 28
    assert isinstance(RetentionTable, type)


class NoStore:
    """Stands in for a store tier where the cache only asks whether one is attached (and up)."""

    write_mode = "evict"  # publish writes nothing (no trim hook is attached either)
    down = False

    def cancel(self, request_id: str) -> None:
        pass


def test_pressure_with_a_store_demotes_and_a_returning_prefix_pins_again() -> None:
    cm, root, clock = make(6, max_retained_fraction=1.0)
    cm.store = NoStore()  # type: ignore[assignment]
    run(cm, root, "a", P, [(12, "1h")])
    cm.begin("b", root, [100 + i for i in range(24)])
    assert cm.allocate("b", 24)  # all 6 blocks: the retention is demoted, not dropped
    cm.release("b")
    snap = cm.retention_snapshot()
    assert (snap["demoted_retentions"], snap["retentions"], snap["demoted_blocks_total"],
            snap["preempted_tokens_total"]) == (1, 0, 3, 0)
    (info,) = cm.list_retentions(None)
    assert (info.num_tokens, info.expires_in_s) == (12, 3600.0)
    clock.t = 10.0
    # The prefix computed again (or loaded back from the store): pinned and refreshed.
    assert run(cm, root, "c", P + [7], []) == (0, {}, 12)
    snap = cm.retention_snapshot()
    assert (snap["repinned_total"], snap["demoted_retentions"], snap["retained_blocks"]) == (
        1, 0, 3)
    (info,) = cm.list_retentions(None)
    assert (info.expires_in_s, info.num_refreshes) == (3600.0, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(
    st.sampled_from(["run", "run", "run", "hold", "drop", "tick", "evict", "release"]),
    st.integers(0, 5), st.integers(1, 24), st.sampled_from(sorted(TTL_CLASSES)),
    st.sampled_from([None, "t1", "t2"]), st.integers(0, 4000)), max_size=30),
    policy=st.sampled_from(["lru", "cost", "s3fifo"]),
    fraction=st.sampled_from([0.0, 0.3, 0.5, 1.0]), with_store=st.booleans())
def test_property_random_retain_evict_expire_keeps_integrity(ops, policy, fraction,
                                                             with_store) -> None:
    cm, root, clock = make(12, eviction_policy=policy, max_retained_fraction=fraction,
                           tenant_max_retained_tokens={"t1": 12})
    if with_store:  # pressure demotes instead of dropping; a returning prefix is pinned again
        cm.store = NoStore()  # type: ignore[assignment]
    held: list[str] = []
    for i, (op, seed, length, ttl, tenant, dt) in enumerate(ops):
        tokens = [(seed * 7 + j) % 11 + 1 for j in range(length)]
        rid = f"r{i}"
        if op in ("run", "hold"):
            cm.begin(rid, root, tokens, tenant=tenant)
            if not cm.allocate(rid, length):
                cm.release(rid)
            else:
                cm.publish(rid, tokens, length)
                created, retained, ids = cm.retain(
                    rid, [(length, ttl), (length // 2 or 1, "5m")], num_prompt_tokens=length)
                assert len(ids) <= 2 and all(i.startswith("ret_") for i in ids)
                assert cm.num_cached_tokens(rid) + sum(created.values()) <= length
                assert retained % B == 0 and retained <= length
                if op == "hold":
                    held.append(rid)
                else:
                    cm.release(rid)
        elif op == "drop" and held:
            cm.release(held.pop(seed % len(held)))
        elif op == "tick":
            clock.t += dt
            cm.expire_retentions()
        elif op == "evict":
            cm.evict(seed + 1)
        elif op == "release":
            cm.release_retentions(tenant, all_tenants=seed == 0)
        cm.check_integrity()
        snap = cm.retention_snapshot()
        assert snap["retained_blocks"] <= snap["max_retained_blocks"]
        assert cm.retention.tree.retained_blocks_by_tenant.get("t1", 0) <= 3
    for rid in held:
        cm.release(rid)
    clock.t += 86400.0
    cm.expire_retentions()
    cm.check_integrity()
    assert cm.num_retained_blocks == 0 and cm.num_in_use_blocks == 0


# ---- creation against the reported hit; what pressure unpins; demoted retentions ----------


def test_creation_counts_past_the_engines_hit_when_a_resume_found_less() -> None:
    cm, root, _ = make(16)
    tokens = list(range(1, 25))  # 24 tokens: 6 blocks
    run(cm, root, "a", tokens[:16])
    assert cm.begin("b", root, tokens) == 16  # m0: the first admission's hit (reported)
    assert cm.allocate("b", 24)
    cm.publish("b", tokens, 20)  # one prefill chunk, then preempted
    cm.release("b")
    assert cm.evict(cm.num_cached_evictable_blocks) == 5  # its cached prefix evicted meanwhile
    assert cm.begin("b", root, tokens) == 0  # the resume finds nothing
    assert cm.allocate("b", 24)
    cm.publish("b", tokens, 24)
    with pytest.raises(ValueError, match="^num_cached_tokens: "):
        cm.retain("b", [(24, "5m")], num_prompt_tokens=24, num_cached_tokens=-4)
    result = cm.retain("b", [(24, "5m")], num_prompt_tokens=24, num_cached_tokens=16)
    # 24 - 16: never the 16 tokens the client was told came from the cache.
    assert (result.created, result.num_retained_tokens) == ({"5m": 8}, 24)
    cm.check_integrity()
    cm.release("b")


def test_clamp_created_cuts_the_last_classes_first() -> None:
    assert clamp_created({"1h": 8, "5m": 12}, 20) == {"1h": 8, "5m": 12}
    assert clamp_created({"1h": 8, "5m": 12}, 10) == {"1h": 8, "5m": 2}
    assert clamp_created({"1h": 8, "5m": 12}, 8) == {"1h": 8}
    assert clamp_created({"1h": 8}, -4) == {}


def test_pressure_keeps_a_retention_whose_path_a_running_request_holds() -> None:
    cm, root, _ = make(8, max_retained_fraction=1.0)
    a = [10 + i for i in range(8)]
    cm.begin("a", root, a)  # session A: running, its prompt retained for 5 minutes
    assert cm.allocate("a", 8)
    cm.publish("a", a, 8)
    assert cm.retain("a", [(8, "5m")], num_prompt_tokens=8).created == {"5m": 8}
    run(cm, root, "b", [40 + i for i in range(8)], [(8, "1h")])  # session B: idle, 1 hour
    cm.begin("c", root, [100 + i for i in range(24)])
    assert cm.allocate("c", 24)  # 6 blocks: the 4 free ones and B's 2
    assert sorted(cm.block_table("c")) == [2, 3, 4, 5, 6, 7]
    # A's retention frees nothing while A runs: kept (it expires first, so it was dropped too).
    assert [(r.ttl_class, r.num_tokens) for r in cm.list_retentions(None)] == [("5m", 8)]
    assert cm.retention_snapshot()["preempted_tokens_total"] == 8
    cm.check_integrity()
    cm.release("c")
    cm.release("a")


def test_pressure_keeps_a_prefix_a_deeper_retention_also_pins() -> None:
    cm, root, _ = make(8, max_retained_fraction=1.0)
    run(cm, root, "a", P, [(4, "5m"), (12, "1h")])  # S: 1 block, D: 3 blocks on one path
    cm.begin("c", root, [100 + i for i in range(28)])
    assert cm.allocate("c", 28)  # 7 blocks: the 5 free ones and D's last 2
    assert [(r.ttl_class, r.num_tokens) for r in cm.list_retentions(None)] == [("5m", 4)]
    snap = cm.retention_snapshot()
    assert (snap["preempted_tokens_total"], snap["retained_blocks"]) == (12, 1)
    assert cm.block_states()[0] == "cached_locked"  # S's block, still pinned
    cm.check_integrity()
    cm.release("c")


def test_pressure_unpins_two_retentions_ending_at_one_node() -> None:
    cm, root, _ = make(8, max_retained_fraction=1.0)
    run(cm, root, "a", P[:8], [(8, "5m"), (8, "1h")])  # neither frees a block alone
    cm.begin("c", root, [100 + i for i in range(28)])
    assert cm.allocate("c", 28)  # 7 blocks: the 6 free ones and 1 of theirs
    assert cm.list_retentions(None) == []
    assert cm.retention_snapshot()["preempted_tokens_total"] == 16
    cm.check_integrity()
    cm.release("c")


def test_a_demoted_retention_is_matched_by_its_chained_hash_not_its_tokens() -> None:
    cm, root, _ = make(6, max_retained_fraction=1.0)
    cm.store = NoStore()  # type: ignore[assignment]
    run(cm, root, "a", P, [(12, "1h")])
    cm.begin("b", root, [100 + i for i in range(24)])
    assert cm.allocate("b", 24)  # demoted
    cm.release("b")
    # The same tokens with an image over the first block: another prefix, not pinned.
    image = [(0, 4, b"image-digest")]
    cm.begin("c", root, P + [7], mm_items=image)
    assert cm.allocate("c", 13)
    cm.publish("c", P + [7], 13)
    assert cm.retain("c", [], num_prompt_tokens=13) == ({}, 0, ())
    snap = cm.retention_snapshot()
    assert (snap["repinned_total"], snap["demoted_retentions"]) == (0, 1)
    cm.check_integrity()
    cm.release("c")
    # It keeps the chained hash of its last block, not its tokens.
    (rid,) = [r.retention_id for r in cm.list_retentions(None)]
    assert cm.retention._by_id[rid].end_hash == cm.hasher.hash_blocks(root, pack_tokens(P), B)[-1]
    assert run(cm, root, "d", P + [7]) == (0, {}, 12)  # the text prefix: pinned again
    assert cm.retention_snapshot()["repinned_total"] == 1


def test_demoted_retentions_are_bounded_per_tenant_oldest_dropped() -> None:
    cm, root, _ = make(8, max_retained_fraction=1.0)
    cm.store = NoStore()  # type: ignore[assignment]
    cm.retention.max_demoted_per_tenant = 1
    run(cm, root, "a", P[:8], [(8, "5m")], tenant="t")
    run(cm, root, "b", [40 + i for i in range(8)], [(8, "1h")], tenant="t")
    cm.begin("c", root, [100 + i for i in range(32)])
    assert cm.allocate("c", 32)  # all 8 blocks: both demoted, the older one then dropped
    snap = cm.retention_snapshot()
    assert (snap["demoted_retentions"], snap["demoted_blocks_total"],
            snap["preempted_tokens_total"]) == (1, 4, 8)
    assert [(r.ttl_class, r.num_tokens) for r in cm.list_retentions("t")] == [("1h", 8)]
    cm.check_integrity()
    cm.release("c")


def test_a_store_tier_that_is_down_gets_nothing_demoted() -> None:
    cm, root, _ = make(6, max_retained_fraction=1.0)
    store = NoStore()
    store.down = True
    cm.store = store  # type: ignore[assignment]
    run(cm, root, "a", P, [(12, "1h")])
    cm.begin("b", root, [100 + i for i in range(24)])
    assert cm.allocate("b", 24)
    snap = cm.retention_snapshot()
    assert (snap["demoted_retentions"], snap["demoted_blocks_total"],
            snap["preempted_tokens_total"]) == (0, 0, 12)
    assert cm.list_retentions(None) == []
    cm.check_integrity()
    cm.release("b")


class TickingClock:
    """A clock that moves 1 ms every time it is read (a real clock's effect)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def test_a_hit_refreshes_once_on_a_clock_that_moves() -> None:
    cm = CacheManager(16, B, clock=TickingClock())
    root = cm.identity_root(CacheIdentity("r1", B, "float32", ROPE))
    run(cm, root, "a", P, [(12, "5m")])
    run(cm, root, "b", P, [(12, "5m")])  # a hit on it, and the same breakpoint again
    (info,) = cm.list_retentions(None)
    assert (info.num_refreshes, cm.retention_snapshot()["refreshes_total"]) == (1, 1)


def test_a_hit_refreshes_a_demoted_retention_the_budget_keeps_unpinned() -> None:
    cm, root, clock = make(6, max_retained_fraction=0.5)  # 3 blocks
    cm.store = NoStore()  # type: ignore[assignment]
    run(cm, root, "a", P, [(12, "1h")])
    cm.begin("b", root, [100 + i for i in range(24)])
    assert cm.allocate("b", 24)  # demoted
    cm.release("b")
    clock.t = 100.0
    run(cm, root, "x", [60 + i for i in range(8)], [(8, "5m")])  # 2 of the 3 blocks
    clock.t = 200.0
    assert run(cm, root, "c", P + [7]) == (0, {}, 0)  # P is back, but does not fit
    snap = cm.retention_snapshot()
    assert (snap["repinned_total"], snap["demoted_retentions"], snap["refreshes_total"]) == (
        0, 1, 1)
    info = {r.ttl_class: r for r in cm.list_retentions(None)}["1h"]
    assert (info.expires_in_s, info.num_refreshes) == (3600.0, 1)


class MarkStore(NoStore):
    """Records what the cache tells a store tier that keeps retained blocks longest."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mark_retained(self, root: bytes, hashes: list[bytes], until_s: float) -> None:
        self.calls.append(("mark", root, list(hashes), until_s))

    def unmark_retained(self, root: bytes, hashes: list[bytes]) -> None:
        self.calls.append(("unmark", root, list(hashes)))


def test_release_and_expiry_clear_store_marks_of_blocks_no_retention_holds() -> None:
    cm, root, clock = make(16)
    store = MarkStore()
    cm.store = store  # type: ignore[assignment]
    cm.retention.touched, cm.retention.cleared = {}, []  # as attach_store for such a tier
    h = cm.hasher.hash_blocks(root, pack_tokens(P), B)
    run(cm, root, "a", P, [(4, "5m"), (12, "1h")])
    assert store.calls == [("mark", root, h[:1], 300.0), ("mark", root, h, 3600.0)]
    store.calls.clear()
    (deep,) = [r.retention_id for r in cm.list_retentions(None) if r.ttl_class == "1h"]
    assert cm.release_retentions(None, deep) == 1
    assert store.calls == [("unmark", root, h[1:])]  # block 0: still the 5m one's
    store.calls.clear()
    clock.t = 300.0
    assert cm.expire_retentions() == 1
    assert store.calls == [("unmark", root, h[:1])]
    store.calls.clear()
    run(cm, root, "b", P, [(12, "1h")])  # pinned again: marked, nothing cleared
    assert [c[0] for c in store.calls] == ["mark"]

"""Retention through the engine on the tiny random-init model: breakpoints applied when the
prompt is cached (exact ``cache_creation_tokens_by_ttl`` / ``num_retained_tokens`` on every
output), retained prefixes surviving a pool flooded by other requests, expiry and refresh on the
cache clock the test moves, whole-sequence retention at finish, budgets from the config, bad
breakpoints refused, ``/stats`` keys, and listing/release through ``AsyncEngine``'s thread."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from radixkv.cache.retention import RetentionBreakpoint
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from tests.factories import engine_config

B = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tiny_model, *, num_blocks: int = 32, fraction: float = 0.5,
         budgets: tuple[tuple[str, int], ...] = (), **kwargs) -> tuple[LLMEngine, Clock]:
    config = engine_config(block_size=B, num_blocks=num_blocks, **kwargs)
    config = dataclasses.replace(config, cache=dataclasses.replace(
        config.cache, max_retained_fraction=fraction, tenant_max_retained_tokens=budgets))
    engine = LLMEngine(config, tiny_model)
    clock = Clock()
    engine.cache.set_clock(clock)
    return engine, clock


def run(engine: LLMEngine, prompt: list[int], retention=(), tenant: str | None = None,
        params: SamplingParams = GREEDY) -> list:
    """Run one request to its end; return its outputs (the integrity checked after)."""
    req = engine.make_request(prompt, params, retention=retention, tenant=tenant)
    engine.add_request(req)
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    engine.cache.check_integrity()
    assert outputs and outputs[-1].finished
    return outputs


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 900 + 20 for i in range(length)]


def flood(engine: LLMEngine, num: int = 6) -> None:
    """Requests with fresh prompts that need the whole pool's evictable blocks."""
    for i in range(num):
        run(engine, prompt_of(500 + i, 40))


def test_breakpoints_report_creation_on_every_output_and_survive_a_flood(tiny_model) -> None:
    engine, _ = make(tiny_model, num_blocks=32)
    prompt = prompt_of(1, 22)
    outputs = run(engine, prompt, (RetentionBreakpoint(8, "1h"), RetentionBreakpoint(22, "5m")))
    assert [(o.cache_creation_tokens_by_ttl, o.num_retained_tokens) for o in outputs] == [
        ({"1h": 8, "5m": 12}, 20)] * 3
    assert outputs[0].num_cached_tokens == 0
    ids = {(r.num_tokens, r.ttl_class): r.retention_id for r in engine.list_retentions(None)}
    assert all(o.retention_ids == (ids[(8, "1h")], ids[(20, "5m")]) for o in outputs)
    flood(engine)
    again = run(engine, prompt + [5, 6, 7])
    assert again[0].num_cached_tokens == 20  # the retained 5 blocks, whatever the flood did
    assert [(o.cache_creation_tokens_by_ttl, o.num_retained_tokens) for o in again] == [
        ({}, 20)] * 3
    # Without retention the same flood leaves nothing of a prompt.
    engine2, _ = make(tiny_model, num_blocks=32)
    run(engine2, prompt)
    flood(engine2)
    assert run(engine2, prompt + [5, 6, 7])[0].num_cached_tokens == 0


def test_expiry_on_the_moved_clock_and_refresh_on_hit(tiny_model) -> None:
    engine, clock = make(tiny_model, num_blocks=32)
    prompt = prompt_of(2, 17)
    run(engine, prompt, (RetentionBreakpoint(16, "5m"),))
    clock.t += 200.0
    assert run(engine, prompt + [9, 9])[0].num_cached_tokens == 16  # a hit: refreshed
    (info,) = engine.list_retentions(None)
    assert (info.num_tokens, info.expires_in_s, info.num_refreshes) == (16, 300.0, 1)
    clock.t += 299.0
    flood(engine)
    assert run(engine, prompt + [8, 8])[0].num_cached_tokens == 16
    clock.t += 301.0
    flood(engine)  # expired first: its blocks are ordinary cached blocks, evicted by the flood
    assert engine.list_retentions(None) == []
    assert run(engine, prompt + [7, 7])[0].num_cached_tokens == 0
    stats = engine.stats_snapshot()["retention"]
    assert (stats["expired_total"], stats["refreshes_total"]) == (1, 2)


def test_whole_sequence_retained_at_finish(tiny_model) -> None:
    engine, _ = make(tiny_model, num_blocks=32)
    prompt = prompt_of(3, 10)
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    outputs = run(engine, prompt, (RetentionBreakpoint(-1, "24h"),), params=params)
    # The prompt (2 full blocks) at the first output; prompt + 6 computed generated tokens
    # (16 tokens: 4 blocks) at the last.
    assert [o.num_retained_tokens for o in outputs] == [8] * 6 + [16]
    assert all(o.cache_creation_tokens_by_ttl == {"24h": 8} for o in outputs)
    by_size = {r.num_tokens: r.retention_id for r in engine.list_retentions(None)}
    assert sorted(by_size) == [8, 16]
    assert [o.retention_ids for o in outputs] == [(by_size[8],)] * 6 + [(by_size[8], by_size[16])]
    flood(engine)
    generated = [o.new_token_ids[0] for o in outputs]
    assert run(engine, prompt + generated)[0].num_cached_tokens == 16


def test_tenant_budget_and_pool_fraction_from_the_config(tiny_model) -> None:
    engine, _ = make(tiny_model, num_blocks=32, fraction=0.25, budgets=(("t1", 12),))
    outs = run(engine, prompt_of(4, 30), (RetentionBreakpoint(30, "5m"),), tenant="t1")
    assert (outs[0].cache_creation_tokens_by_ttl, outs[0].num_retained_tokens) == ({"5m": 12}, 12)
    outs = run(engine, prompt_of(5, 30), (RetentionBreakpoint(30, "1h"),), tenant="t2")
    assert outs[0].num_retained_tokens == 20  # 8 blocks pool-wide, 3 taken by t1
    stats = engine.stats_snapshot()
    ret = stats["retention"]
    assert (ret["retained_blocks"], ret["max_retained_blocks"], ret["refused_tokens_total"]) == (
        8, 8, 16 + 8)
    assert ret["by_tenant"]["t1"]["max_retained_tokens"] == 12
    assert ret["by_ttl"]["1h"]["retained_tokens"] == 20
    assert stats["pool"]["retained_blocks"] == 8


def test_bad_breakpoints_are_refused_naming_the_field(tiny_model) -> None:
    engine, _ = make(tiny_model)
    for retention, message in (
            ((RetentionBreakpoint(9, "5m"),), "retention[0].num_tokens"),
            ((RetentionBreakpoint(4, "7d"),), "retention[0].ttl_class"),
            (tuple(RetentionBreakpoint(i, "5m") for i in range(1, 6)), "retention: at most 4")):
        with pytest.raises(ValueError) as err:
            engine.prepare_request(prompt_of(6, 8), GREEDY, retention=retention)
        assert str(err.value).startswith(message)
    assert engine.list_retentions(None, all_tenants=True) == []


def test_async_engine_lists_and_releases_on_its_thread(tiny_model) -> None:
    from radixkv.engine.async_engine import AsyncEngine

    async def main() -> None:
        engine = AsyncEngine(engine_config(block_size=B, num_blocks=32), tiny_model,
                             check_integrity_when_idle=True)
        engine.start()
        try:
            for tenant, seed in (("t1", 7), ("t2", 8)):
                stream = engine.generate(prompt_of(seed, 9), GREEDY, tenant=tenant,
                                         retention=(RetentionBreakpoint(9, "1h"),))
                outs = [o async for o in stream]
                assert outs[-1].cache_creation_tokens_by_ttl == {"1h": 8}
            (mine,) = await engine.list_retentions("t1")
            assert (mine.tenant, mine.num_tokens, mine.ttl_class) == ("t1", 8, "1h")
            assert len(await engine.list_retentions(None, all_tenants=True)) == 2
            assert await engine.release_retentions("t2", mine.retention_id) == 0
            assert await engine.release_retentions("t1", mine.retention_id) == 1
            assert [r.tenant for r in await engine.list_retentions(None, all_tenants=True)] \
                == ["t2"]
            assert engine.stats()["retention"]["released_total"] == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_store_tier_demotes_under_pressure_and_a_hit_pins_again(tiny_model) -> None:
    engine, _ = make(tiny_model, num_blocks=24, fraction=1.0, kv_store="host:0.01")
    try:
        prompt = prompt_of(9, 41)
        first = run(engine, prompt, (RetentionBreakpoint(40, "1h"),))
        assert first[0].num_retained_tokens == 40
        assert engine.store.flush()
        # 93 tokens need all 24 blocks: the 10 retained ones are demoted, not dropped.
        run(engine, prompt_of(10, 90))
        ret = engine.stats_snapshot()["retention"]
        assert (ret["demoted_blocks_total"], ret["demoted_retentions"], ret["retentions"],
                ret["preempted_tokens_total"]) == (10, 1, 0, 0)
        (info,) = engine.list_retentions(None)
        assert info.num_tokens == 40  # still listed: it lives in the store tier
        assert engine.store.flush()
        back = run(engine, prompt + [1, 2])
        assert back[0].num_cached_tokens == 40
        ret = engine.stats_snapshot()["retention"]
        assert (ret["repinned_total"], ret["demoted_retentions"], ret["retentions"],
                ret["retained_blocks"]) == (1, 0, 1, 10)
        # The big request left one block of the prefix on the device; the store had the rest.
        assert engine.stats_snapshot()["cached_prompt_tokens_by_tier"] == {"device": 4,
                                                                           "store": 36}
    finally:
        engine.store.close()


def test_a_disk_tier_is_told_which_blocks_are_retained(tiny_model, tmp_path) -> None:
    # The engine's own clock (time.monotonic): the disk tier keeps them until the expiry on it.
    engine = LLMEngine(engine_config(block_size=B, num_blocks=32,
                                     kv_store=f"disk:{tmp_path / 'kv'}"), tiny_model)
    try:
        run(engine, prompt_of(11, 21), (RetentionBreakpoint(20, "1h"),))
        run(engine, prompt_of(12, 9))  # published and written, not retained
        assert engine.store.flush()
        store = engine.stats_snapshot()["store"]
        assert (store["disk_num_blocks"], store["disk_retained_blocks"]) == (5 + 2, 5)
    finally:
        engine.store.close()


def test_serve_flags_and_key_file_budgets_reach_the_cache_config(tmp_path, capsys) -> None:
    import json

    from radixkv.cli import build_parser, engine_config_from_args
    from radixkv.server.auth import load_api_keys

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({
        "key-one-1": {"tenant": "t1", "max_retained_tokens": 4096},
        "key-two-2": {"tenant": "t1", "max_retained_tokens": 1024},
        "key-three": {"tenant": "t2"},
        "key-four4": {"tenant": "ops", "admin": True, "max_retained_tokens": 0}}))
    args = build_parser().parse_args(["serve", "--device", "cpu", "--max-retained-fraction",
                                      "0.25", "--api-keys", str(keys)])
    cache = engine_config_from_args(args, load_api_keys(keys)).cache
    assert cache.max_retained_fraction == 0.25
    assert cache.tenant_max_retained_tokens == (("ops", 0), ("t1", 1024))  # a tenant's least
    assert engine_config_from_args(args).cache.tenant_max_retained_tokens == ()
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "--max-retained-fraction", bad])
        assert exit_.value.code == 2
        assert "--max-retained-fraction: expected a number in [0, 1]" in capsys.readouterr().err


def test_metrics_export_retention_by_ttl_and_tenant(tiny_model) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from radixkv.server.metrics import _retention_families

    engine, _ = make(tiny_model, num_blocks=32, budgets=(("t1", 8),))
    run(engine, prompt_of(13, 13), (RetentionBreakpoint(12, "1h"),), tenant="t1")
    snapshot = engine.stats_snapshot()["retention"]

    class Collector:
        def collect(self):
            yield from _retention_families(snapshot)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    lines = set(generate_latest(registry).decode().splitlines())
    assert {"radixkv_retention_created_total 1.0",
            "radixkv_retention_refused_tokens_total 4.0",
            "radixkv_retention_retained_blocks 2.0",
            "radixkv_retention_max_retained_blocks 16.0",
            'radixkv_retention_retentions{ttl="1h"} 1.0',
            'radixkv_retention_retained_tokens{ttl="1h"} 8.0',
            'radixkv_retention_retained_tokens{ttl="5m"} 0.0',
            'radixkv_retention_tenant_retained_tokens{tenant="t1"} 8.0',
            'radixkv_retention_tenant_refused_tokens_total{tenant="t1"} 4.0'} <= lines


def test_creation_never_counts_the_reported_hit_after_a_preemption_in_prefill(tiny_model) -> None:
    engine, _ = make(tiny_model, num_blocks=32, prefill_chunk_tokens=8)
    prompt = prompt_of(20, 32)
    run(engine, prompt[:16] + [3])  # caches the prompt's first 16 tokens
    req = engine.make_request(prompt, GREEDY, retention=(RetentionBreakpoint(32, "5m"),))
    engine.add_request(req)
    assert engine.step() == []  # admitted with 16 cached tokens; computes tokens 16..24
    assert (req.num_cached_tokens, req.num_computed_tokens) == (16, 24)
    engine.scheduler._preempt(req)  # preempted during its prefill ...
    engine.reset_prefix_cache()  # ... and its cached prefix evicted before it resumes
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    engine.cache.check_integrity()
    # The resume found nothing (the cache's m is 0), but the client was told 16 came from the
    # cache: only the other 16 are newly retained, so the usage still adds up to 32.
    assert [(o.num_prompt_tokens, o.num_cached_tokens, o.cache_creation_tokens_by_ttl,
             o.num_retained_tokens) for o in outputs] == [(32, 16, {"5m": 16}, 32)] * 3
    assert engine.stats_snapshot()["retention"]["created_total"] == 1


def test_releasing_a_retention_clears_the_disk_tiers_marks(tiny_model, tmp_path) -> None:
    engine = LLMEngine(engine_config(block_size=B, num_blocks=32,
                                     kv_store=f"disk:{tmp_path / 'kv'}"), tiny_model)
    tier = engine.store
    assert tier is not None
    try:
        run(engine, prompt_of(11, 21), (RetentionBreakpoint(20, "1h"),))
        assert tier.flush()
        assert engine.stats_snapshot()["store"]["disk_retained_blocks"] == 5
        assert engine.release_retentions(None) == 1
        assert tier.flush()
        store = engine.stats_snapshot()["store"]
        assert (store["disk_num_blocks"], store["disk_retained_blocks"]) == (5, 0)
    finally:
        tier.close()

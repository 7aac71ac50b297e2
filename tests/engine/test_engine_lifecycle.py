"""Engine scheduling and lifecycle: partial tail blocks never shared, no eviction of blocks in
use, no leak after an abort, only fully computed KV published, chunked prefill, sliding windows.

Engine level with token ids on the tiny random-init model. Phases are made deterministic by
stepping the engine by hand.
"""

from __future__ import annotations

import random

import pytest

from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.request import RequestStatus
from radixkv.engine.sampling import SamplingParams
from radixkv.model.loader import load_model
from tests.conftest import make_tiny_model_dir
from tests.factories import make_engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def cold_output(model, prompt, params):
    (req,) = make_engine(model, prefix_cache=False).generate([prompt], params)
    return req.output_token_ids


def drain(engine: LLMEngine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work:
            return
        engine.step()
        engine.cache.check_integrity()
    raise AssertionError("engine did not drain")


def assert_idle_and_clean(engine: LLMEngine) -> None:
    cache = engine.cache
    cache.check_integrity()
    assert cache.num_in_use_blocks == 0
    assert cache.num_active_requests == 0
    assert cache.num_free_blocks + cache.num_cached_evictable_blocks == cache.num_blocks


def test_c08_partial_tail_never_shared(tiny_model):
    p6, p7 = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]
    engine = make_engine(tiny_model)
    r1 = engine.make_request(p6, greedy(6))
    engine.add_request(r1)
    engine.step()
    engine.step()  # r1 is decoding: its tail block holds [5, 6, g1, ...]
    assert r1.status is RequestStatus.RUNNING and r1.num_output_tokens == 2
    r1_table = list(engine.cache.block_table(r1.request_id))
    r1_tail_k = engine.runner.k_pools[0][r1_table[1]].clone()
    r2, r3 = engine.make_request(p6, greedy(6)), engine.make_request(p7, greedy(6))
    engine.add_request(r2)
    engine.add_request(r3)
    engine.step()  # r2 and r3 prefilled next to r1's decode
    t2, t3 = engine.cache.block_table(r2.request_id), engine.cache.block_table(r3.request_id)
    assert t2[0] == t3[0] == r1_table[0]  # block 0 is shared
    assert len({t2[1], t3[1], r1_table[1]}) == 3  # each owns its tail
    # r1's tail slots 0-1 (tokens 5, 6) are untouched by the other requests' prefill.
    assert engine.runner.k_pools[0][r1_table[1]][:2].equal(r1_tail_k[:2])
    drain(engine)
    assert (r2.num_cached_tokens, r3.num_cached_tokens) == (4, 4)
    assert r1.output_token_ids == r2.output_token_ids == cold_output(tiny_model, p6, greedy(6))
    assert r3.output_token_ids == cold_output(tiny_model, p7, greedy(6))
    # Every tree block is full: 12 = r1's 6 prompt + 5 fed-back tokens -> 2 full blocks, and
    # r3's 7 + 5 -> 3 blocks, sharing block 0: the tree holds 1 + 1 + 2 blocks.
    assert engine.cache.num_cached_blocks == 4
    # r2 and r3 own their tails: block 1 of each is private, never r1's.
    assert_idle_and_clean(engine)


def test_c09_admission_waits_and_never_evicts_running_blocks(tiny_model):
    engine = make_engine(tiny_model, num_blocks=4)
    r1 = engine.make_request([10 + i for i in range(8)], greedy(4))
    engine.add_request(r1)
    engine.step()  # r1 prefilled: 2 published blocks (locked)
    engine.step()  # first decode step: + 1 private block for the fed-back token
    assert len(engine.cache.block_table(r1.request_id)) == 3
    r2 = engine.make_request([200 + i for i in range(12)], greedy(1))
    engine.add_request(r2)
    held = list(engine.cache.block_table(r1.request_id))
    while r1.status is RequestStatus.RUNNING:
        engine.step()
        engine.cache.check_integrity()
        if r1.status is RequestStatus.RUNNING:
            assert r2.status is RequestStatus.WAITING
            assert engine.cache.block_table(r1.request_id)[:3] == held[:3]
    drain(engine)
    assert r1.output_token_ids == cold_output(tiny_model, r1.prompt_token_ids, greedy(4))
    assert r2.status is RequestStatus.FINISHED and r2.num_cached_tokens == 0
    # r1 published 2 blocks (8 prompt + 3 fed-back tokens); r2 needs 3 of the 4: 2 free + 1
    # evicted (r1's tail-most cached block).
    assert engine.cache.evicted_blocks_total == 1
    assert_idle_and_clean(engine)


def test_c10_aborts_in_every_phase_leak_nothing(tiny_model):
    engine = make_engine(tiny_model, num_blocks=32, max_num_seqs=2, prefill_chunk_tokens=4)
    prefix = [900 + i for i in range(8)]
    snapshots = []
    for rep in range(100):
        tails = [[1000 + 50 * rep + 8 * k + j for j in range(8)] for k in range(5)]
        queued, prefilling, decoding, d, e = (engine.make_request(prefix + t, greedy(n))
                                              for t, n in zip(tails, (20, 20, 20, 3, 3)))
        engine.add_request(decoding)
        while decoding.num_output_tokens == 0:
            engine.step()
        engine.add_request(prefilling)
        engine.step()
        assert prefilling.status is RequestStatus.RUNNING
        assert prefilling.num_computed_tokens < prefilling.num_prompt_tokens
        engine.add_request(queued)
        engine.step()
        assert queued.status is RequestStatus.WAITING  # max_num_seqs = 2
        for req in (queued, prefilling, decoding):
            (out,) = engine.abort_request(req.request_id)
            assert out.finished and out.finish_reason == "abort"
            assert req.status is RequestStatus.ABORTED
        assert engine.cache.num_active_requests == 0
        engine.add_request(d)
        engine.add_request(e)
        drain(engine)
        assert d.status is e.status is RequestStatus.FINISHED
        with pytest.raises(ValueError, match="pool holds only 32 blocks"):
            engine.make_request(prefix + list(range(140)), greedy(1))
        assert_idle_and_clean(engine)
        if rep in (0, 99):
            pool = engine.stats_snapshot()["pool"]
            snapshots.append((pool["in_use_blocks"], engine.cache.num_active_requests,
                              pool["free_blocks"] + pool["cached_evictable_blocks"]))
    assert snapshots == [(0, 0, 32), (0, 0, 32)]
    assert engine.stats_snapshot()["requests_aborted_total"] == 300


def test_c11_only_fully_written_blocks_are_published(tiny_model):
    prompt = [40 + 3 * i for i in range(12)]
    cold = cold_output(tiny_model, prompt, greedy(5))
    engine = make_engine(tiny_model, prefill_chunk_tokens=4)
    r1 = engine.make_request(prompt, greedy(5))
    engine.add_request(r1)
    engine.step()  # first chunk: tokens 0..3 computed -> block 0 published
    assert r1.num_computed_tokens == 4 and engine.cache.num_cached_blocks == 1
    block0 = engine.cache.block_table(r1.request_id)[0]
    k_block0 = engine.runner.k_pools[0][block0].clone()
    engine.abort_request(r1.request_id)
    assert engine.cache.num_cached_blocks == 1
    (r2,) = engine.generate([prompt], greedy(5))
    assert r2.num_cached_tokens == 4 and r2.output_token_ids == cold
    assert engine.runner.k_pools[0][block0].equal(k_block0)  # a published block never changes

    r3 = engine.make_request(prompt, greedy(5))
    engine.add_request(r3)
    while r3.num_output_tokens < 2:
        engine.step()
    (r4,) = engine.generate([prompt], greedy(5))
    drain(engine)
    assert r4.num_cached_tokens == 8
    assert r3.output_token_ids == r4.output_token_ids == cold
    assert_idle_and_clean(engine)


def test_c12_chunked_prefill_is_not_a_hit_and_allocates_once(tiny_model):
    prompt = [70 + 5 * i for i in range(12)]
    engine = make_engine(tiny_model, prefill_chunk_tokens=4)
    r1 = engine.make_request(prompt, greedy(1))
    engine.add_request(r1)
    tables = []
    while engine.has_work:
        engine.step()
        if engine.cache.is_active(r1.request_id):
            tables.append(list(engine.cache.block_table(r1.request_id)))
    assert [len(t) for t in tables] == [1, 2]  # grows chunk by chunk; 3rd step finishes it
    assert r1.num_cached_tokens == 0
    stats = engine.stats_snapshot()
    assert stats["cached_prompt_tokens_total"] == 0 and stats["requests_with_hit_total"] == 0
    assert engine.cache.num_cached_blocks == 3 and engine.cache.pool.num_blocks - engine.cache.num_free_blocks == 3
    (r2,) = engine.generate([prompt + [99]], greedy(1))
    assert r2.num_cached_tokens == 12


def test_c13_sliding_window_model_caches_prefixes(tmp_path):
    # Every block of every layer stays resident (keep-all), so a hit on a window model reads
    # only K/V it has; exactness across the window edge: tests/engine/test_engine_window.py.
    model = load_model(str(make_tiny_model_dir(tmp_path / "swa", sliding_window=8)))
    assert model.shape.sliding_window == 8
    engine = make_engine(model)
    stats = engine.stats_snapshot()
    assert stats["prefix_caching"] is True
    assert stats["hit_granularity"] == {
        "block_size_tokens": 4, "window_kv": "keep-all",
        "layer_groups": [{"attention": "sliding", "window_tokens": 8, "num_layers": 2}]}
    p = [300 + i for i in range(16)]
    r2_prompt = p[:14] + [5, 6, 7]
    engine.generate([p], greedy(4))
    (r2,) = engine.generate([r2_prompt], greedy(4))
    assert r2.num_cached_tokens == 12
    assert r2.output_token_ids == cold_output(model, r2_prompt, greedy(4))


def test_chunked_prefill_and_small_budget_keep_greedy_outputs(tiny_model):
    prompts = [[(i * 37 + j * 11) % 5000 + 3 for j in range(9 + 5 * i)] for i in range(8)]
    alone = [cold_output(tiny_model, p, greedy(6)) for p in prompts]
    engine = make_engine(tiny_model, max_num_batched_tokens=16, prefill_chunk_tokens=5)
    reqs = engine.generate(prompts, greedy(6))
    assert [r.output_token_ids for r in reqs] == alone
    assert_idle_and_clean(engine)


def test_lifecycle_stress_random_aborts_eviction_and_preemption(tiny_model):
    rng = random.Random(7)
    engine = make_engine(tiny_model, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=24,
                         prefill_chunk_tokens=8)
    bases = [[rng.randrange(3, 4000) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    reqs = []
    for _ in range(200):
        prompt = rng.choice(bases)[: rng.randrange(1, 20)] + [rng.randrange(3, 4000)
                                                              for _ in range(rng.randrange(1, 30))]
        reqs.append(engine.make_request(prompt, greedy(rng.randrange(1, 12))))
    phases: dict[str, int] = {}
    pending = list(reqs)
    for _ in range(20_000):
        while pending and rng.random() < 0.5:
            engine.add_request(pending.pop(0))
        live = [r for r in reqs if r.status not in (RequestStatus.FINISHED, RequestStatus.ABORTED)
                and r not in pending]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            if victim.status is RequestStatus.RUNNING:
                phase = "prefill" if victim.num_output_tokens == 0 else "decode"
            else:
                phase = victim.status.value
            engine.abort_request(victim.request_id)
            phases[phase] = phases.get(phase, 0) + 1
        if not engine.has_work and not pending:
            break
        engine.step()
        engine.cache.check_integrity()
    assert all(r.is_finished for r in reqs)
    assert set(phases) >= {"waiting", "prefill", "decode"}
    stats = engine.stats_snapshot()
    assert stats["preemptions_total"] > 0 and stats["evicted_blocks_total"] > 0
    assert stats["requests_aborted_total"] == sum(phases.values())
    assert_idle_and_clean(engine)


def test_c15_parallel_sampling_forks_the_prompt(tiny_model):
    prompt = [1, 2, 3, 4, 5, 6]
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=11, n=3)
    engine = make_engine(tiny_model)
    parent = engine.make_request(prompt, params)
    engine.add_request(parent)
    engine.step()  # prompt prefilled once, then forked into 3 choices
    group = engine._groups[parent.request_id]
    assert [r.index for r in group] == [0, 1, 2]
    tables = [engine.cache.block_table(r.request_id) for r in group]
    assert len({t[0] for t in tables}) == 1  # block 0 computed once, held by all three
    assert len({t[1] for t in tables}) == 3  # each choice owns its (copied) tail
    assert engine.stats_snapshot()["prompt_tokens_total"] == 6  # the prompt counted once
    drain(engine)
    assert all(r.status is RequestStatus.FINISHED for r in group)
    assert [r.num_cached_tokens for r in group] == [0, 0, 0]
    stats = engine.stats_snapshot()
    assert (stats["requests_total"], stats["prompt_tokens_total"]) == (1, 6)
    assert stats["generated_tokens_total"] == 18
    for r in group:
        single = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=11 + r.index)
        (alone,) = make_engine(tiny_model).generate([prompt], single)
        assert r.output_token_ids == alone.output_token_ids
    assert len({tuple(r.output_token_ids) for r in group}) > 1  # the seeds differ
    assert_idle_and_clean(engine)


def test_parallel_sampling_abort_ends_every_choice(tiny_model):
    engine = make_engine(tiny_model)
    parent = engine.make_request([9, 8, 7, 6, 5], SamplingParams(max_tokens=20, temperature=1.0, n=4))
    engine.add_request(parent)
    engine.step()
    engine.step()
    outs = engine.abort_request(parent.request_id)
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" and o.request_id == parent.request_id for o in outs)
    assert not engine.has_work
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("policy,max_bypass,expected_order", [
    ("lpm", 8, ["long", "medium", "cold"]),   # longest cached prefix first
    ("lpm", 1, ["long", "cold", "medium"]),   # "cold" was overtaken once: it goes next
    ("fcfs", 8, ["cold", "long", "medium"]),  # arrival order
])
def test_prefix_aware_admission_with_bounded_wait(tiny_model, policy, max_bypass, expected_order):
    engine = make_engine(tiny_model, max_num_seqs=1, admission_policy=policy, max_bypass=max_bypass)
    shared = [600 + i for i in range(16)]
    engine.generate([shared + [1]], greedy(1))  # warm 16 tokens
    prompts = {"cold": [700 + i for i in range(17)], "long": shared + [2, 3],
               "medium": shared[:8] + [4, 5, 6]}
    reqs = {name: engine.make_request(p, greedy(2)) for name, p in prompts.items()}
    for name in ("cold", "long", "medium"):  # arrival order
        engine.add_request(reqs[name])
    order = []
    while engine.has_work:
        engine.step()
        for name, req in reqs.items():
            if req.status is not RequestStatus.WAITING and name not in order:
                order.append(name)
    assert order == expected_order
    assert (reqs["long"].num_cached_tokens, reqs["medium"].num_cached_tokens) == (16, 8)

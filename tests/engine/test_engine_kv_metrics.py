"""The engine's KV metrics in ``/stats`` (``pool``, ``fork``, ``kv_activity``,
``missed_reuse_flops_total``) on hand-worked runs: exact tail waste, fork counts, KV tokens
read and written, lookups, recomputation after preemption, cancel → release samples."""

from __future__ import annotations

import math
import random

from radixkv.cache.retention import RetentionBreakpoint
from radixkv.engine.request import RequestStatus
from radixkv.engine.sampling import SamplingParams
from radixkv.eviction.cost_model import prefill_flops
from radixkv.model.loader import load_model
from tests.conftest import make_tiny_model_dir
from tests.factories import make_engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_tail_waste_of_17_token_prompts_at_block_16(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_blocks=64)
    reqs = [engine.make_request([100 * k + t for t in range(1, 18)], greedy(4)) for k in range(3)]
    for req in reqs:
        engine.add_request(req)
    engine.step()  # prefill: 17 slots of 2 blocks each, 15 empty in each second block
    pool = engine.stats_snapshot()["pool"]
    assert pool["live_tail_waste_tokens"] == 3 * 15
    assert pool["used_token_slots"] == 3 * 17 and pool["total_token_slots"] == 64 * 16
    assert pool["live_blocks"] == 6 and pool["allocated_blocks_total"] == 6
    engine.step()  # one decode token each: 18 slots
    assert engine.stats_snapshot()["pool"]["live_tail_waste_tokens"] == 3 * 14
    while engine.has_work:
        engine.step()
    pool = engine.stats_snapshot()["pool"]
    # Finished: the full first blocks stay cached (20 tokens: 1 full block each), tails freed.
    assert (pool["live_tail_waste_tokens"], pool["live_blocks"]) == (0, 0)
    assert pool["used_token_slots"] == 3 * 16 == pool["cached_evictable_blocks"] * 16
    assert pool["allocated_blocks_total"] - pool["freed_blocks_total"] == 3


def test_fork_counters_of_parallel_sampling(tiny_model):
    # The parallel-sampling test's request: a 6-token prompt at B = 4, n = 3: block 0 shared
    # by the three choices, the 2-token tail block copied for each of the two children.
    engine = make_engine(tiny_model)
    (*_,) = engine.generate([[1, 2, 3, 4, 5, 6]],
                            SamplingParams(max_tokens=6, temperature=0.8, seed=11, n=3))
    fork = engine.stats_snapshot()["fork"]
    assert fork == {"forks_total": 2, "shared_blocks_total": 2, "copied_blocks_total": 2,
                    "copied_bytes_total": 2 * engine.runner.bytes_per_block}


def test_kv_tokens_read_and_written_steps_and_lookups(tiny_model):
    engine = make_engine(tiny_model)
    engine.generate([[5, 6, 7, 8, 9]], greedy(4))
    act = engine.stats_snapshot()["kv_activity"]
    # Step 1 prefills 5 tokens; steps 2-4 decode at positions 5, 6, 7 (contexts 6, 7, 8).
    assert (act["steps_total"], act["prefill_kv_written_tokens_total"],
            act["decode_kv_read_tokens_total"]) == (4, 5, 6 + 7 + 8)
    per_token = engine.runner.kv_bytes_per_token
    assert act["decode_kv_read_bytes_total"] == 21 * per_token
    assert act["prefill_kv_written_bytes_total"] == 5 * per_token
    assert act["lookups_total"] == 1
    hist = engine.stats.activity.histograms()
    assert hist["schedule"][0][-1][1] == hist["block_table"][0][-1][1] == 4
    assert hist["lookup"][0][-1][1] == 1


def test_attention_time_by_phase_and_longest_context(tmp_path, monkeypatch):
    # head_dim 32: decode steps take the fused C decode layer where it builds, which times its
    # attention part inside the call.
    engine = make_engine(load_model(str(make_tiny_model_dir(tmp_path / "d32", head_dim=32))),
                         block_size=16, num_blocks=256)
    model = engine.runner.forward_model
    fused: list[float] = []
    if engine.runner._native_decode is not None:
        take = model.native.take_attention_seconds
        monkeypatch.setattr(model.native, "take_attention_seconds",
                            lambda: fused.append(take()) or fused[-1])
    # A 1,100-token prompt: its prefill step and first decode steps (contexts 1,101..1,103)
    # land in the <= 4096 bucket; a 5-token prompt's steps in the <= 1024 one.
    engine.generate([[5 + (i % 300) for i in range(1100)]], greedy(3))
    engine.generate([[5, 6, 7, 8, 9]], greedy(2))
    act = engine.stats_snapshot()["kv_activity"]
    counts = {key: hist[0][-1][1] for key, hist in engine.stats.activity.attention_histograms().items()}
    assert {key: n for key, n in counts.items() if n} == {
        ("prefill", "4096"): 1, ("decode", "4096"): 2, ("prefill", "1024"): 1, ("decode", "1024"): 1}
    assert act["attention_by_context"]["decode"]["4096"]["steps"] == 2
    assert all(entry["ms_mean"] > 0 for phase in act["attention_by_context"].values()
               for entry in phase.values())
    assert sum(counts.values()) == act["steps_total"] == 5
    if engine.runner._native_decode is not None:  # reset before, read after each decode step
        assert len(fused) == 6 and all(s > 0 for s in fused[1::2])


def test_context_buckets_and_step_phase():
    from types import SimpleNamespace

    from radixkv.engine.kv_activity import chunk_attention_context, context_label
    assert [context_label(n) for n in (1, 1024, 1025, 4096, 16384, 65536, 65537)] == [
        "1024", "1024", "4096", "4096", "16384", "65536", "+Inf"]
    request = SimpleNamespace(num_prompt_tokens=10)
    decode = SimpleNamespace(start=12, num_tokens=1, request=request)
    suffix = SimpleNamespace(start=4, num_tokens=6, request=request)
    last_prompt_token = SimpleNamespace(start=9, num_tokens=1, request=request)
    assert chunk_attention_context([decode]) == ("decode", 13)
    assert chunk_attention_context([decode, suffix]) == ("prefill", 13)
    assert chunk_attention_context([last_prompt_token]) == ("prefill", 10)


def test_recomputed_tokens_after_preemption(tiny_model):
    # The preemption test's load: 12 requests growing to ~30 tokens in 24 blocks of 4.
    prompts = [[(i * 31 + j * 17) % 6000 + 1 for j in range(10 + 3 * i)] for i in range(8)]
    prompts += [[500 + j for j in range(12)] + [7 + i] * (i + 1) for i in range(4)]
    engine = make_engine(tiny_model, num_blocks=24)
    reqs = engine.generate(prompts, greedy(12))
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    stats = engine.stats_snapshot()
    act = stats["kv_activity"]
    assert stats["preemptions_total"] > 0 and act["recomputed_tokens_total"] > 0
    # Every preempted request resumed and ran past what it had computed: what it computes
    # again is what it had, less what its resume found cached.
    assert act["recomputed_tokens_total"] == (act["preempted_kv_tokens_total"]
                                              - stats["resumed_cached_tokens_total"])
    assert engine.scheduler._recompute_until == {}


def test_every_abort_feeds_the_cancel_release_histogram(tiny_model):
    rng = random.Random(7)
    engine = make_engine(tiny_model, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=24,
                         prefill_chunk_tokens=8)
    reqs = [engine.make_request([rng.randrange(3, 4000) for _ in range(rng.randrange(2, 30))],
                                greedy(rng.randrange(2, 12))) for _ in range(16)]
    for req in reqs:
        engine.add_request(req)
    aborted = 0
    for _ in range(2000):
        if not engine.has_work:
            break
        live = [r for r in reqs if not r.is_finished]
        if live and rng.random() < 0.2:
            aborted += bool(engine.abort_request(rng.choice(live).request_id))
        engine.step()
    assert aborted > 0
    act = engine.stats_snapshot()["kv_activity"]
    assert act["cancels_total"] == aborted == engine.stats_snapshot()["requests_aborted_total"]
    assert engine.abort_request("no-such-request") == []  # nothing live: no sample
    assert engine.stats_snapshot()["kv_activity"]["cancels_total"] == aborted
    assert act["cancel_release_ms_p99"] is not None
    # Every step that ran a forward is timed, and no cancel waits longer than the steps did
    # (aborts are taken between steps here, so a release takes far less than one step).
    hist = engine.stats.activity.histograms()["step"][0]
    assert hist[-1] == (math.inf, act["steps_total"]) and act["steps_total"] > 0
    assert 0 < act["step_ms_p50"] <= act["step_ms_p99"] <= act["step_ms_max"]
    assert act["cancel_release_ms_p99"] <= act["step_ms_max"]


def test_missed_reuse_flops_of_an_evicted_prefix(tiny_model):
    engine = make_engine(tiny_model, num_blocks=64)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks of 4 below the hit cap
    engine.generate([prompt], greedy(1))
    assert engine.stats_snapshot()["missed_reuse_flops_total"] == 0.0
    assert engine.reset_prefix_cache() == 5
    engine.generate([prompt], greedy(1))
    stats = engine.stats_snapshot()
    assert stats["miss_tokens"]["evicted"] == 20
    assert stats["missed_reuse_flops_total"] == prefill_flops(engine.stats.cost_shape, 0, 20)


def test_live_blocks_leave_out_blocks_only_a_retention_pins(tiny_model):
    engine = make_engine(tiny_model, num_blocks=64)
    prompt = list(range(40, 61))  # 21 tokens at B = 4: 5 full blocks
    engine.generate([prompt], greedy(1), retention=[RetentionBreakpoint(16, "1h")])
    pool = engine.stats_snapshot()["pool"]
    # 4 blocks pinned by the retention, no request running: in use, but not live.
    assert (pool["retained_blocks"], pool["in_use_blocks"], pool["live_blocks"]) == (4, 4, 0)
    req = engine.make_request(prompt[:12] + [7, 7, 7], greedy(3))
    engine.add_request(req)
    engine.step()  # holds 3 of the retained blocks (its hit) and its own tail block
    pool = engine.stats_snapshot()["pool"]
    assert req.num_cached_tokens == 12
    assert (pool["in_use_blocks"], pool["live_blocks"]) == (5, 4)

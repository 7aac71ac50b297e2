"""Engine-level prefix-cache behaviour with token ids on the tiny random-init model.

The hit cap at exact block multiples, hit-rate and saved-token definitions (output tokens
cached too), exact cached-token counts, and greedy outputs that do not depend on the cache, on batching or on preemption.
"""

from __future__ import annotations

import pytest

from radixkv.config import CacheConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.request import RequestStatus
from radixkv.engine.sampling import SamplingParams
from radixkv.model.loader import load_model
from tests.factories import make_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def run_one(engine: LLMEngine, prompt, params=GREEDY):
    (req,) = engine.generate([prompt], params)
    engine.cache.check_integrity()
    return req


@pytest.mark.parametrize("length,expected_cached",
                         [(1, 0), (4, 0), (8, 4), (12, 8), (13, 12), (16, 12), (17, 16)])
def test_c07_full_hit_and_exact_block_multiples(tiny, length, expected_cached):
    prompt = [100 + 7 * i for i in range(length)]
    cold = run_one(make_engine(tiny, prefix_cache=False), prompt)
    engine = make_engine(tiny)
    first = run_one(engine, prompt)
    second = run_one(engine, prompt)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == expected_cached
    assert second.output_token_ids == first.output_token_ids == cold.output_token_ids
    assert len(second.output_token_ids) == GREEDY.max_tokens


def test_c16_per_token_hit_rate_and_generated_tokens_cached(tiny):
    engine = make_engine(tiny)
    r1_prompt = [(37 * i) % 4000 + 5 for i in range(100)]
    run_one(engine, r1_prompt)
    r2 = run_one(engine, r1_prompt[:10])
    assert (r2.num_prompt_tokens, r2.num_cached_tokens) == (10, 8)
    stats = engine.stats_snapshot()
    assert stats["prompt_tokens_total"] == 110
    assert stats["cached_prompt_tokens_total"] == 8
    assert stats["computed_prompt_tokens_total"] == 102
    assert stats["token_hit_rate"] == pytest.approx(8 / 110)
    assert stats["requests_total"] == 2 and stats["requests_with_hit_total"] == 1
    assert stats["request_hit_rate"] == pytest.approx(0.5)

    engine = make_engine(tiny)
    t1_prompt = [(53 * i) % 4000 + 9 for i in range(100)]
    t1 = run_one(engine, t1_prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert len(t1.output_token_ids) == 50
    t2_prompt = t1.token_ids + [(11 * i) % 3000 + 3 for i in range(50)]
    assert len(t2_prompt) == 200
    t2 = run_one(engine, t2_prompt)
    # T1 computed K/V for its 100 prompt tokens and 49 generated ones (the 50th was sampled,
    # never fed back): 149 tokens -> 37 full blocks of 4.
    assert t2.num_cached_tokens == 148
    stats = engine.stats_snapshot()
    assert stats["pool"]["in_use_blocks"] == 0
    assert stats["pool"]["cached_evictable_blocks"] > 0
    assert stats["tree"]["cached_blocks"] == stats["pool"]["cached_evictable_blocks"]
    assert stats["generated_tokens_total"] == 50 + GREEDY.max_tokens


def test_shared_system_prefix_hits_the_cap(tiny):
    engine = make_engine(tiny, block_size=16)
    system = [(13 * i) % 5000 + 20 for i in range(300)]
    a = run_one(engine, system + [1, 2, 3, 4, 5])
    b = run_one(engine, system + [9, 8, 7])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == (300 // 16) * 16 == 288
    assert engine.stats_snapshot()["cached_prompt_tokens_total"] == 288


def test_cache_salt_isolates(tiny):
    engine = make_engine(tiny)
    prompt = list(range(50, 62))
    engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    (other,) = engine.generate([prompt], GREEDY, cache_salt="tenant-b")
    (same,) = engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    (none,) = engine.generate([prompt], GREEDY)
    assert (other.num_cached_tokens, same.num_cached_tokens, none.num_cached_tokens) == (0, 8, 0)


def test_batch_preemption_and_cache_do_not_change_greedy_outputs(tiny):
    prompts = [[(i * 31 + j * 17) % 6000 + 1 for j in range(10 + 3 * i)] for i in range(8)]
    shared = [500 + j for j in range(12)]
    prompts += [shared + [7 + i] * (i + 1) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [run_one(make_engine(tiny, prefix_cache=False), p, params).output_token_ids
             for p in prompts]

    batched = make_engine(tiny)
    reqs = batched.generate(prompts, params)
    assert [r.output_token_ids for r in reqs] == alone

    # A pool of 24 blocks of 4 cannot hold 12 running requests growing to ~30 tokens each:
    # decode steps must preempt and later resume by recompute.
    tight = make_engine(tiny, num_blocks=24)
    reqs = tight.generate(prompts, params)
    assert tight.stats.preemptions_total > 0
    assert [r.output_token_ids for r in reqs] == alone
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    tight.cache.check_integrity()
    assert tight.cache.num_in_use_blocks == 0


def test_abort_releases_blocks_in_every_phase(tiny):
    engine = make_engine(tiny, num_blocks=32, max_num_seqs=2)
    prefix = [900 + i for i in range(8)]
    reqs = [engine.make_request(prefix + [10 * k + j for j in range(8)], GREEDY) for k in range(4)]
    for r in reqs:
        engine.add_request(r)
    # req 0 prefills; 1-3 wait for its prefill of their shared prefix (then for max_num_seqs=2)
    engine.step()
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] + [RequestStatus.WAITING] * 3
    (out_waiting,) = engine.abort_request(reqs[3].request_id)
    (out_running,) = engine.abort_request(reqs[0].request_id)
    assert out_waiting.finished and out_waiting.finish_reason == "abort"
    assert out_running.finished and out_running.finish_reason == "abort"
    assert engine.abort_request(reqs[0].request_id) == []
    while engine.has_work:  # the waiters are not held by the aborted prefill
        engine.step()
    assert [r.status for r in reqs[1:3]] == [RequestStatus.FINISHED] * 2
    engine.cache.check_integrity()
    assert engine.cache.num_in_use_blocks == 0
    assert engine.cache.num_free_blocks + engine.cache.num_cached_evictable_blocks == 32


def test_request_validation_names_the_limit(tiny):
    engine = make_engine(tiny, num_blocks=8)
    ctx = engine.max_model_len
    with pytest.raises(ValueError, match=f"maximum context length is {ctx}"):
        engine.make_request([1] * ctx, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="pool holds only 8 blocks"):
        engine.make_request([1] * 40, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt"):
        engine.make_request([], SamplingParams())
    assert engine.cache.num_in_use_blocks == 0


def test_stop_string_and_eos(tiny):
    engine = make_engine(tiny)
    prompt = [300 + i for i in range(9)]
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    text = free.detokenizer.text
    assert len(text) >= 4
    stop = text[2:4]
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                          ignore_eos=True, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.detokenizer.text == text[:text.find(stop)]


def test_c06_model_revision_is_part_of_the_cache_identity(tiny, tmp_path):
    from radixkv.cache.hashing import CacheIdentity
    from radixkv.cache.manager import CacheManager
    from tests.conftest import make_tiny_model_dir

    other = load_model(str(make_tiny_model_dir(tmp_path / "r2", seed=99)))
    assert other.revision != tiny.revision  # the revision is the weights' digest
    cache = CacheManager(64, 4)
    roots = [cache.identity_root(CacheIdentity(model_revision=m.revision, block_size=4,
                                               kv_dtype="float32", rope=m.shape.rope_description()))
             for m in (tiny, other)]
    prompt = list(range(10, 18))
    assert cache.begin("r1", roots[0], prompt) == 0
    assert cache.allocate("r1", 8)
    cache.record_admission("r1")
    cache.publish("r1", prompt, 8)
    cache.release("r1")
    assert cache.begin("r2", roots[1], prompt) == 0  # r1's blocks are never served to r2
    cache.record_admission("r2")
    assert cache.miss_breakdown("r2")["isolated"] == 4  # the same tokens under another identity
    cache.release("r2")
    assert cache.begin("r1-again", roots[0], prompt) == 4  # positive control
    cache.release("r1-again")
    cache.check_integrity()

    # Engine level: the revision reaches the identity root the engine matches under.
    engines = [make_engine(m) for m in (tiny, other)]
    assert engines[0].cache_root(None) != engines[1].cache_root(None)


def test_identity_memos_stay_bounded_and_in_step(tiny, monkeypatch):
    """Client-chosen salts must not grow the one identity memo (the cache's: the engine keeps
    none); an identity in use stays in it."""
    from radixkv.cache import manager as cache_manager
    monkeypatch.setattr(cache_manager, "IDENTITY_MEMO_SIZE", 3)
    engine = make_engine(tiny)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks, 4 cacheable below the cap

    def cached(tokens, salt):
        (req,) = engine.generate([tokens], GREEDY, cache_salt=salt)
        engine.cache.check_integrity()
        return req.num_cached_tokens

    assert cached(prompt, "keep") == 0
    keep_root = engine.cache_root("keep")
    for i in range(10):
        engine.cache_root("keep")  # in use between one-off salts
        cached([7, 8, 9, 10, 11], f"once-{i}")
    memo = engine.cache.identities
    assert (memo.capacity, len(memo)) == (3, 3)
    # Whatever its name, no engine attribute keeps the one-off salts (only the cache's memo).
    kept = [name for name, value in vars(engine).items()
            if isinstance(value, (dict, set, list)) and "once-0" in repr(value)]
    assert kept == []
    assert memo.tenant(keep_root) == "keep"  # still memoised
    assert memo.tenant(engine.cache_root("once-0")) == "once-0"  # back in, pushing one out
    assert len(memo) == 3
    assert cached(prompt, "keep") == 20
    # One-off salts' blocks stay cached (evictable) under their roots; nothing else is kept.
    assert len(engine.cache.tree.roots) == 11


def test_cache_config_refuses_a_non_bool_prefix_caching_flag():
    for bad in (0, 1, None, "no"):
        with pytest.raises(ValueError, match="enable_prefix_caching: must be a bool"):
            CacheConfig(enable_prefix_caching=bad)

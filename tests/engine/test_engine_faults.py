"""Fault isolation in the engine: a fault of one request's own ends that request
with ``finish_reason == "error"``, frees its blocks and is counted; a failed batched forward
ends that step's requests and the engine goes on while the cache's integrity holds; a device
error or a failed integrity check stops it. Also the 64-bit seed range and the requests /
sequences counters of aborts.

Faults are injected by monkeypatching our own functions (test hooks), on the tiny model.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from radixkv.engine import sampling
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.faults import is_fatal
from radixkv.engine.llm_engine import LLMEngine, RequestOutput
from radixkv.engine.request import Request, RequestStatus
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.stats import EngineStats
from tests.engine.test_engine_lifecycle import assert_idle_and_clean
from tests.factories import make_engine

TOP_SEED = 2**64 - 1
PROMPT_A = [11, 12, 13, 14, 15]
PROMPT_B = [21, 22, 23, 24, 25, 26]


def sampled(max_tokens: int = 6, *, seed: int = 7, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n,
                          ignore_eos=True, **kw)


def run(engine: LLMEngine, reqs: list[Request], max_steps: int = 1000
        ) -> dict[str, list[RequestOutput]]:
    """Add ``reqs``, step until idle; every output by request id, in order."""
    for req in reqs:
        engine.add_request(req)
    outs: dict[str, list[RequestOutput]] = {req.request_id: [] for req in reqs}
    for _ in range(max_steps):
        if not engine.has_work:
            return outs
        for out in engine.step():
            outs[out.request_id].append(out)
    raise AssertionError("engine did not drain")


def reference(model, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each choice's tokens from a fresh engine without any fault."""
    return [r.output_token_ids for r in make_engine(model, prefix_cache=False).generate([prompt], params)]


def counters(engine: LLMEngine) -> tuple[int, ...]:
    s = engine.stats_snapshot()
    return (s["requests_total"], s["sequences_total"], s["requests_failed_total"],
            s["sequences_failed_total"], s["requests_aborted_total"], s["sequences_aborted_total"])


def test_seed_at_the_top_of_the_64_bit_range_wraps_for_later_choices(tiny_model):
    engine = make_engine(tiny_model)
    top, wrapped = engine.generate([PROMPT_A], sampled(4, seed=TOP_SEED, n=2))
    assert (top.finish_reason, wrapped.finish_reason) == ("length", "length")
    assert [top.output_token_ids, wrapped.output_token_ids] == [
        reference(tiny_model, PROMPT_A, sampled(4, seed=TOP_SEED))[0],
        reference(tiny_model, PROMPT_A, sampled(4, seed=0))[0]]
    # A negative seed is its two's complement: -1 is 2**64 - 1.
    assert reference(tiny_model, PROMPT_A, sampled(4, seed=-1))[0] == top.output_token_ids
    assert sampling.choice_seed(TOP_SEED, 3) == 2 and sampling.choice_seed(-5, 1) == 2**64 - 4
    assert_idle_and_clean(engine)


def test_a_sampling_fault_ends_only_its_request(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    bad = engine.make_request(PROMPT_A, sampled(seed=1))
    good = engine.make_request(PROMPT_B, sampled(seed=2))
    real = sampling.sample_token
    calls = []

    def faulty(logits, params, generator):
        if generator is bad.generator:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected sampling fault")
        return real(logits, params, generator)

    monkeypatch.setattr(sampling, "sample_token", faulty)
    outs = run(engine, [bad, good])
    assert [(o.finish_reason, len(o.new_token_ids)) for o in outs[bad.request_id]] == [
        (None, 1), (None, 1), ("error", 0)]
    assert bad.status is RequestStatus.ABORTED and bad.num_output_tokens == 2
    assert [good.output_token_ids] == reference(tiny_model, PROMPT_B, sampled(seed=2))
    assert outs[good.request_id][-1].finish_reason == "length"
    assert counters(engine) == (2, 2, 1, 1, 0, 0)
    assert_idle_and_clean(engine)
    (later,) = engine.generate([[31, 32, 33]], sampled(3))
    assert later.finish_reason == "length" and counters(engine)[:3] == (3, 3, 1)


def test_a_detokenizer_fault_in_one_choice_ends_every_choice_of_its_request(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    bad = engine.make_request(PROMPT_A, sampled(8, seed=3, n=3, stop=("<<FAULT>>",)))
    good = engine.make_request(PROMPT_B, sampled(8, seed=5, n=2))
    real_add = IncrementalDetokenizer.add

    def faulty(self, output_ids, *, final=False):
        if "<<FAULT>>" in self._stop and len(output_ids) == 3:
            raise ValueError("injected detokenizer fault")
        return real_add(self, output_ids, final=final)

    monkeypatch.setattr(IncrementalDetokenizer, "add", faulty)
    outs = run(engine, [bad, good])
    bad_outs = outs[bad.request_id]
    # Two steps of three choices, then the parent's third token faults: all three end.
    assert [o.finish_reason for o in bad_outs] == [None] * 6 + ["error"] * 3
    assert sorted(o.index for o in bad_outs[-3:]) == [0, 1, 2]
    assert all(o.finished and not o.new_token_ids for o in bad_outs[-3:])
    group = sorted((o for o in outs[good.request_id] if o.finished), key=lambda o: o.index)
    assert [o.finish_reason for o in group] == ["length", "length"]
    got = {i: [t for o in outs[good.request_id] if o.index == i for t in o.new_token_ids]
           for i in (0, 1)}
    assert [got[0], got[1]] == reference(tiny_model, PROMPT_B, sampled(8, seed=5, n=2))
    assert counters(engine) == (2, 5, 1, 3, 0, 0)
    assert_idle_and_clean(engine)


def test_a_fork_fault_frees_the_half_made_choice(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    bad = engine.make_request(PROMPT_A, sampled(4, seed=9, n=3))
    good = engine.make_request(PROMPT_B, sampled(4, seed=2))

    def broken_copy(copies):
        raise RuntimeError("injected copy-on-write fault")

    monkeypatch.setattr(engine.runner, "copy_blocks", broken_copy)
    outs = run(engine, [bad, good])
    # The parent and the one child made before the copy failed end; choice 2 never existed.
    assert [(o.index, o.finish_reason) for o in outs[bad.request_id]] == [(0, "error"), (1, "error")]
    assert [good.output_token_ids] == reference(tiny_model, PROMPT_B, sampled(4, seed=2))
    assert counters(engine) == (2, 4, 1, 3, 0, 0)
    assert_idle_and_clean(engine)


def test_a_forward_fault_ends_that_steps_requests_and_the_engine_goes_on(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    first = engine.make_request(PROMPT_A, sampled(5, seed=1))
    second = engine.make_request(PROMPT_B, sampled(5, seed=2, n=2))
    real_forward = engine.runner.forward
    steps = []

    def faulty(batch):
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("injected forward fault")
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "forward", faulty)
    outs = run(engine, [first, second])
    assert [o.finish_reason for o in outs[first.request_id]] == [None, None, "error"]
    assert sorted((o.index, o.finish_reason) for o in outs[second.request_id] if o.finished) == [
        (0, "error"), (1, "error")]
    assert counters(engine) == (2, 3, 2, 3, 0, 0)
    assert_idle_and_clean(engine)
    (later,) = engine.generate([PROMPT_A], sampled(5, seed=1))
    assert later.output_token_ids == reference(tiny_model, PROMPT_A, sampled(5, seed=1))[0]


def test_a_forward_fault_with_a_failed_integrity_check_stops_the_engine(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)

    def broken_forward(batch):
        raise RuntimeError("injected forward fault")

    def broken_check(**kwargs):
        raise AssertionError("injected integrity failure")

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    monkeypatch.setattr(engine.cache, "check_integrity", broken_check)
    engine.add_request(engine.make_request(PROMPT_A, sampled(3)))
    with pytest.raises(AssertionError, match="injected integrity failure"):
        engine.step()


@pytest.mark.parametrize("fault", [
    torch.OutOfMemoryError("injected: CUDA out of memory"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    KeyboardInterrupt(),
])
def test_a_device_fault_in_the_forward_is_fatal(tiny_model, monkeypatch, fault):
    engine = make_engine(tiny_model)

    def broken_forward(batch):
        raise fault

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    engine.add_request(engine.make_request(PROMPT_A, sampled(3)))
    with pytest.raises(type(fault)):
        engine.step()
    assert counters(engine)[2] == 0  # not counted as a request's own failure


def test_fatal_classification():
    assert is_fatal(torch.OutOfMemoryError("x")) and is_fatal(MemoryError())
    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_fatal(RuntimeError("probability tensor contains either inf, nan or element < 0"))
    assert not is_fatal(ValueError("x")) and not is_fatal(KeyError("x"))


def test_aborting_an_n3_request_counts_one_request_and_three_sequences(tiny_model):
    engine = make_engine(tiny_model)
    running = engine.make_request(PROMPT_A, sampled(20, n=3))
    engine.add_request(running)
    engine.step()
    engine.step()  # forked: three choices decoding
    assert len(engine.abort_request(running.request_id)) == 3
    assert counters(engine) == (1, 3, 0, 0, 1, 3)
    waiting = engine.make_request(PROMPT_B, sampled(20, n=3))
    engine.add_request(waiting)  # never admitted: its three choices count as aborted
    (out,) = engine.abort_request(waiting.request_id)
    assert out.finish_reason == "abort" and counters(engine) == (1, 3, 0, 0, 2, 6)
    assert_idle_and_clean(engine)


def test_request_and_sequence_counters_per_tenant_sum_into_the_totals():
    stats = EngineStats()
    stats.record_admission(10, 0, num_sequences=3, tenant="a")
    stats.record_admission(10, 4, tenant="b")
    stats.record_abort(num_sequences=3, tenant="a")
    stats.record_failure(num_sequences=2, tenant="b")
    stats.record_server_error(tenant="a")
    stats.record_server_error()
    keys = ("requests_total", "sequences_total", "requests_aborted_total",
            "sequences_aborted_total", "requests_failed_total", "sequences_failed_total",
            "server_errors_total")
    a, b = stats.tenant_snapshot("a"), stats.tenant_snapshot("b")
    assert [a[k] for k in keys] == [1, 3, 1, 3, 0, 0, 1]
    assert [b[k] for k in keys] == [1, 1, 0, 0, 1, 2, 0]
    assert [stats.counts()[k] for k in keys] == [2, 4, 1, 3, 1, 2, 2]


async def test_an_abort_in_the_same_batch_as_a_failed_admit_still_ends_the_stream(
        tiny_model, monkeypatch):
    """A request whose admit fails (a fault of its own) gets a final output in the same inbox
    batch; an abort for it right behind (a client gone, a shutdown past its drain) must not
    drop that output, or the stream's reader waits forever."""
    import radixkv.engine.llm_engine as llm_engine_mod
    from tests.factories import make_async_engine

    def refuse(*args, **kwargs):
        raise ValueError("generator refused")

    monkeypatch.setattr(llm_engine_mod, "make_generator", refuse)
    engine = make_async_engine(tiny_model)
    engine.start()
    params = SamplingParams(max_tokens=4, temperature=0.7, ignore_eos=True)
    try:
        for _ in range(5):
            engine._wake.clear()  # both land in one drain of the inbox
            stream = engine.generate([5, 6, 7, 8], params)
            engine.abort(stream.request_id)
            outputs = await asyncio.wait_for(_collect(stream), 5.0)
            assert [(o.finished, o.finish_reason) for o in outputs] == [(True, "error")]
        assert engine._streams == {}
    finally:
        await engine.shutdown()


async def _collect(stream) -> list:
    return [out async for out in stream]

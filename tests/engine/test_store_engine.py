"""The store tier under a real engine (tiny model, host backend): blocks evicted from the device
pool come back from the store with the cold outputs, identities stay apart, bad values and slow
or failing stores cost a recompute and are counted."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from radixkv.cache.store.host import HostStore
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.store.value import store_key
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import StoreError
from radixkv.model.loader import load_model
from tests.conftest import make_tiny_model_dir
from tests.factories import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(37 * i) % 400 + 5 for i in range(41)]  # B = 4: hit cap 40 tokens = 10 blocks
HOST = "host:0.01"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def cold(tiny):
    return make_engine(tiny, prefix_cache=False).generate([PROMPT], GREEDY)[0].output_token_ids


def run(engine, prompt=PROMPT, **kw):
    (req,) = engine.generate([prompt], GREEDY, **kw)
    engine.cache.check_integrity()
    return req


def warm_then_evict(engine, prompt=PROMPT, **kw):
    """Run ``prompt``, wait for its blocks to be written, drop every cached device block."""
    first = run(engine, prompt, **kw)
    assert engine.store.flush()
    engine.cache.evict(engine.num_blocks)
    assert engine.cache.num_cached_blocks == 0
    return first


def test_an_evicted_prefix_comes_back_from_the_store_with_the_cold_output(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    try:
        first = warm_then_evict(engine)
        second = run(engine)
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 40)
        assert second.num_store_tokens == 40
        assert first.output_token_ids == second.output_token_ids == cold
        stats = engine.stats_snapshot()
        assert stats["cached_prompt_tokens_by_tier"] == {"device": 0, "store": 40}
        # The second lookup's 40 missed tokens were loaded: only the two unaligned tails miss.
        assert stats["miss_tokens"]["cold"] == 40 and stats["miss_tokens"]["evicted"] == 0
        assert stats["miss_tokens"]["unaligned_tail"] == 2
        store = stats["store"]
        value_bytes = engine.store.value_bytes
        # Blocks of prompt + output: 46 tokens, 11 full blocks published (10 by the prompt).
        assert store["written_blocks_total"] == 11
        assert store["written_bytes_total"] == 11 * value_bytes
        assert (store["hit_blocks_total"], store["read_bytes_total"]) == (10, 10 * value_bytes)
        assert store["lookup_blocks_total"] == 20 and store["miss_blocks_total"] == 10
        assert store["rejected_blocks_total"] == store["errors_total"] == 0
        third = run(engine)  # now a device hit: the loaded blocks are in the tree
        assert (third.num_cached_tokens, third.num_store_tokens) == (40, 0)
        assert engine.stats_snapshot()["store"]["written_blocks_total"] == 11  # not re-written
    finally:
        engine.store.close()


def test_a_partial_device_match_is_completed_from_the_store(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    try:
        run(engine)
        assert engine.store.flush()
        # 11 blocks cached (10 prompt + 1 generated); trim the tail 6: 5 prompt blocks stay.
        assert engine.cache.evict(6) == 6
        again = run(engine)
        assert (again.num_cached_tokens, again.num_store_tokens) == (40, 20)
        assert again.output_token_ids == cold
        assert engine.stats_snapshot()["cached_prompt_tokens_by_tier"] == {"device": 20,
                                                                            "store": 20}
    finally:
        engine.store.close()


def test_identities_stay_apart_through_the_store(tiny, tmp_path):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    other_model = load_model(str(make_tiny_model_dir(tmp_path / "other", seed=7)))
    other = make_engine(other_model, num_blocks=24)
    try:
        warm_then_evict(engine, cache_salt="tenant-a")
        assert run(engine, cache_salt="tenant-b").num_cached_tokens == 0
        assert run(engine).num_cached_tokens == 0  # no salt: another identity too
        engine.cache.evict(engine.num_blocks)
        control = run(engine, cache_salt="tenant-a")
        assert (control.num_cached_tokens, control.num_store_tokens) == (40, 40)
        # Another model revision on the same store (same layout, other weights): 0 cached.
        tier = StoreTier(engine.store.backend, engine.store.layout)
        tier.attach_pool(other.runner.kv_segment_bases())
        other.cache.attach_store(tier)
        other.store = tier
        assert run(other, cache_salt="tenant-a").num_cached_tokens == 0
        assert tier.snapshot()["hit_blocks_total"] == 0
    finally:
        engine.store.close()


def test_an_adapter_and_the_base_model_stay_apart_through_the_store(tiny, tmp_path):
    from tests.lora_files import write_adapter

    adapter = write_adapter(tmp_path / "A", tiny.shape, r=4, alpha=8, seed=1)
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST, lora_adapters=(("A", str(adapter)),))
    try:
        warm_then_evict(engine, lora_name="A")
        assert run(engine).num_cached_tokens == 0  # the base model: another identity
        engine.cache.evict(engine.num_blocks)
        control = run(engine, lora_name="A")
        assert (control.num_cached_tokens, control.num_store_tokens) == (40, 40)
    finally:
        engine.store.close()


def test_a_corrupted_value_is_rejected_and_the_output_stays_cold(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    backend = engine.store.backend
    try:
        warm_then_evict(engine)
        # Block 3 of the prompt: read it, flip one payload byte, remove and put it again.
        root = engine.cache_root(None)
        block_hash = engine.cache.hasher.chain(root, PROMPT[:16], 4)[3]
        key = store_key(engine.store.layout, root, block_hash)
        size = engine.store.value_bytes
        buf = ctypes.create_string_buffer(size)
        assert backend.get_into([key], [ctypes.addressof(buf)], [size]) == [size]
        buf[size - 5] = bytes([buf.raw[size - 5] ^ 0x01])
        parent = store_key(engine.store.layout, root,
                           engine.cache.hasher.chain(root, PROMPT[:12], 4)[2])
        assert backend.remove([key]) == 1
        from radixkv.cache.store.backend import PutEntry

        assert backend.put([PutEntry(key, parent, 12, ctypes.addressof(buf), size)]) == [True]
        again = run(engine)
        assert (again.num_cached_tokens, again.num_store_tokens) == (12, 12)
        assert again.output_token_ids == cold
        stats = engine.stats_snapshot()
        assert stats["store"]["rejected_blocks_by_reason"] == {"header": 0, "checksum": 1,
                                                               "size": 0, "format": 0}
        assert stats["miss_tokens"]["store_rejected"] == 28  # blocks 3..9 computed
    finally:
        engine.store.close()


class SlowHostStore(HostStore):
    """A host store whose reads take ``delay_s`` (a slow or distant store)."""

    delay_s = 0.0

    def get_into(self, keys, ptrs, sizes):
        time.sleep(self.delay_s)
        return super().get_into(keys, ptrs, sizes)


class GatedHostStore(HostStore):
    """A host store whose reads wait for ``gate`` (a store that answers when the test says)."""

    gate: threading.Event | None = None

    def get_into(self, keys, ptrs, sizes):
        if self.gate is not None:
            self.gate.wait(30)
        return super().get_into(keys, ptrs, sizes)


class FailingHostStore(HostStore):
    """A host store that is unreachable while ``failing`` is set."""

    failing = False
    reconnect_calls = 0

    def exists(self, keys):
        if self.failing:
            raise StoreError("store unreachable")
        return super().exists(keys)

    def reconnect(self):
        self.reconnect_calls += 1
        return not self.failing


def _swap_backend(engine, backend, **tier_kw):
    """Replace the engine's tier with one over ``backend`` (same layout)."""
    layout = engine.store.layout
    engine.store.close()
    tier = StoreTier(backend, layout, **tier_kw)
    tier.attach_pool(engine.runner.kv_segment_bases())
    engine.cache.attach_store(tier)
    engine.store = tier
    return tier


def test_a_load_past_its_deadline_computes_and_is_counted(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    backend = SlowHostStore(1 << 24, block_size=4)
    tier = _swap_backend(engine, backend, timeout_s=0.2)
    try:
        warm_then_evict(engine)
        # The read takes 25x the load timeout, so "did not wait for it" holds with a wide
        # margin on a loaded 2-core machine (a run of the tiny model there can take ~1 s).
        backend.delay_s = 5.0
        started = time.monotonic()
        again = run(engine)
        assert time.monotonic() - started < 4.0  # did not wait for the slow read
        assert (again.num_cached_tokens, again.num_store_tokens) == (0, 0)
        assert again.output_token_ids == cold
        stats = engine.stats_snapshot()
        assert stats["miss_tokens"]["store_timeout"] == 40
        assert stats["store"]["load_timeouts_total"] == 1
        deadline = time.monotonic() + 15  # the abandoned read returns its staging slots
        while tier.read_arena.num_free_slots != tier.read_arena.num_slots:
            assert time.monotonic() < deadline, tier.read_arena.num_free_slots
            time.sleep(0.05)
    finally:
        tier.close()


def test_other_requests_keep_stepping_while_one_loads(tiny):
    engine = make_engine(tiny, num_blocks=64, kv_store=HOST)
    backend = GatedHostStore(1 << 24, block_size=4)
    tier = _swap_backend(engine, backend, timeout_s=30.0)
    try:
        warm_then_evict(engine)
        backend.gate = threading.Event()  # reads wait until the test opens it
        other = engine.make_request([7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0,
                                                               ignore_eos=True))
        loading = engine.make_request(PROMPT, GREEDY)
        engine.add_request(other)
        engine.step()  # `other` prefills and decodes from here on
        engine.add_request(loading)
        for _ in range(200):
            if other.is_finished:
                break
            engine.step()
        # `other` ran all its 20 tokens while the load was held up; `loading` never ran.
        assert other.is_finished and len(other.output_token_ids) == 20
        assert not loading.admitted and loading.status.value == "loading"
        backend.gate.set()
        for _ in range(10_000):
            if loading.is_finished:
                break
            engine.step()
        assert loading.num_store_tokens == 40 and len(loading.output_token_ids) == 6
        engine.cache.check_integrity()
    finally:
        backend.gate.set()
        tier.close()


def test_a_store_that_goes_down_costs_a_recompute_and_comes_back(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    backend = FailingHostStore(1 << 24, block_size=4)
    tier = _swap_backend(engine, backend, reconnect_interval_s=0.05)
    try:
        warm_then_evict(engine)
        backend.failing = True
        down = run(engine)
        assert (down.num_cached_tokens, down.output_token_ids) == (0, cold)
        stats = engine.stats_snapshot()["store"]
        assert stats["down"] is True and stats["errors_total"] == 1
        engine.cache.evict(engine.num_blocks)
        assert run(engine).num_cached_tokens == 0  # skipped while down: no wait, no error
        assert engine.stats_snapshot()["store"]["loads_skipped_down_total"] == 1
        backend.failing = False
        deadline = time.monotonic() + 5
        while tier.down and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not tier.down and backend.reconnect_calls >= 1
        engine.cache.evict(engine.num_blocks)
        back = run(engine)
        assert (back.num_cached_tokens, back.num_store_tokens) == (40, 40)
    finally:
        tier.close()


def test_evict_write_mode_writes_only_what_the_pool_evicts(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST, kv_store_write="evict")
    try:
        run(engine)
        assert engine.store.flush()
        assert engine.stats_snapshot()["store"]["written_blocks_total"] == 0
        assert engine.cache.evict(engine.num_blocks) == 11
        assert engine.store.flush()
        assert engine.stats_snapshot()["store"]["written_blocks_total"] == 11
        again = run(engine)
        assert (again.num_cached_tokens, again.num_store_tokens) == (40, 40)
        assert again.output_token_ids == cold
    finally:
        engine.store.close()


def test_concurrent_loads_and_writes_keep_the_cache_consistent(tiny):
    engine = make_engine(tiny, num_blocks=64, kv_store=HOST)
    prompts = [[(11 * i + j) % 300 + 3 for i in range(33)] for j in range(6)]
    try:
        for p in prompts:
            run(engine, p)
        assert engine.store.flush()
        engine.cache.evict(engine.num_blocks)
        reqs = engine.generate(prompts, GREEDY)
        engine.cache.check_integrity()
        assert [r.num_cached_tokens for r in reqs] == [32] * 6
        assert sum(r.num_store_tokens for r in reqs) == engine.stats_snapshot()[
            "cached_prompt_tokens_by_tier"]["store"]
    finally:
        engine.store.close()
    assert threading.active_count() < 50


def test_host_tier_blocks_are_kv_events_with_medium_cpu(tiny):
    from radixkv.cache.events import KVEventLog, decode_event

    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    engine.cache.events = KVEventLog(4)
    try:
        run(engine)  # (identity_root allows the unsalted root once events are on)
        assert engine.store.flush()
        engine.store.drain_kv_events(engine.cache.events)
        events = [decode_event(e) for e in engine.cache.events.drain()]
        device = [e for e in events if e[0] == "stored" and e[5] == "GPU"]
        host = [e for e in events if e[0] == "stored" and e[5] == "CPU"]
        assert sum(len(e[1]) for e in device) == sum(len(e[1]) for e in host) == 11
        assert [i for e in host for i in e[1]] == [i for e in device for i in e[1]]
        assert host[0][2] is None and host[0][3] == PROMPT[:len(host[0][1]) * 4]
        # A host tier of 12 values evicts under pressure: BlockRemoved with medium CPU.
        value_bytes = engine.store.value_bytes
        tier = _swap_backend(engine, HostStore(12 * value_bytes, block_size=4))
        other = [p + 1 for p in PROMPT]
        for prompt in (PROMPT, other):
            engine.cache.evict(engine.num_blocks)
            run(engine, prompt)
            assert tier.flush()
        tier.drain_kv_events(engine.cache.events)
        events = [decode_event(e) for e in engine.cache.events.drain()]
        removed = [i for e in events if e[0] == "removed" and e[2] == "CPU" for i in e[1]]
        first = [i for e in events if e[0] == "stored" and e[5] == "CPU" for i in e[1]][:11]
        assert len(removed) == 10 and set(removed) <= set(first)
        assert tier.backend.stats()["num_blocks"] == 12
    finally:
        engine.store.close()


def test_a_run_longer_than_one_load_is_loaded_in_several(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    tier = _swap_backend(engine, HostStore(1 << 24, block_size=4), read_slots=4)
    try:
        warm_then_evict(engine)
        again = run(engine)
        assert (again.num_cached_tokens, again.num_store_tokens) == (40, 40)
        assert again.output_token_ids == cold
        stats = engine.stats_snapshot()
        # The cold run looked up 4 blocks (a load's most); then loads of 4 + 4 + 2 blocks.
        assert (stats["store"]["lookup_blocks_total"], stats["store"]["hit_blocks_total"]) \
            == (4 + 10, 10)
        assert stats["cached_prompt_tokens_by_tier"]["store"] == 40
    finally:
        tier.close()


def test_published_blocks_wait_for_a_write_slot_instead_of_being_dropped(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    tier = _swap_backend(engine, HostStore(1 << 24, block_size=4), write_slots=2)
    try:
        run(engine)  # 11 blocks published, 2 write slots
        deadline = time.monotonic() + 10
        while not tier.flush(0.05):  # the engine's steps pump; here the test does
            assert time.monotonic() < deadline, tier.snapshot()
            tier.pump()
        stats = tier.snapshot()
        assert (stats["written_blocks_total"], stats["dropped_write_blocks_total"]) == (11, 0)
        engine.cache.evict(engine.num_blocks)
        again = run(engine)
        assert (again.num_store_tokens, again.output_token_ids) == (40, cold)
    finally:
        tier.close()


def test_a_finished_load_waits_for_room_instead_of_loading_part(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    try:
        warm_then_evict(engine)
        big = engine.make_request([(13 * i) % 300 + 7 for i in range(57)],
                                  SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        engine.add_request(big)
        engine.step()  # `big` holds 15 of the 24 blocks and grows to 20
        loading = engine.make_request(PROMPT, GREEDY)
        engine.add_request(loading)
        for _ in range(10_000):
            if loading.is_finished:
                break
            engine.step()
            # 10 verified blocks + 1 for its chunk do not fit beside `big`: it waits whole.
            assert loading.admitted is False or big.is_finished
        assert (loading.num_cached_tokens, loading.num_store_tokens) == (40, 40)
        assert loading.output_token_ids == cold
        engine.cache.check_integrity()
    finally:
        engine.store.close()


class SlowPutHostStore(HostStore):
    """A host store whose writes take 0.3 s."""

    def put(self, entries):
        time.sleep(0.3)
        return super().put(entries)


def test_a_lookup_right_after_an_eviction_finds_the_blocks_being_written(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST, kv_store_write="evict")
    tier = _swap_backend(engine, SlowPutHostStore(1 << 24, block_size=4), write_mode="evict")
    try:
        run(engine)
        assert engine.cache.evict(engine.num_blocks) == 11  # queued for writing, not put yet
        again = run(engine)  # its lookup waits for those writes (within its deadline)
        assert (again.num_cached_tokens, again.num_store_tokens) == (40, 40)
        assert again.output_token_ids == cold
    finally:
        tier.close()


class FrozenHostStore(HostStore):
    """A host store whose ``exists`` hangs until ``gate`` opens (a frozen master)."""

    gate: threading.Event | None = None

    def exists(self, keys):
        if self.gate is not None:
            self.gate.wait(30)
        return super().exists(keys)


def test_a_store_that_stops_answering_costs_one_timeout_then_is_skipped(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store=HOST)
    backend = FrozenHostStore(1 << 24, block_size=4)
    # A timeout well above a loaded machine's run time, so "the second run did not wait for
    # it" is a bound with margin (the skip counter below says it too).
    tier = _swap_backend(engine, backend, timeout_s=3.0)
    try:
        warm_then_evict(engine)
        backend.gate = threading.Event()
        first = run(engine)
        assert (first.num_cached_tokens, first.output_token_ids) == (0, cold)
        engine.cache.evict(engine.num_blocks)
        started = time.monotonic()
        second = run(engine)  # the loader is still stuck: no second wait
        assert time.monotonic() - started < 3.0 and second.num_cached_tokens == 0
        stats = engine.stats_snapshot()
        # The first lookup never learned what the store held: all 10 blocks it asked for.
        assert stats["miss_tokens"]["store_timeout"] == 40
        assert (tier.snapshot()["load_timeouts_total"],
                tier.snapshot()["loads_skipped_down_total"]) == (1, 1)
        backend.gate.set()
        deadline = time.monotonic() + 5
        while tier._stuck:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.cache.evict(engine.num_blocks)
        assert run(engine).num_store_tokens == 40
    finally:
        backend.gate.set()
        tier.close()

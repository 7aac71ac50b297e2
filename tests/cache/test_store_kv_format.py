"""The KV format in the cache identity and the store tier (``--kv-cache-dtype``).

* Value sizes per format (SmolLM2 at B = 16 and the tiny model), exact.
* An int8 / fp8 block goes through a real host store and comes back into other pool blocks
  bit-exact, values and scales, with the payload laid out as ``runner.kv_segments()`` orders it.
* Values of another format are refused by reason (``format``; ``size`` when larger than the
  reader's room) in the tier over a host store, a Mooncake store and in the disk tier.
* Engines (tiny model) with fp32 and int8 KV sharing one real ``host`` store, one real Mooncake
  master, and one disk directory across a restart: the second format gets 0 store hits (its
  keys and roots differ), then serves its own blocks.

Nothing is mocked: real stores, a real ``mooncake_master`` (tests/mooncake_harness.py), pools
of the real storage dtypes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from radixkv.cache.hashing import BlockHasher, CacheIdentity, pack_tokens
from radixkv.cache.store.backend import PutEntry
from radixkv.cache.store.disk import MISSING, DiskStore
from radixkv.cache.store.host import HostStore
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.store.value import (
    BlockLayout,
    ValueHeader,
    check_stored_value,
    check_value,
    encode_header,
    payload_checksum,
    read_header,
    store_key,
)
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.store_setup import block_layout
from radixkv.kernels.kv_quant import KVFormat, quantize_kv, resolve_kv_format
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner
from tests.factories import engine_config
from tests.mooncake_harness import MooncakeMaster, local_hostname, run_master

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(37 * i) % 400 + 5 for i in range(41)]  # B = 4: hit cap 40 tokens = 10 blocks
HOST = "host:0.01"
FP32, INT8, FP8 = (resolve_kv_format(name, torch.float32) for name in ("auto", "int8", "fp8_e4m3"))
ROPE = "theta=100000.0;scaling=None"


def smollm2_layout(fmt: KVFormat) -> BlockLayout:
    """SmolLM2-135M's store layout (30 layers, 3 KV heads, D 64) at B = 16 in ``fmt``."""
    itemsize = torch.empty((), dtype=fmt.storage_dtype).element_size()
    return BlockLayout(30, 3, 64, fmt.tag, itemsize, 16, 4 if fmt.quantized else 0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


# ---- sizes and identity -------------------------------------------------------------------

def test_smollm2_value_sizes_per_format():
    fp32, int8, fp8 = (smollm2_layout(f) for f in (FP32, INT8, FP8))
    bf16 = smollm2_layout(resolve_kv_format("auto", torch.bfloat16))
    assert [x.tag for x in (fp32, bf16, int8, fp8)] == [
        "L30.H3.D64.float32.B16", "L30.H3.D64.bfloat16.B16",
        "L30.H3.D64.int8-tokhead-f32-v1.B16", "L30.H3.D64.fp8_e4m3-tokhead-f32-v1.B16"]
    # fp32: 60 segments of 16*3*64*4 bytes; nothing else (unchanged by the format work).
    assert (fp32.num_segments, fp32.segment_sizes) == (60, (12288,) * 60)
    assert (fp32.payload_bytes, fp32.header_bytes(16), fp32.value_bytes(16)) == (737280, 192, 737472)
    assert (bf16.payload_bytes, bf16.value_bytes(16)) == (368640, 368832)
    # int8 / fp8: 60 value segments of 16*3*64 bytes, then 60 scale segments of 16*3*4 bytes.
    for q in (int8, fp8):
        assert q.num_segments == 120
        assert q.segment_sizes == (3072,) * 60 + (192,) * 60
        assert (q.payload_bytes, q.header_bytes(16), q.value_bytes(16)) == (195840, 192, 196032)
        # = the format's bytes per token (scales included) times B: 12240 * 16
        assert q.payload_bytes == INT8.bytes_per_token(30, 3, 64) * 16 == 12240 * 16
    assert fp32.payload_bytes == FP32.bytes_per_token(30, 3, 64) * 16 == 46080 * 16
    assert int8.value_bytes(16) / fp32.value_bytes(16) == 196032 / 737472  # 0.2658...
    root, h = b"r" * 16, b"h" * 16
    assert store_key(int8, root, h) == ("rkv1:L30.H3.D64.int8-tokhead-f32-v1.B16:" + "72" * 16
                                        + ":" + "68" * 16)


def test_layout_fields_are_checked_by_name():
    with pytest.raises(ValueError, match="^dtype: must be a non-empty str of letters"):
        BlockLayout(2, 2, 16, "int8.v1", 1, 4, 4)  # a '.' would break the tag
    with pytest.raises(ValueError, match="^dtype: "):
        BlockLayout(2, 2, 16, "int8:v1", 1, 4, 4)
    with pytest.raises(ValueError, match="^scale_itemsize: must be an int >= 0, got -4"):
        BlockLayout(2, 2, 16, "int8-tokhead-f32-v1", 1, 4, -4)


def test_the_format_tag_is_in_the_identity_root_and_unquantized_roots_are_unchanged():
    hasher = BlockHasher()
    fp32 = hasher.identity_root(CacheIdentity("r1", 4, FP32.tag, ROPE))
    int8 = hasher.identity_root(CacheIdentity("r1", 4, INT8.tag, ROPE))
    fp8 = hasher.identity_root(CacheIdentity("r1", 4, FP8.tag, ROPE))
    # The float32 root is tests/cache/test_hashing.py's golden root: FP32.tag == "float32".
    assert fp32.hex() == "2ac3a5858109c23108a2187185f68cb8"
    assert len({fp32, int8, fp8}) == 3
    tokens = list(range(8))
    # Every chained hash differs, so no tree, KV event or store key can match across formats.
    assert set(hasher.chain(fp32, tokens, 4)).isdisjoint(hasher.chain(int8, tokens, 4))


# ---- a quantized block through a real host store, bit-exact ---------------------------------

class Pools:
    """A tiny quantized pool set (2 layers, 2 KV heads, D 16, B 4, 8 blocks) in the storage
    dtype, with fp32 scale pools, addressed as ``runner.kv_segments()`` does."""

    def __init__(self, fmt: KVFormat, num_blocks: int = 8) -> None:
        self.fmt = fmt
        shape = (num_blocks, 4, 2, 16)
        self.k = [torch.zeros(shape, dtype=fmt.storage_dtype) for _ in range(2)]
        self.v = [torch.zeros(shape, dtype=fmt.storage_dtype) for _ in range(2)]
        self.ks = [torch.zeros(shape[:3]) for _ in range(2)]
        self.vs = [torch.zeros(shape[:3]) for _ in range(2)]

    def tensors(self) -> list[torch.Tensor]:
        """K0, V0, K1, V1, Ks0, Vs0, Ks1, Vs1."""
        return [self.k[0], self.v[0], self.k[1], self.v[1],
                self.ks[0], self.vs[0], self.ks[1], self.vs[1]]

    def segments(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t[0].numel() * t.element_size()) for t in self.tensors()]

    def fill(self, block: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for layer in range(2):
            for pool, scales in ((self.k, self.ks), (self.v, self.vs)):
                q, s = quantize_kv(torch.randn(4, 2, 16, generator=gen) * 3, self.fmt)
                pool[layer][block] = q
                scales[layer][block] = s

    def block_bytes(self, block: int) -> bytes:
        """The block's payload as the store lays it out: every segment's row, in order."""
        return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes()
                        for t in self.tensors())


def header_of(value: bytes) -> ValueHeader:
    header = read_header(value)
    assert isinstance(header, ValueHeader), header
    return header


def wait_load(tier: StoreTier, request_id: str) -> None:
    deadline = time.monotonic() + 10
    while not tier.is_ready(request_id):
        assert time.monotonic() < deadline
        tier.wait(0.05)


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=lambda f: f.name)
def test_a_quantized_block_is_stored_and_loaded_back_bit_exact(fmt):
    layout = BlockLayout(2, 2, 16, fmt.tag, 1, 4, 4)
    assert layout.segment_sizes == (128,) * 4 + (32,) * 4
    backend = HostStore(1 << 20, block_size=4)
    tier = StoreTier(backend, layout)
    pools = Pools(fmt)
    tier.attach_pool(pools.segments())
    try:
        pools.fill(3, seed=11)
        want = pools.block_bytes(3)
        assert len(want) == 640 and any(want[512:])  # the scales are in it, non-zero
        root = b"R" * 16
        tokens = pack_tokens([1, 2, 3, 4])
        (h,) = BlockHasher().hash_blocks(root, tokens, 4)
        assert tier.write(root, root, [h], tokens, [3], 0, defer=False) == 1
        assert tier.flush()
        key = store_key(layout, root, h)
        size = tier.value_bytes
        assert size == layout.header_bytes(16) + 640 == 192 + 640
        buf = ctypes.create_string_buffer(size)
        assert backend.get_into([key], [ctypes.addressof(buf)], [size]) == [size]
        header = header_of(buf.raw)
        assert (header.tag, header.payload_bytes) == ("L2.H2.D16." + fmt.tag + ".B4", 640)
        assert buf.raw[192:] == want  # K0 V0 K1 V1 then Ks0 Vs0 Ks1 Vs1, block 3's rows
        saved = [t[3].clone() for t in pools.tensors()]
        for t in pools.tensors():
            t.view(torch.uint8).zero_()
        assert tier.start_load("r1", root, root, [h], tokens, 0)
        wait_load(tier, "r1")
        job = tier.finish("r1")
        assert len(job.slots) == 1
        tier.copy_into(job, [5])
        for before, t in zip(saved, pools.tensors()):  # values and scales, bit for bit
            assert torch.equal(t[5].view(torch.uint8), before.view(torch.uint8))
            assert not t[3].view(torch.uint8).any()  # nothing written elsewhere
        snap = tier.snapshot()
        assert (snap["written_blocks_total"], snap["hit_blocks_total"]) == (1, 1)
        assert snap["read_bytes_total"] == snap["written_bytes_total"] == 832
    finally:
        tier.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_real_runners_quantized_block_comes_back_bit_exact(tiny, kv_cache_dtype):
    runner = ModelRunner(tiny, num_blocks=8, block_size=4, kv_cache_dtype=kv_cache_dtype)
    layout = block_layout(runner)
    assert layout == BlockLayout(2, 2, 16, runner.kv_format.tag, 1, 4, 4)
    assert layout.payload_bytes == runner.bytes_per_block == 640
    tier = StoreTier(HostStore(1 << 20, block_size=4), layout)
    tier.attach_pool(runner.kv_segments())
    try:
        runner.forward(runner.build_batch([([11, 12, 13, 14, 15, 16], 0, [2, 6])]))
        assert runner.k_scales is not None and runner.v_scales is not None
        pools = [*runner.k_pools, *runner.v_pools, *runner.k_scales, *runner.v_scales]
        saved = [t[2].clone() for t in pools]
        assert all(s.view(torch.uint8).any() for s in saved)  # the prefill wrote block 2
        root = b"R" * 16
        tokens = pack_tokens([11, 12, 13, 14])
        (h,) = BlockHasher().hash_blocks(root, tokens, 4)
        assert tier.write(root, root, [h], tokens, [2], 0, defer=False) == 1
        assert tier.flush()
        assert tier.start_load("r1", root, root, [h], tokens, 0)
        wait_load(tier, "r1")
        job = tier.finish("r1")
        tier.copy_into(job, [5])
        for before, t in zip(saved, pools):  # values and scales of every layer, bit for bit
            assert torch.equal(t[5].view(torch.uint8), before.view(torch.uint8))
    finally:
        tier.close()


def test_pool_segments_that_do_not_match_the_layout_are_refused_by_name():
    layout = BlockLayout(2, 2, 16, INT8.tag, 1, 4, 4)
    tier = StoreTier(HostStore(1 << 20, block_size=4), layout)
    try:
        pools = Pools(INT8)
        with pytest.raises(ValueError, match=r"^segments: the layout L2\.H2\.D16\.int8-tokhead-"
                                             r"f32-v1\.B4 has 8 pool segments per block, got 4"):
            tier.attach_pool(pools.segments()[:4])  # the scale segments left out
        bad = pools.segments()
        bad[5] = (bad[5][0], 64)
        with pytest.raises(ValueError, match=r"^segments: bytes per block \[128, 128, 128, 128, "
                                             r"32, 64, 32, 32\] are not the layout"):
            tier.attach_pool(bad)
        with pytest.raises(ValueError, match="^segments: the layout .* has scale segments; give "
                                             r"\(address, bytes per block\) pairs"):
            tier.attach_pool([p for p, _ in pools.segments()])  # addresses only
    finally:
        tier.close()


# ---- values of another format are refused by reason ----------------------------------------

ROOT, H1, H0 = b"r" * 16, b"h" * 16, b"p" * 16
TOKENS = pack_tokens([9, 8, 7, 6])


def tiny_value(layout: BlockLayout, root: bytes = ROOT) -> bytes:
    payload = bytes(range(256)) * (layout.payload_bytes // 256) + bytes(layout.payload_bytes % 256)
    return encode_header(layout, root, H1, H0, TOKENS, payload_checksum(payload)) + payload


TINY_FP32 = BlockLayout(2, 2, 16, FP32.tag, 4, 4)
TINY_INT8 = BlockLayout(2, 2, 16, INT8.tag, 1, 4, 4)
TINY_FP8 = BlockLayout(2, 2, 16, FP8.tag, 1, 4, 4)


def test_check_value_tells_another_format_apart():
    for reader, writer in ((TINY_FP32, TINY_INT8), (TINY_INT8, TINY_FP32), (TINY_INT8, TINY_FP8)):
        expected = encode_header(reader, ROOT, H1, H0, TOKENS, bytes(16))
        assert check_value(expected, memoryview(tiny_value(writer))) == "format"
        # the writer's block under the reader's key (its backend's own check, e.g. disk)
        assert check_stored_value(store_key(reader, ROOT, H1), tiny_value(writer)) == "format"
    # Another layout (L, Hkv, D or B) is not a format difference: a stale / colliding header.
    other = BlockLayout(2, 2, 8, INT8.tag, 1, 4, 4)
    expected = encode_header(TINY_INT8, ROOT, H1, H0, TOKENS, bytes(16))
    assert check_value(expected, memoryview(tiny_value(other))) == "header"
    assert check_stored_value(store_key(TINY_INT8, ROOT, H1), tiny_value(other)) == "foreign"
    assert check_value(expected, memoryview(tiny_value(TINY_INT8))) is None


def test_the_disk_tier_refuses_a_file_of_another_format(tmp_path):
    store = DiskStore(str(tmp_path / "kv"), 1 << 20, fsync=False)
    keep = []

    def put(layout: BlockLayout) -> str:
        value = bytearray(tiny_value(layout))
        keep.append(value)
        key = store_key(layout, ROOT, H1)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(value))
        assert store.put([PutEntry(key, None, 0, ptr, len(value))]) == [True]
        return key

    try:
        fp32_key, int8_key = put(TINY_FP32), put(TINY_INT8)
        (fp32_file,) = (tmp_path / "kv").glob(f"*/{fp32_key}.*")
        fp32_file.write_bytes(tiny_value(TINY_INT8))  # the int8 value under the fp32 name
        buf = ctypes.create_string_buffer(4096)
        assert store.get_into([fp32_key], [ctypes.addressof(buf)], [4096]) == [MISSING]
        assert not fp32_file.exists() and store.exists([fp32_key, int8_key]) == [False, True]
        stats = store.stats()
        assert stats["disk_rejected_blocks_by_reason"] == {
            "size": 0, "header": 0, "foreign": 0, "format": 1, "checksum": 0, "io": 0}
        n = len(tiny_value(TINY_INT8))
        assert store.get_into([int8_key], [ctypes.addressof(buf)], [4096]) == [n]
        assert buf.raw[:n] == tiny_value(TINY_INT8)
    finally:
        store.close()


# ---- engines with fp32 and int8 KV on one store -----------------------------------------------

def engine(tiny, kv_cache_dtype: str, *, store_backend=None, **config) -> LLMEngine:
    cfg = dataclasses.replace(engine_config(num_blocks=24, **config), kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(cfg, tiny, store_backend=store_backend)


def store_of(eng: LLMEngine) -> StoreTier:
    """The engine's store tier (configured in every engine here)."""
    assert eng.store is not None
    return eng.store


def run(eng: LLMEngine, prompt=PROMPT):
    (req,) = eng.generate([prompt], GREEDY)
    eng.cache.check_integrity()
    return req


def warm_then_evict(eng: LLMEngine):
    first = run(eng)
    assert store_of(eng).flush()
    eng.cache.evict(eng.num_blocks)
    return first


def keys_of(eng: LLMEngine, num_blocks: int = 10) -> list[str]:
    root = eng.cache_root(None)
    hashes = eng.cache.hasher.chain(root, PROMPT[: 4 * num_blocks], 4)
    return [store_key(store_of(eng).layout, root, h) for h in hashes]


_BUFFERS: list = []  # registered with a backend (Mooncake moves registered memory only): kept


def _buffer(backend, nbytes: int) -> int:
    buf = ctypes.create_string_buffer(nbytes)
    _BUFFERS.append(buf)
    backend.register_buffer(ctypes.addressof(buf), nbytes)
    return ctypes.addressof(buf)


def read_value(backend, key: str, size: int) -> bytes:
    ptr = _buffer(backend, size)
    assert backend.get_into([key], [ptr], [size]) == [size]
    return ctypes.string_at(ptr, size)


def plant(backend, key: str, value: bytes, parent_key: str | None, depth_tokens: int) -> None:
    """Replace ``key``'s value by ``value`` (a value of another format)."""
    ptr = _buffer(backend, len(value))
    ctypes.memmove(ptr, value, len(value))
    assert backend.remove([key]) == 1
    assert backend.put([PutEntry(key, parent_key, depth_tokens, ptr, len(value))]) == [True]


def test_fp32_and_int8_engines_share_nothing_through_one_host_store(tiny):
    a = engine(tiny, "auto", kv_store=HOST)
    b = engine(tiny, "int8", kv_store=HOST, store_backend=store_of(a).backend)
    try:
        assert (a.runner.kv_format.tag, b.runner.kv_format.tag) == ("float32", INT8.tag)
        assert block_layout(b.runner) == store_of(b).layout == TINY_INT8
        assert store_of(a).layout == TINY_FP32
        # tiny model at B = 4: fp32 2048 payload bytes after a 128-byte header; int8 512 + 128
        # bytes of scales after a 192-byte header (its longer tag)
        assert (store_of(a).value_bytes, store_of(b).value_bytes) == (128 + 2048, 192 + 640)
        roots = a.cache_root(None), b.cache_root(None)
        assert roots[0] != roots[1]
        # Their chained hashes (tree matches, KV events' block hashes) differ for every block.
        hashes_a, hashes_b = (e.cache.hasher.chain(r, PROMPT, 4) for e, r in zip((a, b), roots))
        assert len(hashes_a) == 10 and set(hashes_a).isdisjoint(hashes_b)
        warm_then_evict(a)
        cold_b = run(b)  # the fp32 blocks are in the store: none is found, none is read
        assert (cold_b.num_cached_tokens, cold_b.num_store_tokens) == (0, 0)
        snap = store_of(b).snapshot()
        assert (snap["lookup_blocks_total"], snap["miss_blocks_total"]) == (10, 10)
        assert (snap["hit_blocks_total"], snap["read_bytes_total"], snap["rejected_blocks_total"]) \
            == (0, 0, 0)
        assert store_of(b).flush()
        a_keys, b_keys = keys_of(a), keys_of(b)
        assert set(a_keys).isdisjoint(b_keys)
        backend = store_of(a).backend
        assert backend.exists(a_keys) == backend.exists(b_keys) == [True] * 10
        # 11 blocks each (10 prompt + 1 generated), both formats side by side
        assert backend.stats()["num_blocks"] == 22
        assert backend.stats()["used_bytes"] == 11 * 2176 + 11 * 832
        # Each engine still serves its own blocks from the store.
        b.cache.evict(b.num_blocks)
        warm_b = run(b)
        assert (warm_b.num_cached_tokens, warm_b.num_store_tokens) == (40, 40)
        assert warm_b.output_token_ids == cold_b.output_token_ids
        again_a = run(a)
        assert (again_a.num_cached_tokens, again_a.num_store_tokens) == (40, 40)

        # A value of the other format under an engine's own key is refused, counted, computed.
        a.cache.evict(a.num_blocks)
        b.cache.evict(b.num_blocks)
        plant(backend, a_keys[3], read_value(backend, b_keys[3], store_of(b).value_bytes),
              a_keys[2], 12)
        planted_a = run(a)
        assert (planted_a.num_cached_tokens, planted_a.num_store_tokens) == (12, 12)
        assert planted_a.output_token_ids == again_a.output_token_ids
        assert store_of(a).snapshot()["rejected_blocks_by_reason"] == {
            "header": 0, "checksum": 0, "size": 0, "format": 1}
        assert a.stats_snapshot()["miss_tokens"]["store_rejected"] == 28
        # The other way, the fp32 value is larger than an int8 slot: refused by its size.
        plant(backend, b_keys[5], read_value(backend, a_keys[5], store_of(a).value_bytes),
              b_keys[4], 20)
        planted_b = run(b)
        assert (planted_b.num_cached_tokens, planted_b.num_store_tokens) == (20, 20)
        assert planted_b.output_token_ids == cold_b.output_token_ids
        assert store_of(b).snapshot()["rejected_blocks_by_reason"] == {
            "header": 0, "checksum": 0, "size": 1, "format": 0}
        # The host tier dropped both refused values; the blocks computed again were rewritten.
        assert store_of(a).flush() and store_of(b).flush()
        assert header_of(read_value(backend, a_keys[3], store_of(a).value_bytes)).tag \
            == TINY_FP32.tag
        assert header_of(read_value(backend, b_keys[5], store_of(b).value_bytes)).tag \
            == TINY_INT8.tag
    finally:
        store_of(b).close()  # closes the shared backend too
        store_of(a).close()


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    with run_master(tmp_path_factory.mktemp("mooncake")) as proc:
        yield proc


def test_fp32_and_int8_replicas_share_nothing_through_one_mooncake_master(tiny, master):
    a = engine(tiny, "auto", kv_store=master.kv_store_url(local=local_hostname()))
    b = engine(tiny, "int8", kv_store=master.kv_store_url(local=local_hostname()))
    try:
        assert (store_of(a).backend.name, store_of(b).backend.name) == ("mooncake", "mooncake")
        warm_then_evict(a)
        cold_b = run(b)
        assert (cold_b.num_cached_tokens, cold_b.num_store_tokens) == (0, 0)
        snap = store_of(b).snapshot()
        assert (snap["lookup_blocks_total"], snap["miss_blocks_total"], snap["hit_blocks_total"]) \
            == (10, 10, 0)
        assert snap["rejected_blocks_total"] == 0
        assert store_of(b).flush()
        a_keys, b_keys = keys_of(a), keys_of(b)
        assert set(a_keys).isdisjoint(b_keys)
        # Both replicas see both formats' blocks on the master, under their own keys.
        assert store_of(b).backend.exists(a_keys) == store_of(a).backend.exists(b_keys) == [True] * 10
        b.cache.evict(b.num_blocks)
        warm_b = run(b)
        assert (warm_b.num_cached_tokens, warm_b.num_store_tokens) == (40, 40)
        assert warm_b.output_token_ids == cold_b.output_token_ids
        # Replica B's int8 value planted under replica A's key: A refuses it as "format".
        a.cache.evict(a.num_blocks)
        int8_value = read_value(store_of(b).backend, b_keys[3], store_of(b).value_bytes)
        plant(store_of(a).backend, a_keys[3], int8_value, a_keys[2], 12)
        planted = run(a)
        assert (planted.num_cached_tokens, planted.num_store_tokens) == (12, 12)
        assert store_of(a).snapshot()["rejected_blocks_by_reason"] == {
            "header": 0, "checksum": 0, "size": 0, "format": 1}
        assert a.stats_snapshot()["miss_tokens"]["store_rejected"] == 28
        # And A's fp32 value under B's key is larger than B's slots: refused by its size.
        b.cache.evict(b.num_blocks)
        fp32_value = read_value(store_of(a).backend, a_keys[5], store_of(a).value_bytes)
        plant(store_of(b).backend, b_keys[5], fp32_value, b_keys[4], 20)
        planted_b = run(b)
        assert (planted_b.num_cached_tokens, planted_b.num_store_tokens) == (20, 20)
        assert planted_b.output_token_ids == cold_b.output_token_ids
        assert store_of(b).snapshot()["rejected_blocks_by_reason"] == {
            "header": 0, "checksum": 0, "size": 1, "format": 0}
    finally:
        store_of(a).close()
        store_of(b).close()


def test_a_disk_store_written_under_fp32_serves_nothing_to_an_int8_restart(tiny, tmp_path):
    kv = f"disk:{tmp_path / 'kv'}"
    a = engine(tiny, "auto", kv_store=kv)
    try:
        warm_then_evict(a)
        a_keys = keys_of(a)
    finally:
        store_of(a).close()
    b = engine(tiny, "int8", kv_store=kv)  # the same directory after a restart with int8 KV
    try:
        assert store_of(b).backend.exists(a_keys) == [True] * 10
        cold_b = run(b)
        assert (cold_b.num_cached_tokens, cold_b.num_store_tokens) == (0, 0)
        snap = store_of(b).snapshot()
        assert (snap["lookup_blocks_total"], snap["hit_blocks_total"]) == (10, 0)
        assert snap["disk_rejected_blocks_total"] == 0  # other keys: nothing read, nothing refused
        assert store_of(b).flush()
        assert store_of(b).snapshot()["disk_num_blocks"] == 22  # 11 blocks in each format
    finally:
        store_of(b).close()

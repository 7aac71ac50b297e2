"""Quantized KV pools (int8, fp8_e4m3) on the torch paths: the reference write stores exactly
``kv_quant.quantize_kv``'s bytes and scales at the slots named (nothing else), the reference
extend / decode attention over a quantized pool equal the same functions over the dequantized
values in an fp32 pool (torch.equal: the same operations on the same numbers), the
``paged_sdpa`` plan writes the same bytes and attends within SDPA's reordering of the
reference, a cold prefill and a prefix hit read the same K/V, and bad scale pools are refused
by name."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import paged_sdpa, reference
from radixkv.kernels.kv_quant import dequantize_kv, quantize_kv, resolve_kv_format

FORMATS = ("int8", "fp8_e4m3")
M, B, HKV, HQ, D = 12, 4, 2, 4, 16
# fp32 SDPA against the reference's explicit / fused paths over identical K/V values.
SDPA_TOL = 2e-6


def fmt_of(name: str):
    return resolve_kv_format(name, torch.float32)


def pools(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    storage = fmt_of(name).storage_dtype
    return (torch.zeros(M, B, HKV, D, dtype=storage), torch.zeros(M, B, HKV, D, dtype=storage),
            torch.zeros(M, B, HKV), torch.zeros(M, B, HKV))


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a pool (float8 compared bit for bit, NaN-free by construction)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def dequantized(pool: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(pool, scales, torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_write_stores_exactly_quantize_kv_at_the_slots(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(5, HKV, D, generator=gen) * 3
    v = torch.randn(5, HKV, D, generator=gen)
    k[3, 1] = 0.0  # an all-zero head (row 3 -> slot 17): scale 0, values 0
    slots = torch.tensor([0, 5, -1, 17, 23])  # block 0 slot 0, block 1 slot 1, padding, ...
    k_pool, v_pool, k_scales, v_scales = pools(name)
    reference.paged_kv_write(k, v, k_pool, v_pool, slots, k_scale_pool=k_scales, v_scale_pool=v_scales)
    fmt = fmt_of(name)
    for x, pool, scales in ((k, k_pool, k_scales), (v, v_pool, v_scales)):
        want_q, want_s = quantize_kv(x, fmt)
        flat_q, flat_s = raw(pool).view(M * B, HKV, D), scales.view(M * B, HKV)
        for row, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            assert torch.equal(flat_q[slot], raw(want_q)[row]), (name, slot)
            assert torch.equal(flat_s[slot], want_s[row]), (name, slot)
        untouched = [s for s in range(M * B) if s not in (0, 5, 17, 23)]
        assert int(flat_q[untouched].count_nonzero()) == 0
        assert int(flat_s[untouched].count_nonzero()) == 0
    assert float(k_scales.view(M * B, HKV)[17, 1]) == 0.0
    assert int(raw(k_pool).view(M * B, HKV, D)[17, 1].count_nonzero()) == 0
    assert float(k_scales.view(M * B, HKV)[17, 0]) > 0.0


@pytest.mark.parametrize("name", FORMATS)
def test_write_from_bf16_rows_quantizes_their_fp32_widening(name: str) -> None:
    k = (torch.randn(3, HKV, D, generator=torch.Generator().manual_seed(2)) * 0.7).to(torch.bfloat16)
    k_pool, v_pool, k_scales, v_scales = pools(name)
    reference.paged_kv_write(k, k, k_pool, v_pool, torch.tensor([1, 2, 3]),
                             k_scale_pool=k_scales, v_scale_pool=v_scales)
    want_q, want_s = quantize_kv(k, fmt_of(name))
    assert torch.equal(raw(k_pool).view(M * B, HKV, D)[1:4], raw(want_q))
    assert torch.equal(v_scales.view(M * B, HKV)[1:4], want_s)


def test_scale_pools_are_checked_by_name() -> None:
    k = torch.randn(2, HKV, D)
    slots = torch.tensor([0, 1])
    k_pool, v_pool, k_scales, v_scales = pools("int8")
    with pytest.raises(ValueError, match="^k_scale_pool: a torch.int8 pool needs"):
        reference.paged_kv_write(k, k, k_pool, v_pool, slots)
    with pytest.raises(ValueError, match="^v_scale_pool: need float32"):
        reference.paged_kv_write(k, k, k_pool, v_pool, slots, k_scale_pool=k_scales,
                                 v_scale_pool=v_scales[:, :2])
    f32 = torch.zeros(M, B, HKV, D)
    with pytest.raises(ValueError, match="^k_scale_pool: scale pools given for an unquantized"):
        reference.paged_kv_write(k, k, f32, f32.clone(), slots, k_scale_pool=k_scales,
                                 v_scale_pool=v_scales)
    with pytest.raises(ValueError, match="^v_pool: dtype"):
        reference.decode_attention(torch.randn(1, HQ, D), k_pool, f32, torch.tensor([[0]], dtype=torch.int32),
                                   torch.tensor([1], dtype=torch.int32))
    plan = _plan([(0, 3)], [[0]])
    with pytest.raises(ValueError, match="^k_scales: a torch.int8 pool needs"):
        plan.attend(torch.randn(3, HQ, D), k[:1].expand(3, HKV, D), k[:1].expand(3, HKV, D), k_pool, v_pool)
    assert reference.pool_kv_format(f32) is None
    assert reference.pool_kv_format(k_pool).name == "int8"


def _step(gen: torch.Generator, seqs: list[tuple[int, int]]):
    """Packed q/k/v and metadata of sequences ``(prefix_len, new_tokens)``, each owning its own
    consecutive blocks from block 0 on."""
    tables, slots, indptr, next_block = [], [], [0], 0
    for prefix, new in seqs:
        blocks = -(-(prefix + new) // B)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        tables.append(table + [-1] * (3 - len(table)))
        slots += [table[p // B] * B + p % B for p in range(prefix, prefix + new)]
        indptr.append(indptr[-1] + new)
    total = indptr[-1]
    q = torch.randn(total, HQ, D, generator=gen)
    k = torch.randn(total, HKV, D, generator=gen) * 2
    v = torch.randn(total, HKV, D, generator=gen)
    meta = (torch.tensor(tables, dtype=torch.int32), torch.tensor([p for p, _ in seqs], dtype=torch.int32),
            torch.tensor(indptr, dtype=torch.int32), torch.tensor(slots))
    return q, k, v, meta


def _fill_prefixes(name: str, gen: torch.Generator, seqs, tables):
    """Quantized pools holding random K/V for every prefix slot (through the reference write)."""
    k_pool, v_pool, k_scales, v_scales = pools(name)
    slots = [int(tables[i][p // B]) * B + p % B for i, (prefix, _) in enumerate(seqs) for p in range(prefix)]
    if slots:
        n = len(slots)
        reference.paged_kv_write(torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen),
                                 k_pool, v_pool, torch.tensor(slots), k_scale_pool=k_scales,
                                 v_scale_pool=v_scales)
    return k_pool, v_pool, k_scales, v_scales


SEQS = [(0, 6), (4, 3), (5, 1), (8, 2)]  # no prefix, at a block boundary, one past it, decode-like


@pytest.mark.parametrize("name", FORMATS)
def test_reference_extend_equals_attention_over_the_dequantized_pool(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v, (tables, prefix_lens, indptr, slots) = _step(gen, SEQS)
    k_pool, v_pool, k_scales, v_scales = _fill_prefixes(name, gen, SEQS, tables)
    reference.paged_kv_write(k, v, k_pool, v_pool, slots, k_scale_pool=k_scales, v_scale_pool=v_scales)
    got = reference.extend_attention(q, k, v, k_pool, v_pool, tables, prefix_lens, indptr, max_q_len=6,
                                     k_scale_pool=k_scales, v_scale_pool=v_scales)
    fmt = fmt_of(name)
    want = reference.extend_attention(q, reference.stored_kv(k, fmt, torch.float32),
                                      reference.stored_kv(v, fmt, torch.float32),
                                      dequantized(k_pool, k_scales), dequantized(v_pool, v_scales),
                                      tables, prefix_lens, indptr, max_q_len=6)
    assert torch.equal(got, want)
    # The suffix attended over is what the pool holds (quantized), not the unrounded rows.
    raw_rows = reference.extend_attention(q, k, v, dequantized(k_pool, k_scales),
                                          dequantized(v_pool, v_scales), tables, prefix_lens, indptr,
                                          max_q_len=6)
    assert not torch.equal(got, raw_rows)


@pytest.mark.parametrize("name", FORMATS)
def test_reference_decode_equals_attention_over_the_dequantized_pool(name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    seqs = [(4, 1), (7, 1), (0, 1)]
    q, k, v, (tables, prefix_lens, _, slots) = _step(gen, seqs)
    k_pool, v_pool, k_scales, v_scales = _fill_prefixes(name, gen, seqs, tables)
    reference.paged_kv_write(k, v, k_pool, v_pool, slots, k_scale_pool=k_scales, v_scale_pool=v_scales)
    kv_lens = prefix_lens + 1
    got = reference.decode_attention(q, k_pool, v_pool, tables, kv_lens, k_scale_pool=k_scales,
                                     v_scale_pool=v_scales)
    want = reference.decode_attention(q, dequantized(k_pool, k_scales), dequantized(v_pool, v_scales),
                                      tables, kv_lens)
    assert torch.equal(got, want)


def _native_write(kind: str):
    """The plan's ``native_write`` for ``kind`` (``torch``: None; ``native``: the C library,
    skipped where it does not build or lacks the quantized write)."""
    if kind == "torch":
        return None
    from radixkv.kernels import native

    kernels = native.load()
    if kernels is None or "int8" not in getattr(native, "KV_QUANT_FORMATS", ()):
        pytest.skip("native kernels without quantized KV here")
    return kernels


def _plan(seqs, tables, native_write=None):
    indptr, slots = [0], []
    for (prefix, new), table in zip(seqs, tables):
        indptr.append(indptr[-1] + new)
        slots += [table[p // B] * B + p % B for p in range(prefix, prefix + new)]
    return paged_sdpa.plan_attention(torch.tensor(tables, dtype=torch.int32),
                                     torch.tensor([p for p, _ in seqs], dtype=torch.int32),
                                     torch.tensor(indptr, dtype=torch.int32), torch.tensor(slots),
                                     block_size=B, num_pool_blocks=M, head_dim=D,
                                     kv_bytes_per_token=2 * HKV * D * 4, native_write=native_write)


@pytest.mark.parametrize("write", ["torch", "native"])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seqs", [SEQS, [(0, 7)], [(4, 1), (9, 1)]], ids=["mixed", "prefill", "decode"])
def test_paged_sdpa_writes_the_same_bytes_and_attends_as_the_reference(name: str, seqs, write: str) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v, (tables, prefix_lens, indptr, slots) = _step(gen, seqs)
    ref_pools = _fill_prefixes(name, gen, seqs, tables)
    plan_pools = tuple(t.clone() for t in ref_pools)
    reference.paged_kv_write(k, v, ref_pools[0], ref_pools[1], slots, k_scale_pool=ref_pools[2],
                             v_scale_pool=ref_pools[3])
    want = reference.extend_attention(q, k, v, ref_pools[0], ref_pools[1], tables, prefix_lens, indptr,
                                      max_q_len=7, k_scale_pool=ref_pools[2], v_scale_pool=ref_pools[3])
    plan = _plan(seqs, tables.tolist(), _native_write(write))
    got = plan.attend(q, k, v, *plan_pools)
    for a, b in zip(ref_pools, plan_pools):
        assert torch.equal(raw(a), raw(b))
    assert (got - want).abs().max().item() <= SDPA_TOL


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("cut", [4, 8, 9])
def test_prefix_hit_reads_what_the_cold_prefill_attended_over(name: str, cut: int) -> None:
    """A cold 12-token prefill, then the same tokens as a prefix hit of ``cut`` cached tokens
    (after the cold run's write: the pool is what a hit finds) and a suffix: the suffix rows'
    outputs agree within SDPA's reordering, and the suffix writes leave the pool bit-identical."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, (tables, prefix_lens, indptr, slots) = _step(gen, [(0, 12)])
    k_pool, v_pool, k_scales, v_scales = pools(name)
    plan = _plan([(0, 12)], tables.tolist())
    cold = plan.attend(q, k, v, k_pool, v_pool, k_scales, v_scales)
    snapshot = [raw(t).clone() for t in (k_pool, v_pool, k_scales, v_scales)]
    hit = _plan([(cut, 12 - cut)], tables.tolist())
    warm = hit.attend(q[cut:], k[cut:], v[cut:], k_pool, v_pool, k_scales, v_scales)
    for before, after in zip(snapshot, (k_pool, v_pool, k_scales, v_scales)):
        assert torch.equal(before, raw(after))
    assert (warm - cold[cut:]).abs().max().item() <= SDPA_TOL


# fp32 attention over the same quantized pools, backend against backend (the C kernels fold
# the scales into the dot products, Triton and SDPA reorder sums): measured <= 2.1e-6.
BACKEND_TOL = 2e-5


@pytest.mark.parametrize("name", FORMATS)
def test_runner_backends_agree_over_quantized_pools(tiny_model, name: str) -> None:
    """A prefill, then a mixed step (a decode row and a suffix reading another sequence's
    block): the torch (C kernels where they load) and triton (interpreter on CPU) backends
    against the reference backend, same pool bytes written."""
    from radixkv.model.runner import ModelRunner

    results = {}
    for backend in ("reference", "torch", "triton"):
        runner = ModelRunner(tiny_model, num_blocks=8, block_size=4, attention_backend=backend,
                             kv_cache_dtype=name)
        assert runner.k_scales is not None and runner.v_scales is not None
        prefill = runner.forward(runner.build_batch([(list(range(10, 19)), 0, [0, 1, 2])]), all_logits=True)
        mixed = runner.forward(runner.build_batch([([5], 9, [0, 1, 2]), ([7, 8], 4, [0, 3])]))
        results[backend] = (prefill, mixed, [dequantized(p, s) for p, s in zip(runner.k_pools, runner.k_scales)],
                            max(float(s.max()) for s in runner.k_scales))
    want_prefill, want_mixed, want_keys, step = results["reference"]
    for backend in ("torch", "triton"):
        prefill, mixed, keys, _ = results[backend]
        assert prefill.shape == (9, 49152) and mixed.shape == (2, 49152)
        assert (prefill - want_prefill).abs().max().item() <= BACKEND_TOL, backend
        assert (mixed - want_mixed).abs().max().item() <= BACKEND_TOL, backend
        # The stored keys: the backends' fp32 K differ by ulps (GEMM paths), so a value may sit
        # one quantization level away (int8: 1 unit of the scale; e4m3: at most 32 units, its
        # spacing in [256, 448]) and a scale an ulp away, never more.
        level = step * (1 if name == "int8" else 32)
        for got, want in zip(keys, want_keys):
            assert (got - want).abs().max().item() <= level * 1.001, backend

"""The C kernels over quantized KV pools (int8, float8_e4m3fn with one fp32 scale per token and
KV head), once per ISA build this CPU runs, against ``radixkv.kernels.kv_quant`` (the oracle):

- the C quantizer (``native.paged_kv_write``, the same code as the decode layer's fused write)
  stores exactly ``quantize_kv``'s bytes and scales, bit for bit, over a dense sweep of fp32
  values: every e4m3fn value, every rounding tie and its fp32 neighbours, fp32 subnormals,
  +-448 / +-127, zero and -0, rows of every magnitude, bf16 rows;
- the kernels read every stored byte back as exactly ``dequantize_kv``'s value;
- decode and extend attention over quantized pools equal the reference attention over the
  dequantized pools within fp32 reordering: 3e-6 absolute on unit-variance inputs for decode
  (as the fp32 decode tests), 2e-5 for extend (as the fp32 extend tests). The decode kernel folds
  each key's scale into its score and each value's into its softmax weight, so it rounds
  differently from multiplying first; a read of a slot no sequence owns (scales NaN there)
  turns an output NaN;
- the decode layer quantizes the new tokens' K/V it computes (fp32 rows that differ from torch's
  by summation order, so a value at a rounding boundary may land one step away: compared within
  one quantization step) and attends over them, and ``LlamaForward.decode_native`` with scale
  pools matches a torch forward that writes ``quantize_kv``'s bytes and attends over the
  dequantized pools: fp32 model 1e-4 absolute on logits up to ~3.6 (measured 1.2e-6 and 1.8e-6;
  a one-step difference in a written value stays below it), bf16 model 0.1 (the torch bf16 path
  rounds every intermediate to bf16, as in test_native_isa; measured 0.028 and 0.034).
"""

from __future__ import annotations

import math
import platform

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import kv_quant, native, native_attention, reference
from radixkv.model.llama import LlamaForward
from radixkv.model.loader import LoadedModel
from tests.kernels.paged import make_paged_batch

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the native kernels are x86-64 (AVX2 or AVX-512) only")

FORMATS = ["int8", "fp8_e4m3"]


def _fmt(name: str) -> kv_quant.KVFormat:
    return kv_quant.resolve_kv_format(name, torch.float32)


def _f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _sweep(fmt: kv_quant.KVFormat) -> torch.Tensor:
    """fp32 values in [-QMAX, QMAX] covering every rounding case of the format's cast."""
    qmax = fmt.qmax
    top = int(torch.tensor(qmax).view(torch.int32))
    dense = _f32_from_bits(torch.arange(0, top + 1, 997, dtype=torch.int64))  # ~1.1M, every binade
    subnormal = _f32_from_bits(torch.arange(1, 1 << 23, 4099, dtype=torch.int64))
    if fmt.name == "int8":
        grid = torch.arange(0, 128, dtype=torch.float32)
    else:  # every finite non-negative e4m3fn value
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (grid[:-1] + grid[1:]) / 2  # exact in fp32: the rounding ties
    near = torch.cat([ties, torch.nextafter(ties, torch.full_like(ties, math.inf)),
                      torch.nextafter(ties, torch.zeros_like(ties))])
    edge = torch.tensor([0.0, qmax, torch.nextafter(torch.tensor(qmax), torch.tensor(0.0)).item(),
                         2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -126, 1e-45])
    values = torch.cat([dense, subnormal, grid, near, edge]).clamp(max=qmax)
    return torch.cat([values, -values])


def _rows_with_unit_scale(values: torch.Tensor, fmt: kv_quant.KVFormat, head_dim: int,
                          num_kv_heads: int) -> torch.Tensor:
    """``[T, Hkv, D]`` rows holding ``values`` after a first element of +-QMAX: amax is QMAX, so
    scale = inv = 1 and the cast sees each value itself."""
    per_row = head_dim - 1
    pad = (-values.numel()) % (per_row * num_kv_heads)
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per_row)
    first = torch.full((values.shape[0], 1), fmt.qmax)
    first[1::2] = -fmt.qmax
    return torch.cat([first, values], dim=1).view(-1, num_kv_heads, head_dim)


def _varied_rows(gen: torch.Generator, head_dim: int, num_kv_heads: int) -> torch.Tensor:
    """Rows of every magnitude (1e-30 .. 1e30), all-zero rows, one-hot rows."""
    scales = 10.0 ** torch.arange(-30, 31, 3, dtype=torch.float32)
    rows = [torch.randn(len(scales) * 8, num_kv_heads, head_dim, generator=gen)
            * scales.repeat_interleave(8)[:, None, None]]
    rows.append(torch.zeros(4, num_kv_heads, head_dim))
    one_hot = torch.zeros(4, num_kv_heads, head_dim)
    one_hot[:, :, 5] = torch.tensor([1e-20, -3.0, 7e10, -2.5])[:, None]
    rows.append(one_hot)
    heavy = torch.randn(64, num_kv_heads, head_dim, generator=gen) ** 3  # outliers: small values
    rows.append(heavy)                                                   # land in subnormals
    return torch.cat(rows)


def _quantize_with_kernel(kernels: native.NativeKernels, x: torch.Tensor, v: torch.Tensor,
                          fmt: kv_quant.KVFormat, gen: torch.Generator, block_size: int = 4):
    """(k bytes, k scales, v bytes, v scales) as ``[T, Hkv, D]`` / ``[T, Hkv]`` in row order,
    written by the kernel to shuffled slots of a pool with spare blocks."""
    num_tokens, num_kv_heads, head_dim = x.shape
    num_blocks = -(-num_tokens // block_size) + 2
    k_pool = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=fmt.storage_dtype)
    v_pool = torch.zeros_like(k_pool)
    k_scales = torch.full((num_blocks, block_size, num_kv_heads), -1.0)
    v_scales = torch.full_like(k_scales, -1.0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    native.paged_kv_write(kernels, x, v, k_pool, v_pool, slots, k_scales=k_scales, v_scales=v_scales)
    flat = num_blocks * block_size
    unwritten = torch.ones(flat, dtype=torch.bool)
    unwritten[slots] = False
    assert bool((k_scales.view(flat, -1)[unwritten] == -1.0).all())  # nothing else touched
    return (k_pool.view(flat, num_kv_heads, head_dim)[slots], k_scales.view(flat, -1)[slots],
            v_pool.view(flat, num_kv_heads, head_dim)[slots], v_scales.view(flat, -1)[slots])


def _assert_bit_exact(got_q: torch.Tensor, got_s: torch.Tensor, x: torch.Tensor, fmt: kv_quant.KVFormat) -> None:
    want_q, want_s = kv_quant.quantize_kv(x, fmt)
    assert got_q.dtype == want_q.dtype
    assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))
    mismatch = got_q.view(torch.uint8) != want_q.view(torch.uint8)
    assert int(mismatch.sum()) == 0, (f"{int(mismatch.sum())} bytes differ, e.g. x={x[mismatch][:5].tolist()} "
                                      f"got {got_q.view(torch.uint8)[mismatch][:5].tolist()} "
                                      f"want {want_q.view(torch.uint8)[mismatch][:5].tolist()}")


@pytest.mark.parametrize("name", FORMATS)
def test_write_matches_quantize_kv_bit_for_bit_over_a_dense_sweep(kernels, name: str) -> None:
    fmt = _fmt(name)
    gen = torch.Generator().manual_seed(7)
    swept = _rows_with_unit_scale(_sweep(fmt), fmt, 64, 3)
    assert swept.shape[0] > 10_000
    varied = _varied_rows(gen, 64, 3)
    x = torch.cat([swept, varied])
    v = torch.cat([varied, swept])  # each row also as a V row
    kq, ks, vq, vs = _quantize_with_kernel(kernels, x, v, fmt, gen, block_size=16)
    _assert_bit_exact(kq, ks, x, fmt)
    _assert_bit_exact(vq, vs, v, fmt)
    assert bool((ks[: swept.shape[0]] == 1.0).all())  # the sweep rows kept scale 1
    zero_rows = ks[swept.shape[0]:][(varied == 0).all(-1)]
    assert zero_rows.numel() == 12 and bool((zero_rows == 0).all())


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim", [32, 128])
def test_write_of_bf16_rows_and_other_head_dims(kernels, name: str, head_dim: int) -> None:
    fmt = _fmt(name)
    gen = torch.Generator().manual_seed(head_dim)
    x = _varied_rows(gen, head_dim, 2).to(torch.bfloat16)
    v = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    kq, ks, vq, vs = _quantize_with_kernel(kernels, x, v, fmt, gen)
    _assert_bit_exact(kq, ks, x, fmt)  # quantize_kv widens bf16 exactly, as the kernel does
    _assert_bit_exact(vq, vs, v, fmt)


def _all_bytes_pools(fmt: kv_quant.KVFormat, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[8, 1, 1, D]`` pools (block size 1) holding every byte value (fp8: NaN codes replaced by
    0), and scales 1 or 0.37."""
    codes = torch.arange(8 * head_dim, dtype=torch.int64) % 256
    if fmt.name == "fp8_e4m3":
        codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    pool = codes.to(torch.uint8).view(fmt.storage_dtype).view(8, 1, 1, head_dim)
    scales = torch.tensor([1.0, 0.37, 1.0, 0.37, 2.0 ** -20, 3.0, 1.0, 0.5]).view(8, 1, 1)
    return pool, scales


@pytest.mark.parametrize("name", FORMATS)
def test_kernels_read_every_stored_value_exactly(kernels, name: str) -> None:
    # One key per sequence: its softmax weight is exactly 1, so the output is the value as the
    # kernel widened it.
    fmt = _fmt(name)
    head_dim = 64
    v_pool, v_scales = _all_bytes_pools(fmt, head_dim)
    k_pool, k_scales = v_pool.clone(), v_scales.clone()
    want = kv_quant.dequantize_kv(v_pool.view(8, 1, head_dim), v_scales.view(8, 1))  # [8, 1, D]
    tables = torch.arange(8, dtype=torch.int32).view(8, 1)
    q = torch.randn(8, 2, head_dim)
    out = native.paged_decode(kernels, q, torch.arange(8), k_pool, v_pool, tables,
                              torch.ones(8, dtype=torch.int32), sm_scale=0.125, k_scales=k_scales,
                              v_scales=v_scales)
    assert torch.equal(out, want.expand(8, 2, head_dim))
    ext = native_attention.paged_extend(kernels, q, torch.arange(9), torch.zeros(8, dtype=torch.int32),
                                        k_pool, v_pool, tables, sm_scale=0.125, k_scales=k_scales,
                                        v_scales=v_scales)
    assert torch.equal(ext, want.expand(8, 2, head_dim))


def _quantized_pools(kv_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                     fmt: kv_quant.KVFormat, seed: int):
    """Pools with each sequence's keys (values: x3) quantized by ``quantize_kv`` into the
    shuffled blocks of :func:`make_paged_batch`'s tables (-1 past the used blocks, two spare
    blocks), random bytes and NaN scales in every slot no sequence owns, and the dequantized
    pools (what attention must read)."""
    batch = make_paged_batch([(n, 0) for n in kv_lens], block_size=block_size,
                             heads=(num_kv_heads, num_kv_heads), head_dim=head_dim, seed=seed,
                             spare_blocks=2, device=torch.device("cpu"))
    shape = batch.k_pool.shape
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8).view(fmt.storage_dtype)
    v_pool = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8).view(fmt.storage_dtype)
    k_scales = torch.full(shape[:3], math.nan)
    v_scales = torch.full(shape[:3], math.nan)
    for i, n in enumerate(kv_lens):
        slots = batch.slots(i, range(n))
        kq, ks = kv_quant.quantize_kv(batch.prefix_k[i], fmt)
        vq, vs = kv_quant.quantize_kv(batch.prefix_v[i] * 3, fmt)
        k_pool.flatten(0, 1)[slots], k_scales.flatten(0, 1)[slots] = kq, ks
        v_pool.flatten(0, 1)[slots], v_scales.flatten(0, 1)[slots] = vq, vs
    k_deq = kv_quant.dequantize_kv(k_pool.flatten(0, 1), k_scales.flatten(0, 1)).view(shape)
    v_deq = kv_quant.dequantize_kv(v_pool.flatten(0, 1), v_scales.flatten(0, 1)).view(shape)
    return k_pool, v_pool, k_scales, v_scales, batch.block_tables, k_deq, v_deq


@pytest.mark.parametrize(("kv_lens", "block_size", "heads", "head_dim", "window_left", "chunk"), [
    ([1, 16, 17, 300, 515], 16, (9, 3), 64, -1, 256),  # SmolLM2's heads; at and past a block edge
    ([33, 5, 64], 1, (4, 4), 32, -1, 7),               # page size 1, no GQA, D 32
    ([130, 2, 77], 8, (10, 2), 32, 20, 16),            # group 5, window across chunks
    ([40, 9, 3], 5, (8, 2), 128, -1, 12),              # block size 5: sub-blocks start mid-vector
    ([257], 16, (16, 1), 96, 100, 64),                 # MQA group 16, D 96 = 64 + a 32 rest
])
@pytest.mark.parametrize("name", FORMATS)
def test_paged_decode_matches_reference_on_dequantized_pools(kernels, kv_lens, block_size, heads, head_dim,
                                                             window_left, chunk, name) -> None:
    num_q_heads, num_kv_heads = heads
    k_pool, v_pool, k_scales, v_scales, tables, k_deq, v_deq = _quantized_pools(
        kv_lens, block_size, num_kv_heads, head_dim, _fmt(name), seed=len(kv_lens))
    gen = torch.Generator().manual_seed(11)
    n = len(kv_lens)
    rows = torch.tensor([2, 0, 5, 3, 1][:n], dtype=torch.int64)
    q = torch.randn(6, num_q_heads, head_dim, generator=gen)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, -7.0)
    native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, sm_scale=scale, window_left=window_left,
                        out=out, chunk_tokens=chunk, k_scales=k_scales, v_scales=v_scales)
    want = reference.decode_attention(q[rows], k_deq, v_deq, tables, lens, sm_scale=scale,
                                      window_left=window_left)
    torch.testing.assert_close(out[rows], want, rtol=0, atol=3e-6 * 3)  # values are 3x unit variance
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == -7.0).all())


@pytest.mark.parametrize(("seqs", "block_size", "heads", "head_dim", "window_left"), [
    ([(0, 40), (16, 5), (17, 16), (31, 2)], 16, (9, 3), 64, -1),  # prefix at / one past a block edge
    ([(64, 70), (1, 3)], 16, (9, 3), 64, 33),                      # window; a tile's worth of prefix
    ([(5, 9), (0, 2), (48, 1)], 4, (8, 2), 128, -1),
    ([(7, 20)], 8, (4, 4), 32, 5),
])
@pytest.mark.parametrize("name", FORMATS)
def test_paged_extend_matches_reference_on_dequantized_pools(kernels, seqs, block_size, heads, head_dim,
                                                             window_left, name) -> None:
    fmt = _fmt(name)
    num_q_heads, num_kv_heads = heads
    kv_lens = [p + n for p, n in seqs]
    k_pool, v_pool, k_scales, v_scales, tables, k_deq, v_deq = _quantized_pools(
        kv_lens, block_size, num_kv_heads, head_dim, fmt, seed=sum(kv_lens))
    gen = torch.Generator().manual_seed(3)
    num_tokens = sum(n for _, n in seqs)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    indptr = torch.tensor([0] + torch.tensor([n for _, n in seqs]).cumsum(0).tolist())
    prefix = torch.tensor([p for p, _ in seqs], dtype=torch.int32)
    scale = head_dim ** -0.5
    got = native_attention.paged_extend(kernels, q, indptr, prefix, k_pool, v_pool, tables, sm_scale=scale,
                                        window_left=window_left, k_scales=k_scales, v_scales=v_scales)
    # the reference reads the prefix from the dequantized pools and the suffix as given: the
    # same dequantized values, which the C kernel reads back from the quantized pools
    flat_k, flat_v = k_deq.flatten(0, 1), v_deq.flatten(0, 1)
    suffix_slots = torch.cat([
        torch.tensor([int(tables[i, pos // block_size]) * block_size + pos % block_size
                      for pos in range(p, p + n)]) for i, (p, n) in enumerate(seqs)])
    want = reference.extend_attention(q, flat_k[suffix_slots], flat_v[suffix_slots], k_deq, v_deq, tables,
                                      prefix, indptr, max_q_len=max(n for _, n in seqs), sm_scale=scale,
                                      window_left=window_left)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * 3)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _within_one_step(got_q: torch.Tensor, got_s: torch.Tensor, x: torch.Tensor, fmt: kv_quant.KVFormat) -> None:
    """The kernel's bytes of its own fp32 rows against quantize_kv of torch's rows (equal up to
    summation order): scales to 1e-5 relative, values within one quantization step."""
    want_q, want_s = kv_quant.quantize_kv(x, fmt)
    torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=0)
    got = kv_quant.dequantize_kv(got_q, got_s)
    want = kv_quant.dequantize_kv(want_q, want_s)
    if fmt.name == "int8":
        step = want_s[..., None].expand_as(want)
    else:  # an e4m3fn step: 2^-3 of the value, 2^-9 at the subnormals, times the scale
        step = torch.maximum(want.abs() * 2.0 ** -3, want_s[..., None] * 2.0 ** -9)
    assert bool(((got - want).abs() <= step * 1.0001).all())
    assert float((got_q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean()) > 0.99


@pytest.mark.parametrize(("kv_lens", "heads", "head_dim", "block_size", "window_left"), [
    ([5, 16, 17, 300], (6, 2), 32, 16, -1),   # new tokens at, one past and far past a block edge
    ([9, 70, 2], (2, 2), 128, 8, 25),          # window
])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_layer_quantizes_its_write_and_attends_over_it(kernels, kv_lens, heads, head_dim, block_size,
                                                              window_left, weight_dtype, name) -> None:
    fmt = _fmt(name)
    num_q_heads, num_kv_heads = heads
    n, hidden, inter = len(kv_lens), 64, 48
    k_pool, v_pool, k_scales, v_scales, tables, _, _ = _quantized_pools(
        kv_lens, block_size, num_kv_heads, head_dim, fmt, seed=n)
    gen = torch.Generator().manual_seed(n + hidden)
    qkv_n = (num_q_heads + 2 * num_kv_heads) * head_dim

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(weight_dtype)

    weights = dict(qkv_weight=w(qkv_n, hidden), o_weight=w(hidden, num_q_heads * head_dim),
                   gate_up_weight=w(2 * inter, hidden), down_weight=w(hidden, inter))
    input_norm = 1 + 0.1 * torch.randn(hidden, generator=gen)
    post_norm = 1 + 0.1 * torch.randn(hidden, generator=gen)
    x0 = torch.randn(n, hidden, generator=gen)
    positions = torch.tensor(kv_lens) - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    # each sequence's new token goes to the slot of its last key (overwritten by the layer)
    slots = torch.tensor([int(tables[i, (kv_lens[i] - 1) // block_size]) * block_size
                          + (kv_lens[i] - 1) % block_size for i in range(n)], dtype=torch.int64)
    eps, scale = 1e-5, head_dim ** -0.5
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    got = x0.clone()
    step = native.DecodeStep(slots=slots, block_tables=tables, kv_lens=lens,
                             q_rows=torch.arange(n, dtype=torch.int64), cos=cos, sin=sin, sm_scale=scale,
                             window_left=window_left, chunk_tokens=64)
    native.decode_layer(kernels, got, step, input_norm=input_norm, qkv_bias=None, post_norm=post_norm,
                        rms_norm_eps=eps, k_pool=k_pool, v_pool=v_pool, num_q_heads=num_q_heads,
                        k_scales=k_scales, v_scales=v_scales, qkv_weight=weights["qkv_weight"],
                        o_weight=weights["o_weight"], gate_up_weight=weights["gate_up_weight"],
                        down_weight=weights["down_weight"])

    # torch: the same maths in fp32 on the exact (bf16) weight values
    wf = {key: t.float() for key, t in weights.items()}
    xq = _rms(x0, input_norm, eps) @ wf["qkv_weight"].T
    q, k, v = xq.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = _rope(q.view(n, num_q_heads, head_dim), cos[:, None], sin[:, None])
    k = _rope(k.view(n, num_kv_heads, head_dim), cos[:, None], sin[:, None])
    v = v.reshape(n, num_kv_heads, head_dim)
    flat_k, flat_v = k_pool.flatten(0, 1), v_pool.flatten(0, 1)
    flat_ks, flat_vs = k_scales.flatten(0, 1), v_scales.flatten(0, 1)
    _within_one_step(flat_k[slots], flat_ks[slots], k, fmt)
    _within_one_step(flat_v[slots], flat_vs[slots], v, fmt)
    # attention over the pools as the layer left them (its own written bytes included)
    k_deq = kv_quant.dequantize_kv(flat_k, flat_ks).view(k_pool.shape)
    v_deq = kv_quant.dequantize_kv(flat_v, flat_vs).view(v_pool.shape)
    attn = reference.decode_attention(q, k_deq, v_deq, tables, lens, sm_scale=scale, window_left=window_left)
    assert isinstance(attn, torch.Tensor)
    h = x0 + attn.reshape(n, -1) @ wf["o_weight"].T
    gate, up = (_rms(h, post_norm, eps) @ wf["gate_up_weight"].T).chunk(2, -1)
    want = h + (F.silu(gate) * up) @ wf["down_weight"].T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _QuantizedTorchCache:
    """Per-layer quantized pools written and read by torch: ``quantize_kv`` at the slots, then
    attention over ``dequantize_kv`` of the pools (the oracle of the native decode layer)."""

    def __init__(self, model: LoadedModel, fmt: kv_quant.KVFormat, num_blocks: int, block_size: int) -> None:
        shape = model.shape
        pool = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.fmt, self.block_size, self.head_dim = fmt, block_size, shape.head_dim
        self.k = [torch.zeros(pool, dtype=fmt.storage_dtype) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(pool, dtype=fmt.storage_dtype) for _ in range(shape.num_layers)]
        self.ks = [torch.zeros(pool[:3]) for _ in range(shape.num_layers)]
        self.vs = [torch.zeros(pool[:3]) for _ in range(shape.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for pools, scales, x in ((self.k, self.ks, k), (self.v, self.vs, v)):
            q, s = kv_quant.quantize_kv(x.float(), self.fmt)
            pools[layer].flatten(0, 1)[slots] = q
            scales[layer].flatten(0, 1)[slots] = s

    def dequantized(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer], self.v[layer]
        return (kv_quant.dequantize_kv(k.flatten(0, 1), self.ks[layer].flatten(0, 1)).view(k.shape),
                kv_quant.dequantize_kv(v.flatten(0, 1), self.vs[layer].flatten(0, 1)).view(v.shape))

    def clone(self) -> _QuantizedTorchCache:
        other = object.__new__(_QuantizedTorchCache)
        other.fmt, other.block_size, other.head_dim = self.fmt, self.block_size, self.head_dim
        for attr in ("k", "v", "ks", "vs"):
            setattr(other, attr, [t.clone() for t in getattr(self, attr)])
        return other


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_native_with_scale_pools_matches_a_torch_quantized_cache(kernels, tiny_d32: LoadedModel,
                                                                        model_dtype, name) -> None:
    # Three sequences of 5, 16 and 33 cached tokens (block size 16: the new token in the middle of
    # a block, at the start of one, one past one) decode one token: decode_native's C layers
    # against the torch forward over a cache written with quantize_kv.
    fmt = _fmt(name)
    fwd = LlamaForward(tiny_d32.shape, tiny_d32.state_dict, dtype=model_dtype, native_kernels=kernels)
    assert fwd.native is kernels
    gen = torch.Generator().manual_seed(9)
    lengths, block_size = [5, 16, 33], 16
    tables = torch.tensor([[0, -1, -1], [1, 2, -1], [3, 4, 5]], dtype=torch.int32)
    cache = _QuantizedTorchCache(tiny_d32, fmt, num_blocks=6, block_size=block_size)
    ids = [torch.randint(0, 1000, (n + 1,), generator=gen) for n in lengths]

    def slots_of(i: int, positions: torch.Tensor) -> torch.Tensor:
        return tables[i].to(torch.int64)[positions // block_size] * block_size + positions % block_size

    for i, n in enumerate(lengths):  # prefill, one sequence per forward
        positions = torch.arange(n)

        def prefill_attention(layer, q, k, v, _i=i, _n=n, _pos=positions):
            cache.write(layer, slots_of(_i, _pos), k, v)
            k_deq, v_deq = cache.dequantized(layer)
            keys = k_deq.flatten(0, 1)[slots_of(_i, _pos)].to(q.dtype)
            values = v_deq.flatten(0, 1)[slots_of(_i, _pos)].to(q.dtype)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(0, 1)

        fwd.forward(ids[i][:n], positions, prefill_attention)

    positions = torch.tensor(lengths)
    new_slots = torch.cat([slots_of(i, positions[i:i + 1]) for i in range(3)])
    kv_lens = positions.to(torch.int32) + 1
    torch_cache = cache.clone()

    def decode_attention(layer, q, k, v):
        torch_cache.write(layer, new_slots, k, v)
        k_deq, v_deq = torch_cache.dequantized(layer)
        out = reference.decode_attention(q.float(), k_deq, v_deq, tables, kv_lens,
                                         sm_scale=tiny_d32.shape.head_dim ** -0.5)
        assert isinstance(out, torch.Tensor)
        return out.to(q.dtype)

    input_ids = torch.stack([ids[i][n] for i, n in enumerate(lengths)])
    want = fwd.forward(input_ids, positions, decode_attention)
    got = fwd.decode_native(input_ids, positions, cache.k, cache.v, new_slots, tables, kv_lens,
                            k_scales=cache.ks, v_scales=cache.vs)
    assert got.shape == (3, tiny_d32.shape.vocab_size) and got.dtype == torch.float32
    atol = 1e-4 if model_dtype == torch.float32 else 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the fused write stored the new tokens' quantized K/V and their scales
    for layer in range(tiny_d32.shape.num_layers):
        assert bool((cache.ks[layer].flatten(0, 1)[new_slots] > 0).all())
        written = cache.k[layer].flatten(0, 1)[new_slots].view(torch.uint8)
        reference_written = torch_cache.k[layer].flatten(0, 1)[new_slots].view(torch.uint8)
        if model_dtype == torch.float32:  # the same K up to summation order
            assert float((written == reference_written).float().mean()) > 0.97

    with pytest.raises(ValueError, match="k_scales, v_scales"):
        fwd.decode_native(input_ids, positions, cache.k, cache.v, new_slots, tables, kv_lens, k_scales=cache.ks)
    with pytest.raises(ValueError, match="v_scales"):
        fwd.decode_native(input_ids, positions, cache.k, cache.v, new_slots, tables, kv_lens,
                          k_scales=cache.ks, v_scales=cache.vs[:1])
    with pytest.raises(ValueError, match="k_scales"):  # quantized pools without their scales
        fwd.decode_native(input_ids, positions, cache.k, cache.v, new_slots, tables, kv_lens)


def test_bad_scale_pools_are_refused_by_name(kernels) -> None:
    fmt = _fmt("int8")
    k_pool, v_pool, k_scales, v_scales, tables, _, _ = _quantized_pools([20, 3], 4, 2, 32, fmt, seed=1)
    q = torch.randn(2, 4, 32)
    rows, lens = torch.arange(2), torch.tensor([20, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scales"):
        native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, sm_scale=0.2)
    with pytest.raises(ValueError, match="v_scales"):
        native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, k_scales=k_scales,
                            v_scales=v_scales[:, :2], sm_scale=0.2)
    with pytest.raises(ValueError, match="k_scales"):
        native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, k_scales=k_scales.double(),
                            v_scales=v_scales, sm_scale=0.2)
    with pytest.raises(ValueError, match="k_scales"):  # scales with an unquantized pool
        native.paged_decode(kernels, q, rows, k_pool.float(), v_pool.float(), tables, lens, k_scales=k_scales,
                            v_scales=v_scales, sm_scale=0.2)
    with pytest.raises(ValueError, match="k_pool, v_pool"):  # int8 K with fp8 V
        native.paged_decode(kernels, q, rows, k_pool, v_pool.view(torch.float8_e4m3fn), tables, lens,
                            k_scales=k_scales, v_scales=v_scales, sm_scale=0.2)
    indptr, prefix = torch.tensor([0, 1, 2]), torch.tensor([19, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="v_scales"):
        native_attention.paged_extend(kernels, q, indptr, prefix, k_pool, v_pool, tables, sm_scale=0.2,
                                      k_scales=k_scales)
    with pytest.raises(ValueError, match="k_scales, v_scales"):  # the unchecked launch still refuses
        native_attention.launch(kernels, q, indptr.to(torch.int64), prefix, k_pool, v_pool, tables,
                                sm_scale=0.2, window_left=-1, out=torch.empty_like(q))
    x = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="k_pool"):
        native.paged_kv_write(kernels, x, x, k_pool.float(), v_pool.float(), torch.tensor([0, 1]),
                              k_scales=k_scales, v_scales=v_scales)
    with pytest.raises(ValueError, match="slot_mapping"):
        native.paged_kv_write(kernels, x, x, k_pool, v_pool, torch.tensor([0, k_pool.shape[0] * 4]),
                              k_scales=k_scales, v_scales=v_scales)
    with pytest.raises(ValueError, match="k:"):
        native.paged_kv_write(kernels, torch.randn(2, 3, 32), x, k_pool, v_pool, torch.tensor([0, 1]),
                              k_scales=k_scales, v_scales=v_scales)
    before = (k_pool.clone(), k_scales.clone())
    with pytest.raises(ValueError, match="v:"):
        native.paged_kv_write(kernels, x, torch.randn(3, 2, 32), k_pool, v_pool, torch.tensor([0, 1]),
                              k_scales=k_scales, v_scales=v_scales)
    assert torch.equal(k_pool.view(torch.uint8), before[0].view(torch.uint8))  # nothing written
    assert torch.equal(k_scales.nan_to_num(-1), before[1].nan_to_num(-1))


def test_kv_quant_formats_are_the_kv_quant_names() -> None:
    assert native.KV_QUANT_FORMATS == ("int8", "fp8_e4m3")
    assert native_attention.KV_QUANT_FORMATS == native.KV_QUANT_FORMATS
    for name in native.KV_QUANT_FORMATS:
        assert _fmt(name).storage_dtype in native.KV_QUANT_DTYPES

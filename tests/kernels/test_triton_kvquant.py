"""Triton kernels over int8 / fp8_e4m3 KV pools with per-(token, KV head) fp32 scale pools.

- ``paged_kv_write`` with scale pools stores exactly ``kv_quant.quantize_kv``'s bytes and scales
  (compared bit for bit, rounding ties, subnormal fp8 values, ±448, 0 and -0 included), and
  touches no other slot.
- ``extend_attention`` / ``decode_attention`` over quantized pools equal the torch reference run
  on the dequantized pools (``dequantize_kv`` to fp32; the suffix of an extend as
  ``dequantize(quantize(k))``, what the pool holds) within the unquantized kernels' tolerance
  (``tests.kernels.paged.tolerance``): dequantized K/V are exact fp32 numbers, so the kernels
  add no error of their own. Scale pools are NaN outside written slots, so a kernel that reads
  a wrong slot or ignores a mask fails.
- A prefix hit at and one token past a block boundary attends over the same values as a cold
  prefill of the whole prompt.

Cases are tiny: under ``TRITON_INTERPRET=1`` every launch runs on numpy.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from radixkv.kernels import triton_backend as triton_ops
from radixkv.kernels.kv_quant import KVFormat, dequantize_kv, quantize_kv, resolve_kv_format
from tests.kernels.paged import DEVICE, LSE_TOL, PagedBatch, dtype_id, make_paged_batch, nan_like, tolerance

FORMATS = {name: resolve_kv_format(name, torch.float32) for name in ("int8", "fp8_e4m3")}
SENTINEL = 0x55  # byte of every unwritten value slot


def _fmt_id(value: object) -> str:
    if isinstance(value, torch.dtype):
        return dtype_id(value)
    return str(value)


def _empty_quant_pools(shape: tuple[int, ...], fmt: KVFormat) -> list[torch.Tensor]:
    """``[k_pool, v_pool, k_scales, v_scales]``: values all SENTINEL bytes, scales NaN."""
    values = [torch.full(shape, SENTINEL, dtype=torch.uint8, device=DEVICE).view(fmt.storage_dtype)
              for _ in range(2)]
    scales = [torch.full(shape[:3], float("nan"), dtype=torch.float32, device=DEVICE) for _ in range(2)]
    return values + scales


def _write(k: torch.Tensor, v: torch.Tensor, pools: list[torch.Tensor], slots: torch.Tensor) -> None:
    triton_ops.paged_kv_write(k, v, pools[0], pools[1], slots, k_scale_pool=pools[2], v_scale_pool=pools[3])


def _quantize_batch(batch: PagedBatch, fmt: KVFormat, *, suffix: bool = True) -> list[torch.Tensor]:
    """Quantized pools holding each sequence's prefix and (``suffix``) its suffix rows, written
    by the Triton kernel as the runner does before attending."""
    pools = _empty_quant_pools(tuple(batch.k_pool.shape), fmt)
    indptr = batch.qo_indptr.tolist()
    for i, (p, l) in enumerate(batch.seqs):
        _write(batch.prefix_k[i].to(DEVICE), batch.prefix_v[i].to(DEVICE), pools, batch.slots(i, range(p)))
        if suffix:
            rows = slice(indptr[i], indptr[i + 1])
            _write(batch.k[rows], batch.v[rows], pools, batch.slots(i, range(p, p + l)))
    return pools


def _roundtrip(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """What a pool of ``fmt`` gives back for rows ``x``, as fp32."""
    return dequantize_kv(*quantize_kv(x, fmt))


def _reference_extend(batch: PagedBatch, pools: list[torch.Tensor], fmt: KVFormat, **kwargs):
    """The torch reference over the dequantized pools, in fp32."""
    k_pool, v_pool = dequantize_kv(pools[0], pools[2]), dequantize_kv(pools[1], pools[3])
    return reference.extend_attention(batch.q.float(), _roundtrip(batch.k, fmt), _roundtrip(batch.v, fmt),
                                      k_pool, v_pool, batch.block_tables, batch.prefix_lens, batch.qo_indptr,
                                      max_q_len=batch.max_q_len, **kwargs)


def _quant_kwargs(pools: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"k_scale_pool": pools[2], "v_scale_pool": pools[3]}


# ----------------------------------------------------------------------------- write


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_write_stores_quantize_kv_bytes_and_scales(name: str, dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(7)
    num_tokens, heads, head_dim, block_size = 21, 3, 48, 4
    num_blocks = 12
    # Rows of very different magnitudes (the scale is per row), one all-zero row, one -0 row.
    magnitude = 10.0 ** torch.randint(-6, 7, (num_tokens, 2 * heads + 1, 1), generator=gen).float()
    fused = (torch.randn(num_tokens, 2 * heads + 1, head_dim, generator=gen) * magnitude).to(dtype)
    fused[3, 1] = 0.0
    fused[4, heads + 2] = -0.0
    k, v = fused[:, :heads], fused[:, heads + 1:]  # strided views, as the runner passes them
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::6] = -1  # padding rows are skipped
    pools = _empty_quant_pools((num_blocks, block_size, heads, head_dim), fmt)
    _write(k, v, pools, slots.to(torch.int32).to(DEVICE))

    kept = slots >= 0
    flat_slots = slots[kept].to(DEVICE)
    for values, scales, x in ((pools[0], pools[2], k), (pools[1], pools[3], v)):
        want_q, want_scale = quantize_kv(x[kept.to(DEVICE)], fmt)
        got_q = values.view(torch.uint8).view(-1, heads, head_dim)[flat_slots]
        assert torch.equal(got_q, want_q.view(torch.uint8))
        got_scale = scales.view(-1, heads)[flat_slots]
        assert torch.equal(got_scale.view(torch.int32), want_scale.view(torch.int32))
        # Every other slot is untouched: sentinel bytes, NaN scales.
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
        untouched[flat_slots] = False
        assert bool((values.view(torch.uint8).view(-1, heads, head_dim)[untouched] == SENTINEL).all())
        assert bool(scales.view(-1, heads)[untouched].isnan().all())
        assert int(untouched.sum()) == num_blocks * block_size - int(kept.sum())


def _int8_tie_rows() -> torch.Tensor:
    """Rows whose amax is 127, so inv = 1 and the scaled values are the inputs themselves:
    every half-integer tie in (-127, 127), and the fp32 neighbours of a few of them."""
    ties = torch.arange(-126.5, 127.0, 1.0)
    near = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5])
    values = torch.cat([ties, torch.nextafter(near, torch.tensor(200.0)), torch.nextafter(near, torch.tensor(-200.0)),
                        torch.tensor([0.0, -0.0, 127.0, -127.0, 0.49999997, 1e-30])])
    return values


def _fp8_tie_rows() -> torch.Tensor:
    """Values for rows whose amax is 448 (inv = 1): every midpoint between neighbouring finite
    e4m3fn values (normal and subnormal), its fp32 neighbours, and edge cases."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    grid = codes.view(torch.float8_e4m3fn).float()   # 0 .. 448, increasing
    mids = (grid[:-1] + grid[1:]) / 2                  # exact in fp32
    up, down = torch.nextafter(mids, torch.tensor(1e4)), torch.nextafter(mids, torch.tensor(-1.0))
    positive = torch.cat([grid, mids, up, down, torch.tensor([1e-30, 2.0 ** -10, 447.99, 440.0])])
    return torch.cat([positive, -positive, torch.tensor([-0.0])])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_write_rounds_ties_like_quantize_kv(name: str) -> None:
    fmt = FORMATS[name]
    values = _int8_tie_rows() if name == "int8" else _fp8_tie_rows()
    head_dim = 64
    per_row = head_dim - 1
    num_rows = -(-values.numel() // per_row)
    padded = torch.cat([values, torch.zeros(num_rows * per_row - values.numel())])
    x = torch.cat([torch.full((num_rows, 1), fmt.qmax), padded.view(num_rows, per_row)], dim=1)
    x = x.view(num_rows, 1, head_dim).to(DEVICE)
    pools = _empty_quant_pools((num_rows, 1, 1, head_dim), fmt)
    slots = torch.arange(num_rows, device=DEVICE)
    _write(x, -x, pools, slots)
    for values_pool, scales, rows in ((pools[0], pools[2], x), (pools[1], pools[3], -x)):
        want_q, want_scale = quantize_kv(rows, fmt)
        assert torch.equal(want_scale, torch.ones_like(want_scale))  # the rows test rounding alone
        assert torch.equal(values_pool.view(torch.uint8).view(num_rows, 1, head_dim), want_q.view(torch.uint8))
        assert torch.equal(scales.view(num_rows, 1), want_scale)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_write_matches_quantize_kv_on_a_wide_random_sweep(name: str) -> None:
    # 1024 tokens x 2 heads x 64 values: magnitudes from 1e-30 to 1e30 per row, and rows with
    # one outlier 1e4 times the rest (most scaled values then land in fp8's subnormal range or
    # round to 0 / ±1 in int8).
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(11)
    num_tokens, heads, head_dim = 1024, 2, 64
    x = torch.randn(num_tokens, heads, head_dim, generator=gen)
    x *= 10.0 ** torch.randint(-30, 31, (num_tokens, heads, 1), generator=gen).float()
    outliers = torch.rand(num_tokens, heads, generator=gen) < 0.5
    x[..., 0] = torch.where(outliers, x[..., 0] * 1e4, x[..., 0])
    x = x.to(DEVICE)
    pools = _empty_quant_pools((num_tokens // 16, 16, heads, head_dim), fmt)
    slots = torch.randperm(num_tokens, generator=gen).to(DEVICE)
    _write(x, x.flip(0), pools, slots)
    for values, scales, rows in ((pools[0], pools[2], x), (pools[1], pools[3], x.flip(0))):
        want_q, want_scale = quantize_kv(rows, fmt)
        assert torch.equal(values.view(torch.uint8).view(-1, heads, head_dim)[slots], want_q.view(torch.uint8))
        assert torch.equal(scales.view(-1, heads)[slots], want_scale)


# ----------------------------------------------------------------------------- extend


EXTEND_CASES = [  # (format, dtype, block size, heads): sequences are (P, L) at / past block boundaries
    ("int8", torch.float32, 4, (4, 2)),
    ("fp8_e4m3", torch.bfloat16, 4, (8, 2)),
    ("int8", torch.bfloat16, 16, (6, 2)),
    ("fp8_e4m3", torch.float32, 1, (4, 1)),
]


def _extend_seqs(block_size: int) -> list[tuple[int, int]]:
    b = block_size
    # P = 0, B, B + 1, 2B - 1 (one short of a boundary) and 3B; one L of 37 rows reaches past the
    # interpreter's 32-key tile, so the unmasked below-diagonal suffix loop runs too.
    return [(0, 9), (b, 5), (b + 1, 37), (2 * b - 1, 2), (3 * b, 1)]


@pytest.mark.parametrize("name,dtype,block_size,heads", EXTEND_CASES, ids=_fmt_id)
def test_extend_matches_reference_on_dequantized_pools(name: str, dtype: torch.dtype, block_size: int,
                                                        heads: tuple[int, int]) -> None:
    fmt = FORMATS[name]
    batch = make_paged_batch(_extend_seqs(block_size), block_size=block_size, heads=heads, dtype=dtype,
                             seed=block_size)
    pools = _quantize_batch(batch, fmt)
    out = nan_like(batch.q)
    got, lse = triton_ops.extend_attention(batch.q, batch.k, batch.v, pools[0], pools[1], batch.block_tables,
                                           batch.prefix_lens, batch.qo_indptr, max_q_len=batch.max_q_len,
                                           out=out, return_lse=True, **_quant_kwargs(pools))
    assert got is out and got.dtype == dtype and not got.isnan().any()
    want, want_lse = _reference_extend(batch, pools, fmt, return_lse=True)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_extend_reads_the_suffix_from_the_pool_not_from_k_v(name: str) -> None:
    # Quantized: attention sees the dequantized suffix the pool holds, so zeroing the k/v
    # arguments after the write changes nothing (they are only shape-checked).
    fmt = FORMATS[name]
    batch = make_paged_batch([(5, 6), (0, 3)], block_size=4, heads=(4, 2), seed=2)
    pools = _quantize_batch(batch, fmt)
    args = (batch.block_tables, batch.prefix_lens, batch.qo_indptr)
    got = triton_ops.extend_attention(batch.q, batch.k, batch.v, pools[0], pools[1], *args,
                                      max_q_len=batch.max_q_len, **_quant_kwargs(pools))
    zeros = triton_ops.extend_attention(batch.q, torch.zeros_like(batch.k), torch.zeros_like(batch.v),
                                        pools[0], pools[1], *args, max_q_len=batch.max_q_len,
                                        **_quant_kwargs(pools))
    assert torch.equal(got, zeros)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("prefix_len", [8, 9], ids=["P=2B", "P=2B+1"])
def test_prefix_hit_equals_cold_prefill(name: str, prefix_len: int) -> None:
    # Cold: the whole prompt (P + L tokens) written and attended in one extend. Hit: the first
    # P tokens written earlier (a cached prefix), then extend(P, L). Quantization is per token,
    # so the pools hold the same bytes, and the last L rows agree to fp32 rounding (the kernels
    # walk the keys in different tiles).
    fmt = FORMATS[name]
    block_size, suffix_len = 4, 7
    full = make_paged_batch([(0, prefix_len + suffix_len)], block_size=block_size, heads=(4, 2), seed=prefix_len)
    cold_pools = _quantize_batch(full, fmt)
    cold = triton_ops.extend_attention(*full.args()[:3], cold_pools[0], cold_pools[1], *full.args()[5:],
                                       max_q_len=full.max_q_len, **_quant_kwargs(cold_pools))

    hit_pools = _empty_quant_pools(tuple(full.k_pool.shape), fmt)
    cached, rest = slice(0, prefix_len), slice(prefix_len, prefix_len + suffix_len)
    _write(full.k[cached], full.v[cached], hit_pools, full.slots(0, range(prefix_len)))   # earlier request
    _write(full.k[rest], full.v[rest], hit_pools, full.slots(0, range(prefix_len, prefix_len + suffix_len)))
    for a, b in zip(cold_pools, hit_pools):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    hit = triton_ops.extend_attention(
        full.q[rest], full.k[rest], full.v[rest], hit_pools[0], hit_pools[1], full.block_tables,
        torch.tensor([prefix_len], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, suffix_len], dtype=torch.int32, device=DEVICE), max_q_len=suffix_len,
        **_quant_kwargs(hit_pools))
    torch.testing.assert_close(hit, cold[rest], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- decode


DECODE_CASES = [  # (format, dtype, block size, heads, splits)
    ("int8", torch.float32, 4, (8, 2), 3),
    ("fp8_e4m3", torch.bfloat16, 16, (6, 2), 2),
    ("fp8_e4m3", torch.float32, 4, (4, 1), 1),
    ("int8", torch.bfloat16, 1, (4, 2), 5),
]


@pytest.mark.parametrize("name,dtype,block_size,heads,splits", DECODE_CASES, ids=_fmt_id)
def test_decode_matches_reference_on_dequantized_pools(name: str, dtype: torch.dtype, block_size: int,
                                                        heads: tuple[int, int], splits: int) -> None:
    fmt = FORMATS[name]
    b = block_size
    kv_lens = sorted({1, max(1, b - 1), b, b + 1, 2 * b + 3, 37})
    batch = make_paged_batch([(n, 1) for n in kv_lens], block_size=b, heads=heads, dtype=dtype, seed=b + splits)
    pools = _quantize_batch(batch, fmt, suffix=False)  # the whole KV is "prefix" in the pool
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    out = nan_like(batch.q)
    got, lse = triton_ops.decode_attention(batch.q, pools[0], pools[1], batch.block_tables, lens, out=out,
                                           return_lse=True, num_kv_splits=splits, **_quant_kwargs(pools))
    assert got is out and not got.isnan().any()
    want, want_lse = reference.decode_attention(batch.q.float(), dequantize_kv(pools[0], pools[2]),
                                                dequantize_kv(pools[1], pools[3]), batch.block_tables, lens,
                                                return_lse=True)
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decode_equals_extend_of_the_last_token(name: str) -> None:
    # The runner decodes after writing the new token; an extend with P = kv_len - 1, L = 1 over
    # the same pools attends over the same dequantized keys.
    fmt = FORMATS[name]
    batch = make_paged_batch([(2 * 4, 1), (4 + 1, 1)], block_size=4, heads=(4, 2), seed=13)
    pools = _quantize_batch(batch, fmt)
    ext = triton_ops.extend_attention(batch.q, batch.k, batch.v, pools[0], pools[1], batch.block_tables,
                                      batch.prefix_lens, batch.qo_indptr, max_q_len=1, **_quant_kwargs(pools))
    dec = triton_ops.decode_attention(batch.q, pools[0], pools[1], batch.block_tables,
                                      (batch.prefix_lens + 1).to(torch.int32), num_kv_splits=2,
                                      **_quant_kwargs(pools))
    torch.testing.assert_close(dec, ext, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_triton_and_reference_backends_agree_on_quantized_pools(name: str) -> None:
    # The runner swaps backends by name: the same calls with scale pools store the same bytes
    # and scales and attend to the same values.
    fmt = FORMATS[name]
    batch = make_paged_batch([(5, 6), (8, 1), (0, 3)], block_size=4, heads=(4, 2), seed=17)
    tri = _quantize_batch(batch, fmt)
    ref = _empty_quant_pools(tuple(batch.k_pool.shape), fmt)
    indptr = batch.qo_indptr.tolist()
    for i, (p, l) in enumerate(batch.seqs):
        for k, v, positions in ((batch.prefix_k[i].to(DEVICE), batch.prefix_v[i].to(DEVICE), range(p)),
                                (batch.k[indptr[i]:indptr[i + 1]], batch.v[indptr[i]:indptr[i + 1]],
                                 range(p, p + l))):
            reference.paged_kv_write(k, v, ref[0], ref[1], batch.slots(i, positions), **_quant_kwargs(ref))
    for a, b in zip(tri, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.nan_to_num(7.0),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b.nan_to_num(7.0))
    tables = (batch.block_tables, batch.prefix_lens, batch.qo_indptr)
    got = triton_ops.extend_attention(batch.q, batch.k, batch.v, tri[0], tri[1], *tables,
                                      max_q_len=batch.max_q_len, **_quant_kwargs(tri))
    want = reference.extend_attention(batch.q, batch.k, batch.v, ref[0], ref[1], *tables,
                                      max_q_len=batch.max_q_len, **_quant_kwargs(ref))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    kv_lens = (batch.prefix_lens + 1).to(torch.int32)
    last = torch.tensor(indptr[1:], device=DEVICE) - 1
    got = triton_ops.decode_attention(batch.q[last], tri[0], tri[1], batch.block_tables, kv_lens,
                                      num_kv_splits=2, **_quant_kwargs(tri))
    want = reference.decode_attention(batch.q[last], ref[0], ref[1], batch.block_tables, kv_lens,
                                      **_quant_kwargs(ref))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run on the CPU's torch backend")
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_runner_triton_backend_matches_torch_backend_with_quantized_kv(name: str, tiny_model) -> None:
    # A real forward: prefill 13 tokens, extend 6 over the 13 cached (P not block aligned), then
    # two decode steps (the split-KV kernel), with the pools and scale pools the runner
    # allocates for the format; the torch backend on the same format gives the same logits.
    from radixkv.model.runner import ModelRunner

    block_size = 4
    ids = torch.randint(0, 49152, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(8, 2, -1))  # 6 blocks, descending ids
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tiny_model, num_blocks=12, block_size=block_size, attention_backend=backend,
                             kv_cache_dtype=name)
        assert runner.kv_format == FORMATS[name] and runner.k_pools[0].dtype == FORMATS[name].storage_dtype
        steps = [runner.forward(runner.build_batch([(ids[:13], 0, table)]), all_logits=True),
                 runner.forward(runner.build_batch([(ids[13:19], 13, table)]), all_logits=True)]
        for pos in (19, 20):
            steps.append(runner.forward(runner.build_batch([([ids[pos]], pos, table)])))
        logits[backend] = steps
    for want, got in zip(logits["torch"], logits["triton"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


_AOT_DRIVER = """
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixkv.kernels import decode, extend, kv_write

def ptx(fn, ptrs, constexprs, options):
    sig = {p.name: "constexpr" if p.is_constexpr else ptrs.get(p.name, "fp32" if p.name in ("sm_scale", "soft_cap")
           else "i32") for p in fn.params}
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=options).asm["ptx"]

out = {}
for fp8 in (False, True):
    pool = "*u8" if fp8 else "*i8"
    out["write_fp8" if fp8 else "write_int8"] = ptx(kv_write._paged_kv_write_quant_kernel,
        {"K": "*bf16", "V": "*bf16", "KPool": pool, "VPool": pool, "KScale": "*fp32", "VScale": "*fp32",
         "SlotMapping": "*i64"},
        dict(PAGE_SIZE=16, HEAD_DIM=64, QMAX=448.0 if fp8 else 127.0, IS_FP8=fp8, BLOCK_T=16, BLOCK_D=64),
        {"enable_fp_fusion": False})
common = dict(PAGE_SIZE=16, HEAD_DIM=64, BLOCK_D=64, HAS_WINDOW=False, HAS_SOFT_CAP=False, QUANT=True,
              UPCAST=False, DOT_PRECISION="tf32")
out["decode_fp8"] = ptx(decode._decode_split_kernel,
    {"Q": "*bf16", "KPool": "*fp8e4nv", "VPool": "*fp8e4nv", "KScale": "*fp32", "VScale": "*fp32",
     "BlockTables": "*i32", "KvLens": "*i32", "MidO": "*fp32", "MidLse": "*fp32"},
    dict(common, GROUP=4, BLOCK_H=16, BLOCK_N=32), {"num_warps": 4, "num_stages": 2})
out["extend_int8"] = ptx(extend._extend_kernel,
    {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KPool": "*i8", "VPool": "*i8", "KScale": "*fp32",
     "VScale": "*fp32", "BlockTables": "*i32", "PrefixLens": "*i32", "QoIndptr": "*i32", "Out": "*bf16",
     "Lse": "*fp32"},
    dict(common, GROUP=4, BLOCK_M=64, BLOCK_N=32, RETURN_LSE=False), {"num_warps": 4, "num_stages": 2})
json.dump(out, open(sys.argv[1], "w"))
"""


def test_quantized_kernels_compile_for_hopper_with_exact_rounding(tmp_path) -> None:
    # No GPU needed: Triton compiles for sm_90 down to PTX (and ptxas) on the CPU. The write's
    # PTX must divide with IEEE rounding (div.rn, not div.full / div.approx) and keep the
    # +-1.5 * 2**23 round-half-even pair as two separate rounded adds (no FMA contraction).
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "ptx.json"
    proc = subprocess.run([sys.executable, "-c", _AOT_DRIVER, str(out)], cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(out.read_text())
    for name in ("write_int8", "write_fp8"):
        assert "div.rn.f32" in ptx[name] and "div.full" not in ptx[name] and "div.approx" not in ptx[name]
        assert "add.rn.f32" in ptx[name] and "0f4B400000" in ptx[name] and "0fCB400000" in ptx[name]
        assert "fma.rn.f32" not in ptx[name]
    assert "e4m3" in ptx["decode_fp8"]  # the hardware fp8 -> wider conversion
    assert ".entry" in ptx["extend_int8"]


# ----------------------------------------------------------------------------- validation


def _bad_scale_calls(pools: list[torch.Tensor], fp_pools: list[torch.Tensor]):
    """(expected message start, scale/pool arguments) of invalid combinations."""
    k_pool, v_pool, ks, vs = pools
    return [
        ("k_scale_pool: required", (k_pool, v_pool, None, None)),
        ("v_scale_pool: required", (k_pool, v_pool, ks, None)),
        ("k_scale_pool: required", (k_pool, v_pool, None, vs)),
        ("k_scale_pool: given for an unquantized", (fp_pools[0], fp_pools[1], ks, vs)),
        ("v_scale_pool: shape", (k_pool, v_pool, ks, vs[:, :2])),
        ("k_scale_pool: dtype", (k_pool, v_pool, ks.double(), vs)),
        ("v_pool: dtype", (k_pool, v_pool.view(torch.uint8), ks, vs)),
    ]


def test_kernels_refuse_bad_scale_pools_naming_the_field() -> None:
    fmt = FORMATS["int8"]
    batch = make_paged_batch([(4, 3)], block_size=4, heads=(2, 1), seed=0)
    pools = _empty_quant_pools(tuple(batch.k_pool.shape), fmt)
    before = [t.clone() for t in pools]
    kv_lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    for message, (k_pool, v_pool, ks, vs) in _bad_scale_calls(pools, [batch.k_pool, batch.v_pool]):
        kwargs = {"k_scale_pool": ks, "v_scale_pool": vs}
        with pytest.raises(ValueError, match=message):
            triton_ops.paged_kv_write(batch.k, batch.v, k_pool, v_pool, batch.slots(0, range(4, 7)), **kwargs)
        with pytest.raises(ValueError, match=message):
            triton_ops.extend_attention(batch.q, batch.k, batch.v, k_pool, v_pool, batch.block_tables,
                                        batch.prefix_lens, batch.qo_indptr, max_q_len=3, **kwargs)
        with pytest.raises(ValueError, match=message):
            triton_ops.decode_attention(batch.q[:1], k_pool, v_pool, batch.block_tables, kv_lens, **kwargs)
    # Nothing was written by a refused call.
    for a, b in zip(before, pools):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.nan_to_num(7.0),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b.nan_to_num(7.0))

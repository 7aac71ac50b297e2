"""radixkv.kernels.gemm: the oneDNN prefill GEMM and the C elementwise kernels of a prefill,
against torch references (fp32 tight, bf16 within one-to-two bf16 ulps of the values)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import gemm, native


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("pack", [None, True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, pack: bool | None) -> None:
    g = _gen(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    lin = gemm.PackedLinear(w, b, pack=pack)
    packs = pack if pack is not None else True  # both dtypes pack by default
    fast = gemm.onednn_available() and (dtype == torch.float32 or gemm.onednn_bf16_supported())
    c_gemm = fast and packs and gemm.native_gemm(dtype) is not None  # fp32, AVX2 build: the C GEMM
    assert lin.backend == ("native" if c_gemm else "onednn" if fast else "torch")
    assert (lin.packed is not None) == (packs and fast) and lin.onednn == (fast and not c_gemm)
    # 96 columns: whole panels of the C GEMM (16 or 32 wide), so no padding either way
    assert lin.packed_bytes == (96 * 64 * w.element_size() if lin.packed is not None else 0)
    assert lin.weight is not None
    for m in (1, 33, 200):  # the pack hint is 2048 rows: any M must still be right
        x = torch.randn(m, 64, generator=g).to(dtype)
        y = lin(x)
        assert y.shape == (m, 96) and y.dtype == dtype
        ref = x.double() @ w.double().T + b.double()
        # fp32: K=64 products summed in fp32; bf16: the output rounded to 8 bits of mantissa.
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7 * float(ref.abs().max()) + 1e-2
        assert float((y.double() - ref).abs().max()) <= tol


def _require_onednn_bf16() -> None:
    if not gemm.onednn_available():
        pytest.skip("oneDNN linear unavailable here (torch without mkldnn, or RADIXKV_ONEDNN_GEMM=0)")
    if not gemm.onednn_bf16_supported():
        pytest.skip(gemm.BF16_UNSUPPORTED)


def test_packed_linear_can_drop_the_plain_weight() -> None:
    _require_onednn_bf16()
    g = _gen(5)
    w = torch.randn(40, 32, generator=g).bfloat16()
    x = torch.randn(3, 32, generator=g).bfloat16()
    kept = gemm.PackedLinear(w, pack=True)
    dropped = gemm.PackedLinear(w, pack=True, keep_plain=False)
    assert torch.equal(kept(x), dropped(x))
    assert dropped.weight is None and dropped.packed is not None and dropped.fallback_reason is None


def test_bf16_falls_back_to_f_linear_without_onednn_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT): torch's bf16 reorder and linear
    # raise there, so a bf16 PackedLinear must take F.linear and say why.
    monkeypatch.setattr(gemm, "onednn_bf16_supported", lambda: False)
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "0")  # fp32 on oneDNN, not the C GEMM
    g = _gen(8)
    w = torch.randn(24, 16, generator=g).bfloat16()
    b = torch.randn(24, generator=g).bfloat16()
    x = torch.randn(5, 16, generator=g).bfloat16()
    lin = gemm.PackedLinear(w, b, keep_plain=False)
    assert not lin.onednn and lin.packed is None and lin.weight is not None
    assert lin.packed_bytes == 0
    assert torch.equal(lin(x), F.linear(x, w, b))
    if gemm.onednn_available():
        assert lin.fallback_reason == gemm.BF16_UNSUPPORTED
        assert gemm.gemm_backend(torch.bfloat16) == f"torch F.linear ({gemm.BF16_UNSUPPORTED})"
        assert gemm.gemm_backend(torch.float32) == "onednn (packed weights)"
        assert gemm.PackedLinear(w.float()).onednn  # fp32 keeps oneDNN
    assert gemm.gflops(16, 32, 48, torch.bfloat16, repeats=1) > 0


def test_bf16_falls_back_when_the_reorder_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    if not gemm.onednn_available():
        pytest.skip("oneDNN linear unavailable here")
    monkeypatch.setattr(gemm, "onednn_bf16_supported", lambda: True)  # the check passed, yet:
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "0")  # fp32 on oneDNN, where the reorder raises

    def refuse(weight: torch.Tensor, rows: int) -> torch.Tensor:
        raise RuntimeError("bf16 path needs the cpu support avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(gemm, "_reorder", refuse)
    w = torch.randn(8, 16, generator=_gen(9)).bfloat16()
    x = torch.randn(3, 16, generator=_gen(10)).bfloat16()
    lin = gemm.PackedLinear(w, keep_plain=False)
    assert not lin.onednn and lin.packed is None and lin.weight is not None
    assert lin.fallback_reason is not None and "bf16 path needs the cpu support" in lin.fallback_reason
    assert torch.equal(lin(x), F.linear(x, w))
    with pytest.raises(RuntimeError, match="cpu support"):  # fp32 has no fallback to hide it
        gemm.PackedLinear(w.float(), pack=True)


def test_packed_linear_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="weight"):
        gemm.PackedLinear(torch.zeros(4))
    with pytest.raises(ValueError, match="weight"):
        gemm.PackedLinear(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        gemm.PackedLinear(torch.zeros(4, 8), torch.zeros(8))
    with pytest.raises(ValueError, match="bias"):
        gemm.PackedLinear(torch.zeros(4, 8), torch.zeros(4, dtype=torch.bfloat16))


def test_gflops_and_backend() -> None:
    assert gemm.gflops(16, 32, 48, torch.float32, repeats=2) > 0
    assert gemm.gflops(16, 32, 48, torch.bfloat16, repeats=1) > 0
    c_gemm = gemm.native_gemm(torch.float32)
    assert gemm.gemm_backend() == ("torch F.linear" if not gemm.onednn_available()
                                   else f"native {c_gemm.isa} (packed weights)" if c_gemm is not None
                                   else "onednn (packed weights)")
    with pytest.raises(ValueError, match="repeats"):
        gemm.gflops(16, 32, 48, repeats=0)
    with pytest.raises(ValueError, match="k"):
        gemm.gflops(16, -1, 48)
    with pytest.raises(ValueError, match="dtype"):
        gemm.gflops(16, 32, 48, torch.float16)
    assert not gemm.onednn_available("meta")


def test_env_turns_onednn_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm.DISABLE_ENV, "0")
    assert not gemm.onednn_available() and gemm.gemm_backend() == "torch F.linear"
    w = torch.randn(8, 16, generator=_gen(6)).bfloat16()
    lin = gemm.PackedLinear(w, keep_plain=False)
    x = torch.randn(3, 16, generator=_gen(7)).bfloat16()
    assert lin.packed is None and lin.weight is not None and torch.equal(lin(x), F.linear(x, w))


def test_bf16_dot_flags_from_cpuinfo_text() -> None:
    zen4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
            "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\nbugs\t\t: sysret_ss_attrs\n"
            "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert gemm.bf16_dot_flags(zen4) == ("avx512_bf16",)
    spr = "flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert gemm.bf16_dot_flags(spr) == ("avx512_bf16", "amx_bf16")
    # Zen 3 / Skylake: AVX-512 or AVX2 but no bf16 dot products; a flag in another line
    # (or a longer flag name containing it) does not count.
    assert gemm.bf16_dot_flags("flags\t\t: avx2 fma avx512f avx512_bf16x\n") == ()
    assert gemm.bf16_dot_flags("model name\t: avx512_bf16 marketing\nflags\t: avx2\n") == ()
    assert gemm.bf16_dot_flags("") == ()


def _kernels(isa: str) -> gemm.PrefillKernels:
    if isa not in native.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    loaded = native.load(isa)
    kernels = gemm.prefill_kernels(loaded)
    if kernels is None:
        pytest.skip(f"native kernels ({isa}) unavailable here")
    return kernels


ISAS = ["avx512", "avx2"]
DTYPES = [torch.float32, torch.bfloat16]


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # The torch path of LlamaForward._rms_norm.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 72, 5])  # whole vectors, a tail, a row shorter than a vector
def test_add_rms_norm(isa: str, dtype: torch.dtype, size: int) -> None:
    kernels = _kernels(isa)
    g = _gen(1)
    h = torch.randn(37, size, generator=g).to(dtype)
    d = torch.randn(37, size, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(size, generator=g)).to(dtype)
    out = gemm.add_rms_norm(kernels, h.clone(), w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7 * 4
    assert float((out.float() - _ref_norm(h, w, 1e-5).float()).abs().max()) <= tol
    h2 = h.clone()
    out = gemm.add_rms_norm(kernels, h2, w, 1e-5, d)
    assert torch.equal(h2, h + d)  # the residual add rounds to the dtype exactly as torch's
    assert float((out.float() - _ref_norm(h + d, w, 1e-5).float()).abs().max()) <= tol


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16, 40])
def test_rope_inplace(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    kernels = _kernels(isa)
    g = _gen(2)
    hq, hkv, rows = 4, 2, 29
    qkv = torch.randn(rows, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (rows,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.arange(512).double()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    out = qkv.clone()
    gemm.rope_inplace(kernels, out, hq + hkv, head_dim, positions, cos, sin)
    heads = qkv[:, :(hq + hkv) * head_dim].double().view(rows, hq + hkv, head_dim)
    ref = _rotate(heads, emb.cos()[positions][:, None], emb.sin()[positions][:, None])
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * float(ref.abs().max())
    got = out[:, :(hq + hkv) * head_dim].double().view(rows, hq + hkv, head_dim)
    assert float((got - ref).abs().max()) <= tol
    assert torch.equal(out[:, (hq + hkv) * head_dim:], qkv[:, (hq + hkv) * head_dim:])  # v untouched


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 21])
def test_silu_mul(isa: str, dtype: torch.dtype, inter: int) -> None:
    kernels = _kernels(isa)
    g = _gen(3)
    gate_up = (4 * torch.randn(13, 2 * inter, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -90.0])  # saturating exp(-g), silu(0) = 0
    out = gemm.silu_mul(kernels, gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert out.shape == (13, inter) and out.dtype == dtype
    tol = 1e-5 * float(ref.abs().max()) if dtype == torch.float32 else 2 ** -7 * float(ref.abs().max())
    assert float((out.double() - ref).abs().max()) <= tol
    assert float(out[0, 2]) == 0.0


def test_elementwise_validation() -> None:
    kernels = _kernels(native.cpu_isas()[0] if native.cpu_isas() else "avx2")
    h = torch.randn(4, 8)
    with pytest.raises(ValueError, match="hidden"):
        gemm.add_rms_norm(kernels, h.T, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        gemm.add_rms_norm(kernels, h, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        gemm.add_rms_norm(kernels, h, torch.ones(8), 1e-5, torch.ones(4, 9))
    with pytest.raises(ValueError, match="x"):
        gemm.add_rms_norm(kernels, h.half(), torch.ones(8).half(), 1e-5)
    cos = torch.ones(16, 8)
    with pytest.raises(ValueError, match="positions"):
        gemm.rope_inplace(kernels, h, 1, 8, torch.zeros(3, dtype=torch.int64), cos, cos)
    with pytest.raises(ValueError, match="positions"):
        gemm.rope_inplace(kernels, h, 1, 8, torch.zeros(4, dtype=torch.int32), cos, cos)
    with pytest.raises(ValueError, match="cos"):
        gemm.rope_inplace(kernels, h, 1, 8, torch.zeros(4, dtype=torch.int64), cos.double(), cos)
    with pytest.raises(ValueError, match="heads"):
        gemm.rope_inplace(kernels, h, 2, 8, torch.zeros(4, dtype=torch.int64), cos, cos)
    with pytest.raises(ValueError, match="gate_up"):
        gemm.silu_mul(kernels, torch.randn(4, 7))
    with pytest.raises(ValueError, match="gate_up"):
        gemm.silu_mul(kernels, torch.randn(8, 4).T)


# --------------------------------------------------------------------------- the C GEMM
# csrc/cpu_gemm.c once per ISA build this CPU runs. Shapes aim at its edges: M not a multiple
# of the 6-row tile, N not a multiple of the 16/32-column panel, K across its kc-blocks (at
# most 320 on AVX2, 160 on AVX-512, so 321 / 700 / 1537 take 2-5 blocks with a short last one),
# fewer rows than threads need (the column split). Tolerance: fp32 sums in another order than
# the fp64 reference, outputs ~N(0, 1): measured max error 3e-6 at K = 1537.


def _c_gemm(isa: str) -> gemm.NativeGemm:
    if isa not in native.cpu_isas():
        pytest.skip(f"this CPU lacks the instructions of the {isa} build "
                    f"({', '.join(native._missing_features(isa))})")
    loaded = native.load(isa)
    if loaded is None:
        pytest.skip(f"native kernels ({isa}) unavailable here")
    return gemm.NativeGemm(loaded.lib, isa)


def _pack(c_gemm: gemm.NativeGemm, w: torch.Tensor) -> torch.Tensor:
    packed = torch.empty(int(c_gemm.packed_floats(*w.shape)))
    assert c_gemm.pack(w.data_ptr(), *w.shape, w.stride(0), packed.data_ptr()) == 0
    return packed


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (5, 7, 3), (6, 16, 16), (7, 33, 17), (13, 320, 32),
                                           (13, 321, 33), (50, 700, 48), (97, 1537, 65), (200, 64, 3)])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])  # 4 on (50, 700, 48): 2 row parts x 2 column parts
def test_c_gemm_matches_fp64_reference(isa: str, m: int, k: int, n: int, threads: int) -> None:
    c_gemm = _c_gemm(isa)
    g = _gen(m * 131 + k * 7 + n)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    bias = torch.randn(n, generator=g)
    # x and C inside wider rows (lda = k + 5, ldc = n + 3): the kernel must keep to its columns
    x_rows = torch.randn(m, k + 5, generator=g)
    x = x_rows[:, 2:2 + k]
    packed = _pack(c_gemm, w)
    for b in (bias, None):
        c_rows = torch.full((m, n + 3), float("nan"))
        rc = c_gemm.run(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                        None if b is None else b.data_ptr(), c_rows.data_ptr(), n + 3, threads)
        assert rc == 0
        ref = x.double() @ w.double().T + (0.0 if b is None else b.double())
        torch.testing.assert_close(c_rows[:, :n].double(), ref, rtol=1e-5, atol=2e-5)
        assert bool(c_rows[:, n:].isnan().all())  # the 3 columns past n untouched


@pytest.mark.parametrize("isa", ISAS)
def test_c_gemm_packed_layout_and_bad_sizes(isa: str) -> None:
    c_gemm = _c_gemm(isa)
    nr = c_gemm.panel_columns
    assert nr == {"avx2": 16, "avx512": 32}[isa]
    n, k = nr + 3, 5
    w = torch.arange(n * k, dtype=torch.float32).view(n, k) + 1
    packed = _pack(c_gemm, w)
    assert packed.numel() == 2 * nr * k
    # panel p = columns p*nr .. p*nr+nr-1 as [k][nr], zeros past n
    padded = torch.cat([w, torch.zeros(2 * nr - n, k)]).view(2, nr, k).transpose(1, 2).reshape(-1)
    assert torch.equal(packed, padded)
    x, c = torch.ones(2, k), torch.empty(2, n)
    assert c_gemm.pack(w.data_ptr(), 0, k, k, packed.data_ptr()) == -1
    assert c_gemm.pack(w.data_ptr(), n, k, k - 1, packed.data_ptr()) == -1
    assert c_gemm.run(x.data_ptr(), 0, k, k, packed.data_ptr(), n, None, c.data_ptr(), n, 1) == -1
    assert c_gemm.run(x.data_ptr(), 2, k, k, packed.data_ptr(), n, None, c.data_ptr(), n - 1, 1) == -1
    # the packed weight's panels are read with aligned loads: a misaligned one is refused
    assert c_gemm.run(x.data_ptr(), 2, k, k, packed[1:].data_ptr(), n, None, c.data_ptr(), n, 1) == -1


_SMALL_TEAM = """
import torch
from radixkv.kernels import gemm, native
c_gemm = gemm.NativeGemm(native.load("avx2").lib, "avx2")
g = torch.Generator().manual_seed(3)
m, k, n = 50, 700, 48
w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
packed = torch.empty(int(c_gemm.packed_floats(n, k)))
assert c_gemm.pack(w.data_ptr(), n, k, k, packed.data_ptr()) == 0
c = torch.full((m, n), float("nan"))
assert c_gemm.run(x.data_ptr(), m, k, k, packed.data_ptr(), n, None, c.data_ptr(), n, 4) == 0
torch.testing.assert_close(c.double(), x.double() @ w.double().T, rtol=1e-5, atol=2e-5)
print("ok")
"""


def test_c_gemm_splits_the_team_it_gets() -> None:
    # OMP_THREAD_LIMIT=1 gives a one-thread team to a region that asks for 4: the split must
    # follow the team, or three quarters of C stay unwritten (NaN here) behind a 0 return.
    _c_gemm("avx2")
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", _SMALL_TEAM], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_packed_linear_on_the_c_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    if not gemm.onednn_available():
        pytest.skip("the prefill fast path (oneDNN available) is off here")
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "1")  # any build, also an AVX-512 one
    if gemm.native_gemm(torch.float32) is None:
        pytest.skip("native kernels unavailable here")
    g = _gen(11)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    lin = gemm.PackedLinear(w, b, keep_plain=False)
    assert lin.backend == "native" and not lin.onednn and lin.weight is None
    wide = torch.randn(9, 30, generator=g)
    for x in (wide[:, :24], wide[:, :24].contiguous(), torch.randn(24, 9, generator=g).T):
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert lin(torch.empty(0, 24)).shape == (0, 40)
    # one row whose row stride torch ignores (a transposed column: strides (1, 1))
    column = torch.randn(24, 1, generator=g).t()
    torch.testing.assert_close(lin(column), F.linear(column, w, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x: need a CPU float32"):
        lin(torch.ones(3, 23))
    with pytest.raises(ValueError, match="x: need a CPU float32"):
        lin(torch.ones(3, 24, dtype=torch.bfloat16))
    # the packed copy is fp32 whatever torch's default dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        wide_default = gemm.PackedLinear(w)
    finally:
        torch.set_default_dtype(previous)
    assert wide_default.packed is not None and wide_default.packed.dtype == torch.float32
    nr = wide_default._native.panel_columns if wide_default._native is not None else 0
    assert nr in (16, 32) and wide_default.packed_bytes == -(-40 // nr) * nr * 24 * 4  # 40 -> 48 or 64 columns
    torch.testing.assert_close(wide_default(wide[:, :24]), F.linear(wide[:, :24], w), rtol=1e-5, atol=1e-5)
    # bf16 weights never take the C GEMM
    assert gemm.native_gemm(torch.bfloat16) is None


def test_native_gemm_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "sometimes")
    with pytest.raises(ValueError, match="RADIXKV_NATIVE_GEMM"):
        gemm.native_gemm()
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "0")
    assert gemm.native_gemm() is None
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "auto")
    loaded = native.load()
    chosen = gemm.native_gemm()
    # auto: the C GEMM on CPUs without AVX-512 only (there oneDNN reaches 91-95 % of the peak)
    no_avx512 = "avx512" not in native.cpu_isas()
    assert (chosen is not None) == (loaded is not None and no_avx512)
    if "avx2" in native.cpu_isas() and native.load("avx2") is not None:
        monkeypatch.setenv(native.ISA_ENV, "avx2")  # forcing the AVX2 build does not change auto
        forced = gemm.native_gemm()
        assert (forced is not None) == no_avx512
        if forced is not None:
            assert forced.isa == "avx2" and forced.panel_columns == 16
            if gemm.onednn_available():
                assert gemm.gemm_backend(torch.float32) == "native avx2 (packed weights)"
        monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "1")
        on = gemm.native_gemm()
        assert on is not None and on.isa == "avx2"

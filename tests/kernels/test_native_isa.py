"""Every native decode entry point (linear, paged_decode, decode_layer) against torch, once per
ISA build this CPU runs (``avx512`` with 16-lane vectors, ``avx2`` with 8), with fp32 and bf16
weights / pools; and the ISA selection (``RADIXKV_NATIVE_ISA``, missing CPU features).

Shapes aim at the width-generic code's edges: K a multiple of 8 but not of 16 (the AVX-512
build's masked tail), head dims 32 / 64 / 128 (the AVX-512 build's P.V runs 64-dim blocks and a
32-dim rest), odd batch sizes (the linear kernel pairs rows), GQA groups 1 / 3 / 5 / 16 (the
P.V kernel takes 3 query heads at a time), sliding windows across chunks.

Tolerances: fp32 in a different summation order (RK_VL-lane partial sums, chunked softmax
merged at the end, a polynomial ``exp`` of relative error ~1e-7). bf16 operands are compared
against the same maths in fp32 on the exact bf16 values (``.float()``), so only summation order
differs there too; the K/V a layer writes are compared to the reference rounded to bf16 (one
bf16 step, 2^-8 relative, where the fp32 values straddle a rounding boundary). The runner's bf16
decode logits are compared to the torch bf16 path, which rounds every intermediate to bf16 while
the kernel stays fp32: 0.1 absolute on logits up to 3.5 (the tiny random model; a bf16 step
there is 2^-6, the measured gap 0.042, 0.039 for a mixed step's rows); and they must be closer than that path to the fp32 model
on the same (bf16-valued) weights (measured 0.021 against 0.035).
"""

from __future__ import annotations

import dataclasses
import logging
import platform

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import native, reference
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner
from tests.conftest import make_tiny_model_dir
from tests.kernels.paged import decode_pools

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the native kernels are x86-64 (AVX2 or AVX-512) only")


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(("m", "k", "n"), [(1, 24, 7), (3, 72, 33), (5, 584, 9), (17, 8, 4),
                                           (2, 1536, 13), (32, 40, 65)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_tails_and_odd_rows(kernels, m: int, k: int, n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 7919 + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    got = native.linear(kernels, x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, x @ w.float().T + bias, rtol=1e-5, atol=2e-5)
    if dtype == torch.bfloat16:  # a bf16 x is widened, the result rounded once to bf16
        xb = x.to(torch.bfloat16)
        got_b = native.linear(kernels, xb, w)
        assert got_b.dtype == torch.bfloat16
        torch.testing.assert_close(got_b.float(), (xb.float() @ w.float().T).to(torch.bfloat16).float(),
                                   rtol=2 ** -7, atol=1e-5)


def test_linear_rejects_mixed_dtypes(kernels) -> None:
    with pytest.raises(ValueError, match="x, weight"):
        native.linear(kernels, torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(3, 16))
    with pytest.raises(ValueError, match="x, weight"):
        native.linear(kernels, torch.randn(2, 16), torch.randn(3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        native.linear(kernels, torch.randn(2, 16), torch.randn(3, 16, dtype=torch.bfloat16),
                      torch.randn(3, dtype=torch.float16))


@pytest.mark.parametrize(("kv_lens", "block_size", "heads", "head_dim", "window_left", "chunk"), [
    ([1, 17, 300, 515], 16, (9, 3), 64, -1, 256),   # SmolLM2's heads, ragged, chunk merge
    ([33, 5, 64], 1, (4, 4), 32, -1, 7),            # page size 1, no GQA, D 32 (< one 64-dim block)
    ([130, 2, 77], 8, (10, 2), 32, 20, 16),         # group 5, window across chunks
    ([40, 9, 3], 5, (8, 2), 128, -1, 12),           # block size 5: sub-blocks start mid-vector
    ([257], 16, (16, 1), 96, 100, 64),              # MQA group 16, D 96 = 64 + a 32 rest
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_reference(kernels, kv_lens, block_size, heads, head_dim, window_left,
                                        chunk, dtype) -> None:
    num_q_heads, num_kv_heads = heads
    k_pool, v_pool, tables = decode_pools(kv_lens, block_size, num_kv_heads, head_dim, dtype, seed=len(kv_lens))
    gen = torch.Generator().manual_seed(11)
    n = len(kv_lens)
    rows = torch.tensor([2, 0, 5, 3][:n], dtype=torch.int64)
    q = torch.randn(6, num_q_heads, head_dim, generator=gen)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, -7.0)
    native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, sm_scale=scale,
                        window_left=window_left, out=out, chunk_tokens=chunk)
    want = reference.decode_attention(q[rows], k_pool.float(), v_pool.float(), tables, lens,
                                      sm_scale=scale, window_left=window_left)
    torch.testing.assert_close(out[rows], want, rtol=0, atol=3e-6)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == -7.0).all())


def test_paged_decode_bf16_queries_write_bf16_rows(kernels) -> None:
    k_pool, v_pool, tables = decode_pools([50, 7], 4, 2, 64, torch.bfloat16, seed=3)
    q = torch.randn(3, 6, 64).to(torch.bfloat16)
    rows = torch.tensor([2, 0], dtype=torch.int64)
    lens = torch.tensor([50, 7], dtype=torch.int32)
    out = torch.full_like(q, 5.0)
    native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, sm_scale=0.125, out=out)
    want = reference.decode_attention(q[rows].float(), k_pool.float(), v_pool.float(), tables, lens,
                                      sm_scale=0.125)
    torch.testing.assert_close(out[rows].float(), want.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)
    assert bool((out[1] == 5.0).all())
    with pytest.raises(ValueError, match="k_pool, v_pool"):
        native.paged_decode(kernels, q, rows, k_pool, v_pool.float(), tables, lens, sm_scale=0.125)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize(("kv_lens", "hidden", "inter", "heads", "head_dim", "block_size", "window_left",
                          "bias"), [
    ([5, 40, 300], 72, 40, (6, 2), 32, 4, -1, True),     # hidden, I % 16 == 8; group 3; 2 chunks
    ([1], 64, 48, (4, 1), 64, 16, -1, False),            # batch 1, first token, MQA
    ([9, 70, 2, 33, 18], 96, 24, (2, 2), 128, 8, 25, False),  # batch 5, D 128, window
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_layer_matches_torch(kernels, kv_lens, hidden, inter, heads, head_dim, block_size,
                                    window_left, bias, dtype) -> None:
    num_q_heads, num_kv_heads = heads
    n = len(kv_lens)
    k_pool, v_pool, tables = decode_pools(kv_lens, block_size, num_kv_heads, head_dim, dtype, seed=n)
    gen = torch.Generator().manual_seed(n + hidden)
    qkv_n = (num_q_heads + 2 * num_kv_heads) * head_dim

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    weights = dict(qkv_weight=w(qkv_n, hidden), o_weight=w(hidden, num_q_heads * head_dim),
                   gate_up_weight=w(2 * inter, hidden), down_weight=w(hidden, inter))
    input_norm, post_norm = 1 + 0.1 * torch.randn(hidden, generator=gen), 1 + 0.1 * torch.randn(hidden, generator=gen)
    qkv_bias = 0.1 * torch.randn(qkv_n, generator=gen) if bias else None
    x0 = torch.randn(n, hidden, generator=gen)
    positions = torch.tensor(kv_lens) - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    # each sequence's new token goes to the slot of its last key (NaN until written)
    slots = torch.tensor([int(tables[i, (kv_lens[i] - 1) // block_size]) * block_size
                          + (kv_lens[i] - 1) % block_size for i in range(n)], dtype=torch.int64)
    eps, scale = 1e-5, head_dim ** -0.5
    lens = torch.tensor(kv_lens, dtype=torch.int32)

    # torch: the same maths in fp32 on the exact (bf16) weight values
    wf = {name: t.float() for name, t in weights.items()}
    xq = _rms(x0, input_norm, eps) @ wf["qkv_weight"].T + (qkv_bias if bias else 0)
    q, k, v = xq.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = _rope(q.view(n, num_q_heads, head_dim), cos[:, None], sin[:, None])
    k = _rope(k.view(n, num_kv_heads, head_dim), cos[:, None], sin[:, None])
    kf, vf = k_pool.float().flatten(0, 1), v_pool.float().flatten(0, 1)
    kf[slots], vf[slots] = k.to(dtype).float(), v.view(n, num_kv_heads, head_dim).to(dtype).float()
    attn = reference.decode_attention(q, kf.view(k_pool.shape), vf.view(v_pool.shape), tables, lens,
                                      sm_scale=scale, window_left=window_left)
    h = x0 + attn.reshape(n, -1) @ wf["o_weight"].T
    gate, up = (_rms(h, post_norm, eps) @ wf["gate_up_weight"].T).chunk(2, -1)
    want = h + (F.silu(gate) * up) @ wf["down_weight"].T

    got = x0.clone()
    step = native.DecodeStep(slots=slots, block_tables=tables, kv_lens=lens,
                             q_rows=torch.arange(n, dtype=torch.int64), cos=cos, sin=sin, sm_scale=scale,
                             window_left=window_left, chunk_tokens=256 if n < 5 else 16)
    kernels.take_attention_seconds()
    native.decode_layer(kernels, got, step, input_norm=input_norm, qkv_bias=qkv_bias, post_norm=post_norm,
                        rms_norm_eps=eps, k_pool=k_pool, v_pool=v_pool, num_q_heads=num_q_heads, **weights)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The layer timed its attention part (clock_gettime in the parallel region), then reset.
    attention_s = kernels.take_attention_seconds()
    assert 0 < attention_s < 10 and kernels.take_attention_seconds() == 0.0
    written_k = k_pool.flatten(0, 1)[slots].float()
    written_v = v_pool.flatten(0, 1)[slots].float()
    step_tol = dict(rtol=2 ** -8, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(written_k, k, **step_tol)
    torch.testing.assert_close(written_v, v.reshape(n, num_kv_heads, head_dim), **step_tol)


def test_decode_layer_rejects_mixed_dtypes(kernels) -> None:
    k_pool, v_pool, tables = decode_pools([3], 4, 1, 32, torch.bfloat16, seed=1)
    step = native.DecodeStep(slots=torch.tensor([2]), block_tables=tables,
                             kv_lens=torch.tensor([3], dtype=torch.int32), q_rows=torch.tensor([0]),
                             cos=torch.ones(1, 32), sin=torch.zeros(1, 32), sm_scale=0.2, window_left=-1,
                             chunk_tokens=256)
    bf = dict(qkv_weight=torch.zeros(96, 16, dtype=torch.bfloat16), o_weight=torch.zeros(16, 32),
              gate_up_weight=torch.zeros(16, 16, dtype=torch.bfloat16),
              down_weight=torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="o_weight"):
        native.decode_layer(kernels, torch.zeros(1, 16), step, input_norm=torch.ones(16), qkv_bias=None,
                            post_norm=torch.ones(16), rms_norm_eps=1e-5, k_pool=k_pool, v_pool=v_pool,
                            num_q_heads=1, **bf)
    bf["o_weight"] = bf["o_weight"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="input_norm"):
        native.decode_layer(kernels, torch.zeros(1, 16), step, input_norm=torch.ones(16, dtype=torch.bfloat16),
                            qkv_bias=None, post_norm=torch.ones(16), rms_norm_eps=1e-5, k_pool=k_pool,
                            v_pool=v_pool, num_q_heads=1, **bf)


@pytest.fixture(scope="module")
def tiny_d32_bf16(tmp_path_factory) -> LoadedModel:
    """The tiny model (head_dim 32, which the native decode kernel takes) in bf16."""
    return load_model(str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-d32-bf16"), head_dim=32)),
                      dtype=torch.bfloat16)


def test_bf16_decode_steps_match_the_torch_bf16_path(kernels, tiny_d32_bf16: LoadedModel, monkeypatch) -> None:
    # Three sequences (1, 13 and 70 cached tokens) decode two tokens each: one C call per layer
    # with bf16 weights and pools, against the reference backend's bf16 torch path.
    monkeypatch.setenv(native.ISA_ENV, kernels.isa)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 15, 72)]
    tables = [[0], list(range(1, 5)), list(range(5, 23))]
    results = {}
    fp32_twin = dataclasses.replace(tiny_d32_bf16, dtype=torch.float32,
                                    state_dict={k: t.float() for k, t in tiny_d32_bf16.state_dict.items()})
    for name, model, backend in (("native", tiny_d32_bf16, "torch"), ("torch", tiny_d32_bf16, "reference"),
                                 ("fp32", fp32_twin, "reference")):
        runner = ModelRunner(model, num_blocks=24, block_size=4, attention_backend=backend)
        assert (runner._native_decode is kernels) == (name == "native")
        runner.forward(runner.build_batch([(ids[0][:1], 0, tables[0]), (ids[1][:13], 0, tables[1]),
                                           (ids[2][:70], 0, tables[2])]))
        calls = []
        if name == "native":
            real = native.decode_layer
            monkeypatch.setattr(native, "decode_layer",
                                lambda *a, _real=real, _calls=calls, **k: _calls.append(a[0].isa) or _real(*a, **k))
        steps = []
        for j in range(2):
            batch = runner.build_batch([([ids[0][1 + j]], 1 + j, tables[0]), ([ids[1][13 + j]], 13 + j, tables[1]),
                                        ([ids[2][70 + j]], 70 + j, tables[2])])
            steps.append(runner.forward(batch).float())
        if name == "native":
            monkeypatch.setattr(native, "decode_layer", real)
            assert calls == [kernels.isa] * (2 * tiny_d32_bf16.shape.num_layers)
        results[name] = torch.stack(steps)
    assert results["native"].shape == (2, 3, tiny_d32_bf16.shape.vocab_size)
    torch.testing.assert_close(results["native"], results["torch"], rtol=0, atol=0.1)
    # fp32 inside the kernel: closer to the fp32 model on the same weights than the torch
    # bf16 path is (only the cached K/V are rounded to bf16)
    native_err = float((results["native"] - results["fp32"]).abs().max())
    torch_err = float((results["torch"] - results["fp32"]).abs().max())
    assert native_err < torch_err


def test_bf16_mixed_step_decode_rows_match_the_torch_bf16_path(kernels, tiny_d32_bf16: LoadedModel,
                                                              monkeypatch) -> None:
    # Two decodes, an extend and a prefill in one bf16 step: the decode rows go through
    # paged_decode over the bf16 pools (bf16 queries widened, outputs rounded once to bf16).
    monkeypatch.setenv(native.ISA_ENV, kernels.isa)
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (70, 9, 23, 6)]
    tables = [list(range(0, 18)), list(range(18, 21)), list(range(21, 28)), list(range(28, 30))]
    results = {}
    for backend in ("torch", "reference"):
        runner = ModelRunner(tiny_d32_bf16, num_blocks=32, block_size=4, attention_backend=backend)
        runner.forward(runner.build_batch([(ids[0][:69], 0, tables[0]), (ids[1][:8], 0, tables[1]),
                                           (ids[2][:15], 0, tables[2])]))
        calls = []
        if backend == "torch":
            real = native.paged_decode
            monkeypatch.setattr(native, "paged_decode",
                                lambda *a, _real=real, _calls=calls, **k: _calls.append(1) or _real(*a, **k))
        step = runner.build_batch([([ids[0][69]], 69, tables[0]), (ids[2][15:], 15, tables[2]),
                                   ([ids[1][8]], 8, tables[1]), (ids[3], 0, tables[3])])
        results[backend] = runner.forward(step, all_logits=True).float()
        if backend == "torch":
            monkeypatch.setattr(native, "paged_decode", real)
            assert len(calls) == tiny_d32_bf16.shape.num_layers
    torch.testing.assert_close(results["torch"], results["reference"], rtol=0, atol=0.1)


def test_isa_env_and_argument(monkeypatch, caplog) -> None:
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match=native.ISA_ENV):
        native.load()
    with pytest.raises(ValueError, match="isa"):
        native.load("neon")
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    forced = native.load()
    assert forced is not None and forced.isa == "avx2" and native.load("avx2") is forced
    assert forced.lib.rk_isa() == b"avx2" and "avx2" in native.cpu_isas()
    monkeypatch.setenv(native.ISA_ENV, "auto")
    assert native.load().isa == native.cpu_isas()[0]


def test_a_cpu_without_avx512_gets_the_avx2_build(monkeypatch, caplog) -> None:
    flags = native._cpu_flags()
    assert flags is not None and "avx2" in flags
    reduced = flags - {"avx512bw", "avx512dq"}
    monkeypatch.setattr(native, "_cpu_flags", lambda: reduced)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_logged", set())
    assert native.cpu_isas() == ["avx2"]
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.load("avx512") is None
        auto = native.load("auto")
    assert auto is not None and auto.isa == "avx2"
    # avx512bw and avx512dq on an AVX-512 CPU; all four on a CPU with AVX2 only.
    missing = [f for f in native._CPU_FLAGS["avx512"] if f not in reduced]
    assert {"avx512bw", "avx512dq"} <= set(missing)
    assert f"lacks {', '.join(missing)} for the avx512 build" in caplog.text
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags - {"avx2"})
    monkeypatch.setattr(native, "_state", {})
    assert native.cpu_isas() == [] and native.load() is None


def test_auto_falls_back_to_avx2_when_the_avx512_build_fails(monkeypatch, caplog, tmp_path) -> None:
    # An old compiler or assembler that cannot build the AVX-512 library: made real here with
    # a flag no compiler knows, so the avx512 build fails in the compiler itself.
    if native._missing_features("avx512"):
        pytest.skip("this CPU cannot run the avx512 build, so auto never tries it")
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_ISA_FLAGS", {**native._ISA_FLAGS, "avx512": (
        *native._ISA_FLAGS["avx512"], "-mradixkv-no-such-flag")})
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_logged", set())
    monkeypatch.setenv(native.ISA_ENV, "auto")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        auto = native.load()
        assert native.load("auto") is auto
    assert auto is not None and auto.isa == "avx2" and auto.lib.rk_isa() == b"avx2"
    assert native.load("avx512") is None  # named explicitly: that build or nothing
    assert "avx512 build or load failed" in caplog.text
    assert "the avx512 build is unavailable here; using the avx2 build" in caplog.text
    assert caplog.text.count("using the avx2 build") == 1  # logged once


def test_bf16_peak_reports_unavailable_from_a_compiler_without_its_intrinsics(monkeypatch, tmp_path) -> None:
    # -DRK_PEAK_NO_BF16 builds cpu_peak.c as a compiler before GCC 10 / Clang 9 must: without
    # the VDPBF16PS kernel; the library still builds and the fp32 peak still runs.
    from radixkv.kernels import cpu_peak

    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_ISA_FLAGS", {**native._ISA_FLAGS, "avx2": (
        *native._ISA_FLAGS["avx2"], "-DRK_PEAK_NO_BF16")})
    monkeypatch.setattr(native, "_state", {})
    lib = native.load("avx2")
    assert lib is not None
    lib.lib.rk_bf16_peak_compiled.restype = lib.lib.rk_cpu_has_avx512_bf16.restype
    assert lib.lib.rk_bf16_peak_compiled() == 0 and lib.lib.rk_cpu_has_avx512_bf16() == 0
    assert cpu_peak.bf16_dot_peak_gflops(0.01, 1, isa="avx2") is None
    assert (cpu_peak.fma_peak_gflops(0.01, 1, isa="avx2") or 0) > 0
    monkeypatch.setattr(native, "_ISA_FLAGS", dict(native._ISA_FLAGS, avx2=native._ISA_FLAGS["avx2"][:-1]))
    monkeypatch.setattr(native, "_state", {})
    normal = native.load("avx2")
    assert normal is not None
    assert normal.lib.rk_bf16_peak_compiled() == 1  # GCC >= 10 / Clang >= 9 here

"""The C decode kernels (``radixkv.kernels.native``) against torch: few-row linear, paged decode
attention over the pool, and the runner with them on and off.

Tolerances: fp32 with a different summation order (8-lane partial sums, chunked softmax
merged at the end, a polynomial ``exp`` of relative error ~1e-7): 1e-5 relative on the linear
outputs of K ≤ 1536 and 2e-6 absolute on attention outputs of unit-variance values.
"""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch

from radixkv.kernels import native, reference
from radixkv.kernels.paged_sdpa import plan_attention
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner
from tests.kernels.paged import decode_pools

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the native kernels are x86-64 (AVX2) only")


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    """The build ``native.load()`` picks for this CPU (conftest's ``kernels`` runs every build)."""
    lib = native.load()
    assert lib is not None, "the native kernels did not build (see the log: compiler, CPU flags)"
    return lib


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (2, 576, 3072), (3, 1536, 576),
                                           (16, 64, 7), (32, 576, 49), (5, 8, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(kernels, m: int, k: int, n: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = native.linear(kernels, x, w, bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_linear_takes_a_strided_x_and_names_bad_arguments(kernels) -> None:
    x = torch.randn(4, 32)[:, :16]  # non-contiguous rows: copied, not refused
    w = torch.randn(3, 16)
    torch.testing.assert_close(native.linear(kernels, x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="K % 8"):
        native.linear(kernels, torch.randn(2, 12), torch.randn(3, 12))
    with pytest.raises(ValueError, match="float32"):
        native.linear(kernels, torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(3, 16))
    with pytest.raises(ValueError, match="bias"):
        native.linear(kernels, torch.randn(2, 16), torch.randn(3, 16), torch.randn(4))


@pytest.mark.parametrize(("kv_lens", "block_size", "heads", "head_dim", "window_left", "chunk"), [
    ([1, 17, 300, 1000], 16, (9, 3), 64, -1, 256),   # SmolLM2's heads, ragged, chunk merge
    ([33, 5, 64], 1, (4, 4), 32, -1, 7),             # page size 1, no GQA, odd chunk
    ([130, 2, 77], 8, (8, 2), 32, 20, 16),           # sliding window across chunks
    ([40, 9], 4, (10, 2), 64, -1, 12),               # group 5: a partial 3-head tile
    ([513], 16, (16, 1), 128, -1, 256),              # MQA, group 16, D 128
])
def test_paged_decode_matches_reference(kernels, kv_lens, block_size, heads, head_dim, window_left,
                                        chunk) -> None:
    num_q_heads, num_kv_heads = heads
    k_pool, v_pool, tables = decode_pools(kv_lens, block_size, num_kv_heads, head_dim, seed=len(kv_lens))
    gen = torch.Generator().manual_seed(7)
    n = len(kv_lens)
    # Queries sit at rows 2, 0, 5 … of a larger packed batch, in that order.
    rows = torch.tensor([2, 0, 5, 3][:n], dtype=torch.int64)
    q = torch.randn(6, num_q_heads, head_dim, generator=gen)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, -7.0)
    native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, sm_scale=scale,
                        window_left=window_left, out=out, chunk_tokens=chunk)
    want = reference.decode_attention(q[rows], k_pool, v_pool, tables, lens, sm_scale=scale,
                                      window_left=window_left)
    torch.testing.assert_close(out[rows], want, rtol=0, atol=2e-6)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == -7.0).all())


def test_paged_decode_refuses_what_it_cannot_run(kernels) -> None:
    k_pool, v_pool, tables = decode_pools([5], 4, 2, 16, seed=1)  # D = 16: not a multiple of 32
    assert not native.decode_supported(2, 2, 16) and native.decode_supported(9, 3, 64)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="native decode refused"):
        native.paged_decode(kernels, q, torch.zeros(1, dtype=torch.int64), k_pool, v_pool, tables,
                            torch.tensor([5], dtype=torch.int32), sm_scale=0.3)
    with pytest.raises(ValueError, match="kv_lens"):
        native.paged_decode(kernels, q, torch.zeros(1, dtype=torch.int64), k_pool, v_pool, tables,
                            torch.tensor([5]), sm_scale=0.3)


def test_paged_decode_names_mismatched_shapes_and_rows(kernels) -> None:
    # Checked in Python: the C kernel indexes q by q_rows and reads N rows of lens and tables.
    k_pool, v_pool, tables = decode_pools([5, 9], 4, 1, 32, seed=2)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    rows = torch.tensor([0, 2], dtype=torch.int64)
    q = torch.randn(3, 2, 32)
    ref = native.paged_decode(kernels, q, rows, k_pool, v_pool, tables, lens, sm_scale=0.3)
    assert bool(torch.isfinite(ref[rows]).all())

    def call(**kw) -> None:
        args = {"q": q, "q_rows": rows, "block_tables": tables, "kv_lens": lens, **kw}
        native.paged_decode(kernels, args["q"], args["q_rows"], k_pool, v_pool, args["block_tables"],
                            args["kv_lens"], sm_scale=0.3)

    with pytest.raises(ValueError, match="^q: head dim 64 must equal the pool's 32"):
        call(q=torch.randn(3, 2, 64))
    with pytest.raises(ValueError, match=r"^q_rows: .*\[0, 3\).* values 0\.\.3"):
        call(q_rows=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"^q_rows: .* values -1\.\.2"):
        call(q_rows=torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="^q_rows: need a \\[N\\] tensor"):
        call(q_rows=torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^kv_lens: need \[2\]"):
        call(kv_lens=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^block_tables: need \[2, max_blocks\]"):
        call(block_tables=tables[:1].contiguous())


def test_plan_checks_native_decode_tables(kernels) -> None:
    with pytest.raises(ValueError, match="block_tables"):
        plan_attention(torch.tensor([[0, -1]]), torch.tensor([4]), torch.tensor([0, 1]),
                       torch.tensor([4]), block_size=4, num_pool_blocks=2, head_dim=8,
                       native_kernels=kernels)


def test_runner_with_native_kernels_matches_torch_on_a_mixed_step(tiny_d32: LoadedModel, kernels) -> None:
    # Prefixes written by per-sequence steps, then one step with two decodes (one long, one
    # short), an extend and a prefill: logits with the C kernels equal the torch path's.
    tiny_model = tiny_d32
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (70, 9, 23, 6)]
    tables = [list(range(0, 18)), list(range(18, 21)), list(range(21, 28)), list(range(28, 30))]
    results = {}
    for use in (True, False):
        runner = ModelRunner(tiny_model, num_blocks=32, block_size=4, native_kernels=use)
        assert (runner.native is not None) == use
        assert (runner._native_decode is not None) == use
        runner.forward(runner.build_batch([(ids[0][:69], 0, tables[0]), (ids[1][:8], 0, tables[1]),
                                           (ids[2][:15], 0, tables[2])]))
        step = runner.build_batch([([ids[0][69]], 69, tables[0]), (ids[2][15:], 15, tables[2]),
                                   ([ids[1][8]], 8, tables[1]), (ids[3], 0, tables[3])])
        results[use] = runner.forward(step, all_logits=True)
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=1e-4)


def test_runner_native_for_bfloat16_off_by_backend_compile_and_env(tiny_model: LoadedModel,
                                                                    tiny_d32: LoadedModel,
                                                                    monkeypatch) -> None:
    # bf16 runs on the C kernels too: decode (bf16 weights and pools) and prefill elementwise.
    bf16 = ModelRunner(dataclasses.replace(tiny_d32, dtype=torch.bfloat16), num_blocks=4, block_size=4)
    assert bf16.native is native.load() and bf16._native_decode is bf16.native
    assert bf16.forward_model.native is bf16.native
    assert ModelRunner(tiny_model, num_blocks=4, block_size=4, attention_backend="reference").native is None
    # --compile keeps every projection on torch (the compiled graph takes no ctypes call), and
    # the decode path with it: nothing may route a decode step to decode_native then.
    compiled = ModelRunner(tiny_model, num_blocks=4, block_size=4, compile=True)
    assert compiled.native is None and compiled._native_decode is None
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert ModelRunner(tiny_model, num_blocks=4, block_size=4).native is None


def test_pure_decode_step_runs_one_c_call_per_layer_and_matches_torch(tiny_d32: LoadedModel, kernels,
                                                                      monkeypatch) -> None:
    # Three sequences of 1, 13 and 70 cached tokens decode one token each, twice: the fused
    # layer kernel (norms, projections, RoPE, K/V write, attention, MLP) gives the torch path's
    # logits, and writes the same K/V into the pools.
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 15, 72)]
    tables = [[0], list(range(1, 5)), list(range(5, 23))]
    results, pools = {}, {}
    for use in (True, False):
        runner = ModelRunner(tiny_d32, num_blocks=24, block_size=4, native_kernels=use)
        calls = []
        if use:
            real = native.decode_layer
            monkeypatch.setattr(native, "decode_layer",
                                lambda *a, _calls=calls, _real=real, **k: _calls.append(1) or _real(*a, **k))
        runner.forward(runner.build_batch([(ids[0][:1], 0, tables[0]), (ids[1][:13], 0, tables[1]),
                                           (ids[2][:70], 0, tables[2])]))
        steps = []
        for j in range(2):
            batch = runner.build_batch([([ids[0][1 + j]], 1 + j, tables[0]), ([ids[1][13 + j]], 13 + j, tables[1]),
                                        ([ids[2][70 + j]], 70 + j, tables[2])])
            steps.append(runner.forward(batch))
        if use:
            monkeypatch.undo()
            assert len(calls) == 2 * tiny_d32.shape.num_layers
        results[use] = torch.stack(steps)
        pools[use] = torch.stack([p[:23] for p in runner.k_pools + runner.v_pools])
    assert results[True].shape == (2, 3, tiny_d32.shape.vocab_size)
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools[True], pools[False], rtol=1e-5, atol=1e-5)


def test_a_cache_dir_it_cannot_write_keeps_torch(tiny_model: LoadedModel, monkeypatch, tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(blocked))  # mkdir under a file fails
    assert native.load() is None
    runner = ModelRunner(tiny_model, num_blocks=4, block_size=4)
    assert runner.native is None and runner.forward_model.native is None

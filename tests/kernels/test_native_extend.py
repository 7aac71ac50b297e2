"""The C extend kernel (``radixkv.kernels.native_attention``) against the per-sequence reference,
once per ISA build this CPU runs, and the model runner with it against the reference backend.

Pools are NaN in every slot no sequence owns (``make_paged_batch``: spare blocks, the tail of
each last block, ``-1`` table padding past each sequence): a read the kernel should not make
turns its output into NaN. Block ids are a random permutation (non-contiguous tables).

Tolerance: fp32 with a different summation order (key tiles of 64, online softmax with
rescaling, a polynomial ``exp`` of relative error ~1e-7) on unit-variance inputs: 2e-5
absolute and relative, as the torch plan's tests. bf16 pools are widened exactly, so they are
compared with the reference on the same rounded values at the same tolerance.
"""

from __future__ import annotations

import ctypes
import math
import platform
import shutil
import subprocess

import pytest
import torch

from radixkv.kernels import native, native_attention, reference
from radixkv.kernels.paged_sdpa import plan_attention
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner

from .paged import make_paged_batch, reference_extend

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the native kernels are x86-64 only")

ATOL = RTOL = 2e-5


def _run(kernels: native.NativeKernels, seqs: list[tuple[int, int]], *, block_size: int,
         heads: tuple[int, int] = (9, 3), head_dim: int = 64, window_left: int = -1,
         dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference output) of one batch: the suffix K/V written first, as the
    engine does, so the kernel reads every key from the pool."""
    batch = make_paged_batch(seqs, block_size=block_size, heads=heads, head_dim=head_dim, dtype=dtype,
                             seed=seed, device=torch.device("cpu"))
    want = reference_extend(batch, window_left=window_left)
    slots = torch.cat([batch.slots(i, range(p, p + n)) for i, (p, n) in enumerate(seqs)])
    k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
    reference.paged_kv_write(batch.k, batch.v, k_pool, v_pool, slots)
    got = native_attention.paged_extend(kernels, batch.q.float().contiguous(), batch.qo_indptr,
                                        batch.prefix_lens, k_pool, v_pool, batch.block_tables,
                                        sm_scale=1.0 / math.sqrt(head_dim), window_left=window_left)
    return got, want


CASES = {  # id: ((P, L) per sequence, block size)
    "prefill-one": ([(0, 150)], 16),
    "prefix-at-block-edges": ([(0, 9), (15, 7), (16, 20), (17, 2), (31, 40)], 16),
    "prefix-large-ragged": ([(200, 70), (5, 3), (129, 64), (64, 65)], 16),
    "chunked-prefill": ([(300, 200)], 16),
    "decode-rows-mixed-in": ([(20, 1), (0, 33), (7, 1), (5, 9), (64, 1)], 16),
    "page-size-1": ([(6, 1), (3, 4), (0, 70), (65, 66)], 1),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_extend_matches_reference(kernels: native.NativeKernels, case: str) -> None:
    seqs, block_size = CASES[case]
    got, want = _run(kernels, seqs, block_size=block_size)
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("heads", "head_dim"), [((4, 4), 32), ((9, 3), 64), ((16, 2), 128),
                                                 ((4, 2), 16), ((3, 1), 48)],
                         ids=["mha-d32", "gqa3-d64", "gqa8-d128", "gqa2-d16", "mqa-d48"])
def test_extend_heads_and_dims(kernels: native.NativeKernels, heads: tuple[int, int], head_dim: int) -> None:
    got, want = _run(kernels, [(0, 70), (37, 29), (130, 2)], block_size=16, heads=heads, head_dim=head_dim)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def wide_pass_kernels(tmp_path_factory: pytest.TempPathFactory) -> native.NativeKernels:
    """The AVX2 build compiled with ``-DRK_NV=4``: the AVX-512 build's 4-vector column passes
    (32 floats here), so packed tiles get passes narrower than D (D = 48: 32 + 16) and K^T tiles
    of two passes, the layouts an AVX-512 build makes, on a CPU without AVX-512."""
    missing = native._missing_features("avx2")
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} for the avx2 build")
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None, "the native kernels need a C compiler"
    out = tmp_path_factory.mktemp("wide") / "radixkv-avx2-nv4.so"
    sources = sorted(str(p) for p in native._CSRC.glob("*.c"))
    subprocess.run([compiler, *native._COMMON_FLAGS, *native._ISA_FLAGS["avx2"], "-DRK_NV=4",
                    "-I", str(native._CSRC), "-o", str(out), *sources, "-lm"], check=True, timeout=300)
    return native.NativeKernels(ctypes.CDLL(str(out)), out, "avx2")


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_extend_with_four_vector_passes(wide_pass_kernels: native.NativeKernels, head_dim: int) -> None:
    got, want = _run(wide_pass_kernels, [(0, 70), (37, 29), (130, 2)], block_size=16, heads=(6, 2),
                     head_dim=head_dim)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window_left", [0, 4, 63, 64, 100])
def test_extend_sliding_window(kernels: native.NativeKernels, window_left: int) -> None:
    # Windows inside one key tile, at its edge and across tiles; prefixes longer than the
    # window, so whole tiles are skipped on the left.
    got, want = _run(kernels, [(0, 140), (200, 90), (10, 5)], block_size=16, window_left=window_left)
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_extend_bf16_pools(kernels: native.NativeKernels) -> None:
    got, want = _run(kernels, [(0, 90), (33, 17)], block_size=16, dtype=torch.bfloat16)
    torch.testing.assert_close(got, want.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("prefix", [0, 130])
def test_extend_scores_rising_and_falling_across_tiles(kernels: native.NativeKernels, prefix: int) -> None:
    # Scores along one direction of q and k: a drift of 3.2 over each 64-key tile and a step
    # at each tile edge of +4 (under the kernel's lazy-max bound of 8 log2 units, so the running
    # max trails the true max), +15 (over it: O rescaled) or -20, plus a ripple, so a row's max
    # moves up by small and large steps and down. Compared with an fp64 softmax written out
    # here on the same fp32 inputs at the usual tolerance (scores kept within ~+-20: fp32
    # rounding of larger scores alone costs ~2e-5).
    torch.manual_seed(3)
    hq, hkv, d, bs, L = 9, 3, 64, 16, 200
    S = prefix + L
    t = torch.arange(S, dtype=torch.float64)
    tile = torch.div(t, 64, rounding_mode="floor").long()
    offset = torch.tensor([0.0, 4.0, 19.0, -1.0, 3.0, 18.0], dtype=torch.float64)
    score = 0.05 * (t - 64 * tile) + offset[tile] + 3.0 * torch.sin(t / 5.0)
    score -= score.mean()
    scale = 1.0 / math.sqrt(d)
    k = 0.3 * torch.randn(S, hkv, d, dtype=torch.float64)
    k[:, :, 0] = score[:, None] / scale
    v = torch.randn(S, hkv, d, dtype=torch.float64)
    q = 0.3 * torch.randn(L, hq, d, dtype=torch.float64) / d
    q[:, :, 0] = 1.0
    q, k, v = (x.float().double() for x in (q, k, v))  # the kernel's fp32 inputs, exactly
    kq = k.repeat_interleave(hq // hkv, dim=1)  # [S, hq, d]
    vq = v.repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("lhd,shd->hls", q, kq) * scale
    visible = torch.arange(S)[None, :] <= (prefix + torch.arange(L))[:, None]
    prob = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    want = torch.einsum("hls,shd->lhd", prob, vq).float()

    nb = (S + bs - 1) // bs
    perm = torch.randperm(nb + 2)[:nb].to(torch.int32)
    k_pool = torch.full(((nb + 2) * bs, hkv, d), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    slots = (perm.long()[:, None] * bs + torch.arange(bs)).flatten()[:S]
    k_pool[slots] = k.float()
    v_pool[slots] = v.float()
    got = native_attention.paged_extend(kernels, q.float().contiguous(), torch.tensor([0, L]),
                                        torch.tensor([prefix], dtype=torch.int32),
                                        k_pool.view(nb + 2, bs, hkv, d), v_pool.view(nb + 2, bs, hkv, d),
                                        perm.view(1, nb).contiguous(), sm_scale=scale)
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_extend_refuses_what_it_cannot_run(kernels: native.NativeKernels) -> None:
    batch = make_paged_batch([(3, 5)], block_size=4, heads=(2, 1), head_dim=16, device=torch.device("cpu"))
    args = (batch.q, batch.qo_indptr, batch.prefix_lens, batch.k_pool, batch.v_pool, batch.block_tables)

    def call(*a: torch.Tensor, **kw: object) -> None:
        native_attention.paged_extend(kernels, *a, sm_scale=0.25, **kw)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="q:"):
        call(batch.q.double(), *args[1:])
    with pytest.raises(ValueError, match="k_pool:"):
        call(args[0], *args[1:3], batch.k_pool.half(), batch.v_pool.half(), args[5])
    with pytest.raises(ValueError, match="v_pool:"):
        call(*args[:4], torch.cat([batch.v_pool, batch.v_pool], -1)[..., :16], args[5])  # strided
    with pytest.raises(ValueError, match="block_tables:"):
        call(*args[:5], batch.block_tables.long())
    with pytest.raises(ValueError, match="block_tables:"):
        call(*args[:5], batch.block_tables[:, :1].contiguous())  # 8 keys need 2 blocks of 4
    with pytest.raises(ValueError, match="qo_indptr:"):
        call(args[0], torch.tensor([0, 4]), *args[2:])
    with pytest.raises(ValueError, match="window_left:"):
        call(*args, window_left=-2)
    with pytest.raises(ValueError, match="out:"):
        call(*args, out=torch.empty(5, 2, 8))
    q24 = torch.randn(5, 2, 24)
    pool24 = torch.zeros(3, 4, 1, 24)
    with pytest.raises(ValueError, match="q:"):
        call(q24, *args[1:3], pool24, pool24, args[5])
    assert not native_attention.extend_supported(3, 2, 64)
    assert not native_attention.extend_supported(2, 1, 272)
    assert native_attention.extend_supported(9, 3, 64)


def test_plan_routes_extend_rows_to_the_kernel(kernels: native.NativeKernels) -> None:
    # A mixed step through the plan: extend rows on the C extend kernel, decode rows on the C
    # decode kernel, no SDPA group left; the result equals the reference's.
    seqs = [(20, 1), (0, 33), (7, 1), (5, 9), (64, 70)]
    batch = make_paged_batch(seqs, block_size=16, heads=(6, 2), head_dim=32, device=torch.device("cpu"))
    slot_mapping = torch.cat([batch.slots(i, range(p, p + n)) for i, (p, n) in enumerate(seqs)])
    want = reference.extend_attention(*batch.args(), max_q_len=batch.max_q_len)
    for decode_kernels in (kernels, None):
        k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
        plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                              block_size=16, num_pool_blocks=k_pool.shape[0], head_dim=32,
                              native_kernels=decode_kernels, native_extend=kernels)
        assert plan.native_extend is not None
        assert plan.native_extend.rows is not None
        assert plan.native_extend.rows.tolist() == list(range(1, 34)) + list(range(35, 44 + 70))
        assert len(plan.groups) == (0 if decode_kernels is not None else 1)
        got = plan.attend(batch.q, batch.k, batch.v, k_pool, v_pool)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_plan_checks_native_extend_tables(kernels: native.NativeKernels) -> None:
    batch = make_paged_batch([(0, 9)], block_size=4, heads=(2, 1), head_dim=16, device=torch.device("cpu"))
    tables = batch.block_tables.clone()
    tables[0, 2] = -1  # the third block holds key 8
    slots = torch.arange(9)
    with pytest.raises(ValueError, match="block_tables"):
        plan_attention(tables, batch.prefix_lens, batch.qo_indptr, slots, block_size=4,
                       num_pool_blocks=batch.k_pool.shape[0], head_dim=16, native_extend=kernels)


def test_runner_native_extend_matches_reference_backend(tiny_model: LoadedModel) -> None:
    # A cold prefill, then a prefix hit extending it by an unaligned suffix in a step that also
    # prefills another sequence and decodes a third: the runner on the C kernels gives the
    # reference backend's logits for every row.
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (83, 40, 12)]
    tables = [list(range(0, 21)), list(range(21, 31)), list(range(31, 34))]
    logits = {}
    for backend in ("reference", "torch"):
        runner = ModelRunner(tiny_model, num_blocks=40, block_size=4, attention_backend=backend)
        if backend == "torch":
            if runner.native is None:
                pytest.skip("the native kernels are not available here")
            assert runner._native_extend is not None
        first = runner.forward(runner.build_batch([(ids[0][:45], 0, tables[0]), (ids[2][:11], 0, tables[2])]),
                               all_logits=True)
        step = [(ids[0][45:], 45, tables[0]), (ids[1], 0, tables[1]), ([ids[2][11]], 11, tables[2])]
        logits[backend] = (first, runner.forward(runner.build_batch(step), all_logits=True))
    for got, want in zip(logits["torch"], logits["reference"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_plan_bf16_pools_and_queries(kernels: native.NativeKernels) -> None:
    # A bf16 model: queries and pools bf16; the kernel widens both and returns fp32, which the
    # plan rounds to q's dtype. Reference: fp32 on the same rounded inputs; tolerance is the
    # final bf16 rounding (2^-8 relative).
    seqs = [(0, 40), (19, 23)]
    batch = make_paged_batch(seqs, block_size=8, heads=(6, 2), head_dim=32, dtype=torch.bfloat16,
                             device=torch.device("cpu"))
    slot_mapping = torch.cat([batch.slots(i, range(p, p + n)) for i, (p, n) in enumerate(seqs)])
    want = reference_extend(batch)
    k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
    plan = plan_attention(batch.block_tables, batch.prefix_lens, batch.qo_indptr, slot_mapping,
                          block_size=8, num_pool_blocks=k_pool.shape[0], head_dim=32, native_extend=kernels)
    assert plan.native_extend is not None and not plan.groups
    got = plan.attend(batch.q, batch.k, batch.v, k_pool, v_pool)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=8e-3, rtol=8e-3)


def test_extend_reads_a_row_strided_q_in_place(kernels: native.NativeKernels) -> None:
    # q as the model makes it: the first Hq * D columns of a fused [T, (Hq + 2 Hkv) D] qkv
    # output, rows (Hq + 2 Hkv) D apart. Same result as on a contiguous copy; a q whose heads
    # are not contiguous within a row is refused.
    seqs = [(0, 37), (21, 12)]
    batch = make_paged_batch(seqs, block_size=8, heads=(6, 2), head_dim=32, device=torch.device("cpu"))
    slots = torch.cat([batch.slots(i, range(p, p + n)) for i, (p, n) in enumerate(seqs)])
    k_pool, v_pool = batch.k_pool.clone(), batch.v_pool.clone()
    reference.paged_kv_write(batch.k, batch.v, k_pool, v_pool, slots)
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], 1)
    q_view = qkv[:, :6 * 32].view(-1, 6, 32)
    assert not q_view.is_contiguous()
    args = (batch.qo_indptr, batch.prefix_lens, k_pool, v_pool, batch.block_tables)
    got = native_attention.paged_extend(kernels, q_view, *args, sm_scale=0.2)
    want = native_attention.paged_extend(kernels, batch.q.contiguous(), *args, sm_scale=0.2)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, reference_extend(batch, sm_scale=0.2), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="q:"):
        native_attention.paged_extend(kernels, batch.q.transpose(0, 1).contiguous().transpose(0, 1)[:, ::2],
                                      *args, sm_scale=0.2)

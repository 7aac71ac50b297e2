"""Roofs, byte / FLOP models and timed points of ``bench/step.py`` (see its docstring).

Loaded by path like its caller (``bench/`` is on ``sys.path``); imports torch and radixkv.
"""

# No ``from __future__ import annotations``: the CLI loads bench/step.py (and so this) by path.
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from radixkv.eviction.cost_model import cost_shape_from_model_shape, prefill_flops
from radixkv.kernels import reference
from radixkv.kernels.kv_quant import resolve_kv_format
from radixkv.model.family_forward import make_forward
from radixkv.model.llama import LlamaForward
from radixkv.model.loader import LoadedModel, embedded_tokenizer_dir, load_model
from radixkv.model.runner import ModelRunner
from radixkv.tools.verify.variants import AttentionSettings

GIB = 1 << 30

#: The tiny random Llama of ``--tiny``: tests/conftest.py's ``TINY_CONFIG`` (kept equal there
#: by tests/bench/test_bench_step.py), SmolLM2's vocabulary so the tokenizer loads.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "initializer_range": 0.1, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2,
}
TINY_SEED = 1234


# Extra ModelRunner arguments of every point (``--compile``: {"compile": True}).
RUNNER_OPTIONS: dict = {}


def load_tiny_model(dtype: torch.dtype) -> LoadedModel:
    """Random-init :data:`TINY_CONFIG` Llama (seed :data:`TINY_SEED`), loaded through the HF loader."""
    import transformers  # deferred: heavy import, only for --tiny

    tmp = Path(tempfile.mkdtemp(prefix="radixkv-bench-step-tiny-"))
    try:
        torch.manual_seed(TINY_SEED)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIG))
        model.to(torch.float32).eval().save_pretrained(str(tmp))
        shutil.copytree(embedded_tokenizer_dir(), tmp, dirs_exist_ok=True)
        return load_model(str(tmp), dtype=dtype)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- models of work


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(model: LoadedModel) -> int:
    """Weight bytes one forward step reads: ``(P + vocab · hidden) · itemsize``.

    ``P`` is ``ModelShape.num_non_embedding_params()`` (every projection, norm and bias, once);
    ``vocab · hidden`` is the LM head, read whole for the logits (it is the embedding matrix
    when tied). The embedding lookup (N rows) and the RoPE tables are not counted.
    """
    shape = model.shape
    return (shape.num_non_embedding_params() + shape.vocab_size * shape.hidden_size) * itemsize(model.dtype)


def kv_bytes(model: LoadedModel, context: int, kv_cache_dtype: str = "auto") -> int:
    """K + V bytes a decode step reads of one sequence's ``context`` cached tokens in the
    ``kv_cache_dtype`` format, scales included: per layer, the cached tokens its attention sees
    (all ``ctx`` for a full layer; ``min(ctx, window_left)`` for a sliding-window layer, whose
    kernels read only the window) × that layer's bytes per token (unquantized
    ``2 · Hkv · D · itemsize``; int8 ``2 · Hkv · (D + 4)``). A model without windows reads
    ``ctx · KVFormat.bytes_per_token``; the pool still holds every token (keep-all)."""
    s = model.shape
    fmt = resolve_kv_format(kv_cache_dtype, model.dtype)
    per_layer_token = fmt.bytes_per_token(1, s.num_kv_heads, s.head_dim)
    return sum((context if left < 0 else min(context, left)) * per_layer_token
               for left in s.layer_window_lefts)


def times_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Wall times of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, ms."""
    return statistics.median(times_ms(fn, warmup, repeats))


def _copy_ms(numel: int, repeats: int) -> float:
    src = torch.rand(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), 1, repeats)  # buffers freed on return


def measure_roofs(dtype: torch.dtype, copy_bytes: int, gemm_n: int, repeats: int) -> dict:
    """Copy bandwidth and torch's square GEMM throughput of this machine, now.

    Copy: ``dst.copy_(src)`` of two contiguous ``copy_bytes`` buffers; ``gbps`` counts bytes
    read + bytes written (``2 · copy_bytes / t``), as ``bench kernels`` does. GEMM:
    ``torch.matmul`` of two ``gemm_n``² matrices of ``dtype``, ``2 · n³ / t`` FLOP/s (torch's
    own BLAS: MKL for fp32 in the x86 wheels; a comparison column, not the floor).
    """
    numel = copy_bytes // 4
    copy_ms = _copy_ms(numel, max(repeats, 3))
    a = torch.rand(gemm_n, gemm_n, dtype=dtype)
    b = torch.rand(gemm_n, gemm_n, dtype=dtype)
    gemm_ms = median_ms(lambda: torch.matmul(a, b), 1, max(repeats, 3))
    return {
        "copy": {"bytes": numel * 4, "ms": copy_ms, "gbps": 2 * numel * 4 / copy_ms / 1e6,
                 "counts": "read + write"},
        "gemm": {"n": gemm_n, "dtype": str(dtype)[6:], "ms": gemm_ms,
                 "gflops": 2 * gemm_n ** 3 / gemm_ms / 1e6, "library": "torch.matmul"},
    }


def measure_fma_peak(num_threads: int, seconds: float) -> dict:
    """The CPU's own peak (``radixkv.kernels.cpu_peak``) on ``num_threads`` threads.

    Returns:
        ``{"isa": the native build in use (``native.load()``) or None, "threads",
        "seconds": budget per measurement, "gflops": fp32 FMA peak of that build (None where
        no build runs here), "by_isa": {isa: fp32 FMA GFLOP/s} for every build this CPU runs,
        "chains": FMA chains per thread of the build in use, "bf16_dot_gflops": VDPBF16PS peak
        (None without AVX512_BF16, or from a compiler without its intrinsics), "amx_bf16":
        whether /proc/cpuinfo lists ``amx_bf16`` (AMX tiles outrun VDPBF16PS, so the bf16 dot
        peak is then no bound)}``.
    """
    from radixkv.kernels import cpu_peak, native

    in_use = native.load()
    isa = in_use.isa if in_use is not None else None
    by_isa: dict[str, float] = {}
    for name in native.cpu_isas():
        value = cpu_peak.fma_peak_gflops(seconds, num_threads, isa=name)
        if value is not None:
            by_isa[name] = value
    bf16 = cpu_peak.bf16_dot_peak_gflops(seconds, num_threads, isa=isa) if isa else None
    return {"isa": isa, "threads": num_threads, "seconds": seconds,
            "gflops": by_isa.get(isa) if isa else None, "by_isa": by_isa,
            "chains": cpu_peak.peak_chains(isa) if isa else None, "bf16_dot_gflops": bf16,
            "amx_bf16": "amx_bf16" in (native._cpu_flags() or set())}


def prefill_gemm_shapes(model: LoadedModel, tokens: int) -> list[dict]:
    """The four linear layers of one decoder layer in a ``tokens``-row prefill, as ``(m, k, n)``
    of ``y[m, n] = x[m, k] · w[n, k]ᵀ``: fused q/k/v, output, fused gate/up, down."""
    s = model.shape
    q_dim, kv_dim = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return [{"name": "qkv", "m": tokens, "k": s.hidden_size, "n": q_dim + 2 * kv_dim},
            {"name": "o", "m": tokens, "k": q_dim, "n": s.hidden_size},
            {"name": "gate_up", "m": tokens, "k": s.hidden_size, "n": 2 * s.intermediate_size},
            {"name": "down", "m": tokens, "k": s.intermediate_size, "n": s.hidden_size}]


def torch_linear_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """``torch.nn.functional.linear(x[m, k], w[n, k])`` throughput, ``2 · m · k · n / t`` GFLOP/s
    with ``t`` the best of ``repeats`` calls after two warm-ups (as the engine GEMM's
    ``gflops``): torch's own BLAS path, the comparison column."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    for _ in range(2):
        torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - started)
    return 2 * m * k * n / best / 1e9


def _engine_gemm() -> Any:
    """``radixkv.kernels.gemm`` (the engine's prefill GEMM), or None where it does not exist."""
    try:
        from radixkv.kernels import gemm
    except ImportError:
        return None
    return gemm if callable(getattr(gemm, "gflops", None)) else None


def gemm_backend_name(gemm: Any, dtype: torch.dtype | None = None) -> str | None:
    """What the engine GEMM module says it runs on for ``dtype`` (``gemm_backend(dtype)``:
    bf16 without oneDNN bf16 support names ``F.linear`` and why), else its name."""
    if gemm is None:
        return None
    for attr in ("gemm_backend", "backend", "BACKEND"):
        value = getattr(gemm, attr, None)
        if callable(value):
            try:
                value = value(dtype)
            except TypeError:  # an engine whose gemm_backend() takes no dtype
                value = value()
        if value is not None:
            return str(value)
    return gemm.__name__


def _aggregate(rows: list[dict], key: str) -> float | None:
    """Total FLOPs ÷ total time over ``rows`` (each ``2 · m · k · n`` FLOPs at ``row[key]``)."""
    if any(r.get(key) is None for r in rows):
        return None
    flops = [2 * r["m"] * r["k"] * r["n"] for r in rows]
    return sum(flops) / sum(f / r[key] for f, r in zip(flops, rows))


def measure_gemms(model: LoadedModel, dtype: torch.dtype, tokens: int, gemm_n: int,
                  repeats: int, peak_gflops: float | None) -> dict:
    """The engine's GEMM and torch's ``F.linear`` at the model's prefill shapes and a square.

    Engine: ``radixkv.kernels.gemm.gflops(m, k, n, dtype, repeats)``; torch:
    :func:`torch_linear_gflops`. ``model`` aggregates the four shapes of
    :func:`prefill_gemm_shapes` as their total FLOPs ÷ total time (the rate a prefill's linear
    layers run at); ``pct_of_peak`` = GFLOP/s ÷ ``peak_gflops`` · 100.

    Returns:
        ``{"backend", "tokens", "shapes": [{name, m, k, n, engine_gflops, torch_gflops}],
        "square": {"n", "engine_gflops", "torch_gflops"}, "model": {"engine_gflops",
        "torch_gflops", "engine_pct_of_peak", "torch_pct_of_peak"}}``; engine values are None
        (and ``backend`` None) where the engine GEMM module is missing.
    """
    gemm = _engine_gemm()
    reps = max(repeats, 3)

    def engine(m: int, k: int, n: int) -> float | None:
        return float(gemm.gflops(m, k, n, dtype, reps)) if gemm is not None else None

    shapes = [{**shape, "engine_gflops": engine(shape["m"], shape["k"], shape["n"]),
               "torch_gflops": torch_linear_gflops(shape["m"], shape["k"], shape["n"], dtype, reps)}
              for shape in prefill_gemm_shapes(model, tokens)]
    square = {"n": gemm_n, "engine_gflops": engine(gemm_n, gemm_n, gemm_n),
              "torch_gflops": torch_linear_gflops(gemm_n, gemm_n, gemm_n, dtype, reps)}

    return summarize_gemms({"backend": gemm_backend_name(gemm, dtype), "dtype": str(dtype)[6:],
                            "tokens": tokens, "shapes": shapes, "square": square}, peak_gflops)


def summarize_gemms(gemms: dict, peak_gflops: float | None) -> dict:
    """``gemms`` with ``model`` (the four shapes' total FLOPs ÷ total time, per library) and
    every ``*_pct_of_peak`` (GFLOP/s ÷ ``peak_gflops`` · 100; None without a peak) set anew."""
    def pct(value: float | None) -> float | None:
        return None if value is None or not peak_gflops else 100.0 * value / peak_gflops

    shapes, square = gemms["shapes"], gemms["square"]
    agg = {"engine_gflops": _aggregate(shapes, "engine_gflops"),
           "torch_gflops": _aggregate(shapes, "torch_gflops")}
    agg.update(engine_pct_of_peak=pct(agg["engine_gflops"]), torch_pct_of_peak=pct(agg["torch_gflops"]))
    square.update(engine_pct_of_peak=pct(square["engine_gflops"]),
                  torch_pct_of_peak=pct(square["torch_gflops"]))
    return {**gemms, "model": agg}


def _best(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def best_of_passes(passes: list[dict], peak_passes: list[dict]) -> tuple[dict, dict]:
    """The roofs of several passes (before and after the points) merged value by value, the
    higher kept: a pass that shared the cores with another process measures low, never high.

    Args:
        passes: :func:`measure_gemms` results of the same shapes.
        peak_passes: :func:`measure_fma_peak` results.

    Returns:
        ``(fma_peak, gemms)``: the first pass's dicts with every rate the best over the passes,
        ``gflops`` the in-use ISA's best, the percentages recomputed from it, and ``passes``
        (each pass's ``by_isa`` / ``bf16_dot_gflops``, or its per-shape rates) kept.
    """
    peak = dict(peak_passes[0])
    by_isa: dict[str, float] = {}
    for one in peak_passes:
        for isa, value in one["by_isa"].items():
            by_isa[isa] = max(by_isa.get(isa, 0.0), value)
    bf16 = None
    for one in peak_passes:
        bf16 = _best(bf16, one["bf16_dot_gflops"])
    peak.update(by_isa=by_isa, bf16_dot_gflops=bf16,
                gflops=by_isa.get(peak["isa"]) if peak["isa"] else None,
                passes=[{"by_isa": one["by_isa"], "bf16_dot_gflops": one["bf16_dot_gflops"]}
                        for one in peak_passes])
    first = passes[0]
    shapes = [dict(shape) for shape in first["shapes"]]
    square = {k: v for k, v in first["square"].items() if not k.endswith("pct_of_peak")}
    for one in passes[1:]:
        for shape, other in zip(shapes, one["shapes"]):
            for key in ("engine_gflops", "torch_gflops"):
                shape[key] = _best(shape[key], other[key])
        for key in ("engine_gflops", "torch_gflops"):
            square[key] = _best(square[key], one["square"][key])
    gemms = summarize_gemms({**first, "shapes": shapes, "square": square}, peak["gflops"])
    gemms["passes"] = [{"shapes": [{k: g[k] for k in ("name", "engine_gflops", "torch_gflops")}
                                   for g in one["shapes"]],
                        "square": {k: one["square"][k] for k in ("engine_gflops", "torch_gflops")}}
                       for one in passes]
    return peak, gemms


#: Why a bf16 floor over the VDPBF16PS peak is no bound on a CPU with AMX (JSON and report).
AMX_NOT_A_BOUND = "not a bound: this CPU has AMX-BF16, faster than the VDPBF16PS peak"


def peak_floor_gflops(roofs: dict, dtype: torch.dtype) -> tuple[float | None, str | None]:
    """The CPU-peak rate a prefill floor divides by, and its name: the bf16 dot-product peak
    for bf16 where the CPU has it, else the fp32 FMA peak, the highest over every ISA build the
    CPU runs (``by_isa``: forcing ``RADIXKV_NATIVE_ISA=avx2`` cannot lower the floor);
    (None, None) where no native build runs here."""
    peak = roofs.get("fma_peak") or {}
    if dtype == torch.bfloat16 and peak.get("bf16_dot_gflops"):
        return peak["bf16_dot_gflops"], "bf16_dot_peak"
    best = max([v for v in (peak.get("by_isa") or {}).values() if v] + [peak.get("gflops") or 0.0])
    if best:
        return best, "fma_peak"
    return None, None


# ----------------------------------------------------------------------------- points


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _skip(row: dict, pool_bytes: int, max_pool_bytes: int) -> bool:
    if pool_bytes > max_pool_bytes:
        row["skipped"] = (f"pool {pool_bytes / GIB:.2f} GiB > --max-pool-gib "
                          f"{max_pool_bytes / GIB:g}")
        return True
    return False


def prefill_point(model: LoadedModel, tokens: int, block_size: int, repeats: int,
                  max_pool_bytes: int, seed: int, kv_cache_dtype: str = "auto") -> dict:
    """One sequence of ``tokens`` new tokens, no prefix: tokens/s (floors are set afterwards by
    :func:`apply_prefill_floors`, once the roofs' second pass is in).

    FLOPs: ``radixkv.eviction.cost_model.prefill_flops(shape, 0, tokens)`` (linear ``2 · P`` per
    token + attention ``4 · L · Hq · D`` per causal pair; no LM head). Floors, each FLOPs ÷ a
    rate: ``floor_ms`` (and ``ratio``) over :func:`peak_floor_gflops` (``floor_basis`` names
    it; torch's square GEMM where no native build runs; ``floor_is_bound`` False, with
    ``floor_note`` saying why, for the bf16 dot peak on a CPU with AMX-BF16); ``engine_gemm_floor_ms`` /
    ``engine_gemm_ratio`` over the engine GEMM's rate at the model's prefill shapes
    (``roofs["gemms"]["model"]["engine_gflops"]``); ``torch_gemm_floor_ms`` /
    ``torch_gemm_ratio`` over torch's square GEMM (``roofs["gemm"]``), the floor this bench
    used before. ``ms`` is the median forward, ``best_ms`` the fastest (``best_ratio`` its
    ratio to the peak floor: the roofs are best-of measurements too, so on a shared VM this
    is the like-for-like ratio, the median's the conservative one). ``kv_cache_dtype``: the
    runner's KV format (``row["kv_cache_dtype"]``: the dtype its pool holds).

    Where the runner times its attention calls (``ModelRunner.last_attention_seconds``, on the
    CPU): ``attention_ms`` the median of the forwards' attention time (the K/V pool writes
    included), ``linear_ms`` the median of the rest (projections, norms, RoPE, SwiGLU, residual
    adds, the LM head's last row), and ``attention_flops`` the FLOPs' attention part; their
    rates against the peak are set by :func:`apply_prefill_floors`.
    """
    shape = model.shape
    requested = tokens
    tokens = min(tokens, shape.max_position_embeddings)
    num_blocks = _blocks(tokens, block_size)
    pool_bytes = num_blocks * ModelRunner.bytes_per_block_for(shape, block_size, model.dtype,
                                                              kv_cache_dtype)
    row: dict = {"kind": "prefill", "tokens": tokens, "requested_tokens": requested,
                 "num_blocks": num_blocks, "pool_bytes": pool_bytes,
                 "kv_cache_dtype": resolve_kv_format(kv_cache_dtype, model.dtype).name}
    if _skip(row, pool_bytes, max_pool_bytes):
        return row
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device="cpu",
                         kv_cache_dtype=kv_cache_dtype, **RUNNER_OPTIONS)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (tokens,), generator=gen).tolist()
    batch = runner.build_batch([(ids, 0, list(range(num_blocks)))])
    attention_s: list[float | None] = []

    def forward() -> None:
        runner.forward(batch)
        attention_s.append(runner.last_attention_seconds)

    times = times_ms(forward, 1, repeats)
    ms = statistics.median(times)
    cost = cost_shape_from_model_shape(shape)
    flops = prefill_flops(cost, 0, tokens)
    row.update(ms=ms, best_ms=min(times), tokens_per_s=tokens / ms * 1e3, flops=flops)
    timed = attention_s[len(attention_s) - repeats:]  # the warm-up's dropped
    if all(t for t in timed):  # None: not timed (not on the CPU); 0: no attention call seen
        attention_ms = [t * 1e3 for t in timed if t is not None]
        row.update(attention_flops=flops - cost.linear_flops_per_token * tokens,
                   attention_ms=statistics.median(attention_ms),
                   linear_ms=statistics.median(t - a for t, a in zip(times, attention_ms)))
    return row


def apply_prefill_floors(row: dict, roofs: dict, dtype: torch.dtype) -> dict:
    """Set a measured prefill row's floors from the final ``roofs`` (see :func:`prefill_point`)."""
    if "skipped" in row:
        return row
    flops, ms, tokens = row["flops"], row["ms"], row["tokens"]
    peak, basis = peak_floor_gflops(roofs, dtype)
    if peak is None:
        peak, basis = roofs["gemm"]["gflops"], "torch_gemm"
    floor_ms = flops / peak / 1e6
    if basis == "bf16_dot_peak" and (roofs.get("fma_peak") or {}).get("amx_bf16"):
        row.update(floor_is_bound=False, floor_note=AMX_NOT_A_BOUND)
    else:
        row.update(floor_is_bound=True)
    row.update(floor_basis=basis, floor_gflops=peak, floor_ms=floor_ms,
               floor_tokens_per_s=tokens / floor_ms * 1e3, ratio=ms / floor_ms)
    if "best_ms" in row:  # the fastest forward, as the roofs keep their best pass
        row.update(best_ratio=row["best_ms"] / floor_ms)
    if "attention_ms" in row:  # where the time goes, each part's FLOPs over its time
        attention = row["attention_flops"] / row["attention_ms"] / 1e6
        linear = (flops - row["attention_flops"]) / row["linear_ms"] / 1e6
        row.update(attention_gflops=attention, attention_pct_of_peak=100 * attention / peak,
                   linear_gflops=linear, linear_pct_of_peak=100 * linear / peak)
    torch_floor = flops / roofs["gemm"]["gflops"] / 1e6
    row.update(torch_gemm_floor_ms=torch_floor, torch_gemm_ratio=ms / torch_floor)
    engine = ((roofs.get("gemms") or {}).get("model") or {}).get("engine_gflops")
    if engine:
        engine_floor = flops / engine / 1e6
        row.update(engine_gemm_floor_ms=engine_floor, engine_gemm_ratio=ms / engine_floor)
    return row


def reference_forward(model: LoadedModel) -> LlamaForward:
    """A separate forward of ``model`` on the CPU (``LlamaForward``, or ``FamilyForward`` for
    Qwen3 / Gemma: ``make_forward``), eager, for :func:`reference_logits`."""
    return make_forward(model.shape, model.state_dict, device="cpu", dtype=model.dtype)


def reference_logits(model: LoadedModel, forward: LlamaForward, runner: ModelRunner,
                     batch) -> torch.Tensor:
    """Last-row logits of ``batch`` from ``forward`` with ``radixkv.kernels.reference``
    attention over ``runner``'s pools (it rewrites the batch's own slots, nothing else).

    A quantized pool is not rewritten: the reference decodes (one row per sequence, the
    runner's step already run) over the new tokens' K/V as the runner stored them. Its own K/V
    differ from the runner's by fp32 ulps, and quantizing them anew can land a value on the
    next int8 / fp8 level, a step that 30 layers over synthetic ``randn`` K/V amplify to O(1)
    logits: that would measure the quantizer's discontinuity, not the kernels."""
    max_q_len = int((batch.qo_indptr[1:] - batch.qo_indptr[:-1]).max())
    k_scales, v_scales = runner.k_scales, runner.v_scales
    attn = AttentionSettings.of(model.shape)  # each layer's window, the scale, the soft cap

    def attention(layer, q, k, v):
        k_pool, v_pool = runner.k_pools[layer], runner.v_pools[layer]
        if k_scales is not None and v_scales is not None:
            assert max_q_len == 1, "reference_logits reads a quantized pool for decode steps only"
            return reference.decode_attention(q, k_pool, v_pool, batch.block_tables, batch.prefix_lens + 1,
                                              **attn.kwargs(layer),
                                              k_scale_pool=k_scales[layer], v_scale_pool=v_scales[layer])
        reference.paged_kv_write(k, v, k_pool, v_pool, batch.slot_mapping)
        return reference.extend_attention(q, k, v, k_pool, v_pool, batch.block_tables, batch.prefix_lens,
                                          batch.qo_indptr, max_q_len=max_q_len, **attn.kwargs(layer))

    with torch.inference_mode():
        return forward.forward(batch.input_ids, batch.positions, attention,
                               batch.qo_indptr[1:].to(torch.int64) - 1)


def decode_inputs(model: LoadedModel, batch_size: int, context: int, block_size: int,
                  seed: int, kv_cache_dtype: str = "auto") -> tuple[ModelRunner, Any]:
    """A runner of ``batch · ceil((ctx + 1) / B)`` blocks whose pools hold ``randn`` K/V, and the
    decode batch: sequence i owns blocks ``[i · n, (i + 1) · n)`` and takes one random token at
    position ``context`` (which must be below the model's context length). A quantized
    ``kv_cache_dtype`` stores the same ``randn`` values quantized, with their scales."""
    per_seq = _blocks(context + 1, block_size)
    runner = ModelRunner(model, num_blocks=batch_size * per_seq, block_size=block_size, device="cpu",
                         kv_cache_dtype=kv_cache_dtype, **RUNNER_OPTIONS)
    gen = torch.Generator().manual_seed(seed)
    if runner.k_scales is None or runner.v_scales is None:
        for pool in (*runner.k_pools, *runner.v_pools):
            pool.normal_(generator=gen)  # synthetic cached K/V; the unused tail slots too
    else:
        pool_shape = runner.k_pools[0].shape
        slots = torch.arange(pool_shape[0] * pool_shape[1])
        for k_pool, v_pool, k_scales, v_scales in zip(runner.k_pools, runner.v_pools,
                                                      runner.k_scales, runner.v_scales):
            rows = (slots.shape[0], *pool_shape[2:])
            keys = torch.randn(rows, generator=gen).to(model.dtype)
            values = torch.randn(rows, generator=gen).to(model.dtype)
            reference.paged_kv_write(keys, values, k_pool, v_pool, slots,
                                     k_scale_pool=k_scales, v_scale_pool=v_scales)
    ids = torch.randint(0, model.shape.vocab_size, (batch_size,), generator=gen).tolist()
    batch = runner.build_batch([([ids[i]], context, list(range(i * per_seq, (i + 1) * per_seq)))
                                for i in range(batch_size)])
    return runner, batch


def decode_point(model: LoadedModel, batch_size: int, context: int, block_size: int, roofs: dict,
                 repeats: int, max_pool_bytes: int, seed: int,
                 check: LlamaForward | None, kv_cache_dtype: str = "auto") -> dict:
    """``batch_size`` sequences with ``context`` cached tokens each take one token at position
    ``context``: step ms (= ms per token of each sequence) against the copy floor.

    The pool is ``batch · ceil((ctx + 1) / B)`` blocks, each sequence its own; the cached K/V
    is synthetic (``randn``, no prefill). Floor: ``weight_bytes + batch · kv_bytes(ctx)`` over
    the copy bandwidth (read + write). ``check`` (a :func:`reference_forward`, or None to
    skip): the last timed step's logits against :func:`reference_logits`
    (``check_max_abs_diff``; over the same quantized pools for a quantized ``kv_cache_dtype``,
    whose K/V bytes, scales included, the floor counts).
    """
    shape = model.shape
    requested = context
    context = min(context, shape.max_position_embeddings - 1)  # the new token needs a position
    per_seq = _blocks(context + 1, block_size)
    num_blocks = batch_size * per_seq
    pool_bytes = num_blocks * ModelRunner.bytes_per_block_for(shape, block_size, model.dtype,
                                                              kv_cache_dtype)
    weights, kv = weight_bytes(model), kv_bytes(model, context, kv_cache_dtype)
    row: dict = {"kind": "decode", "batch": batch_size, "context": context,
                 "requested_context": requested, "num_blocks": num_blocks, "pool_bytes": pool_bytes,
                 "weight_bytes": weights, "kv_bytes_per_seq": kv,
                 "bytes_per_step": weights + batch_size * kv,
                 "kv_cache_dtype": resolve_kv_format(kv_cache_dtype, model.dtype).name}
    if _skip(row, pool_bytes, max_pool_bytes):
        return row
    runner, batch = decode_inputs(model, batch_size, context, block_size, seed, kv_cache_dtype)
    last: dict = {}

    def step() -> None:
        last["logits"] = runner.forward(batch)

    ms = median_ms(step, 2, repeats)
    floor_ms = row["bytes_per_step"] / roofs["copy"]["gbps"] / 1e6
    row.update(ms=ms, tokens_per_s=batch_size / ms * 1e3, floor_ms=floor_ms, ratio=ms / floor_ms)
    if check is not None:
        want = reference_logits(model, check, runner, batch)
        got = last["logits"].float()
        row["check_max_abs_diff"] = float((got - want.float()).abs().max())
        row["logits_shape"] = list(got.shape)
        row["logits_finite"] = bool(torch.isfinite(got).all())
    return row


def point_key(row: dict) -> tuple:
    """What a point measures apart from its KV dtype: ``("prefill", tokens)`` or
    ``("decode", batch, context)``."""
    if row["kind"] == "prefill":
        return ("prefill", row["tokens"])
    return ("decode", row["batch"], row["context"])


def kv_dtype_ratios(points: list[dict]) -> list[dict]:
    """Each quantized KV dtype's time against the unquantized one's (the first measured) at the
    same point: ``{"kind", "tokens" | "batch", "context", "kv_cache_dtype", "base_kv_cache_dtype",
    "ms", "base_ms", "ratio"}`` (``ratio`` = ms ÷ base_ms, < 1 faster), in point order, for
    every point both measured (not skipped)."""
    base_name = next((p["kv_cache_dtype"] for p in points
                      if p.get("kv_cache_dtype") in ("float32", "bfloat16")), None)
    if base_name is None:
        return []
    base = {point_key(p): p for p in points
            if p.get("kv_cache_dtype") == base_name and "skipped" not in p}
    out = []
    for p in points:
        other = base.get(point_key(p))
        if p.get("kv_cache_dtype") == base_name or other is None or "skipped" in p:
            continue
        row = {k: p[k] for k in ("kind", "tokens", "batch", "context") if k in p}
        row.update(kv_cache_dtype=p["kv_cache_dtype"], base_kv_cache_dtype=base_name, ms=p["ms"],
                   base_ms=other["ms"], ratio=p["ms"] / other["ms"])
        out.append(row)
    return out


def finite_positive(value: Any) -> bool:
    """True for a finite float > 0 (a ratio the report may print)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0

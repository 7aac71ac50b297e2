"""``radixkv bench step``: one model step (prefill, decode) on the CPU against its floors.

Times ``radixkv.model.runner.ModelRunner.forward`` (the batch is built once, outside the timer)
on ``--model`` (default: the embedded SmolLM2-135M-Instruct; ``--tiny``: a random 2-layer
Llama for tests), each point on a fresh runner whose pool it sizes itself:

* **prefill** at ``--prefill-tokens`` (default 512, 2048, 8192): one sequence, no prefix,
  1 warm-up then the median of ``--repeats`` forwards; tokens/s.
* **decode** at ``--decode-batch`` × ``--decode-context`` (default 1, 4, 16 × 512, 2048, 8192):
  ``batch`` sequences with ``ctx`` cached tokens each (synthetic ``randn`` K/V, each sequence
  its own ``ceil((ctx + 1) / B)`` blocks, no prefill) take one token at position ``ctx``;
  2 warm-ups then the median of ``--repeats`` steps; ms per token (= ms per step: every
  sequence gets one token per step). Unless ``--no-check``, the last step's logits are compared
  with a separate eager forward of the model's own class (``LlamaForward``, ``FamilyForward``
  for Qwen3 / Gemma) using ``radixkv.kernels.reference`` attention with each layer's window,
  scale and soft cap on the same pools (``check_max_abs_diff``).

**KV dtypes** (``--kv-cache-dtype``, repeatable or a comma list, e.g. ``float32,int8``): every
prefill and decode point is measured once per KV cache format, each on its own runner (the
decode pools hold the same ``randn`` K/V, quantized with their scales for int8 / fp8_e4m3;
the decode floor counts the format's K/V bytes, scales included), and ``kv_ratios`` lists each
quantized format's time ÷ the unquantized one's at the same point (printed as a table).

A context longer than the model's (SmolLM2: 8,192) is cut to what fits (decode: ``max - 1``,
the new token needs a position); both requested and used sizes are recorded. A point whose pool
exceeds ``--max-pool-gib`` is skipped and says so in its row.

**Roofs**, measured in the same run (``roofs`` in the JSON), on the step's thread count; the
CPU peak and the GEMMs twice, before and after the points, each value the higher of the two
(``passes`` keeps both: a pass that shared the cores measures low, never high):

* CPU peak (``roofs.fma_peak``): ``radixkv.kernels.cpu_peak`` — independent FMA chains on
  every thread, no memory traffic, best of 5 runs — for the native build in use (``isa``) and
  for every other ISA build the CPU runs (``by_isa``), plus the AVX512_BF16 dot-product peak
  where the CPU has it (``bf16_dot_gflops``). ``--peak-seconds`` per measurement.
* GEMMs (``roofs.gemms``): the engine's own GEMM (``radixkv.kernels.gemm.gflops``, its
  ``backend``) and torch's ``F.linear`` (MKL in the x86 wheels; a comparison column) at the
  model's four prefill shapes (fused q/k/v, output, fused gate/up, down; ``--gemm-tokens``
  rows) and at the ``--gemm-n`` square, each with % of the FMA peak; ``model`` aggregates the
  four shapes as total FLOPs ÷ total time.
* copy bandwidth: ``dst.copy_(src)`` of a ``--copy-mib`` fp32 buffer, GB/s counting bytes read
  + bytes written (``2 · size / t``, as ``bench kernels``); decode floor ms = bytes read per step
  ÷ that bandwidth, where bytes read per step = ``(P + vocab · hidden) · itemsize`` (every
  non-embedding weight plus the LM head, once) ``+ batch · 2 · L · ctx · Hkv · D · itemsize``
  (each sequence's cached K and V). Counting copy bandwidth as read + write makes the floor
  the tighter one: a copy also moves its writes through memory.
* torch's square GEMM (``roofs.gemm``): ``torch.matmul`` of two ``--gemm-n``² matrices.

Prefill FLOPs = ``radixkv.eviction.cost_model.prefill_flops(shape, 0, tokens)`` (linear
``2 · P`` per token + attention ``4 · L · Hq · D`` per causal (query, key) pair; no LM head).
Prefill floor = FLOPs ÷ the CPU's peak (``floor_basis``: ``fma_peak``, the highest fp32 FMA peak
of the ISA builds the CPU runs; ``bf16_dot_peak`` for ``--dtype bfloat16`` on a CPU with
AVX512_BF16, marked ``floor_is_bound: false`` where the CPU also has AMX-BF16; torch's
square GEMM only where no native build runs), so a slow GEMM library cannot lower the floor it
is judged against. Each prefill row also has ``engine_gemm_ratio`` (over the engine GEMM's
model-shape rate) and ``torch_gemm_ratio`` (over torch's square GEMM, the floor of earlier
versions).

Prefill rows time ``--repeats`` forwards after a warm-up: ``ms`` the median, ``best_ms`` the
fastest with ``best_ratio`` (the roofs are best-of measurements: on a shared VM whose neighbours
slow some forwards, the best forward against the best roof is the like-for-like ratio). They
also split each forward: ``attention_ms`` (the attention calls, K/V pool writes included) and
``linear_ms`` (everything else), medians, with ``attention_gflops`` / ``linear_gflops`` (each
part's FLOPs over its time) and their ``*_pct_of_peak`` against the floor's peak: which part
keeps the ratio above 1.

``ratio`` = measured time ÷ floor time (1 = at the floor; the goals: decode batch 1 at
2k ≤ 1.5, prefill 2k ≤ 1.3 against the peak floor, engine GEMM ≥ 70 % of the FMA peak).
Timings share the machine with whatever else runs: use an idle one. The JSON records the CPU
(model, ISA flags, cores: ``cpu``), the native ISA, the GEMM backend and the threads.

Usage::

    radixkv bench step [--model PATH | --tiny] [--quick] [--dtype float32|bfloat16 [--accuracy]]
        [--kv-cache-dtype auto,int8] [--num-threads N] [--compile] [--json out.json]
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arg_types import sizes as _sizes  # noqa: E402

from radixkv.config import KV_CACHE_DTYPES, kv_cache_dtype_problem  # noqa: E402

DEFAULTS = {"prefill_tokens": "512,2048,8192", "decode_batch": "1,4,16",
            "decode_context": "512,2048,8192"}
QUICK = {"prefill_tokens": "64,256", "decode_batch": "1,4", "decode_context": "64,256"}
#: The prefill point the report's headline names (when measured).
HEADLINE_TOKENS = 2048


def _positive_int(text: str) -> int:
    (value,) = _sizes(text) if "," not in text else (0,)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _kv_dtypes(text: str) -> list[str]:
    """``"float32,int8"`` -> ``["float32", "int8"]``, each one of ``KV_CACHE_DTYPES``."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in KV_CACHE_DTYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(KV_CACHE_DTYPES)}, "
                                         f"got {text!r}")
    return values


def kv_cache_dtypes(args: argparse.Namespace) -> list[str]:
    """The ``--kv-cache-dtype`` values in order, repeats dropped (``auto`` and the model's own
    dtype are one format: the first kept); ``["auto"]`` when none is given."""
    out: list[str] = []
    for value in [v for group in (args.kv_cache_dtype or [["auto"]]) for v in group]:
        name = args.dtype if value == "auto" else value
        if name not in [args.dtype if v == "auto" else v for v in out]:
            out.append(value)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench step``)."""
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true",
                        help="random 2-layer Llama (tests' tiny model) instead of --model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weight / KV dtype (and the GEMM floor's)")
    parser.add_argument("--kv-cache-dtype", type=_kv_dtypes, action="append", default=None,
                        metavar="DTYPES",
                        help=f"KV cache formats to measure every point in, side by side "
                             f"(repeatable or comma list of {', '.join(KV_CACHE_DTYPES)}; "
                             f"default auto = --dtype); quantized ones get a ratio table "
                             f"against the unquantized one")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--prefill-tokens", type=_sizes, default=None,
                        help=f"comma-separated prompt lengths (default {DEFAULTS['prefill_tokens']})")
    parser.add_argument("--decode-batch", type=_sizes, default=None,
                        help=f"comma-separated batch sizes (default {DEFAULTS['decode_batch']})")
    parser.add_argument("--decode-context", type=_sizes, default=None,
                        help=f"comma-separated cached tokens per sequence "
                             f"(default {DEFAULTS['decode_context']})")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    parser.add_argument("--max-pool-gib", type=float, default=8.0,
                        help="skip points whose KV pool is larger (GiB)")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy roof buffer (default 512)")
    parser.add_argument("--gemm-n", type=_positive_int, default=None,
                        help="square GEMM roof size (default 2048; --quick 512)")
    parser.add_argument("--gemm-tokens", type=_positive_int, default=None,
                        help="rows of the model-shape prefill GEMMs (default 2048; --quick 256)")
    parser.add_argument("--peak-seconds", type=_positive_float, default=None,
                        help="time budget of each FMA-peak measurement (default 1.0; --quick 0.2)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the decode logits check against the reference forward")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes (prefill {QUICK['prefill_tokens']}, decode "
                             f"{QUICK['decode_batch']} x {QUICK['decode_context']}, 64 MiB copy, "
                             "512² GEMM, 256-row model GEMMs, 0.2 s peak) unless given")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the layers' dense math (as serve --compile); each "
                             "point's warm-ups absorb its compile time")
    parser.add_argument("--no-native", action="store_true",
                        help="keep every step on torch (no C decode kernels; serve's "
                             "RADIXKV_NATIVE_KERNELS=0), for an A/B run")
    parser.add_argument("--accuracy", action="store_true",
                        help="with --dtype bfloat16: compare its logits and greedy tokens with "
                             "fp32 on a real tau-bench prompt (bench/_step_accuracy.py)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here")


def _resolve(args: argparse.Namespace) -> dict:
    sizes = QUICK if args.quick else DEFAULTS
    out = {k: getattr(args, k) if getattr(args, k) is not None else _sizes(v) for k, v in sizes.items()}
    out["copy_bytes"] = (args.copy_mib or (64 if args.quick else 512)) << 20
    out["gemm_n"] = args.gemm_n or (512 if args.quick else 2048)
    out["gemm_tokens"] = args.gemm_tokens or (256 if args.quick else 2048)
    out["peak_seconds"] = args.peak_seconds or (0.2 if args.quick else 1.0)
    return out


def _row_name(row: dict, kv: bool = False) -> str:
    """A point's name; ``kv``: with its KV dtype (a run over several)."""
    suffix = f" kv={row['kv_cache_dtype']}" if kv and "kv_cache_dtype" in row else ""
    if row["kind"] == "prefill":
        cut = "" if row["tokens"] == row["requested_tokens"] else f" (asked {row['requested_tokens']})"
        return f"prefill {row['tokens']} tok{cut}{suffix}"
    cut = "" if row["context"] == row["requested_context"] else f" (asked {row['requested_context']})"
    return f"decode b={row['batch']} ctx={row['context']}{cut}{suffix}"


def kv_ratio_lines(result: dict) -> list[str]:
    """The ``kv_ratios`` table: per point, each quantized KV dtype's time over the unquantized
    one's (empty when the run measured one format)."""
    ratios = result.get("kv_ratios") or []
    if not ratios:
        return []
    lines = [f"KV dtype ratios (time ÷ {ratios[0]['base_kv_cache_dtype']} KV time, same run; < 1 faster):",
             f"{'point':<34}{'kv dtype':>10}{'ms':>12}{'base ms':>12}{'ratio':>8}"]
    for r in ratios:
        name = (f"prefill {r['tokens']} tok" if r["kind"] == "prefill"
                else f"decode b={r['batch']} ctx={r['context']}")
        lines.append(f"{name:<34}{r['kv_cache_dtype']:>10}{r['ms']:>12.2f}{r['base_ms']:>12.2f}"
                     f"{r['ratio']:>8.3f}")
    return lines


def _gflops(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} %"


def headline(result: dict) -> list[str]:
    """The two lines a reader looks for: the prefill point at :data:`HEADLINE_TOKENS` (else the
    largest measured) against the peak floor, and the engine GEMM's share of the FMA peak."""
    lines = []
    measured = [p for p in result["points"] if p["kind"] == "prefill" and "skipped" not in p]
    if measured:
        exact = [p for p in measured if p["tokens"] == HEADLINE_TOKENS]
        p = exact[0] if exact else max(measured, key=lambda row: row["tokens"])
        basis = {"fma_peak": "the FMA-peak floor", "bf16_dot_peak": "the bf16-dot-peak floor",
                 "torch_gemm": "the torch-GEMM floor (no native build here)"}[p["floor_basis"]]
        if p.get("floor_is_bound") is False:
            basis += f" ({p.get('floor_note', 'not a bound')})"
        extra = (f" (fastest of {result['repeats']}: {p['best_ratio']:.2f}×)"
                 if "best_ratio" in p and "repeats" in result else "")
        extra += (f", {p['engine_gemm_ratio']:.2f}× the engine-GEMM floor"
                  if "engine_gemm_ratio" in p else "")
        lines.append(f"prefill {p['tokens']:,} tokens: {p['tokens_per_s']:.0f} tok/s, "
                     f"{p['ratio']:.2f}× {basis}{extra}")
        if "attention_pct_of_peak" in p:
            lines.append(f"  of which attention {p['attention_ms']:,.0f} ms ({p['attention_gflops']:.1f} "
                         f"GFLOP/s, {_pct(p['attention_pct_of_peak'])} of the peak; K/V writes "
                         f"included), the rest {p['linear_ms']:,.0f} ms (linear FLOPs at "
                         f"{p['linear_gflops']:.1f} GFLOP/s, {_pct(p['linear_pct_of_peak'])})")
    gemms = result["roofs"]["gemms"]
    model = gemms["model"]
    if model["engine_gflops"] is not None:
        lines.append(f"engine GEMM ({gemms['backend']}): {_pct(model['engine_pct_of_peak'])} of FMA "
                     f"peak at the model's prefill shapes ({model['engine_gflops']:.1f} GFLOP/s; "
                     f"torch F.linear {_pct(model['torch_pct_of_peak'])})")
    else:
        lines.append(f"engine GEMM: not available (radixkv.kernels.gemm missing); torch F.linear "
                     f"{_pct(model['torch_pct_of_peak'])} of FMA peak at the model's prefill shapes")
    return lines


def format_report(result: dict) -> str:
    """The result as a table: headline, roofs, then point, measured, floor, ratio (measured time
    ÷ floor time)."""
    roofs = result["roofs"]
    peak, gemms, cpu = roofs["fma_peak"], roofs["gemms"], result["cpu"]
    others = ", ".join(f"{isa} {v:.1f}" for isa, v in peak["by_isa"].items() if isa != peak["isa"])
    lines = [*headline(result),
             f"cpu {cpu['cpu']} ({cpu['cores']} cores; {' '.join(cpu['flags'])})",
             f"model {result['model']}  dtype {result['dtype']}  block {result['block_size']}  "
             f"threads {result['num_threads']}  torch {result['torch']}  native ISA "
             f"{result['native_isa'] or 'none'}  "
             f"native kernels {'on' if result.get('native_kernels') else 'off'}",
             f"FMA peak ({peak['isa'] or 'no native build'}, {peak['threads']} threads): "
             f"{_gflops(peak['gflops'])} GFLOP/s fp32"
             + (f" (other builds: {others})" if others else "")
             + (f"; bf16 dot {peak['bf16_dot_gflops']:.1f} GFLOP/s" if peak["bf16_dot_gflops"] else ""),
             f"GEMM {gemms['dtype']} (m={gemms['tokens']} model shapes; {gemms['square']['n']}² square): "
             f"{'shape':<10}{'engine GFLOP/s':>16}{'% peak':>8}{'torch GFLOP/s':>15}{'% peak':>8}"]
    peak_gflops = peak["gflops"]
    rows = [(f"{s['name']} {s['k']}→{s['n']}", s["engine_gflops"], s["torch_gflops"])
            for s in gemms["shapes"]]
    rows += [("all four", gemms["model"]["engine_gflops"], gemms["model"]["torch_gflops"]),
             (f"{gemms['square']['n']}²", gemms["square"]["engine_gflops"], gemms["square"]["torch_gflops"])]
    for name, engine, torch_rate in rows:
        def pct(v: float | None) -> str:
            return "n/a" if v is None or not peak_gflops else f"{100 * v / peak_gflops:.0f}"
        lines.append(f"{'':<4}{name:<24}{_gflops(engine):>16}{pct(engine):>8}{_gflops(torch_rate):>15}"
                     f"{pct(torch_rate):>8}")
    lines += [f"copy {roofs['copy']['gbps']:.1f} GB/s (read + write, {roofs['copy']['bytes'] >> 20} MiB); "
              f"torch.matmul {roofs['gemm']['gflops']:.1f} GFLOP/s ({roofs['gemm']['dtype']} "
              f"{roofs['gemm']['n']}²); weights read per step {result['weight_bytes'] / 1e6:.1f} MB",
              f"{'point':<34}{'measured':>26}{'floor':>26}{'ratio':>8}  check"]
    several_kv = len(result.get("kv_cache_dtypes") or []) > 1
    for row in result["points"]:
        name = _row_name(row, several_kv)
        if "skipped" in row:
            lines.append(f"{name:<34}  skipped: {row['skipped']}")
            continue
        if row["kind"] == "prefill":
            measured = f"{row['tokens_per_s']:.0f} tok/s ({row['ms']:.0f} ms)"
            floor = f"{row['floor_tokens_per_s']:.0f} tok/s ({row['floor_ms']:.0f} ms)"
            check = (f"engine-GEMM ×{row['engine_gemm_ratio']:.2f}, " if "engine_gemm_ratio" in row
                     else "") + f"torch-GEMM ×{row['torch_gemm_ratio']:.2f}"
        else:
            measured = f"{row['ms']:.2f} ms/tok ({row['tokens_per_s']:.1f} tok/s)"
            floor = f"{row['floor_ms']:.2f} ms ({row['bytes_per_step'] / 1e6:.0f} MB)"
            diff = row.get("check_max_abs_diff")
            check = "" if diff is None else f"max|Δlogit| {diff:.1e}"
        lines.append(f"{name:<34}{measured:>26}{floor:>26}{row['ratio']:>8.2f}  {check}")
    acc = result.get("accuracy")
    if acc:
        lines.append(f"{acc['dtype']} vs float32 on a {acc['prompt_tokens']}-token tau-bench prompt: "
                     f"top-1 agreement {acc['top1_agreement']:.4f}, max|Δlogit| "
                     f"{acc['max_abs_logit_diff']:.3f}, mean|Δlogit| {acc['mean_abs_logit_diff']:.4f}, "
                     f"mean KL {acc['mean_kl']:.2e} nats, greedy tokens identical "
                     f"{acc['greedy_same_tokens']}/{acc['greedy_tokens']}")
    lines += kv_ratio_lines(result)
    lines.append("ratio = measured time ÷ floor time; decode floor = bytes read per step ÷ copy "
                 "GB/s; prefill floor = cost-model FLOPs ÷ the CPU's peak (FMA, or bf16 dot for "
                 "bf16); the prefill rows' last column: the same FLOPs over the engine GEMM's and "
                 "torch's GEMM rates")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Measure roofs and every point per ``args``; print the table, write ``--json``; return it."""
    import _step_measure as m
    import torch

    from radixkv.model.loader import load_model

    for kv in kv_cache_dtypes(args):  # before the model loads
        problem = kv_cache_dtype_problem(kv, args.dtype)
        if problem is not None:
            print(f"radixkv bench step: argument --kv-cache-dtype: {problem}", file=sys.stderr)
            raise SystemExit(2)
    sizes = _resolve(args)
    m.RUNNER_OPTIONS["compile"] = args.compile
    m.RUNNER_OPTIONS["native_kernels"] = False if args.no_native else None
    if args.no_native or args.compile:
        # The runner then keeps fp32 projections off the C GEMM; the engine-GEMM roof must
        # measure what it runs (oneDNN), so the C GEMM is off for the whole process.
        os.environ["RADIXKV_NATIVE_GEMM"] = "0"
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = m.load_tiny_model(dtype) if args.tiny else load_model(args.model, dtype=dtype)
    result: dict = {"model": "tiny-random-llama" if args.tiny else model.name, "dtype": args.dtype,
                    "block_size": args.block_size, "num_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "repeats": args.repeats,
                    "max_pool_gib": args.max_pool_gib, "weight_bytes": m.weight_bytes(model)}
    from _provenance import machine

    result["cpu"] = machine()
    result["roofs"] = m.measure_roofs(dtype, sizes["copy_bytes"], sizes["gemm_n"], args.repeats)
    peak_passes: list[dict] = []
    gemm_passes: list[dict] = []

    def roof_pass() -> None:  # the CPU peak and the GEMMs, measured before and after the points
        peak_passes.append(m.measure_fma_peak(result["num_threads"], sizes["peak_seconds"]))
        gemm_passes.append(m.measure_gemms(model, dtype, sizes["gemm_tokens"], sizes["gemm_n"],
                                           args.repeats, peak_passes[-1]["gflops"]))

    roof_pass()
    result["native_isa"] = peak_passes[0]["isa"]
    result["gemm_backend"] = gemm_passes[0]["backend"]
    max_pool_bytes = int(args.max_pool_gib * m.GIB)
    points: list[dict] = []
    kv_dtypes = kv_cache_dtypes(args)
    several_kv = len(kv_dtypes) > 1
    result["kv_cache_dtypes"] = [m.resolve_kv_format(v, dtype).name for v in kv_dtypes]

    def done(row: dict) -> None:  # progress on stderr: a full run takes minutes
        points.append(row)
        state = row.get("skipped") or f"{row['ms']:.1f} ms, ratio {row['ratio']:.2f}"
        print(f"bench step: {_row_name(row, several_kv)}: {state}", file=sys.stderr, flush=True)

    # Per point, every KV dtype one after the other: a drift in the machine's load hits the
    # formats of a point alike, so their ratio holds.
    for tokens in sizes["prefill_tokens"]:
        for kv in kv_dtypes:
            row = m.prefill_point(model, tokens, args.block_size, args.repeats,
                                  max_pool_bytes, args.seed, kv)
            points.append(row)
            state = row.get("skipped") or f"{row['ms']:.1f} ms, {row['tokens_per_s']:.0f} tok/s"
            print(f"bench step: {_row_name(row, several_kv)}: {state}", file=sys.stderr, flush=True)
    check = None if args.no_check else m.reference_forward(model)
    for batch in sizes["decode_batch"]:
        for context in sizes["decode_context"]:
            for kv in kv_dtypes:
                done(m.decode_point(model, batch, context, args.block_size, result["roofs"],
                                    args.repeats, max_pool_bytes, args.seed, check, kv))
    result["kv_ratios"] = m.kv_dtype_ratios(points)
    roof_pass()
    result["roofs"]["fma_peak"], result["roofs"]["gemms"] = m.best_of_passes(gemm_passes, peak_passes)
    for row in points:
        if row["kind"] == "prefill":
            m.apply_prefill_floors(row, result["roofs"], dtype)
    result["points"] = points
    result["compile"] = args.compile
    # the C decode kernels take fp32 and bf16 weights / pools
    result["native_kernels"] = not args.no_native and not args.compile and dtype in (torch.float32,
                                                                                      torch.bfloat16)
    if args.accuracy and dtype != torch.float32:
        import _step_accuracy

        fp32 = m.load_tiny_model(torch.float32) if args.tiny else load_model(args.model)
        result["accuracy"] = _step_accuracy.dtype_accuracy(fp32, model, block_size=args.block_size)
    print(format_report(result))
    if args.json:
        from _provenance import provenance

        result["provenance"] = provenance()
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/step.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``radixkv bench kernels``: the Triton attention kernels against torch SDPA, a matmul and a copy.

One run on one GPU, in this order:

1. **Checks**: every kernel (paged KV write, extend, decode) against the torch reference on
   shapes up to 4k tokens, NaN-poisoned pools, block sizes 1 / 16 / 64.
2. **Roofs**: a bf16 8192³ matmul (TFLOP/s) and a device-to-device copy (GB/s, read + write).
3. **Cases** (Llama-3-8B attention: 32 query / 8 KV heads, head dim 128, bf16, block size 16
   unless stated), each timed with ``triton.testing.do_bench`` (median):

   - extend, no prefix: L ∈ {1k, 4k, 8k, 16k}; with prefix: P ∈ {1k, 4k, 16k} × L ∈ {128, 512,
     2k}; P = 4k, L = 512 at block sizes 1 and 64. ``N = max(1, 4096 // L)`` sequences.
     TFLOP/s count only unmasked work: ``4 · D · Hq · N · (L·P + L(L+1)/2)``. Baselines on
     pre-gathered contiguous K/V (expanded to Hq heads) with a bottom-right causal mask:
     SDPA-flash (``aten._scaled_dot_product_flash_attention`` with ``is_causal``, which is
     bottom-right there, exactly what ``causal_lower_right`` dispatches to; ``is_causal`` under
     ``sdpa_kernel(FLASH_ATTENTION)`` when P = 0) and SDPA-cuDNN (``sdpa_kernel(CUDNN_ATTENTION)``
     with ``is_causal`` when P = 0, else an explicit boolean mask). A backend that refuses
     reports ``n/a``; each baseline's output is compared with ours (``max_abs_diff``).
   - decode: N ∈ {1, 32, 128} × kv ∈ {1k, 8k, 32k}; N = 32, kv = 32k at block sizes 1 and 64.
     GB/s = K + V bytes read / time; ratios to the copy roof and to SDPA (flash / cuDNN,
     ``enable_gqa``, contiguous K/V).
   - paged KV write of 16k tokens: GB/s (read + write) over the copy roof.
4. **Quantized KV** (``kernels/kv_quant.py``: int8 and fp8_e4m3, one fp32 scale per token and KV
   head): checks — the write stores exactly ``quantize_kv``'s bytes and scales, extend and decode
   over quantized pools match the reference on the dequantized pools (fp32) — and timings of
   extend (P = 0, L = 4k; P = 4k, L = 512), decode (N = 32 × kv = 32k; N = 1 × kv = 8k) and the
   16k-token write with unquantized, int8 and fp8 pools on the same inputs, each with its
   ratio to the unquantized time (fp8 needs sm_89+; a refusing format reports its error).

Goals printed at the end: suffix prefill ≥ 0.6× SDPA-flash TFLOP/s at P = 4k, L = 512; decode
≥ 0.6× copy bandwidth at kv = 32k, N = 32.

Runs from the source tree with only torch and triton importable: ``kernels/`` is loaded by path
as a private package (never as a top-level ``kernels`` module). Every case is wrapped: an error
is recorded in its row and the run goes on. Without CUDA it prints a message and stops;
``--cpu-interpret-smoke`` instead runs the check and reporting paths on tiny shapes under the
Triton interpreter (timings there are meaningless).

Usage::

    python bench/kernels.py [--quick] [--sweep] [--json out.json]
    radixkv bench kernels [--quick] [--sweep] [--json out.json]

``--sweep`` re-times the two goal cases over tile sizes, warps, stages and KV split counts
(through the kernel modules' ``LAUNCH_OVERRIDE``) so a GPU run can also pick better defaults.
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import functools
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _kernels_timing import (  # noqa: E402
    _PKG,
    KV_QUANT_NAMES,
    _make_timer,
    _max_err,
    _paged_inputs,
    build_cases,
    kvquant_cases,
    load_kv_quant,
    run_roofs,
    run_sweep,
    time_decode,
    time_extend,
    time_kv_write,
    time_kvquant,
)

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
LLAMA3_8B = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SMOKE = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64}
GOAL_RATIO = 0.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench kernels``)."""
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="checks, roofs and only the two goal cases plus L=4k without prefix")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--sweep", action="store_true",
                        help="also time the two goal cases over a grid of tile sizes / warps / stages / "
                             "splits")
    parser.add_argument("--cpu-interpret-smoke", action="store_true",
                        help="no GPU: run checks and reporting on tiny shapes under TRITON_INTERPRET=1")


def load_kernels() -> tuple[Any, Any]:
    """``(reference, triton_backend)`` modules of ``kernels/`` in this source tree."""
    if _PKG not in sys.modules:
        spec = importlib.util.spec_from_file_location(_PKG, KERNELS_DIR / "__init__.py",
                                                      submodule_search_locations=[str(KERNELS_DIR)])
        assert spec is not None and spec.loader is not None  # a .py file always has both
        module = importlib.util.module_from_spec(spec)
        sys.modules[_PKG] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{_PKG}.reference"), importlib.import_module(f"{_PKG}.triton_backend")


# ----------------------------------------------------------------------------- checks


def run_checks(torch, reference, ops, kvq, device, dtype, heads, smoke: bool) -> list[dict]:
    """Each kernel against the reference (fp32 math on the same inputs), once per KV format.

    Unquantized pools (``dtype``; block sizes 1 / 16 / 64, extend also fp32 at 16) hold the
    prefixes with every other slot NaN. Quantized pools (``KV_QUANT_NAMES``, block size 16)
    are written by the kernel (prefix and suffix rows, as the runner does), NaN scales in every
    unwritten slot, and read by the reference dequantized in fp32 (the extend suffix as
    ``dequantize(quantize(k))``). The write must equal the reference write bit for bit (for a
    quantized pool: ``kv_quant.quantize_kv``'s bytes and scales), tolerance 0.
    """
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}
    hkv, d = heads["num_kv_heads"], heads["head_dim"]
    if smoke:
        ext_seqs, dec_lens, num_write = [(0, 17), (20, 5), (3, 1)], [1, 15, 40], 37
    else:
        ext_seqs, dec_lens = [(0, 1024), (3000, 1000), (17, 1), (100, 77)], [1, 15, 1000, 4096]
        num_write = 4096
    checks = []

    def record(name: str, fn: Callable[[], tuple[float, float]]) -> None:
        try:
            err, limit = fn()
            checks.append({"check": name, "max_abs_err": err, "tol": limit, "ok": bool(err <= limit)})
        except Exception as exc:  # noqa: BLE001 - a failed check must not stop the run
            checks.append({"check": name, "error": f"{type(exc).__name__}: {exc}", "ok": False})

    def empty_pools(shape, fmt, dt):
        """``(k_pool, v_pool, scale kwargs)`` with nothing written: NaN values (unquantized), or
        zero bytes and NaN scales (quantized)."""
        if fmt is None:
            return (torch.full(shape, float("nan"), dtype=dt, device=device),
                    torch.full(shape, float("nan"), dtype=dt, device=device), {})
        k_pool, v_pool = (torch.zeros(shape, dtype=torch.uint8, device=device).view(fmt.storage_dtype)
                          for _ in range(2))
        return k_pool, v_pool, {"k_scale_pool": torch.full(shape[:3], float("nan"), device=device),
                                "v_scale_pool": torch.full(shape[:3], float("nan"), device=device)}

    def pools_under_test(x, seqs, fmt):
        """``(k_pool, v_pool, scale kwargs)`` the kernel reads and the fp32 ``(k, v)`` pools the
        reference reads: ``x``'s own pools, or quantized pools the kernel wrote every prefix
        and suffix row of ``x`` into."""
        if fmt is None:
            return x["k_pool"], x["v_pool"], {}, x["k_pool"].float(), x["v_pool"].float()
        k_pool, v_pool, scales = empty_pools(tuple(x["k_pool"].shape), fmt, None)
        block_size = k_pool.shape[1]
        for i, (p, ln) in enumerate(seqs):
            prefix = x["prefix_slots"][i]
            ops.paged_kv_write(x["k_pool"].flatten(0, 1)[prefix], x["v_pool"].flatten(0, 1)[prefix],
                               k_pool, v_pool, prefix, **scales)
            pos = torch.arange(p, p + ln, device=device)
            suffix = x["block_tables"][i].long()[pos // block_size] * block_size + pos % block_size
            lo = x["indptr"][i]  # the first ln of the sequence's rows (decode checks pass ln = 0)
            ops.paged_kv_write(x["k"][lo:lo + ln], x["v"][lo:lo + ln], k_pool, v_pool, suffix, **scales)
        return (k_pool, v_pool, scales, kvq.dequantize_kv(k_pool, scales["k_scale_pool"]),
                kvq.dequantize_kv(v_pool, scales["v_scale_pool"]))

    def stored(rows, fmt):
        """fp32 ``rows`` as a pool of ``fmt`` holds them."""
        return rows.float() if fmt is None else kvq.dequantize_kv(*kvq.quantize_kv(rows, fmt))

    def same_bits(a, b) -> bool:
        if a.element_size() == 1:  # int8 / fp8 bytes
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))

    def extend_check(fmt, block_size, dt):
        x = _paged_inputs(torch, ext_seqs, block_size, heads, dt, device, seed=block_size, poison=True)
        k_pool, v_pool, scales, ref_k_pool, ref_v_pool = pools_under_test(x, ext_seqs, fmt)
        got, lse = ops.extend_attention(x["q"], x["k"], x["v"], k_pool, v_pool, x["block_tables"],
                                        x["prefix_lens"], x["qo_indptr"], max_q_len=x["max_q_len"],
                                        out=torch.full_like(x["q"], float("nan")), return_lse=True,
                                        **scales)
        want, want_lse = reference.extend_attention(
            x["q"].float(), stored(x["k"], fmt), stored(x["v"], fmt), ref_k_pool, ref_v_pool,
            x["block_tables"], x["prefix_lens"], x["qo_indptr"], max_q_len=x["max_q_len"], return_lse=True)
        return max(_max_err(torch, got, want), _max_err(torch, lse, want_lse)), tol[dt]

    def decode_check(fmt, block_size):
        x = _paged_inputs(torch, [(n, 1) for n in dec_lens], block_size, heads, dtype, device,
                          seed=block_size + 1, poison=True)
        k_pool, v_pool, scales, ref_k_pool, ref_v_pool = pools_under_test(x, [(n, 0) for n in dec_lens], fmt)
        kv_lens = torch.tensor(dec_lens, dtype=torch.int32, device=device)
        got, lse = ops.decode_attention(x["q"], k_pool, v_pool, x["block_tables"], kv_lens,
                                        out=torch.full_like(x["q"], float("nan")), return_lse=True,
                                        **scales)
        want, want_lse = reference.decode_attention(x["q"].float(), ref_k_pool, ref_v_pool,
                                                    x["block_tables"], kv_lens, return_lse=True)
        return max(_max_err(torch, got, want), _max_err(torch, lse, want_lse)), tol[dtype]

    def write_check(fmt):
        slots = torch.randperm(2 * num_write, generator=torch.Generator().manual_seed(0))[:num_write]
        slots[::7] = -1  # padding rows: skipped
        slots = slots.to(device)
        k = torch.randn(num_write, hkv, d, dtype=dtype, device=device)
        shape = (-(-2 * num_write // 16), 16, hkv, d)
        (k_got, v_got, s_got), (k_want, v_want, s_want) = (empty_pools(shape, fmt, dtype) for _ in range(2))
        ops.paged_kv_write(k, -k, k_got, v_got, slots, **s_got)
        reference.paged_kv_write(k, -k, k_want, v_want, slots, **s_want)
        same = all(same_bits(a, b) for a, b in ((k_got, k_want), (v_got, v_want),
                                                *((s_got[n], s_want[n]) for n in s_got)))
        return (0.0 if same else float("inf")), 0.0

    dt_name = str(dtype)[6:]
    for kv_name in (None, *KV_QUANT_NAMES):
        fmt = None if kv_name is None else kvq.resolve_kv_format(kv_name, torch.float32)
        label = "" if kv_name is None else f" {kv_name}"
        for block_size in ((1, 16, 64) if fmt is None else (16,)):
            for dt in ([dtype, torch.float32] if fmt is None and block_size == 16 else [dtype]):
                record(f"extend{label} B={block_size} {str(dt)[6:]} seqs={ext_seqs}",
                       functools.partial(extend_check, fmt, block_size, dt))
            record(f"decode{label} B={block_size} {dt_name} kv_lens={dec_lens}",
                   functools.partial(decode_check, fmt, block_size))
        record(f"paged_kv_write{label} B=16 {dt_name} T={num_write}"
               + ("" if fmt is None else " (bytes and scales exact)"), functools.partial(write_check, fmt))
    return checks


# ----------------------------------------------------------------------------- report


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(result: dict) -> str:
    lines = [f"device: {result['device']}  torch {result['torch']}  triton {result['triton']}  "
             f"dtype {result['dtype']}"]
    lines.append("checks (kernel vs torch reference, NaN-poisoned pools):")
    for c in result["checks"]:
        status = "ok  " if c["ok"] else "FAIL"
        detail = c.get("error") or f"max_abs_err {c['max_abs_err']:.2e} (tol {c['tol']:.0e})"
        lines.append(f"  {status} {c['check']}: {detail}")
    roofs = result["roofs"]
    lines.append(f"roofs: matmul {_fmt(roofs.get('matmul', {}).get('tflops'), '.1f')} TFLOP/s, "
                 f"copy {_fmt(roofs.get('copy', {}).get('gbps'), '.0f')} GB/s (read+write)")
    lines.append(f"{'case':<34}{'ms':>9}{'ours':>10}{'flash':>10}{'cudnn':>10}{'/flash':>8}{'/cudnn':>8}{'/roof':>8}")
    for row in result["cases"]:
        kind = row["kind"]
        if kind == "extend":
            name = f"extend P={row['P']} L={row['L']} N={row['N']} B={row['block_size']}"
            unit, roof = "tflops", "ratio_matmul"
        elif kind == "decode":
            name = f"decode N={row['N']} kv={row['kv']} B={row['block_size']}"
            unit, roof = "gbps", "ratio_copy"
        else:
            name = f"kv_write T={row['T']} B={row['block_size']}"
            unit, roof = "gbps", "ratio_copy"
        if "error" in row:
            lines.append(f"{name:<34} ERROR {row['error'][:120]}")
            continue
        lines.append(f"{name:<34}{row['ms']:>9.3f}{row[unit]:>10.1f}"
                     f"{_fmt(row.get(f'sdpa_flash_{unit}'), '10.1f'):>10}"
                     f"{_fmt(row.get(f'sdpa_cudnn_{unit}'), '10.1f'):>10}"
                     f"{_fmt(row.get('ratio_flash'), '8.2f'):>8}"
                     f"{_fmt(row.get('ratio_cudnn'), '8.2f'):>8}{_fmt(row.get(roof), '8.2f'):>8}")
    lines.append("units: extend TFLOP/s (unmasked work only), decode / kv_write GB/s; "
                 "/roof = over matmul or copy")
    if result.get("kvquant"):
        lines.append("quantized KV (same inputs; ratio = time / unquantized time):")
        for row in result["kvquant"]:
            kind = row["kind"]
            if kind == "extend":
                name = f"extend P={row['P']} L={row['L']} N={row['N']}"
            elif kind == "decode":
                name = f"decode N={row['N']} kv={row['kv']}"
            else:
                name = f"kv_write T={row['T']}"
            name = f"{name} {row['kv_cache_dtype']}"
            if "error" in row:
                lines.append(f"  {name:<40} ERROR {row['error'][:120]}")
                continue
            gbps = f"  {row['gbps']:.1f} GB/s" if "gbps" in row else ""
            lines.append(f"  {name:<40}{row['ms']:>9.3f} ms  x{_fmt(row.get('ratio'), '.2f')}{gbps}")
    for row in result.get("sweep", []):
        value = row.get("tflops", row.get("gbps"))
        unit = "TFLOP/s" if "tflops" in row else "GB/s"
        lines.append(f"sweep {row['kind']} {row['config']}: "
                     + (f"ERROR {row['error'][:100]}" if "error" in row
                        else f"{row['ms']:.3f} ms {value:.1f} {unit}"))
    for goal in result["goals"]:
        lines.append(f"goal {goal['goal']}: ratio {_fmt(goal['ratio'], '.2f')} -> "
                     f"{'n/a' if goal['met'] is None else ('met' if goal['met'] else 'NOT met')}")
    return "\n".join(lines)


def _goals(cases: list[dict]) -> list[dict]:
    def find(**match):
        return next((r for r in cases if all(r.get(k) == v for k, v in match.items())), None)
    prefill = find(kind="extend", P=4096, L=512, block_size=16)
    decode = find(kind="decode", N=32, kv=32768, block_size=16)
    goals = []
    for name, row, key in (("extend P=4k L=512 >= 0.6x SDPA-flash TFLOP/s", prefill, "ratio_flash"),
                           ("decode kv=32k N=32 >= 0.6x copy GB/s", decode, "ratio_copy")):
        ratio = None if row is None else row.get(key)
        goals.append({"goal": name, "ratio": ratio, "met": None if ratio is None else ratio >= GOAL_RATIO})
    return goals


def run(args: argparse.Namespace) -> dict:
    """Run checks, roofs and cases per ``args``; print the report, write ``--json``; return it."""
    smoke = bool(getattr(args, "cpu_interpret_smoke", False))
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    import torch

    if not smoke and not torch.cuda.is_available():
        message = ("radixkv bench kernels: no CUDA device; this benchmark needs a GPU "
                   "(--cpu-interpret-smoke runs only the check path on tiny shapes)")
        print(message, file=sys.stderr)
        return {"error": "no CUDA device"}
    reference, ops = load_kernels()
    if smoke and not ops.interpreting():
        print("radixkv bench kernels: the kernels were imported before TRITON_INTERPRET=1 was set",
              file=sys.stderr)
        return {"error": "kernels imported without the interpreter"}
    import triton

    device = torch.device("cpu" if smoke else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[getattr(args, "dtype", "bf16")]
    heads = SMOKE if smoke else LLAMA3_8B
    result: dict = {
        "device": "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name(device),
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype)[6:], "heads": heads,
        "smoke": smoke,
    }
    kvq = load_kv_quant()
    result["checks"] = run_checks(torch, reference, ops, kvq, device, dtype, heads, smoke)
    timer = _make_timer(torch, smoke)
    result["roofs"] = run_roofs(torch, device, dtype, timer, smoke)
    timed = {"extend": time_extend, "decode": time_decode, "kv_write": time_kv_write}
    result["cases"] = []
    for case in build_cases(bool(getattr(args, "quick", False)), smoke):
        try:
            row = timed[case["kind"]](torch, ops, case, heads, dtype, device, timer, result["roofs"])
        except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
            row = dict(case, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["cases"].append(row)
    result["kvquant"] = []
    for case in kvquant_cases(smoke):
        try:
            result["kvquant"] += time_kvquant(torch, ops, kvq, case, heads, dtype, device, timer)
        except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
            result["kvquant"].append(dict(case, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if getattr(args, "sweep", False):
        result["sweep"] = run_sweep(torch, ops, heads, dtype, device, timer, result["roofs"], smoke)
    result["goals"] = _goals(result["cases"])
    result["all_checks_ok"] = all(c["ok"] for c in result["checks"])
    print(format_report(result))
    if getattr(args, "json", None):
        from _provenance import provenance

        result["provenance"] = provenance()
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/kernels.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    result = run(parser.parse_args(argv))
    if "error" in result:
        return 1
    return 0 if result["all_checks_ok"] else 3


if __name__ == "__main__":
    sys.exit(main())

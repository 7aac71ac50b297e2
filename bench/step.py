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
  with a separate ``LlamaForward`` using ``radixkv.kernels.reference`` attention on the same
  pools (``check_max_abs_diff``).

A context longer than the model's (SmolLM2: 8,192) is cut to what fits (decode: ``max - 1``,
the new token needs a position); both requested and used sizes are recorded. A point whose pool
exceeds ``--max-pool-gib`` is skipped and says so in its row.

**Floors**, measured in the same run before the points (``roofs`` in the JSON):

* copy bandwidth: ``dst.copy_(src)`` of a ``--copy-mib`` fp32 buffer, GB/s counting bytes read
  + bytes written (``2 · size / t``, as ``bench kernels``); decode floor ms = bytes read per step
  ÷ that bandwidth, where bytes read per step = ``(P + vocab · hidden) · itemsize`` (every
  non-embedding weight plus the LM head, once) ``+ batch · 2 · L · ctx · Hkv · D · itemsize``
  (each sequence's cached K and V). Counting copy bandwidth as read + write makes the floor
  the tighter one: a copy also moves its writes through memory.
* GEMM: ``torch.matmul`` of two ``--gemm-n``² matrices of the model dtype, ``2 · n³ / t``;
  prefill floor = ``radixkv.eviction.cost_model.prefill_flops(shape, 0, tokens)`` (linear
  ``2 · P`` per token + attention ``4 · L · Hq · D`` per causal (query, key) pair; no LM head)
  ÷ GEMM FLOP/s.

``ratio`` = measured time ÷ floor time (1 = at the floor; the goals: decode batch 1 at
2k ≤ 1.5, prefill ≤ 2). Timings share the machine with whatever else runs: use an idle one.

Usage::

    radixkv bench step [--model PATH | --tiny] [--quick] [--dtype float32|bfloat16 [--accuracy]]
        [--num-threads N] [--compile] [--json out.json]
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULTS = {"prefill_tokens": "512,2048,8192", "decode_batch": "1,4,16",
            "decode_context": "512,2048,8192"}
QUICK = {"prefill_tokens": "64,256", "decode_batch": "1,4", "decode_context": "64,256"}


def _sizes(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench step``)."""
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true",
                        help="random 2-layer Llama (tests' tiny model) instead of --model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weight / KV dtype (and the GEMM floor's)")
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
    parser.add_argument("--gemm-n", type=int, default=None, help="GEMM roof size (default 2048)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the decode logits check against the reference forward")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes (prefill {QUICK['prefill_tokens']}, decode "
                             f"{QUICK['decode_batch']} x {QUICK['decode_context']}, 64 MiB copy, "
                             "512² GEMM) unless given")
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
    return out


def _row_name(row: dict) -> str:
    if row["kind"] == "prefill":
        cut = "" if row["tokens"] == row["requested_tokens"] else f" (asked {row['requested_tokens']})"
        return f"prefill {row['tokens']} tok{cut}"
    cut = "" if row["context"] == row["requested_context"] else f" (asked {row['requested_context']})"
    return f"decode b={row['batch']} ctx={row['context']}{cut}"


def format_report(result: dict) -> str:
    """The result as a table: point, measured, floor, ratio (measured time ÷ floor time)."""
    roofs = result["roofs"]
    lines = [f"model {result['model']}  dtype {result['dtype']}  block {result['block_size']}  "
             f"threads {result['num_threads']}  torch {result['torch']}  "
             f"native kernels {'on' if result.get('native_kernels') else 'off'}",
             f"roofs: copy {roofs['copy']['gbps']:.1f} GB/s (read + write, "
             f"{roofs['copy']['bytes'] >> 20} MiB), GEMM {roofs['gemm']['gflops']:.1f} GFLOP/s "
             f"({roofs['gemm']['dtype']} {roofs['gemm']['n']}²); weights read per step "
             f"{result['weight_bytes'] / 1e6:.1f} MB",
             f"{'point':<34}{'measured':>26}{'floor':>26}{'ratio':>8}  check"]
    for row in result["points"]:
        name = _row_name(row)
        if "skipped" in row:
            lines.append(f"{name:<34}  skipped: {row['skipped']}")
            continue
        if row["kind"] == "prefill":
            measured = f"{row['tokens_per_s']:.0f} tok/s ({row['ms']:.0f} ms)"
            floor = f"{row['floor_tokens_per_s']:.0f} tok/s ({row['floor_ms']:.0f} ms)"
            check = ""
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
    lines.append("ratio = measured time ÷ floor time; decode floor = bytes read per step ÷ copy "
                 "GB/s; prefill floor = cost-model FLOPs ÷ GEMM FLOP/s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Measure roofs and every point per ``args``; print the table, write ``--json``; return it."""
    import _step_measure as m
    import torch

    from radixkv.model.loader import load_model

    sizes = _resolve(args)
    m.RUNNER_OPTIONS["compile"] = args.compile
    m.RUNNER_OPTIONS["native_kernels"] = False if args.no_native else None
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = m.load_tiny_model(dtype) if args.tiny else load_model(args.model, dtype=dtype)
    result: dict = {"model": "tiny-random-llama" if args.tiny else model.name, "dtype": args.dtype,
                    "block_size": args.block_size, "num_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "repeats": args.repeats,
                    "max_pool_gib": args.max_pool_gib, "weight_bytes": m.weight_bytes(model)}
    result["roofs"] = m.measure_roofs(dtype, sizes["copy_bytes"], sizes["gemm_n"], args.repeats)
    max_pool_bytes = int(args.max_pool_gib * m.GIB)
    points: list[dict] = []

    def done(row: dict) -> None:  # progress on stderr: a full run takes minutes
        points.append(row)
        state = row.get("skipped") or f"{row['ms']:.1f} ms, ratio {row['ratio']:.2f}"
        print(f"bench step: {_row_name(row)}: {state}", file=sys.stderr, flush=True)

    for tokens in sizes["prefill_tokens"]:
        done(m.prefill_point(model, tokens, args.block_size, result["roofs"], args.repeats,
                             max_pool_bytes, args.seed))
    check = None if args.no_check else m.reference_forward(model)
    for batch in sizes["decode_batch"]:
        for context in sizes["decode_context"]:
            done(m.decode_point(model, batch, context, args.block_size, result["roofs"],
                                args.repeats, max_pool_bytes, args.seed, check))
    result["points"] = points
    result["compile"] = args.compile
    result["native_kernels"] = not args.no_native and not args.compile and dtype == torch.float32
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

"""``radixkv plan``: its flags (:func:`add_arguments`, no torch) and its run (:func:`main`).

Exit 0 with the plan on stdout (a table, or JSON with ``--json``); 2 for a bad flag (naming
the flag) or a config that cannot be read or is not supported (naming the config field).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from radixkv.config import MAX_BLOCK_SIZE, CacheConfig

from .capacity import GIB, PLAN_KV_CACHE_DTYPES, MemoryBudget, memory_budget, plan_capacity
from .layout import KVLayout
from .render import plan_to_dict, plan_to_text, replay_to_dict, replay_to_text
from .trace_input import TRACES

__all__ = ["PLAN_HELP", "SHIPPED_MODELS", "DEFAULT_MEMORY_UTILIZATION", "add_arguments",
           "load_layout", "main"]

PLAN_HELP = ("KV capacity from a model config, no weights: bytes per token per layer group, "
             "blocks and worst-case concurrency in a memory budget")
#: ``--model`` names that radixkv serve ships (the first is its default, the embedded GGUF;
#: the same as ``radixkv.model.shipped.SHIPPED_MODELS``, which imports torch through its package).
SHIPPED_MODELS = ("SmolLM2-135M-Instruct", "gemma3-270m")
DEFAULT_MEMORY_UTILIZATION = 0.9
#: ``--trace`` without a budget: radixkv serve's KV pool on CPU (``--kv-cache-memory`` 4).
DEFAULT_TRACE_KV_MEMORY_BYTES = 4 * GIB
# ValueError field prefixes of the library -> the flag that set the value.
_FIELD_FLAGS = {"trace": "--trace", "concurrency": "--concurrency", "tp": "--tp",
                "block_size": "--block-size", "max_model_len": "--max-model-len",
                "kv_cache_dtype": "--kv-cache-dtype", "device_memory_gib": "--device-memory-gib",
                "memory_utilization": "--memory-utilization"}


def _number(text: str, *, minimum: float, inclusive: bool, maximum: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low_ok = value >= minimum if inclusive else value > minimum
    if not (math.isfinite(value) and low_ok and (maximum is None or value <= maximum)):
        bound = (f"{'>=' if inclusive else '>'} {minimum:g}" if maximum is None
                 else f"in {'[' if inclusive else '('}{minimum:g}, {maximum:g}]")
        raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
    return value


#: The largest GiB a budget flag takes: its bytes (``× 2**30``) must stay a finite float, or
#: ``int(gib × GIB)`` raises OverflowError.
_MAX_GIB = sys.float_info.max / GIB


def _positive_gib(text: str) -> float:
    return _number(text, minimum=0.0, inclusive=False, maximum=_MAX_GIB)


def _non_negative_gib(text: str) -> float:
    return _number(text, minimum=0.0, inclusive=True, maximum=_MAX_GIB)


def _utilization(text: str) -> float:
    return _number(text, minimum=0.0, inclusive=False, maximum=1.0)


def _int_in(text: str, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or (maximum is not None and value > maximum):
        bound = ">= 1" if maximum is None else f"in [1, {maximum}]"
        raise argparse.ArgumentTypeError(f"expected an int {bound}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_in(text)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _block_size(text: str) -> int:
    return _int_in(text, MAX_BLOCK_SIZE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``radixkv plan``'s flags to ``p`` (imports nothing heavy)."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="PATH",
                        help="a Hugging Face config.json, or a directory holding one")
    source.add_argument("--gguf", metavar="PATH", help="a .gguf file (its metadata only)")
    source.add_argument("--model", metavar="NAME",
                        help=f"a model radixkv serve takes: {SHIPPED_MODELS[0]} (the embedded "
                             f"default), {', '.join(SHIPPED_MODELS[1:])} (an optional extra), a "
                             f"Hugging Face directory or a .gguf file")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(PLAN_KV_CACHE_DTYPES),
                   help="KV dtype: auto (the config's torch_dtype; float32 for a GGUF, as "
                        "radixkv serves it), or int8 / fp8_e4m3 with one fp32 scale per token "
                        "and KV head")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                   help="tensor-parallel ranks: KV heads split across them, replicated when "
                        "fewer than the ranks (default: 1)")
    p.add_argument("--block-size", type=_block_size, default=CacheConfig.block_size, metavar="TOKENS",
                   help="tokens per KV block (default: radixkv's, %(default)s)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
                   help="tokens of the worst-case sequence (default: the config's "
                        "max_position_embeddings)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-memory-gib", type=_positive_gib, default=None, metavar="GIB",
                        help="KV memory per rank, given directly")
    budget.add_argument("--device-memory-gib", type=_positive_gib, default=None, metavar="GIB",
                        help="device memory per rank: the KV memory is this x "
                             "--memory-utilization - weights / tp - --workspace-gib")
    p.add_argument("--memory-utilization", type=_utilization, default=None, metavar="FRACTION",
                   help=f"share of --device-memory-gib to use, in (0, 1] (default: "
                        f"{DEFAULT_MEMORY_UTILIZATION})")
    p.add_argument("--weights-gib", type=_non_negative_gib, default=None, metavar="GIB",
                   help="the model's weights over all ranks (default: the config's parameter "
                        "count x the weight dtype's bytes; required for MoE and MLA configs)")
    p.add_argument("--workspace-gib", type=_non_negative_gib, default=None, metavar="GIB",
                   help="activations and other non-KV memory per rank (default: 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trace", default=None, choices=list(TRACES),
                   help="also replay this agent trace (tokenized as radixkv bench serve sends "
                        "it) through radixkv's radix tree and block pool of the planned size "
                        "(default budget: radixkv serve's 4 GiB CPU pool)")
    p.add_argument("--trace-path", default=None, metavar="PATH",
                   help="the trace's transcript file (default: the shipped sample)")
    p.add_argument("--concurrency", type=_positive_int, default=1, metavar="N",
                   help="sessions in flight in the replay, as bench serve's closed loop "
                        "(default: 1)")
    p.add_argument("--max-tokens", type=_non_negative_int, default=16, metavar="TOKENS",
                   help="output tokens of each replayed request (default: bench serve's, 16)")


def load_layout(args: argparse.Namespace) -> KVLayout:
    """The layout of ``--config``, ``--gguf`` or ``--model``.

    Raises:
        ValueError: naming the flag for a path or name that does not exist, else the config
            field (``hf_config`` / ``gguf_meta``), prefixed by the flag and path.
    """
    from .hf_config import layout_from_hf_config, read_config_json

    if args.config is not None:
        flag, target = "--config", args.config
    elif args.gguf is not None:
        flag, target = "--gguf", args.gguf
    else:
        flag, target = "--model", args.model
    try:
        shipped = [m for m in SHIPPED_MODELS if m.lower() == target.lower()]
        if flag == "--model" and shipped and not Path(target).expanduser().exists():
            from radixkv.model.shipped import shipped_gguf_path

            from .gguf_meta import layout_from_gguf

            return layout_from_gguf(shipped_gguf_path(shipped[0]), model=shipped[0])
        path = Path(target).expanduser()
        if flag == "--model" and not path.exists():
            raise ValueError(f"not a shipped model ({', '.join(SHIPPED_MODELS)}) nor an "
                             f"existing path")
        if flag == "--gguf" or (flag == "--model" and path.suffix == ".gguf"):
            from .gguf_meta import layout_from_gguf

            return layout_from_gguf(path)
        config, file = read_config_json(path)
        name = file.parent.name if file.name == "config.json" else file.stem
        return layout_from_hf_config(config, model=name or str(file), source=str(file))
    except ValueError as exc:
        raise ValueError(f"{flag} {target}: {exc}") from exc


def _budget(args: argparse.Namespace, layout: KVLayout) -> MemoryBudget | None:
    if args.device_memory_gib is None:
        for flag, value in (("--memory-utilization", args.memory_utilization),
                            ("--weights-gib", args.weights_gib),
                            ("--workspace-gib", args.workspace_gib)):
            if value is not None:
                raise ValueError(f"{flag}: needs --device-memory-gib")
        if args.kv_memory_gib is None:
            return None
        return MemoryBudget(int(args.kv_memory_gib * GIB))
    if args.weights_gib is not None:
        weights_bytes = int(args.weights_gib * GIB)
    elif layout.num_params is None:
        raise ValueError("--weights-gib: the config's parameters cannot be counted (a mixture "
                         "of experts, MLA or missing sizes); give the weights' GiB")
    else:
        weights_bytes = layout.num_params * layout.weight_dtype_bytes
    utilization = (DEFAULT_MEMORY_UTILIZATION if args.memory_utilization is None
                   else args.memory_utilization)
    return memory_budget(device_memory_gib=args.device_memory_gib, memory_utilization=utilization,
                         weights_bytes=weights_bytes, workspace_gib=args.workspace_gib or 0.0,
                         tp=args.tp)


def _flag_message(exc: ValueError) -> str:
    """A library error ``field: …`` as ``--flag: …`` where a flag set that field."""
    text = str(exc)
    field, sep, rest = text.partition(": ")
    return f"{_FIELD_FLAGS[field]}: {rest}" if sep and field in _FIELD_FLAGS else text


def main(args: argparse.Namespace) -> int:
    """Run ``radixkv plan``: 0 with the plan on stdout, 2 with the reason on stderr."""
    try:
        layout = load_layout(args)
        plan = plan_capacity(layout, kv_cache_dtype=args.kv_cache_dtype, tp=args.tp,
                             block_size=args.block_size, max_model_len=args.max_model_len,
                             budget=_budget(args, layout))
        if plan.budget is not None and plan.max_model_len is None:
            raise ValueError("--max-model-len: the config states no max_position_embeddings; "
                             "give the worst-case sequence length")
        if plan.budget is not None and plan.num_blocks == 0:  # below one block: name the flag
            flag = "--kv-memory-gib" if args.kv_memory_gib is not None else "--device-memory-gib"
            raise ValueError(f"{flag}: the budget ({plan.budget.kv_memory_bytes:,} B) holds no "
                             f"block of {plan.bytes_per_block:,} B")
        result = None
        if args.trace is not None:
            from .replay import replay_sessions
            from .trace_input import trace_prompts

            num_blocks = plan.num_blocks
            if num_blocks is None:  # radixkv serve's CPU default pool
                num_blocks = DEFAULT_TRACE_KV_MEMORY_BYTES // plan.bytes_per_block
            if num_blocks < 1:
                flag = "--kv-memory-gib" if args.kv_memory_gib is not None else "--device-memory-gib"
                raise ValueError(f"{flag}: the budget holds no block of "
                                 f"{plan.bytes_per_block:,} B")
            result = replay_sessions(trace_prompts(args.trace, args.trace_path),
                                     num_blocks=num_blocks, block_size=plan.block_size,
                                     concurrency=args.concurrency, max_tokens=args.max_tokens)
    except ValueError as exc:
        print(f"radixkv plan: {_flag_message(exc)}", file=sys.stderr)
        return 2
    if args.json:
        out = plan_to_dict(plan)
        if result is not None:
            out["replay"] = {"trace": args.trace, **replay_to_dict(result)}
        print(json.dumps(out, indent=2))
    else:
        print(plan_to_text(plan), end="")
        if result is not None:
            print(replay_to_text(result, args.trace), end="")
    return 0

"""Flags of ``radixkv bench tree``, their checks, and the targets (see ``bench/tree.py``)."""

# No ``from __future__ import annotations``: loaded beside bench/tree.py, which the CLI loads
# by path.
import argparse
import math
import sys
from pathlib import Path

from radixkv.cli import eviction_policy_arg, non_negative_int, positive_int
from radixkv.config import online_eviction_policies

# Token counts (inclusive ranges) the generator draws: each session's own opening, each reply,
# each tool output. The shortest prompt is therefore system + HISTORY_TOKENS[0] tokens.
HISTORY_TOKENS = (100, 400)
REPLY_TOKENS = (30, 300)
TOOL_TOKENS = (200, 1500)
#: Most ``ratio_to_floor`` each operation may reach (the targets).
TARGETS = {"match": 0.25, "insert": 1.2, "evict": 1.0}
#: Tree-size scaling: the largest tree's time per operation ÷ the smallest's must stay below this.
SCALING_MAX_RATIO = 3.0
#: The workload the targets were set on (flags that shape the replay; not --repeat or the
#: scaling check's).
DEFAULT_WORKLOAD = {"sessions": 48, "turns": 10, "block_size": 16, "system_tokens": 2048,
                    "capacity_fraction": 0.35, "policy": "lru", "publish_interval_blocks": 16,
                    "seed": 0}


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be a finite number in (0, 1], got {text}")
    return value


def _sizes(text: str) -> list[int]:
    parts = text.split(",")
    try:
        sizes = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of ints, e.g. 5000,50000, got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench tree``).

    Each flag's own range is checked here (argparse's one-line error, exit code 2); checks that
    tie two flags together (and ``--json``'s folder) are in :func:`check_args`.
    """
    d = DEFAULT_WORKLOAD
    parser.add_argument("--sessions", type=positive_int, default=d["sessions"],
                        help="agent sessions (>= 1)")
    parser.add_argument("--turns", type=positive_int, default=d["turns"],
                        help="turns per session (>= 1)")
    parser.add_argument("--block-size", type=positive_int, default=d["block_size"],
                        help="tokens per block (B >= 1), at most the shortest prompt: "
                             f"--system-tokens + {HISTORY_TOKENS[0]}")
    parser.add_argument("--system-tokens", type=non_negative_int, default=d["system_tokens"],
                        help="shared system prompt (>= 0; 0 = none, sessions share nothing)")
    parser.add_argument("--capacity-fraction", type=_fraction, default=d["capacity_fraction"],
                        help="pool blocks as a fraction in (0, 1] of the workload's distinct "
                             "blocks; the pool never holds fewer blocks than the largest "
                             "request needs (its prompt and reply, plus one)")
    parser.add_argument("--policy", type=eviction_policy_arg, default=d["policy"],
                        help=f"eviction policy: {', '.join(online_eviction_policies())} (the "
                             "offline oracles need a trace's future: see bench eviction)")
    parser.add_argument("--publish-interval-blocks", type=positive_int,
                        default=d["publish_interval_blocks"],
                        help="generated blocks published per batch, as the engine's flag (>= 1)")
    parser.add_argument("--seed", type=int, default=d["seed"])
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="replays of the workload (>= 1); each operation keeps its fastest "
                             "replay (the machine may be shared); as many more, alternating, "
                             "time the tree's eviction alone (evict_tree)")
    parser.add_argument("--scaling-sizes", type=_sizes, default="5000,50000",
                        help="leaf counts of the tree-size scaling check (comma list), each "
                             ">= 3 x --scaling-ops")
    parser.add_argument("--scaling-ops", type=positive_int, default=1000,
                        help="evictions and hits of the tree-size scaling check (>= 1)")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the results here (missing parent folders are created "
                             "before the run)")


def check_args(args: argparse.Namespace) -> str | None:
    """Checks that tie flags together, and ``--json``'s folder (created here, before the run).

    Returns:
        The problem as one line naming the flag, or None when the run can go ahead.
    """
    shortest = args.system_tokens + HISTORY_TOKENS[0]
    if args.block_size > shortest:
        return (f"--block-size {args.block_size} is longer than the shortest prompt "
                f"({shortest} tokens: --system-tokens {args.system_tokens} + "
                f"{HISTORY_TOKENS[0]}); every prompt must hold a full block")
    if not args.skip_scaling:
        # The scaling check evicts --scaling-ops leaves (the oldest third of the LRU order must
        # cover them), then hits as many distinct leaves of the middle third, which must still
        # be cached.
        small = [n for n in args.scaling_sizes if n // 3 < args.scaling_ops]
        if small:
            return (f"--scaling-sizes {small[0]} is too small for --scaling-ops {args.scaling_ops}: each "
                    f"size must be >= 3 x --scaling-ops ({3 * args.scaling_ops})")
    if args.json:
        path = Path(args.json)
        if path.is_dir():
            return f"--json {path} is a folder; give a file path"
        try:  # as bench serve: create the folder now, so a bad path fails before the run
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--json {path}: cannot create its folder: {exc}"
    return None


def usage_error(message: str) -> None:
    """End the run as argparse's ``parser.error`` does: one line on stderr, exit code 2."""
    print(f"radixkv bench tree: error: {message}", file=sys.stderr)
    raise SystemExit(2)

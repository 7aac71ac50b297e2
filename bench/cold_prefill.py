"""``radixkv bench cold-prefill``: time to first token of never-seen prompts of exactly N tokens.

For each target (``--url``, then every ``--compare-url`` in order, one at a time, never two at
once) and each ``--tokens`` N: ``--repeats`` requests ``POST /v1/completions`` with a prompt of
N token ids, ``max_tokens`` 1, ``temperature`` 0, streamed. Every prompt is new: N ids drawn
uniformly from ``--id-range`` by a generator seeded from ``os.urandom``, so no prefix cache
(radixkv's tree, vLLM's prefix caching, llama.cpp's slots) can hold any of its blocks. Token-id
prompts skip the tokenizer, so both servers see exactly N tokens; the response's
``usage.prompt_tokens`` is checked against N (a target that reports another count is an
error, not a number; a run whose server sent no ``usage`` has ``prompt_tokens_checked``
false, and its printed line says so). Before the timed requests each target gets ``--warmup`` requests of 64
tokens (first-call costs: thread pools, JIT kernels, page faults).

Per (target, N): ``ttft_s`` of each run (request sent → first streamed token event),
``total_s`` (→ end of stream), the best TTFT, and ``tokens_per_s`` = N ÷ best TTFT (the
prefill rate as a client sees it: HTTP, scheduling and the one sampled token included).
``vs_first`` = this target's tokens/s ÷ the first target's.

A model with an 8,192-token context takes at most 8,191 prompt tokens here (the one generated
token needs a position): the default sizes are 2,048 and 8,191.

Usage::

    radixkv bench cold-prefill --url http://127.0.0.1:8100 \\
        --compare-url vllm-cpu=http://127.0.0.1:8101 --tokens 2048,8191 --json out.json
"""

# No ``from __future__ import annotations``: the CLI loads this file by path.
import argparse
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arg_types import sizes as _sizes  # noqa: E402

DEFAULT_TOKENS = "2048,8191"
WARMUP_TOKENS = 64


class TargetError(Exception):
    """A target that could not be measured (unreachable, an HTTP error, a wrong token count)."""


def _id_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI, got {text!r}")
    return lo, hi


def _target(text: str) -> tuple[str, str]:
    label, sep, url = text.partition("=")
    if not sep:
        label, url = "", text
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected [LABEL=]http://HOST:PORT, got {text!r}")
    return label, url.rstrip("/")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench cold-prefill``)."""
    parser.add_argument("--url", required=True, type=lambda t: _target(t)[1],
                        help="the first target's base URL (http://HOST:PORT)")
    parser.add_argument("--label", default="radixkv", help="the first target's name in the report")
    parser.add_argument("--compare-url", action="append", default=[], type=_target,
                        metavar="[LABEL=]URL", help="another target, measured after the first "
                        "(repeatable; LABEL defaults to the URL)")
    parser.add_argument("--tokens", type=_sizes, default=_sizes(DEFAULT_TOKENS),
                        help=f"comma-separated prompt lengths, tokens (default {DEFAULT_TOKENS})")
    parser.add_argument("--repeats", type=_positive_int, default=3,
                        help="timed requests per target and length (best TTFT kept; default 3)")
    parser.add_argument("--warmup", type=_positive_int, default=1,
                        help=f"untimed {WARMUP_TOKENS}-token requests per target first (default 1)")
    parser.add_argument("--id-range", type=_id_range, default="1000,30000", metavar="LO,HI",
                        help="prompt token ids are drawn from [LO, HI) (default 1000,30000: "
                             "ordinary tokens of any 32k+ vocabulary)")
    parser.add_argument("--model", default=None,
                        help="the request's model field (default: each target's first "
                             "GET /v1/models entry)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per request before the target counts as failed")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def model_name(base: str, timeout: float) -> str:
    """The first model id of ``GET {base}/v1/models``.

    Raises:
        TargetError: unreachable, an HTTP error, or no model listed.
    """
    try:
        data = _get_json(f"{base}/v1/models", timeout)["data"]
        return str(data[0]["id"])
    except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise TargetError(f"{base}/v1/models: {exc}") from exc


def cold_prompt(tokens: int, id_range: tuple[int, int]) -> list[int]:
    """``tokens`` ids uniform in ``[lo, hi)`` from a generator seeded by ``os.urandom`` (a
    prompt no cache has seen: two share a first block with probability ``(hi - lo)^-B``)."""
    rng = random.Random(os.urandom(16))
    lo, hi = id_range
    return [rng.randrange(lo, hi) for _ in range(tokens)]


def timed_completion(base: str, model: str, prompt: list[int], timeout: float) -> dict:
    """One streamed ``/v1/completions`` of ``prompt`` (token ids), ``max_tokens`` 1.

    Returns:
        ``{"ttft_s": seconds to the first event carrying a choice, "total_s": seconds to the
        end of the stream, "prompt_tokens": usage.prompt_tokens or None}``.

    Raises:
        TargetError: an HTTP or connection error, a stream without a choice event, or an
            error event in the stream.
    """
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    ttft = None
    usage = None
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise TargetError(f"{base}: error event {event['error']}")
                if event.get("choices") and ttft is None:
                    ttft = time.perf_counter() - started
                if event.get("usage"):
                    usage = event["usage"]
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise TargetError(f"{base}/v1/completions: HTTP {exc.code}: {detail}") from exc
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise TargetError(f"{base}/v1/completions: {exc}") from exc
    total = time.perf_counter() - started
    if ttft is None:
        raise TargetError(f"{base}/v1/completions: the stream carried no choice")
    return {"ttft_s": ttft, "total_s": total,
            "prompt_tokens": None if usage is None else usage.get("prompt_tokens")}


def measure_target(label: str, base: str, args: argparse.Namespace) -> dict:
    """Every ``--tokens`` length on one target (see the module doc); ``{"label", "url",
    "model", "points": [...]}`` or, on failure, ``{"label", "url", "error"}``."""
    out: dict = {"label": label, "url": base}
    try:
        model = args.model or model_name(base, min(args.timeout, 30.0))
        out["model"] = model
        for _ in range(args.warmup):
            timed_completion(base, model, cold_prompt(WARMUP_TOKENS, args.id_range), args.timeout)
        points = []
        for tokens in args.tokens:
            runs = []
            for _ in range(args.repeats):
                run = timed_completion(base, model, cold_prompt(tokens, args.id_range), args.timeout)
                if run["prompt_tokens"] is not None and run["prompt_tokens"] != tokens:
                    raise TargetError(f"{base}: sent {tokens} prompt tokens, the server counted "
                                      f"{run['prompt_tokens']}")
                run["prompt_tokens_checked"] = run["prompt_tokens"] is not None
                runs.append(run)
                unchecked = "" if run["prompt_tokens_checked"] else (
                    " (no usage sent: prompt token count not checked)")
                print(f"bench cold-prefill: {label} {tokens} tokens: TTFT {run['ttft_s']:.3f} s"
                      f"{unchecked}", file=sys.stderr, flush=True)
            best = min(r["ttft_s"] for r in runs) if runs else None
            points.append({"tokens": tokens, "runs": runs, "best_ttft_s": best,
                           "tokens_per_s": tokens / best if best else None})
        out["points"] = points
    except TargetError as exc:
        out["error"] = str(exc)
        print(f"bench cold-prefill: {label}: {exc}", file=sys.stderr, flush=True)
    return out


def compare(targets: list[dict]) -> None:
    """Add ``vs_first`` (tokens/s ÷ the first target's at the same length) to every point."""
    first = {p["tokens"]: p["tokens_per_s"] for p in targets[0].get("points", [])}
    for target in targets:
        for p in target.get("points", []):
            base = first.get(p["tokens"])
            p["vs_first"] = p["tokens_per_s"] / base if base and p["tokens_per_s"] else None


def format_report(result: dict) -> str:
    """One row per (target, length): best TTFT, tokens/s, ratio to the first target."""
    lines = [f"{'target':<20}{'tokens':>8}{'best TTFT':>12}{'tok/s':>9}{'vs first':>10}  runs (TTFT s)"]
    for t in result["targets"]:
        if "error" in t:
            lines.append(f"{t['label']:<20}  error: {t['error']}")
            continue
        for p in t["points"]:
            runs = ", ".join(f"{r['ttft_s']:.3f}" for r in p["runs"])
            best = "n/a" if p["best_ttft_s"] is None else f"{p['best_ttft_s']:.3f} s"
            rate = "n/a" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"
            vs = "n/a" if p.get("vs_first") is None else f"{p['vs_first']:.2f}"
            unchecked = sum(r.get("prompt_tokens_checked") is False for r in p["runs"])
            note = f" ({unchecked} with no usage: token count not checked)" if unchecked else ""
            lines.append(f"{t['label']:<20}{p['tokens']:>8}{best:>12}{rate:>9}{vs:>10}  {runs}{note}")
    lines.append("cold prompts of exactly N random token ids, max_tokens 1; tok/s = N ÷ best TTFT")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Measure every target per ``args``; print the table, write ``--json``; return the result
    (``error`` set when any target failed, so the CLI exits 1)."""
    from _provenance import provenance

    targets = [(args.label, args.url)] + [(label or url, url) for label, url in args.compare_url]
    result: dict = {"tokens": args.tokens, "repeats": args.repeats, "warmup": args.warmup,
                    "id_range": list(args.id_range), "max_tokens": 1,
                    "targets": [measure_target(label, url, args) for label, url in targets]}
    compare(result["targets"])
    failed = [t["label"] for t in result["targets"] if "error" in t]
    if failed:
        result["error"] = f"failed targets: {', '.join(failed)}"
    result["provenance"] = provenance()
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/cold_prefill.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return 1 if run(parser.parse_args(argv)).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())

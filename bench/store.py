"""``radixkv bench store``: the cost of a store-tier hit vs recomputing the same blocks, per block.

For each run length k (``--blocks``, default 1 / 8 / 64 blocks) a prompt P is a ``--depth``-token
prefix (default 2048, whole blocks) + k blocks + 1 token (the last prompt token is always
computed, to sample from). Each repetition (``--reps``) uses a fresh ``cache_salt``, so nothing
of an earlier one is found, and runs P to its first token (``max_tokens`` 1, greedy) on
``LLMEngine`` directly, in this process:

- store engine (``--kv-store`` host or mooncake): the device tree is emptied, P runs once
  (every full block published and written to the store; the bench waits for
  ``written_blocks_total``), the k deepest blocks are evicted from the device tree (the prefix
  stays), then P runs again: the device matches the prefix, the store serves the k blocks
  (lookup + fetch + verify + insert, the request waiting in its loading state) and the last
  token is computed. P runs a third time, all from the device. Store cost = the time from
  ``add_request`` to the start of the forward, store run minus device run (the forward itself,
  one token at the same depth in both, is left out: its noise would swamp a 1-block load).
- plain engine (no store): the device tree is emptied, the prefix (+1 token) runs, then P runs:
  the k blocks + 1 token are computed at depth ``--depth``; then P again (1 token computed).
  Recompute cost = the forward's time, first run minus second.

The forward is timed by wrapping ``engine.runner.forward`` (one forward per run: the prompt
fits one step). The whole-request difference (``TTFT Δ``) is reported too.

Each engine checks the cached tokens it reports (device and store) before a time counts. Per
block: best of the repetitions (min; other load on the cores only adds time) divided by k, in
µs (medians in the JSON too); ``ratio`` = recompute ÷ store hit (the
goal is ≥ 10 on CPU). Mooncake runs against a ``mooncake_master`` this bench starts
on free loopback ports (``tests/mooncake_harness.py``), skipped with the reason printed when
Mooncake is not installed. Writes ``--json`` and a Markdown table next to it (``.md``).

Usage::

    radixkv bench store                      # host + mooncake, 1/8/64 blocks at depth 2048
    radixkv bench store --backends host --blocks 1,8 --reps 2 --json /tmp/store.json
"""

# No ``from __future__ import annotations``: the CLI loads this file by path (see bench/serve.py).
import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _provenance import provenance  # noqa: E402

DEFAULT_JSON = ROOT / "bench" / "results" / "store-hit-cost.json"
WRITE_WAIT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench store``)."""
    parser.add_argument("--backends", default="host,mooncake",
                        help="comma-separated: host, mooncake (default both)")
    parser.add_argument("--blocks", default="1,8,64", help="run lengths k in blocks (default 1,8,64)")
    parser.add_argument("--depth", type=int, default=2048,
                        help="device-cached prefix in tokens before the k blocks (default 2048)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per k (best taken)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--host-gib", type=float, default=4.0, help="host tier size (GiB)")
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--json", default=str(DEFAULT_JSON), metavar="PATH",
                        help="results JSON; the Markdown table goes next to it (.md)")


def _timed_forward(engine) -> list[tuple[float, float]]:
    """Wrap ``engine.runner.forward`` to record each call's (start, end) ``perf_counter``;
    returns the list it appends to."""
    calls: list[tuple[float, float]] = []
    forward = engine.runner.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            calls.append((start, time.perf_counter()))

    engine.runner.forward = timed
    return calls


def _run_p(engine, prompt: list[int], salt: str) -> tuple[dict[str, float], Any]:
    """Run ``prompt`` to its first token (one forward); returns seconds ``{"pre": add to the
    forward's start (match, store load, batch build), "forward": the forward, "total": to the
    first token}`` and the finished request."""
    from radixkv.engine.sampling import SamplingParams

    calls = engine._bench_forward_calls
    calls.clear()
    start = time.perf_counter()
    [req] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0),
                            cache_salt=salt)
    end = time.perf_counter()
    if len(calls) != 1:
        raise RuntimeError(f"expected one forward, got {len(calls)}")
    (f_start, f_end), = calls
    return {"pre": f_start - start, "forward": f_end - f_start, "total": end - start}, req


def _wait_written(engine, target: int) -> None:
    deadline = time.monotonic() + WRITE_WAIT_S
    while engine.stats_snapshot()["store"]["written_blocks_total"] < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"store writes stuck below {target} blocks: "
                               f"{engine.stats_snapshot()['store']}")
        time.sleep(0.01)


def _check(req, cached: int, store: int, what: str) -> None:
    got = (req.num_cached_tokens, req.num_store_tokens)
    if got != (cached, store):
        raise RuntimeError(f"{what}: cached/store tokens {got}, expected {(cached, store)}")


def measure_store(engine, prompts: dict[int, list[int]], depth: int, reps: int,
                  block_size: int, written: int) -> dict[int, dict[str, list[float]]]:
    """``t_store`` and ``t_base`` seconds per k and repetition on an engine with a store that
    has written ``written`` blocks so far (or will: writes are asynchronous, and a block
    evicted before its write is done would be missing from the store)."""
    out: dict[int, dict[str, list[float]]] = {}
    for k, prompt in prompts.items():
        out[k] = {key: [] for key in ("pre_store_s", "pre_base_s", "total_store_s",
                                      "total_base_s")}
        for _ in range(reps):
            salt = uuid.uuid4().hex
            _wait_written(engine, written)
            engine.cache.reset_prefix_cache()
            _, req = _run_p(engine, prompt, salt)
            _check(req, 0, 0, "cold run")
            written += depth // block_size + k  # the output token leaves its block partial
            _wait_written(engine, written)
            if engine.cache.evict(k) != k:
                raise RuntimeError(f"evicting the {k} deepest blocks failed")
            root = engine.cache_root(salt)
            if engine.cache.peek(root, prompt) != depth:
                raise RuntimeError(f"device match after evicting {k} blocks is not {depth}")
            t_store, req = _run_p(engine, prompt, salt)
            _check(req, depth + k * block_size, k * block_size, "store run")
            t_base, req = _run_p(engine, prompt, salt)
            _check(req, depth + k * block_size, 0, "device run")
            for name, t in (("store", t_store), ("base", t_base)):
                out[k][f"pre_{name}_s"].append(t["pre"])
                out[k][f"total_{name}_s"].append(t["total"])
    return out


def measure_compute(engine, prompts: dict[int, list[int]], depth: int, reps: int,
                    block_size: int) -> dict[int, dict[str, list[float]]]:
    """``t_compute`` and ``t_base`` seconds per k and repetition on an engine without a store."""
    out: dict[int, dict[str, list[float]]] = {}
    for k, prompt in prompts.items():
        out[k] = {key: [] for key in ("forward_compute_s", "forward_base_s",
                                      "total_compute_s", "total_base_s")}
        for _ in range(reps):
            salt = uuid.uuid4().hex
            engine.cache.reset_prefix_cache()
            _run_p(engine, prompt[: depth + 1], salt)
            t_compute, req = _run_p(engine, prompt, salt)
            _check(req, depth, 0, "recompute run")
            t_base, req = _run_p(engine, prompt, salt)
            _check(req, depth + k * block_size, 0, "device run")
            for name, t in (("compute", t_compute), ("base", t_base)):
                out[k][f"forward_{name}_s"].append(t["forward"])
                out[k][f"total_{name}_s"].append(t["total"])
    return out


def _per_block_us(total: list[float], base: list[float], k: int, pick=min) -> float:
    """``(pick(total) - pick(base)) / k`` in µs: ``min`` (best of the repetitions: other load
    on the cores only ever adds time) or ``statistics.median``."""
    return (pick(total) - pick(base)) / k * 1e6


def _engine(model, block_size: int, num_blocks: int, kv_store: str | None):
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_store=kv_store,
                        kv_store_timeout_s=30.0)
    engine = LLMEngine(EngineConfig(cache=cache), model=model)
    engine._bench_forward_calls = _timed_forward(engine)
    return engine


def _mooncake_master(log_dir: Path):
    """A started ``MooncakeMaster``, or the reason there is none."""
    sys.path.insert(0, str(ROOT))
    try:
        from tests.mooncake_harness import MooncakeMaster, mooncake_available
    except ImportError as exc:
        return None, f"tests/mooncake_harness.py not importable: {exc}"
    reason = mooncake_available()
    if reason is not None:
        return None, reason
    return MooncakeMaster(log_dir / "mooncake_master.log").start(), None


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per backend and k."""
    lines = ["| backend | k blocks | store hit µs/block | recompute µs/block | ratio "
             "| TTFT Δ store µs/block | TTFT Δ recompute µs/block |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}×"
        lines.append(f"| {r['backend']} | {r['blocks']} | {r['store_us_per_block']:,.0f} | "
                     f"{r['recompute_us_per_block']:,.0f} | {ratio} | "
                     f"{r['ttft_store_us_per_block']:,.0f} | "
                     f"{r['ttft_recompute_us_per_block']:,.0f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure per ``args``, print the table, write the JSON and Markdown; returns the results."""
    import torch

    from radixkv.model.loader import load_model

    ks = [int(x) for x in args.blocks.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any(k < 1 for k in ks) or args.reps < 1 or args.depth % args.block_size:
        raise SystemExit("bench store: --blocks and --reps must be >= 1, --depth whole blocks")
    if set(backends) - {"host", "mooncake"}:
        raise SystemExit(f"bench store: unknown backend in {args.backends!r}")
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    vocab = model.shape.vocab_size
    prompts = {k: torch.randint(3, vocab, (args.depth + k * args.block_size + 1,),
                                generator=gen).tolist() for k in ks}
    # Room for the longest prompt with its output block, twice over.
    num_blocks = 2 * (args.depth // args.block_size + max(ks) + 2)
    plain = _engine(model, args.block_size, num_blocks, None)
    _run_p(plain, prompts[ks[0]], "warmup")  # first-call costs out of the timings
    compute = measure_compute(plain, prompts, args.depth, args.reps, args.block_size)
    rows, skipped, raw = [], {}, {"recompute": compute}
    log_dir = Path(tempfile.mkdtemp(prefix="radixkv-bench-store-"))
    for backend in backends:
        master = None
        if backend == "host":
            spec = f"host:{args.host_gib:g}"
        else:
            master, reason = _mooncake_master(log_dir)
            if master is None:
                print(f"bench store: mooncake skipped: {reason}", file=sys.stderr)
                skipped[backend] = reason
                continue
            spec = master.kv_store_url(segment_gib=args.host_gib)
        try:
            engine = _engine(model, args.block_size, num_blocks, spec)
            try:
                _run_p(engine, prompts[ks[0]], "warmup")
                got = measure_store(engine, prompts, args.depth, args.reps, args.block_size,
                                    written=args.depth // args.block_size + ks[0])
                snap = engine.stats_snapshot()["store"]
            finally:
                if engine.store is not None:
                    engine.store.close()
        finally:
            if master is not None:
                master.stop()
        raw[backend] = got
        for k in ks:
            g, c = got[k], compute[k]
            store_us = _per_block_us(g["pre_store_s"], g["pre_base_s"], k)
            recompute_us = _per_block_us(c["forward_compute_s"], c["forward_base_s"], k)
            rows.append({"backend": backend, "blocks": k, "store_us_per_block": store_us,
                         "recompute_us_per_block": recompute_us,
                         "ratio": recompute_us / store_us if store_us > 0 else None,
                         "ttft_store_us_per_block": _per_block_us(g["total_store_s"],
                                                                  g["total_base_s"], k),
                         "ttft_recompute_us_per_block": _per_block_us(c["total_compute_s"],
                                                                      c["total_base_s"], k),
                         "median_store_us_per_block": _per_block_us(
                             g["pre_store_s"], g["pre_base_s"], k, statistics.median),
                         "median_recompute_us_per_block": _per_block_us(
                             c["forward_compute_s"], c["forward_base_s"], k, statistics.median),
                         "fetch_ms_p50": snap.get("fetch_ms_p50"),
                         "fetch_ms_p90": snap.get("fetch_ms_p90")})
    # The master's logs matter only when a backend failed (the exception leaves them).
    shutil.rmtree(log_dir, ignore_errors=True)
    table = format_table(rows)
    print(table)
    results = {"provenance": provenance(), "model": model.name, "depth_tokens": args.depth,
               "block_size_tokens": args.block_size,
               "reps": args.reps, "threads": torch.get_num_threads(), "host_gib": args.host_gib,
               "rows": rows, "skipped": skipped, "raw_seconds": raw}
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    json_path.with_suffix(".md").write_text(
        f"# Store hit vs recompute, per block ({model.name}, CPU, {torch.get_num_threads()} "
        f"threads, depth {args.depth} tokens, best of {args.reps})\n\n{table}\n"
        + "".join(f"\n{b} skipped: {r}\n" for b, r in skipped.items()))
    print(f"bench store: wrote {json_path} and {json_path.with_suffix('.md')}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/store.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``radixkv bench serve``: replay agent transcripts against a running OpenAI-compatible server.

Sessions come from ``--source`` (tau-bench, swe-agent, mini-swe-agent, crewai; formats in the
shared data folder's ``agent-transcripts/SOURCES.md``) read from ``--path``; by default from the
small sample of the source shipped in the package (``radixkv/tools/data/``), or with ``--shared``
from the source's full data under ``$RADIXKV_SHARED_DIR`` (default ``<repo>/../shared``). The
server is ``--url`` (default http://127.0.0.1:8000); ``--url`` given k times replays against k
replicas with no router: ``--dispatch session`` keeps a session on one of them, ``--dispatch
alternate`` sends a session's turn i to the i mod k-th (no affinity: what a shared store tier
must make up for). The JSON then has ``urls``, ``dispatch`` and ``per_url`` (per server:
requests, prompt / cached / ideal tokens, the increase of its ``/stats`` counters); the server
counters are summed over the replicas. Each session is replayed turn by turn: a
turn is sent after the previous reply ended, and carries the transcript's own history (the
recorded assistant message is what the agent sends back, not the served model's reply).
``--concurrency`` sessions run in a closed loop, or ``--request-rate`` dispatches ready turns on
a Poisson clock (see ``_serve_replay``).

Token ids come from the server's ``POST /tokenize`` and the block size from ``GET /stats``
(through a router: from ``--tokenize-url``, one replica behind it, when the router does not
forward those paths; sglang-router 0.3.2 does not, vllm-router 0.1.17 forwards each to one
worker); requests whose prompt plus ``--max-tokens`` exceed the server's ``max_model_len`` are skipped
and counted, never truncated (cutting a prompt's head would destroy its prefix).
``ideal_cached_tokens`` is what a perfect prefix cache could reuse: per request, the longest
common prefix with any earlier dispatched request, capped like the engine's hit cap. Each
run's requests carry a fresh ``cache_salt`` (``--cache-salt``), so runs against a server that
is still warm from an earlier run start cold all the same (not through sglang-router, which
drops the field: use fresh replicas and ``--cache-salt none``; KV-aware routing also needs
``none``, since salted blocks are not published). Cached tokens are each response's
``usage.prompt_tokens_details.cached_tokens``, which routers pass back unchanged.

With ``--compare-url`` (e.g. a second server started with ``--no-prefix-cache``) the same
requests are replayed there after the first run ends, so the two never share the cores; the
JSON then holds the second run under ``"compare"`` and ``ttft_ms_p50_ratio`` (compare ÷ this).
A PNG of the TTFT distributions (histogram and CDF, one curve per server) is written next to
``--json`` (or to ``--plot``). Without ``--json`` both go to a new folder
``./radixkv-bench-results/serve-<timestamp>/`` (``results.json``, ``results.png``), named at the
end. Missing parent folders are created before the run; the JSON is written first, and a plot
that fails only warns (the JSON is kept).

Usage::

    radixkv bench serve          # the shipped tau-bench sample against http://127.0.0.1:8000
    radixkv bench serve --url http://127.0.0.1:8000 --source tau-bench --shared --sessions 5 \\
        --concurrency 1 --json out.json [--compare-url http://127.0.0.1:8001]
    radixkv bench serve --url http://127.0.0.1:30000 --tokenize-url http://127.0.0.1:8001 \\
        --cache-salt none --concurrency 3     # through a router, token ids from one replica
"""

# No ``from __future__ import annotations``: the CLI loads this file by path, possibly without
# registering it in sys.modules, and dataclasses resolve string annotations through it.
import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _serve_replay  # noqa: E402
import aiohttp  # noqa: E402

from radixkv.tools.data import SHARED_DIR_ENV, default_results_dir  # noqa: E402
from radixkv.tools.transcripts import SOURCES, default_path, load_source  # noqa: E402

replay = _serve_replay.replay
DEFAULT_URL = "http://127.0.0.1:8000"


class _UrlAction(argparse.Action):
    """The first ``--url`` replaces the default in ``url``; later ones go to ``more_urls``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is self.default:
            setattr(namespace, self.dest, values)
        else:
            namespace.more_urls = (*getattr(namespace, "more_urls", ()), values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the driver's flags on ``parser`` (used by ``radixkv bench serve``)."""
    parser.add_argument("--url", action=_UrlAction, default=DEFAULT_URL,
                        help=f"server base URL (default {DEFAULT_URL}); give it again for more "
                             "replicas (args.more_urls), each turn going to one of them per "
                             "--dispatch")
    parser.add_argument("--dispatch", default="session", choices=_serve_replay.DISPATCH_MODES,
                        help="with several --url: 'session' keeps each session on one server "
                             "(CRC-32 of its id), 'alternate' sends a session's turn i to URL "
                             "i mod k (no affinity); default session")
    parser.add_argument("--tokenize-url", default=None, metavar="REPLICA_URL",
                        help="with --url a router: one replica behind it, asked for the token "
                             "ids, context length, block size, model id and /stats (for routers "
                             "that do not forward /tokenize and /stats, e.g. sglang-router)")
    parser.add_argument("--source", default="tau-bench", choices=sorted(SOURCES))
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--path", "--data-path", dest="path", default=None,
                      help="transcript file or folder in the source's format (default: the "
                           "source's small sample shipped in the package)")
    data.add_argument("--shared", action="store_true",
                      help=f"read the source's full data under the shared data folder "
                           f"(${SHARED_DIR_ENV}, default <repo>/../shared) instead of the sample")
    parser.add_argument("--sessions", type=int, default=5,
                        help="replay the first N sessions, in file order")
    parser.add_argument("--max-turns", type=int, default=None, help="first K turns per session")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed loop: sessions in flight (default 1); with --request-rate: "
                             "most requests in flight (default no cap)")
    parser.add_argument("--request-rate", type=float, default=None, metavar="R",
                        help="open loop: send ready turns on a Poisson clock of R requests/s")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --request-rate clock")
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="requests sent first under a throwaway cache_salt, not measured")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--cache-salt", default="random",
                        help="cache_salt of the measured requests: 'random' (default) draws a "
                             "fresh one per server and run, so a run never hits blocks an "
                             "earlier run left in the server; 'none' sends none")
    parser.add_argument("--request-timeout", type=float, default=900.0,
                        help="seconds without data before a request fails")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the results here (default: results.json in a new folder "
                             "./radixkv-bench-results/serve-<timestamp>/)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="TTFT distribution PNG (default: the --json path with .png)")
    parser.add_argument("--compare-url", default=None,
                        help="a second server (e.g. --no-prefix-cache), replayed after the first")


_ROWS = [("requests", "requests", "{}"), ("skipped", "skipped_requests", "{}"),
         ("failed", "failed_requests", "{}"), ("prompt tokens", "prompt_tokens", "{}"),
         ("cached tokens", "cached_tokens", "{}"), ("computed tokens", "computed_tokens", "{}"),
         ("cached/prompt", "cached_over_prompt", "{:.3f}"),
         ("ideal cached", "ideal_cached_tokens", "{}"), ("cached/ideal", "cached_over_ideal", "{:.3f}"),
         ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"), ("TTFT p90 ms", "ttft_ms_p90", "{:.1f}"),
         ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"), ("ITL p50 ms", "itl_ms_p50", "{:.1f}"),
         ("ITL p90 ms", "itl_ms_p90", "{:.1f}"), ("requests/s", "requests_per_s", "{:.3f}"),
         ("output tok/s", "output_tokens_per_s", "{:.1f}")]


def label(result: dict[str, Any]) -> str:
    """``cache on`` / ``cache off`` from the server's own /stats, else its URL; with several
    replicas, how many and the dispatch mode."""
    caching = result.get("prefix_caching")
    name = result["url"] if caching is None else ("cache on" if caching else "cache off")
    urls = result.get("urls") or [result["url"]]
    return name if len(urls) < 2 else f"{name}, {len(urls)} replicas {result.get('dispatch')}"


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table, one column per server."""
    cols = [[f"{label(r)} ({r['url']})"] + [("-" if r.get(k) is None else fmt.format(r[k]))
                                            for _, k, fmt in _ROWS] for r in results]
    labels = [""] + [name for name, _, _ in _ROWS]
    widths = [max(len(x) for x in labels)] + [max(len(x) for x in c) for c in cols]
    lines = []
    for i, name in enumerate(labels):
        cells = [name.ljust(widths[0])] + [c[i].rjust(w) for c, w in zip(cols, widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot_ttft(results: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Histogram (log-spaced bins) and CDF of TTFT per server, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series = [(label(r), [x["ttft_ms"] for x in r["per_request"]
                          if x["ttft_ms"] is not None and "error" not in x]) for r in results]
    series = [(name, values) for name, values in series if values]
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    if series:
        low = max(min(min(v) for _, v in series), 1e-3)
        high = max(max(v) for _, v in series)
        bins = np.geomspace(low, high * 1.0001, 40)
        for name, values in series:
            p50 = float(np.median(values))
            hist.hist(values, bins=bins, alpha=0.55, label=f"{name} (p50 {p50:,.0f} ms)")
            xs = np.sort(values)
            cdf.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
        for ax in (hist, cdf):
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (ms)")
            ax.grid(alpha=0.3)
            ax.legend()
    hist.set_ylabel("requests")
    cdf.set_ylabel("fraction of requests")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _replay_or_exit(url: str, sessions: list, args: argparse.Namespace,
                    tokenize_url: str | None = None,
                    more_urls: tuple[str, ...] = ()) -> dict[str, Any]:
    salt = {"random": f"bench-{uuid.uuid4().hex[:16]}", "none": None}.get(args.cache_salt,
                                                                         args.cache_salt)
    try:
        return asyncio.run(replay(url, sessions, concurrency=args.concurrency,
                                  max_tokens=args.max_tokens, request_rate=args.request_rate,
                                  seed=args.seed, warmup_requests=args.warmup_requests,
                                  cache_salt=salt, request_timeout_s=args.request_timeout,
                                  tokenize_url=tokenize_url, more_urls=more_urls,
                                  dispatch=getattr(args, "dispatch", "session")))
    except _serve_replay.NotServed as exc:
        if tokenize_url is not None:
            raise SystemExit(f"bench serve: --tokenize-url {tokenize_url} answered {exc.status} "
                             f"to {exc.path}: give a radixkv replica's URL") from exc
        raise SystemExit(
            f"bench serve: {url} answered {exc.status} to {exc.path}: a router that does not "
            "forward /tokenize and /stats to its replicas (sglang-router) needs --tokenize-url "
            "REPLICA_URL, one replica behind it (token ids, block size and model id come from "
            "there; the requests still go through the router)") from exc
    except (aiohttp.ClientError, RuntimeError) as exc:  # unreachable, /stats or /tokenize fail
        via = f" with --tokenize-url {tokenize_url}" if tokenize_url is not None else ""
        raise SystemExit(f"bench serve: cannot use the server at {url}{via}: {exc}") from exc


def _output_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """``(json, plot)`` paths (JSON default: ``results.json`` in a new folder
    ``./radixkv-bench-results/serve-<timestamp>/``; plot default: the JSON path with ``.png``),
    their parent folders created now, so that a bad path fails before the run rather than
    after it."""
    json_path = Path(args.json) if args.json else default_results_dir("serve") / "results.json"
    try:
        plot = Path(args.plot) if args.plot else json_path.with_suffix(".png")
        plot_flag = "--plot" if args.plot else "plot (from --json)"
        if plot == json_path:
            raise SystemExit(f"bench serve: the JSON and the plot would both be {plot}; "
                             "give --json a .json path or a different --plot")
        for path, flag in ((json_path, "--json"), (plot, plot_flag)):
            if path.is_dir():
                raise SystemExit(f"bench serve: {flag} {path} is a folder; give a file path")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SystemExit(f"bench serve: {flag} {path}: cannot create its folder: "
                                 f"{exc}") from exc
    except SystemExit:
        _remove_default_folder(args, json_path)
        raise
    return json_path, plot


def _remove_default_folder(args: argparse.Namespace, json_path: Path) -> None:
    """Remove the default results folder made for this run if it is still empty."""
    if not args.json:
        try:
            json_path.parent.rmdir()
        except OSError:
            pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay per ``args``, print the table, write ``--json`` and the PNG; returns the results."""
    for name in ("sessions", "concurrency", "max_tokens", "max_turns"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SystemExit("--request-rate must be > 0")
    if args.warmup_requests < 0:
        raise SystemExit("--warmup-requests must be >= 0")
    urls = [args.url, *getattr(args, "more_urls", ())]
    if len(set(urls)) != len(urls):
        raise SystemExit("bench serve: the same --url twice")
    path = default_path(args.source, shared=True) if args.shared else args.path
    try:
        sessions = load_source(args.source, path)[: args.sessions]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench serve: {exc}") from exc
    if args.max_turns is not None:
        sessions = [s[: args.max_turns] for s in sessions]
    json_path, plot = _output_paths(args)
    try:
        results = _replay_or_exit(urls[0], sessions, args, args.tokenize_url, tuple(urls[1:]))
        compare = _replay_or_exit(args.compare_url, sessions, args) if args.compare_url else None
    except SystemExit:
        _remove_default_folder(args, json_path)
        raise
    results["source"] = args.source
    results["data_path"] = str(path if path is not None else default_path(args.source))
    shown = [results]
    if compare is not None:
        results["compare"] = compare
        shown.append(compare)
        on, off = results["ttft_ms_p50"], compare["ttft_ms_p50"]
        results["ttft_ms_p50_ratio"] = off / on if on and off else None
    print(format_table(shown))
    if len(urls) > 1:
        for url, per in results["per_url"].items():
            ratio = per["cached_tokens"] / per["ideal_cached_tokens"] if per["ideal_cached_tokens"] else 0
            print(f"  {url}: {per['requests']} requests, {per['cached_tokens']} cached of "
                  f"{per['ideal_cached_tokens']} ideal ({ratio:.3f})")
    if results.get("ttft_ms_p50_ratio"):
        print(f"TTFT p50 {label(compare)} / {label(results)}: {results['ttft_ms_p50_ratio']:.2f}x")
    try:  # first: a failing plot must not lose the results
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    except OSError as exc:
        raise SystemExit(f"bench serve: cannot write --json {json_path}: {exc}") from exc
    if plot is not None:
        turns = f", first {args.max_turns} turns" if args.max_turns else ""
        try:
            plot_ttft(shown, plot, f"{args.source}: {len(sessions)} sessions{turns}, "
                                   f"{results['requests']} requests")
        except Exception as exc:  # noqa: BLE001 - the results are kept; the plot is extra
            print(f"bench serve: warning: the TTFT plot {plot} was not written: "
                  f"{type(exc).__name__}: {exc}; the results are in {json_path}", file=sys.stderr)
            plot = None
    written = " and ".join(str(x) for x in (json_path, plot) if x is not None)
    print(f"bench serve: wrote {written}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/serve.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

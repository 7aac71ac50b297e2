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

``--think-time-s S`` or ``exp:MEAN`` waits a think time (drawn per session and turn with
``--seed``) between the end of a reply and the session's next turn; a thinking session keeps its
``--concurrency`` slot. ``--retention MODE`` with ``--retain-share F`` sends retention for a share
F of the sessions (spread evenly in file order): ``anthropic-5m`` / ``anthropic-1h`` send every
request through ``POST /v1/messages`` (the retained sessions' with ``cache_control`` of that TTL
on the last block of each turn; usage from ``cache_read_input_tokens``), ``openai-24h`` adds
``prompt_cache_retention: "24h"`` to the retained sessions' chat completions. The JSON then has
``groups`` (``retained`` / ``not_retained``: sessions, requests, prompt / cached / ideal /
cache-creation tokens, cached ÷ ideal, TTFT) and a second table prints them.

Every target gets the same requests. Each transcript request is flattened to plain-text
system / user / assistant messages (``_serve_tokens.flatten_request``: tool schemas and
assistant tool calls rendered by radixkv's tool-call fallback, tool results as
``<tool_response>`` user messages), sent as a streamed ``/v1/chat/completions`` with
``max_tokens``, temperature 0 and ``stream_options.include_usage``. Token ids are computed
client side with the served model's tokenizer and chat template (``--tokenizer DIR_OR_GGUF``,
default the embedded SmolLM2 one), so skipping and the ideal are the same for every target:
requests whose prompt plus ``--max-tokens`` exceed ``--max-model-len`` (default: the smallest
``max_model_len`` the targets' ``GET /v1/models`` list, else 8192) are skipped and counted,
never truncated (cutting a prompt's head would destroy its prefix). Where the first target is
radixkv (it serves ``GET /stats``), its ``POST /tokenize`` is a cross-check:
``tokenize_mismatches`` counts the requests whose ids differ (the run goes on).
``ideal_cached_tokens`` is what a perfect prefix cache could reuse: per request, the longest
common prefix with any earlier dispatched request, capped like the engine's hit cap at the
target's block size: from radixkv's ``/stats``, else ``--block-size N`` or ``LABEL=N``
(vLLM-CPU: 128; llama.cpp's ``llama-server`` is token-granular: 1). Each target's model id is
the first of its ``GET /v1/models`` (vLLM serves a model under its folder path). Through a
router that forwards neither ``/tokenize`` nor ``/stats`` (sglang-router 0.3.2; vllm-router
0.1.17 forwards each to one worker), ``--tokenize-url`` names one replica behind it for the
model id, block size and ``/stats``, or ``--block-size`` treats the router as any server.

Each run's requests carry a fresh ``cache_salt`` (``--cache-salt``), so runs against a server
that is still warm from an earlier run start cold all the same (not through sglang-router,
which drops the field; nor vLLM-CPU or llama.cpp, which ignore or lack it: use fresh servers
and ``--cache-salt none``; KV-aware routing also needs ``none``, since salted blocks are not
published). Cached tokens are each response's ``usage.prompt_tokens_details.cached_tokens``
(which routers pass back unchanged; vLLM only with ``--enable-prompt-tokens-details``), else
llama.cpp's ``timings.cache_n``; a target that reports neither has ``cached_tokens_reported``
false and no cached numbers, never zeros.

``--compare-url [LABEL=]URL`` (repeatable) adds targets, replayed one after another after the
first (never at once, so they never share the cores); ``--label`` names the first (default
radixkv). The JSON is the first target's run, with ``targets`` (every run, each with
``label``, ``url``, ``block_size`` and its summary), ``compare`` (the first compare run) and
``ttft_ms_p50_ratio`` (that one's ÷ the first's). One table (a column per target), one PNG
(TTFT histogram and CDF, a curve per target) next to ``--json`` (or to ``--plot``). Without
``--json`` both go to a new folder ``./radixkv-bench-results/serve-<timestamp>/``
(``results.json``, ``results.png``), named at the end. Missing parent folders are created
before the run; the JSON is written first, and a plot that fails only warns (the JSON is kept).

Usage::

    radixkv bench serve          # the shipped tau-bench sample against http://127.0.0.1:8000
    radixkv bench serve --url http://127.0.0.1:8000 --source tau-bench --shared --sessions 5 \\
        --concurrency 1 --json out.json [--compare-url http://127.0.0.1:8001]
    radixkv bench serve --shared --sessions 5 --cache-salt none --label radixkv \
        --compare-url vllm-cpu=http://127.0.0.1:8001 --compare-url llama.cpp=http://127.0.0.1:8002 \
        --block-size vllm-cpu=128 --block-size llama.cpp=1 --max-model-len 8192
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

import _arg_types  # noqa: E402
import _serve_replay  # noqa: E402
import _serve_targets  # noqa: E402
import _serve_tokens  # noqa: E402
import aiohttp  # noqa: E402
from _provenance import provenance  # noqa: E402
from _serve_report import (  # noqa: E402, F401 - label re-exported
    format_groups,
    format_table,
    label,
    plot_ttft,
)

from radixkv.tools.data import SHARED_DIR_ENV, default_results_dir, require_shared  # noqa: E402
from radixkv.tools.transcripts import SOURCES, default_path, load_source  # noqa: E402

replay = _serve_replay.replay
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_MODEL_LEN = 8192  # when no target lists its max_model_len


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
                             "replicas, each turn going to one of them per "
                             "--dispatch")
    parser.add_argument("--dispatch", default="session", choices=_serve_replay.DISPATCH_MODES,
                        help="with several --url: 'session' keeps each session on one server "
                             "(CRC-32 of its id), 'alternate' sends a session's turn i to URL "
                             "i mod k (no affinity); default session")
    parser.add_argument("--tokenize-url", default=None, metavar="REPLICA_URL",
                        help="with --url a router: one replica behind it, asked for the "
                             "/tokenize cross-check, context length, block size, model id and "
                             "/stats (for routers that do not forward /tokenize and /stats, e.g. "
                             "sglang-router)")
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
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the --request-rate clock and the --think-time-s draws")
    parser.add_argument("--think-time-s", type=_arg_types.think_time, default=None,
                        metavar="S|exp:MEAN",
                        help="think time before each turn of a session after its first, from "
                             "the end of the previous reply: S seconds, or exponential of mean "
                             "MEAN (drawn per session and turn with --seed); a thinking session "
                             "keeps its --concurrency slot (default: none)")
    parser.add_argument("--retention", default=None, choices=_serve_tokens.RETENTION_MODES,
                        help="send retention for --retain-share of the sessions: anthropic-5m / "
                             "anthropic-1h send every request through /v1/messages, the retained "
                             "sessions' with cache_control (that ttl) on the last block of each "
                             "turn; openai-24h adds prompt_cache_retention \"24h\" to their chat "
                             "completions; results per group (retained or not)")
    parser.add_argument("--retain-share", type=_arg_types.share, default=None, metavar="F",
                        help="share of the sessions (spread evenly in file order) that send "
                             "--retention (default 1 with --retention)")
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
    parser.add_argument("--compare-url", action="append", default=None, metavar="[LABEL=]URL",
                        help="another server to replay the same requests against, after the "
                             "first (one at a time); repeatable; e.g. vllm-cpu=http://...:8001")
    parser.add_argument("--label", default="radixkv", help="name of the first target (--url)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR_OR_GGUF",
                        help="the served model's tokenizer and chat template: a Hugging Face "
                             "folder, a .gguf file or a shipped model name (gemma3-270m) "
                             "(default: the embedded SmolLM2 one)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                        help="skip requests whose prompt + --max-tokens exceed this (default: "
                             "the smallest max_model_len the targets' /v1/models list, else "
                             f"{DEFAULT_MAX_MODEL_LEN})")
    parser.add_argument("--block-size", action="append", default=None, metavar="[LABEL=]N",
                        help="KV block size in tokens of a target without radixkv's /stats "
                             "(vLLM-CPU 128, llama.cpp 1); N for all of them or LABEL=N; "
                             "repeatable")


def _salt(args: argparse.Namespace) -> str | None:
    """A fresh ``cache_salt`` per target and run ('random'), none, or the one given."""
    return {"random": f"bench-{uuid.uuid4().hex[:16]}", "none": None}.get(args.cache_salt,
                                                                         args.cache_salt)


def _no_block_size(target: dict[str, Any]) -> str:
    return (f"bench serve: {target['label']} ({target['url']}) serves no radixkv /stats to read "
            f"its KV block size from: give --block-size {target['label']}=N (or N for every such "
            "target; vLLM-CPU: 128, llama.cpp llama-server: 1)")


async def _probe_targets(targets: list[dict[str, Any]], block_sizes: dict[str | None, int],
                         first_request: dict) -> None:
    """Fill in each target's model id, ``max_model_len``, ``stats_urls``, ``block_size`` and
    its source, from what it serves; SystemExit naming the flag when a fact is missing."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i, t in enumerate(targets):
            via = f" with --tokenize-url {t['tokenize_url']}" if t.get("tokenize_url") else ""
            try:
                info = await _serve_targets.probe(http, t["info_url"])
            except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as exc:
                raise SystemExit(f"bench serve: cannot use the server at {t['url']}{via}: "
                                 f"{type(exc).__name__}: {exc}") from exc
            stats = info["stats"]
            t.update(model=info["model"], listed_max_model_len=info["max_model_len"],
                     stats_urls=([t["info_url"]] if t.get("tokenize_url") else t["urls"])
                     if stats else [])
            if t["label"] is None:
                caching = None if stats is None else stats.get("prefix_caching")
                t["label"] = t["url"] if caching is None else ("cache on" if caching else "cache off")
            if stats is not None:
                t["block_size"], t["block_size_source"] = stats["pool"]["block_size_tokens"], "/stats"
                continue
            if t.get("tokenize_url"):
                raise SystemExit(f"bench serve: --tokenize-url {t['tokenize_url']} serves no "
                                 "radixkv /stats: give a radixkv replica's URL")
            size = block_sizes.get(t["label"], block_sizes.get(None))
            if size is not None:
                t["block_size"], t["block_size_source"] = size, "--block-size"
                continue
            if i == 0:  # a router that forwards neither path: name --tokenize-url first
                try:
                    await _serve_targets.tokenize_all(http, t["url"], t["model"], [first_request])
                except _serve_targets.NotServed as exc:
                    raise SystemExit(
                        f"bench serve: {t['url']} answered {exc.status} to {exc.path}: a router "
                        "that does not forward /tokenize and /stats to its replicas "
                        "(sglang-router) needs --tokenize-url REPLICA_URL, one replica behind it "
                        "(token ids, block size and model id come from there; the requests still "
                        "go through the router)") from exc
                except (RuntimeError, KeyError, aiohttp.ClientError):
                    pass
            raise SystemExit(_no_block_size(t))


def _targets(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The first target (``--url``, its replicas, ``--tokenize-url``) and the compare ones."""
    urls = [u.rstrip("/") for u in (args.url, *getattr(args, "more_urls", ()))]
    first = {"label": args.label, "url": urls[0], "urls": urls, "tokenize_url": args.tokenize_url,
             "info_url": (args.tokenize_url or urls[0]).rstrip("/")}
    out = [first]
    for value in args.compare_url or ():
        try:
            t = _serve_targets.parse_target(value)
        except ValueError as exc:
            raise SystemExit(f"bench serve: --compare-url: {exc}") from exc
        out.append({"label": t.label, "url": t.url, "urls": [t.url], "info_url": t.url})
    named = [t["label"] for t in out if t["label"] is not None]
    if len(set(named)) != len(named):
        raise SystemExit(f"bench serve: two targets labelled alike: {named}")
    return out


def _replay_target(t: dict[str, Any], sessions: list, tokens: list, max_model_len: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    try:
        result = asyncio.run(replay(
            t["url"], sessions, tokens, model=t["model"], max_model_len=max_model_len,
            block_size=t["block_size"], concurrency=args.concurrency, max_tokens=args.max_tokens,
            request_rate=args.request_rate, seed=args.seed, warmup_requests=args.warmup_requests,
            cache_salt=_salt(args), request_timeout_s=args.request_timeout,
            stats_urls=t["stats_urls"], more_urls=tuple(t["urls"][1:]),
            dispatch=getattr(args, "dispatch", "session"),
            think_time=getattr(args, "think_time_s", None),
            retention=getattr(args, "retention", None),
            retain_share=_retain_share(args)))
    except (aiohttp.ClientError, RuntimeError) as exc:
        raise SystemExit(f"bench serve: cannot use the server at {t['url']}: {exc}") from exc
    result.update(label=t["label"], block_size=t["block_size"],
                  block_size_source=t["block_size_source"])
    if "tokenize_url" in t:
        result["tokenize_url"] = t["tokenize_url"]
    return result


def _retain_share(args: argparse.Namespace) -> float:
    """``--retain-share``, 1 when only ``--retention`` is given, 0 without retention."""
    if getattr(args, "retention", None) is None:
        return 0.0
    value = getattr(args, "retain_share", None)
    return 1.0 if value is None else value


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


def _prepare(args: argparse.Namespace, sessions: list) -> tuple[list, list, list, int, dict]:
    """Flattened sessions, their client-side token ids, the probed targets, the context length
    and the tokenizer facts (``tokenizer``, ``tokenize_mismatches``)."""
    targets = _targets(args)
    try:
        block_sizes = _serve_targets.parse_block_sizes(args.block_size or [])
        flat = [[_serve_tokens.flatten_request(r) for r in s] for s in sessions]
        tokenizer, tokenizer_name = _serve_tokens.load_client_tokenizer(args.tokenizer)
        tokens = [_serve_tokens.client_tokens(tokenizer, s) for s in flat]
    except ValueError as exc:
        raise SystemExit(f"bench serve: {exc}") from exc
    requests = [r for s in flat for r in s]
    asyncio.run(_probe_targets(targets, block_sizes, requests[0] if requests else {}))
    listed = [t["listed_max_model_len"] for t in targets if t["listed_max_model_len"]]
    max_model_len = args.max_model_len or (min(listed) if listed else DEFAULT_MAX_MODEL_LEN)
    first = targets[0]
    mismatches = None
    if first["stats_urls"] and requests:  # radixkv: its /tokenize is the cross-check
        mismatches = asyncio.run(_count_mismatches(first, requests,
                                                   [t for s in tokens for t in s]))
    facts = {"tokenizer": tokenizer_name, "max_model_len": max_model_len,
             "tokenize_checked_url": first["info_url"] if mismatches is not None else None,
             "tokenize_mismatches": mismatches}
    return flat, tokens, targets, max_model_len, facts


async def _count_mismatches(target: dict[str, Any], requests: list, tokens: list) -> int | None:
    async with aiohttp.ClientSession() as http:
        return await _serve_targets.count_mismatches(http, target["info_url"], target["model"],
                                                     requests, tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay per ``args`` against every target in turn, print the table, write ``--json`` and
    the PNG; returns the first target's results (with ``targets`` and ``compare``)."""
    for name in ("sessions", "concurrency", "max_tokens", "max_turns", "max_model_len"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SystemExit("--request-rate must be > 0")
    if args.warmup_requests < 0:
        raise SystemExit("--warmup-requests must be >= 0")
    if getattr(args, "retain_share", None) is not None and getattr(args, "retention", None) is None:
        print("bench serve: --retain-share needs --retention (anthropic-5m, anthropic-1h or "
              "openai-24h)", file=sys.stderr)
        raise SystemExit(2)
    urls = [args.url, *getattr(args, "more_urls", ())]
    if len(set(urls)) != len(urls):
        raise SystemExit("bench serve: the same --url twice")
    path = require_shared(default_path(args.source, shared=True)) if args.shared else args.path
    try:
        sessions = load_source(args.source, path)[: args.sessions]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench serve: {exc}") from exc
    if args.max_turns is not None:
        sessions = [s[: args.max_turns] for s in sessions]
    json_path, plot = _output_paths(args)
    try:
        flat, tokens, targets, max_model_len, facts = _prepare(args, sessions)
        shown = [_replay_target(t, flat, tokens, max_model_len, args) for t in targets]
    except SystemExit:
        _remove_default_folder(args, json_path)
        raise
    results = shown[0]
    results.update(facts, source=args.source,
                   data_path=str(path if path is not None else default_path(args.source)))
    results["targets"] = [{k: v for k, v in r.items() if k not in ("targets", "compare")}
                          for r in shown]
    if len(shown) > 1:
        compare = results["compare"] = shown[1]
        on, off = results["ttft_ms_p50"], compare["ttft_ms_p50"]
        results["ttft_ms_p50_ratio"] = off / on if on and off else None
    print(format_table(shown))
    if results.get("groups") is not None:
        print(format_groups(shown))
    if len(urls) > 1:
        for url, per in results["per_url"].items():
            ideal = per["ideal_cached_tokens"]
            ratio = (per["cached_tokens"] or 0) / ideal if ideal else 0
            print(f"  {url}: {per['requests']} requests, {per['cached_tokens']} cached of "
                  f"{per['ideal_cached_tokens']} ideal ({ratio:.3f})")
    if facts["tokenize_mismatches"] is not None:
        print(f"client-side tokens vs {facts['tokenize_checked_url']}/tokenize: "
              f"{facts['tokenize_mismatches']} of {sum(len(s) for s in flat)} requests differ")
    for other in shown[1:]:
        if other["ttft_ms_p50"] and results["ttft_ms_p50"]:
            print(f"TTFT p50 {label(other)} / {label(results)}: "
                  f"{other['ttft_ms_p50'] / results['ttft_ms_p50']:.2f}x")
    results["provenance"] = provenance()
    try:  # first: a failing plot must not lose the results
        json_path.write_text(json.dumps(results, indent=2) + "\n")
    except OSError as exc:
        raise SystemExit(f"bench serve: cannot write --json {json_path}: {exc}") from exc
    if plot is not None:
        turns = f", first {args.max_turns} turns" if args.max_turns else ""
        try:
            plot_ttft(shown, plot, f"{args.source}: {len(sessions)} sessions{turns}, "
                                   f"{results['requests']} requests, max_tokens {args.max_tokens}")
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

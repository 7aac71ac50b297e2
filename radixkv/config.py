"""Frozen configuration dataclasses, validated at construction, and the shared validators.

Every value is checked by one function here, where it enters: a config, a request
(``LLMEngine.prepare_request``, the server's parsing), the constructor of a public class, or a CLI
flag (``radixkv.cli`` wraps the same checks as argparse types). Inside, values are trusted:
nothing re-checks them per step, and nothing validates device tensors. Every error is a
``ValueError`` whose message starts with the field's name (``block_size: must be ...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from radixkv.eviction import available_policies, make_policy

GIB = 1 << 30
MAX_BLOCK_SIZE = 1024  # tokens per KV block (B), the largest accepted
DTYPES = ("float32", "bfloat16")  # --dtype: the model's weights, activations and KV pool
#: ``--kv-cache-dtype`` values (``radixkv.kernels.kv_quant.KV_CACHE_DTYPES``, kept equal by a
#: test; repeated here so the CLI's parser imports no torch).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def kv_cache_dtype_problem(kv_cache_dtype: object, dtype: str) -> str | None:
    """Why ``kv_cache_dtype`` cannot be the KV pool format of a ``dtype`` model (no field
    prefix), or None if it can (the rule of ``radixkv.kernels.kv_quant.resolve_kv_format``,
    without torch): a value of :data:`KV_CACHE_DTYPES`, and an unquantized one only the
    model's own dtype (``auto`` is that)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    if kv_cache_dtype in DTYPES and kv_cache_dtype != dtype:
        return (f"{kv_cache_dtype} with a {dtype} model is not supported (unquantized K/V are "
                f"kept in the model dtype); use one of auto, {dtype}, int8, fp8_e4m3")
    return None


def int_problem(value: object, *, minimum: int = 0, maximum: int | None = None) -> str | None:
    """Why ``value`` is not an int in ``[minimum, maximum]`` (no field prefix), or None if it is.

    A bool is not an int here. The one wording of every integer check (the CLI's argparse types
    use it too; argparse adds the flag's name).
    """
    if type(value) is int and value >= minimum and (maximum is None or value <= maximum):
        return None
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    return f"must be an int {bound}, got {value!r}"


def check_int(name: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` if it is an int in ``[minimum, maximum]`` (see :func:`int_problem`).

    Raises:
        ValueError: ``"{name}: must be an int >= {minimum}, got {value!r}"`` (or ``in [lo, hi]``).
    """
    problem = int_problem(value, minimum=minimum, maximum=maximum)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    return cast(int, value)  # int_problem accepted it


def check_block_size(block_size: object) -> int:
    """Tokens per KV block (B): an int in ``[1, MAX_BLOCK_SIZE]``.

    Raises:
        ValueError: naming ``block_size``.
    """
    return check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)


def check_token_ids(name: str, token_ids: Sequence[object], vocab_size: int) -> list[int]:
    """A prompt's token ids, as a new list: at least one, each an int in ``[0, vocab_size)``.

    One pass at C speed when the ids are fine; the first bad id is looked for only on failure.

    Raises:
        ValueError: ``"{name}: must contain at least one token"``, or naming the first bad id
            ``"{name}[i]: must be an int in [0, vocab_size - 1], got ..."``.
    """
    ids: list[Any] = list(token_ids)  # checked below: ints in range
    if not ids:
        raise ValueError(f"{name}: must contain at least one token")
    if not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        for i, token in enumerate(ids):  # name the first bad one
            check_int(f"{name}[{i}]", token, minimum=0, maximum=vocab_size - 1)
    return ids


def online_eviction_policies() -> list[str]:
    """Registered eviction policies a live cache can run, sorted.

    The offline oracles (``belady``, ``belady-cost``) refuse to be built without the trace's
    future, so they are left out: each policy is built once, with no arguments, to find out.
    """
    usable = []
    for name in available_policies():
        try:
            make_policy(name)
        except ValueError:  # an oracle: needs next_use= from a trace
            continue
        usable.append(name)
    return usable


def eviction_policy_problem(name: object) -> str | None:
    """Why ``name`` cannot be a live cache's eviction policy (no field prefix), or None if it can.

    Checked when a config is built (and by the CLI at argument parsing), so that a bad name
    fails before a model is loaded or a KV pool allocated.
    """
    usable = online_eviction_policies()
    if name in usable:
        return None
    if isinstance(name, str) and name in available_policies():
        return (f"{name!r} is an offline oracle that needs the trace's future (bench eviction "
                f"only); usable: {', '.join(usable)}")
    return f"unknown policy {name!r}; usable: {', '.join(usable)}"


#: Residency rules for sliding-window layers' KV (``CacheConfig.sliding_window_kv``).
SLIDING_WINDOW_KV = ("keep-all", "window")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache and prefix-cache settings.

    Attributes:
        block_size: tokens per KV block (B), in ``[1, MAX_BLOCK_SIZE]``.
        num_blocks: pool size in blocks (M); None derives it from ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: bytes for the KV pool (K and V, all layers) when ``num_blocks``
            is None. None means the device default: 4 GiB on CPU, ~90 % of free memory on CUDA.
        eviction_policy: registry name of the eviction policy (``radixkv.eviction``); one of
            :func:`online_eviction_policies` (not an offline oracle).
        enable_prefix_caching: False turns matching and publishing off (every prompt is
            prefilled in full); blocks are still paged.
        hash_algo: ``xxh3_128`` (default) or ``sha256``.
        publish_interval_blocks: generated (decode) blocks are published to the tree in
            batches of this many, and the rest when the request ends (finish, abort,
            preemption); prompt blocks are published as soon as they are computed. 1 publishes
            each block as it fills (vLLM's behaviour); a large value publishes at the end
            (SGLang's). Batching keeps per-block Python calls off the decode path.
        cache_salt: server-wide salt mixed into every request's cache identity.
        kv_store: the store tier under the tree (``radixkv.cache.store.backend.parse_kv_store``:
            ``host:GIB`` or ``mooncake://HOST:PORT?metadata=URL``); None: no store.
        kv_store_write: ``all`` writes every published block once; ``evict`` only what the
            device pool evicts.
        kv_store_timeout_s: a store load not done within this many seconds is abandoned and
            its blocks computed.
        max_retained_fraction: share of the pool, in ``[0, 1]``, that retentions (client TTL
            pins, ``radixkv.cache.retention``) may pin; 0 retains nothing.
        tenant_max_retained_tokens: per-tenant cap on retained tokens, as ``(tenant, tokens)``
            pairs (the ``--api-keys`` file's ``max_retained_tokens``); a tenant not named has
            only the pool-wide cap.
        sliding_window_kv: which blocks a model with sliding-window layers keeps
            (docs/sliding-window.md): ``keep-all`` (every block of every layer, one pool) or
            ``window`` (KV groups: window layers keep their own pool and hold only the blocks
            of a request's window, caching runs where requests resume). Models without window
            layers keep every block either way.
        window_kv_fraction: with ``window`` and a memory budget, the share of
            ``kv_cache_memory_bytes`` given to the window layers' pool, in ``(0, 1)``.
        window_num_blocks: with ``window``, the window pool's size in blocks (null block
            included, ≥ 2) instead of ``window_kv_fraction``; None with ``num_blocks`` given
            sizes it ``num_blocks + 1`` (never shorter than the full pool).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    eviction_policy: str = "lru"
    enable_prefix_caching: bool = True
    hash_algo: str = "xxh3_128"
    publish_interval_blocks: int = 16
    kv_store: str | None = None
    kv_store_write: str = "all"
    kv_store_timeout_s: float = 2.0
    max_retained_fraction: float = 0.5
    tenant_max_retained_tokens: tuple[tuple[str, int], ...] = ()
    sliding_window_kv: str = "keep-all"
    window_kv_fraction: float = 0.25
    window_num_blocks: int | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        _require(self.sliding_window_kv in SLIDING_WINDOW_KV, "sliding_window_kv",
                 f"must be one of {', '.join(SLIDING_WINDOW_KV)}, got {self.sliding_window_kv!r}")
        _require(not isinstance(self.window_kv_fraction, bool)
                 and isinstance(self.window_kv_fraction, (int, float))
                 and 0.0 < self.window_kv_fraction < 1.0, "window_kv_fraction",
                 f"must be a number in (0, 1), got {self.window_kv_fraction!r}")
        if self.window_num_blocks is not None:
            check_int("window_num_blocks", self.window_num_blocks, minimum=2)
        _require(self.kv_store is None or self.sliding_window_kv == "keep-all",
                 "sliding_window_kv", "the store tier (kv_store) carries keep-all blocks only; "
                 "use keep-all with a store")
        _require(not isinstance(self.max_retained_fraction, bool)
                 and isinstance(self.max_retained_fraction, (int, float))
                 and 0.0 <= self.max_retained_fraction <= 1.0, "max_retained_fraction",
                 f"must be a number in [0, 1], got {self.max_retained_fraction!r}")
        if isinstance(self.tenant_max_retained_tokens, dict):  # accept a mapping, keep a tuple
            object.__setattr__(self, "tenant_max_retained_tokens",
                               tuple(sorted(self.tenant_max_retained_tokens.items())))
        for pair in self.tenant_max_retained_tokens:
            _require(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                     and type(pair[1]) is int and pair[1] >= 0, "max_retained_tokens",
                     f"must be (tenant, int >= 0) pairs, got {pair!r}")
        _require(self.kv_store_write in ("all", "evict"), "kv_store_write",
                 f"must be 'all' or 'evict', got {self.kv_store_write!r}")
        _require(isinstance(self.kv_store_timeout_s, (int, float))
                 and 0 < self.kv_store_timeout_s < 3600, "kv_store_timeout_s",
                 f"must be in (0, 3600) seconds, got {self.kv_store_timeout_s!r}")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, minimum=1)
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 "kv_cache_memory_bytes", f"must be positive, got {self.kv_cache_memory_bytes!r}")
        _require(type(self.enable_prefix_caching) is bool, "enable_prefix_caching",
                 f"must be a bool, got {self.enable_prefix_caching!r}")
        problem = eviction_policy_problem(self.eviction_policy)
        _require(problem is None, "eviction_policy", problem or "")
        _require(self.hash_algo in ("xxh3_128", "sha256"),
                 "hash_algo", f"must be 'xxh3_128' or 'sha256', got {self.hash_algo!r}")
        check_int("publish_interval_blocks", self.publish_interval_blocks, minimum=1)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    Attributes:
        max_num_seqs: most requests running (decoding or prefilling) at once.
        max_num_batched_tokens: token budget of one forward step (prefill suffix tokens +
            one per decoding request).
        prefill_chunk_tokens: most suffix tokens of one request prefilled in one step; longer
            suffixes are prefilled in chunks over several steps (interleaved with decodes).
            None = ``max_num_batched_tokens``.
        admission_policy: ``lpm`` admits the waiting request with the longest cached prefix
            first (SGLang's longest-prefix-match order: its blocks are reused before an
            eviction can drop them); ``fcfs`` admits in arrival order.
        max_bypass: under ``lpm``, a request overtaken this many times is admitted next
            (arrival order among such requests), so no request waits forever.
        admission_window: under ``lpm``, how many waiting requests are looked up per
            admission (bounds the lookup cost per step).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    prefill_chunk_tokens: int | None = None
    admission_policy: str = "lpm"
    max_bypass: int = 8
    admission_window: int = 64

    def __post_init__(self) -> None:
        chunk = self.prefill_chunk_tokens
        if chunk is None:
            chunk = self.max_num_batched_tokens
            object.__setattr__(self, "prefill_chunk_tokens", chunk)
        _require(chunk >= 1, "prefill_chunk_tokens", f"must be >= 1, got {chunk}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.admission_policy in ("lpm", "fcfs"), "admission_policy",
                 f"must be 'lpm' or 'fcfs', got {self.admission_policy!r}")
        _require(self.max_bypass >= 0, "max_bypass", f"must be >= 0, got {self.max_bypass}")
        _require(self.admission_window >= 1, "admission_window",
                 f"must be >= 1, got {self.admission_window}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    Attributes:
        model: None for the embedded SmolLM2-135M-Instruct, a Hugging Face directory, or a
            ``.gguf`` file.
        device: ``cpu`` or ``cuda``.
        attention_backend: ``auto`` | ``torch`` | ``reference`` | ``triton`` (auto = triton
            on CUDA, torch elsewhere).
        served_model_name: the id clients send as ``model``; None = the model's own name.
        lora_adapters: ``(name, path)`` of PEFT LoRA adapters loaded at start (``--lora``);
            a request's ``model`` = name selects one.
        dtype: weights, activations and KV pool: ``float32`` or ``bfloat16`` (half the bytes
            read per decoded token; part of the cache identity, so the two never share KV).
        num_threads: torch intra-op threads of the forward; None leaves torch's setting.
        compile: ``torch.compile`` the decoder layers' dense math (attention stays eager).
        kv_cache_dtype: KV pool format, one of :data:`KV_CACHE_DTYPES`: ``auto`` = ``dtype``;
            ``int8`` / ``fp8_e4m3`` store K/V quantized with one fp32 scale per (token, KV
            head) inside the block (``radixkv.kernels.kv_quant``); ``float32`` / ``bfloat16``
            only when equal to ``dtype``. Part of the cache identity (its format tag).
    """

    model: str | None = None
    device: str = "cpu"
    attention_backend: str = "auto"
    served_model_name: str | None = None
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora_adapters: tuple[tuple[str, str], ...] = ()
    dtype: str = "float32"
    num_threads: int | None = None
    compile: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_adapters", tuple(tuple(p) for p in self.lora_adapters))
        _require(all(len(p) == 2 for p in self.lora_adapters), "lora_adapters",
                 "must be (name, path) pairs")
        names = [p[0] for p in self.lora_adapters]
        _require(len(set(names)) == len(names), "lora_adapters",
                 f"adapter names must be unique, got {names}")
        _require(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"),
                 "device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(self.attention_backend in ("auto", "torch", "reference", "triton"), "attention_backend",
                 f"must be one of auto, torch, reference, triton, got {self.attention_backend!r}")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        problem = kv_cache_dtype_problem(self.kv_cache_dtype, self.dtype)
        _require(problem is None, "kv_cache_dtype", problem or "")
        _require(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
                 "num_threads", f"must be an integer >= 1, got {self.num_threads!r}")

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

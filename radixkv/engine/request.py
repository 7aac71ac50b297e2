"""A request's state inside the engine.

Token ranges of a running request (N prompt tokens, G generated so far)::

    | cached (m) | computed suffix        | not yet computed |
    0            m                        num_computed_tokens   len(token_ids) = N + G

``num_computed_tokens`` counts tokens whose K/V sit in the pool. While decoding it is
``len(token_ids) - 1``: the newest sampled token is fed to the next step.
"""

from __future__ import annotations

import enum
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixkv.cache.hashing import pack_tokens
from radixkv.cache.retention import RetentionBreakpoint
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from radixkv.model.lora import LoRAAdapter


_pack_u32 = struct.Struct("<I").pack


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"       # waiting for its store-tier load (radixkv.cache.store)
    RUNNING = "running"
    PREEMPTED = "preempted"   # waiting again after preemption by recompute
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True)
class RequestSpec:
    """A validated request not built yet: what any thread may hand the engine thread.

    ``LLMEngine.prepare_request`` makes it (validation, the LoRA adapter resolved and held);
    ``LLMEngine.build_request`` turns it into a :class:`Request` on the thread that owns the
    cache, which resolves the cache identity root then. It holds no cache state and is never
    changed, so the event loop can make it and pass it over a queue.

    Attributes:
        request_id: unique id (the client-visible group id).
        prompt_token_ids: the prompt, N ≥ 1 token ids in ``[0, vocab_size)``.
        params: sampling parameters.
        arrival_s: ``time.monotonic()`` when it was made (time to first token counts from it).
        cache_salt: the isolation namespace (None: unsalted).
        tenant: per-tenant stats label.
        adapter: the LoRA adapter it holds (None: the base model).
        session_key: the client's session hint for the eviction policy.
        retention: retention breakpoints (``radixkv.cache.retention``): prompt prefixes (and
            optionally the whole sequence, ``num_tokens == -1``) to retain with a TTL class;
            validated by ``prepare_request``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_s: float
    cache_salt: str | None = None
    tenant: str | None = None
    adapter: LoRAAdapter | None = None
    session_key: str | None = None
    retention: tuple[RetentionBreakpoint, ...] = ()


@dataclass
class Request:
    """One generation request.

    Attributes:
        request_id: unique id (also the cache manager's key).
        prompt_token_ids: the prompt, N tokens.
        params: sampling parameters.
        cache_root: the cache identity root hash this request matches and publishes under.
        token_ids: prompt + generated tokens (grows by one per decode step).
        token_bytes: the same tokens packed as uint32-LE (``hashing.pack_tokens``), kept in
            step by :meth:`append_token`: the cache manager's lookups and publishes take the
            packed form, so a long prompt is packed once, not once per lookup.
        num_computed_tokens: tokens whose K/V are in the pool.
        num_cached_tokens: prompt tokens served from the prefix cache at admission (m).
        admitted: stats for this request's lookup were recorded (exactly once).
        group_id: the client-visible request id; choice ``index`` of an ``n > 1`` request is
            a forked child with its own ``request_id`` and this group id.
        index: choice index within the group (0 for the parent).
        adapter: the LoRA adapter the request runs with (its identity is in ``cache_root``),
            or None for the base model. The request holds the object, so unloading or
            replacing the adapter by name never changes a request already made.
        store_checked: the store tier was asked for this admission's blocks (one load each).
        num_store_tokens: cached prompt tokens the store tier loaded for it (part of m).
        session_key: the client's session hint (``prompt_cache_key`` / ``user``), handed to
            ``CacheManager.begin`` for the eviction policy; None when none was given.
        retention: its retention breakpoints (``RequestSpec.retention``).
        retention_applied: the prompt breakpoints were applied (once, when the prompt's
            blocks were first all cached).
        cache_creation_tokens_by_ttl: prompt tokens this request newly retained, per TTL class.
        num_retained_tokens: tokens of its prefix under a live retention (after its own
            breakpoints were applied).
        retention_ids: ids of the retentions its breakpoints made or refreshed, in
            breakpoint order (prompt breakpoints; a ``-1``'s whole sequence appended at finish).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_root: bytes
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    admitted: bool = False
    finish_reason: str | None = None
    first_token_s: float | None = None
    group_id: str = ""
    index: int = 0
    num_bypassed: int = 0   # times a later arrival was admitted first (bounded wait)
    tenant: str | None = None  # the server's authenticated tenant (per-tenant stats)
    adapter: LoRAAdapter | None = None
    token_bytes: bytearray = field(default_factory=bytearray, repr=False)
    publish_at_tokens: int = 0  # decode steps publish once this many tokens are computed
    store_checked: bool = False
    num_store_tokens: int = 0
    session_key: str | None = None
    retention: tuple[RetentionBreakpoint, ...] = ()
    retention_applied: bool = False
    cache_creation_tokens_by_ttl: dict[str, int] = field(default_factory=dict)
    num_retained_tokens: int = 0
    retention_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.token_bytes:
            self.token_bytes = bytearray(pack_tokens(self.token_ids))
        if not self.group_id:
            self.group_id = self.request_id

    def append_token(self, token: int) -> None:
        """Append a sampled token to ``token_ids`` and ``token_bytes``."""
        self.token_ids.append(token)
        self.token_bytes += _pack_u32(token)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

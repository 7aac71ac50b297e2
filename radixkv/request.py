"""A request's state inside the engine.

Token ranges of a running request (N prompt tokens, G generated so far)::

    | cached (m) | computed suffix        | not yet computed |
    0            m                        num_computed_tokens   len(token_ids) = N + G

``num_computed_tokens`` counts tokens whose K/V sit in the pool. While decoding it is
``len(token_ids) - 1``: the newest sampled token is fed to the next step.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from radixkv.detokenizer import IncrementalDetokenizer
from radixkv.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"   # waiting again after preemption by recompute
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """One generation request.

    Attributes:
        request_id: unique id (also the cache manager's key).
        prompt_token_ids: the prompt, N tokens.
        params: sampling parameters.
        cache_root: the cache identity root hash this request matches and publishes under.
        token_ids: prompt + generated tokens (grows by one per decode step).
        num_computed_tokens: tokens whose K/V are in the pool.
        num_cached_tokens: prompt tokens served from the prefix cache at admission (m).
        admitted: stats for this request's lookup were recorded (exactly once).
        group_id: the client-visible request id; choice ``index`` of an ``n > 1`` request is
            a forked child with its own ``request_id`` and this group id.
        index: choice index within the group (0 for the parent).
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

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

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

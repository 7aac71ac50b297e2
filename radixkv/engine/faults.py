"""Which engine-thread faults one request owns, and which stop the engine.

A fault raised while the engine works for one request (sampling, its generator, stop matching,
detokenizing, forking its choices, adding it) ends that request only, with
``finish_reason = "error"`` (``fail_request``); a fault in a batched forward ends
that step's requests the same way. Either is followed by the cache manager's
``check_integrity()``: when it holds the engine carries on. The faults in ``is_fatal`` are
never owned by a request: the device (or the process) is in an unknown state, so the engine
thread stops and the server answers 503 ``engine_dead`` from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from radixkv.engine.request import Request, RequestStatus
from radixkv.log import get_logger

if TYPE_CHECKING:
    from radixkv.cache.manager import CacheManager
    from radixkv.engine.scheduler import ScheduledChunk, Scheduler
    from radixkv.engine.stats import EngineStats

log = get_logger(__name__)

FAILED = "error"
"""``RequestOutput.finish_reason`` of a request ended by a fault of its own."""

# Substrings of the RuntimeError messages torch raises for device faults (CUDA / ROCm / cuBLAS /
# cuDNN / NCCL): after one of these the device's memory and streams cannot be trusted.
_DEVICE_FAULT_MARKERS = ("CUDA error", "CUDA driver error", "HIP error", "CUBLAS_STATUS",
                         "CUDNN_STATUS", "cuDNN error", "NCCL error", "device-side assert",
                         "an illegal memory access")


def is_fatal(exc: BaseException) -> bool:
    """True for a fault that must stop the engine rather than end one request.

    Fatal: anything that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``),
    running out of device or host memory (``torch.OutOfMemoryError``, ``MemoryError``), and
    device errors (``torch.AcceleratorError`` where torch has it, or a ``RuntimeError`` whose
    message names a CUDA / HIP / cuBLAS / cuDNN / NCCL failure).
    """
    if not isinstance(exc, Exception):
        return True
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(marker in message for marker in _DEVICE_FAULT_MARKERS)
    return False


@dataclass
class RequestOutput:
    """What one step produced for one choice of one request (see the server's use of each field).

    ``finish_reason`` is None until the choice's last output, then ``"stop"`` (EOS or a stop
    string), ``"length"`` (``max_tokens`` or the context), ``"abort"`` (``abort_request``) or
    ``"error"`` (``faults.FAILED``: a fault of this request's own ended it, see
    ``fail_request``; the server answers 500 ``internal_error``). After an ``"abort"`` or
    ``"error"`` output no other choice of the request produces anything.

    Retention (``radixkv.cache.retention``): ``cache_creation_tokens_by_ttl`` holds the prompt
    tokens this request newly retained at its breakpoints, per TTL class (never tokens served
    from the cache: ``num_cached_tokens + sum(values) <= num_prompt_tokens``); set on every
    output from the first one on. ``num_retained_tokens``: tokens of the request's prefix under
    any live retention after its breakpoints were applied (0: none). ``retention_ids``: the
    retentions its breakpoints made or refreshed, in breakpoint order (a ``-1``'s whole
    sequence is added on the final output); ``()`` before the prompt is cached or without any.
    """

    request_id: str                # the client-visible (group) id
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None      # None, "stop", "length", "abort" or "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int      # of this choice
    index: int = 0                 # choice index (n > 1)
    cache_creation_tokens_by_ttl: dict[str, int] = field(default_factory=dict)
    num_retained_tokens: int = 0
    retention_ids: tuple[str, ...] = ()


def make_output(req: Request, new_ids: list[int], text: str, *, finished: bool) -> RequestOutput:
    """The output of ``req`` for its ``new_ids`` (their ``text``); final when ``finished``."""
    # cache_creation_tokens_by_ttl: shared, not copied (the request replaces it, never changes it)
    return RequestOutput(request_id=req.group_id, index=req.index, new_token_ids=new_ids,
                         new_text=text,
                         finished=finished, finish_reason=req.finish_reason if finished else None,
                         num_prompt_tokens=req.num_prompt_tokens,
                         num_cached_tokens=req.num_cached_tokens,
                         num_generated_tokens=req.num_output_tokens,
                         cache_creation_tokens_by_ttl=req.cache_creation_tokens_by_ttl,
                         num_retained_tokens=req.num_retained_tokens,
                         retention_ids=req.retention_ids)


def num_unfinished(group: list[Request], culprit: Request | None = None) -> int:
    """Choices of a live group that have not finished normally (``n`` counts choices not
    forked yet); ``culprit`` counts as unfinished whatever its status."""
    done = sum(r.status is RequestStatus.FINISHED and r is not culprit for r in group)
    return group[0].params.n - done


class FaultHost(Protocol):
    """What the fault functions need of the engine (``LLMEngine``; engine thread only)."""

    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def cache(self) -> CacheManager: ...
    @property
    def stats(self) -> EngineStats: ...
    def pop_group(self, group_id: str) -> list[Request] | None: ...
    def end_group(self, group: list[Request]) -> None: ...
    def discard_request(self, req: Request) -> None: ...


def fail_request(engine: FaultHost, req: Request, exc: BaseException, *, check: bool = True
                 ) -> list[RequestOutput]:
    """End request ``req`` (every choice of its group) on a fault of its own.

    Its blocks are released (the K/V of completed steps stays publishable), the fault is
    logged with the request id and counted (``requests_failed_total``, and its unfinished
    choices in ``sequences_failed_total``), and its LoRA hold is given back. Works for a
    request in any phase, including one made but never added (``add_request`` raised).

    Args:
        check: run ``cache.check_integrity()`` afterwards (one step failing several
            requests checks once, at its end).

    Returns:
        One final output (``finish_reason = "error"``) per unfinished choice, and one for
        ``req`` itself.

    Raises:
        BaseException: ``exc`` itself when it is fatal (``faults.is_fatal``), and the
            integrity check's ``AssertionError``: either stops the engine.
    """
    if is_fatal(exc):
        raise exc
    group = engine.pop_group(req.group_id)
    live = group is not None
    if group is None:  # its group already ended, or it was never added
        group = [req]
    log.error("request_failed", request_id=req.group_id, choice=req.index,
              error=repr(exc), exc_info=exc)
    outputs = []
    if live:
        num_sequences = num_unfinished(group, culprit=req)
    else:  # never added: all its choices; its group ended: only this choice was left
        num_sequences = req.params.n if not req.admitted else 1
    for member in group:
        if member.status is RequestStatus.FINISHED and member is not req:
            continue
        if (engine.scheduler.abort(member.request_id) is None
                and engine.cache.is_active(member.request_id)):
            engine.cache.release(member.request_id)  # a fork child not yet scheduled
        member.status = RequestStatus.ABORTED
        member.finish_reason = FAILED
        outputs.append(make_output(member, [], "", finished=True))
    engine.stats.record_failure(num_sequences=num_sequences, tenant=req.tenant)
    if live:
        engine.end_group(group)
    elif not req.admitted:
        engine.discard_request(req)  # made but never added: its adapter hold is still taken
    if check:
        engine.cache.check_integrity()
    return outputs


def fail_step(engine: FaultHost, chunks: list[ScheduledChunk], exc: Exception) -> list[RequestOutput]:
    """The batched forward (or building it) failed: every request in it ends with
    ``"error"``; the cache's integrity decides whether the engine goes on."""
    if is_fatal(exc):
        raise exc
    log.error("forward_failed", requests=sorted({c.request.group_id for c in chunks}),
              error=repr(exc), exc_info=exc)
    outputs: list[RequestOutput] = []
    for chunk in chunks:
        if not chunk.request.is_finished:
            outputs += fail_request(engine, chunk.request, exc, check=False)
    engine.cache.check_integrity()
    return outputs

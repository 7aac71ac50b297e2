"""What the engine thread does with the KV cache, step by step: lookup, scheduling and
block-table preparation times, KV bytes moved by attention, recomputed tokens after
preemption, and how long a cancelled request's blocks take to come back.

Written by the engine thread (a few int additions and one ``time.perf_counter`` pair around
work that is already coarse: a tree lookup, a schedule, a batch build), read by ``/stats`` and
``/metrics`` from any thread under :attr:`KVActivity.lock`. Nothing here loops per token.

**KV bytes.** Counted in tokens, turned into bytes at export with the pool's
``kv_bytes_per_token`` (K + V of one token over all layers, scales included:
``ModelRunner.kv_bytes_per_token``):

* decode KV bytes read = Σ over decode chunks of (context length) × ``kv_bytes_per_token``,
  where a decode chunk at position ``p`` attends over ``p + 1`` tokens (its own K/V included):
  the K/V a paged decode kernel reads, the term that bounds decode on memory bandwidth;
* prefill KV bytes written = Σ over prefill chunks (prompt, suffix and recompute chunks) of
  ``num_tokens`` × ``kv_bytes_per_token``: each computed token's K/V is stored once.

Their rates (Prometheus ``rate()``) are the bytes per second the issue asks for.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Iterable, Protocol

from radixkv.engine.histogram import LatencyHistogram, percentile_ms

#: Upper bounds (seconds) of the lookup histogram: a tree match takes microseconds.
LOOKUP_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                    0.1)
#: Upper bounds (seconds) of the per-step CPU-side histograms (schedule, block tables).
STEP_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                  1.0)
#: Upper bounds (seconds) of cancel → blocks released: an abort waits for the engine thread
#: to finish the step in flight, then releases at once.
CANCEL_BUCKETS_S = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)
#: Upper bounds (seconds) of a whole engine step (schedule, batch, forward, sampling): a
#: decode step takes milliseconds, a CPU step carrying thousands of prefill tokens seconds.
ENGINE_STEP_BUCKETS_S = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                         10.0, 30.0)

#: Upper bounds (tokens) of the context-length buckets of the attention histograms: a step's
#: longest context (the most K/V tokens one of its rows attends over).
ATTENTION_CONTEXT_BUCKETS_TOKENS = (1024, 4096, 16384, 65536)
#: The attention histograms' ``context_tokens_le`` label values, Prometheus style.
ATTENTION_CONTEXT_LABELS = (*(str(b) for b in ATTENTION_CONTEXT_BUCKETS_TOKENS), "+Inf")
#: A step is ``decode`` when every row is one generated token, ``prefill`` otherwise (it
#: computes prompt tokens: a prefill, a suffix after a prefix hit, or a recompute).
ATTENTION_PHASES = ("prefill", "decode")


def context_label(context_tokens: int) -> str:
    """The ``context_tokens_le`` label of a step whose longest context is ``context_tokens``."""
    return ATTENTION_CONTEXT_LABELS[bisect.bisect_left(ATTENTION_CONTEXT_BUCKETS_TOKENS,
                                                       context_tokens)]


class _Chunk(Protocol):
    """What :func:`chunk_kv_tokens` reads of a scheduled chunk (``ScheduledChunk``)."""

    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def request(self) -> Any: ...


def chunk_kv_tokens(chunks: Iterable[_Chunk]) -> tuple[int, int]:
    """``(decode context tokens, prefill tokens)`` of one step's chunks (one pass over the
    chunks, not the tokens): a decode chunk is one token at or past the prompt's end
    (``start >= num_prompt_tokens``) and reads ``start + 1`` tokens' K/V; every other chunk
    writes ``num_tokens`` tokens' K/V."""
    read = written = 0
    for chunk in chunks:
        start, num = chunk.start, chunk.num_tokens
        if num == 1 and start >= chunk.request.num_prompt_tokens:
            read += start + 1
        else:
            written += num
    return read, written


def chunk_attention_context(chunks: Iterable[_Chunk]) -> tuple[str, int]:
    """``(phase, longest context in tokens)`` of one step's chunks: ``decode`` when every
    chunk is a decode chunk (see :func:`chunk_kv_tokens`), else ``prefill``; the context of a
    chunk is ``start + num_tokens`` (the K/V its last row attends over, its own included)."""
    decode, longest = True, 0
    for chunk in chunks:
        start, num = chunk.start, chunk.num_tokens
        decode = decode and num == 1 and start >= chunk.request.num_prompt_tokens
        longest = max(longest, start + num)
    return ("decode" if decode else "prefill"), longest


class KVActivity:
    """Per-step engine counters and histograms (see the module docstring for units).

    Attributes:
        lookup_seconds: wall time of each prefix-cache lookup (``CacheManager.begin``: the
            tree match, hit cap, lock and miss classification), seconds.
        schedule_seconds: wall time of each step's ``Scheduler.schedule`` (CPU-bound Python on
            the engine thread: admission, lookups, allocation), seconds.
        block_table_seconds: wall time of each step's batch build (block tables, slot mapping,
            positions: ``ModelRunner.build_batch``), seconds.
        step_seconds: wall time of each engine step that ran a forward, from its schedule to
            its outputs (what a cancel arriving mid-step waits for at most), seconds.
        attention_seconds: per ``(phase, context_tokens_le)`` (:data:`ATTENTION_PHASES`,
            :data:`ATTENTION_CONTEXT_LABELS`), each step's wall time in attention over all
            layers (``ModelRunner.last_attention_seconds``: K/V pool writes included, except
            in the fused C decode layer; measured on the CPU only), bucketed by the step's
            longest context, seconds.
        cancel_release_seconds: from an abort being asked (``AsyncEngine.abort``; the call for
            ``LLMEngine.abort_request`` used directly) to the request's blocks being back in
            the pool (released, on the engine thread), seconds.
        steps_total: steps that ran a forward.
        decode_kv_read_tokens_total / prefill_kv_written_tokens_total: see the module
            docstring (tokens; × ``kv_bytes_per_token`` = bytes).
        preempted_kv_tokens_total: tokens whose K/V preempted requests held when preempted.
        recomputed_tokens_total: tokens computed again after a preemption (positions below
            what the request had computed before, past what its resume found cached).
        lock: guards everything above (writers: the engine thread; readers: any thread).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lookup_seconds = LatencyHistogram(LOOKUP_BUCKETS_S, window=1)
        self.schedule_seconds = LatencyHistogram(STEP_BUCKETS_S, window=1)
        self.block_table_seconds = LatencyHistogram(STEP_BUCKETS_S, window=1)
        self.cancel_release_seconds = LatencyHistogram(CANCEL_BUCKETS_S)
        self.step_seconds = LatencyHistogram(ENGINE_STEP_BUCKETS_S)
        self.attention_seconds = {(phase, label): LatencyHistogram(ENGINE_STEP_BUCKETS_S, window=1)
                                  for phase in ATTENTION_PHASES
                                  for label in ATTENTION_CONTEXT_LABELS}
        self.steps_total = 0
        self.decode_kv_read_tokens_total = 0
        self.prefill_kv_written_tokens_total = 0
        self.preempted_kv_tokens_total = 0
        self.recomputed_tokens_total = 0

    def observe_lookup(self, seconds: float) -> None:
        with self.lock:
            self.lookup_seconds.observe(seconds)

    def observe_step(self, schedule_s: float, block_table_s: float, decode_read_tokens: int,
                     prefill_written_tokens: int) -> None:
        """One step that ran a forward (``chunk_kv_tokens`` gives the token counts)."""
        with self.lock:
            self.steps_total += 1
            self.schedule_seconds.observe(schedule_s)
            self.block_table_seconds.observe(block_table_s)
            self.decode_kv_read_tokens_total += decode_read_tokens
            self.prefill_kv_written_tokens_total += prefill_written_tokens

    def observe_step_end(self, seconds: float) -> None:
        """A step that ran a forward ended ``seconds`` after its schedule began."""
        with self.lock:
            self.step_seconds.observe(seconds)

    def observe_attention(self, phase: str, context_tokens: int, seconds: float) -> None:
        """A step of ``phase`` whose longest context was ``context_tokens`` spent ``seconds``
        in attention (``chunk_attention_context`` gives the first two).

        Raises:
            KeyError: a phase not in :data:`ATTENTION_PHASES`.
        """
        hist = self.attention_seconds[phase, context_label(context_tokens)]
        with self.lock:
            hist.observe(seconds)

    def observe_cancel_release(self, seconds: float) -> None:
        with self.lock:
            self.cancel_release_seconds.observe(seconds)

    def record_preempted(self, num_kv_tokens: int) -> None:
        with self.lock:
            self.preempted_kv_tokens_total += num_kv_tokens

    def record_recomputed(self, num_tokens: int) -> None:
        with self.lock:
            self.recomputed_tokens_total += num_tokens

    def histograms(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """``{name: (cumulative buckets, sum in seconds)}`` for Prometheus: ``lookup``,
        ``schedule``, ``block_table``, ``cancel_release``, ``step``."""
        with self.lock:
            return {name: (hist.cumulative(), hist.sum_s) for name, hist in (
                ("lookup", self.lookup_seconds), ("schedule", self.schedule_seconds),
                ("block_table", self.block_table_seconds),
                ("cancel_release", self.cancel_release_seconds),
                ("step", self.step_seconds))}

    def attention_histograms(self) -> dict[tuple[str, str], tuple[list[tuple[float, int]], float]]:
        """``{(phase, context_tokens_le): (cumulative buckets, sum in seconds)}`` for
        Prometheus, every combination (empty ones included)."""
        with self.lock:
            return {key: (hist.cumulative(), hist.sum_s)
                    for key, hist in self.attention_seconds.items()}

    def snapshot(self, kv_bytes_per_token: int | None) -> dict[str, Any]:
        """The ``kv_activity`` object of ``/stats``: counters, their bytes (when
        ``kv_bytes_per_token`` is known), and sample counts and mean times (ms) of the
        histograms; ``cancel_release_ms_p50/p99`` over the recent window; ``attention_by_context``:
        ``{phase: {context_tokens_le: {"steps", "ms_mean"}}}`` of the attention histograms
        that have samples."""
        with self.lock:
            out: dict[str, Any] = {
                "steps_total": self.steps_total,
                "decode_kv_read_tokens_total": self.decode_kv_read_tokens_total,
                "prefill_kv_written_tokens_total": self.prefill_kv_written_tokens_total,
                "preempted_kv_tokens_total": self.preempted_kv_tokens_total,
                "recomputed_tokens_total": self.recomputed_tokens_total,
                "lookups_total": self.lookup_seconds.count,
                "cancels_total": self.cancel_release_seconds.count,
            }
            for name, hist in (("lookup", self.lookup_seconds),
                               ("schedule", self.schedule_seconds),
                               ("block_table", self.block_table_seconds)):
                out[f"{name}_ms_mean"] = (hist.sum_s / hist.count * 1000.0 if hist.count
                                          else None)
            attention: dict[str, dict[str, dict[str, float | int]]] = {}
            for (phase, label), hist in self.attention_seconds.items():
                if hist.count:
                    attention.setdefault(phase, {})[label] = {
                        "steps": hist.count, "ms_mean": hist.sum_s / hist.count * 1000.0}
            out["attention_by_context"] = attention
            recent = list(self.cancel_release_seconds.recent)
            steps = list(self.step_seconds.recent)
        out["cancel_release_ms_p50"] = percentile_ms(recent, 0.5)
        out["cancel_release_ms_p99"] = percentile_ms(recent, 0.99)
        out["step_ms_p50"] = percentile_ms(steps, 0.5)
        out["step_ms_p99"] = percentile_ms(steps, 0.99)
        out["step_ms_max"] = max(steps) * 1000.0 if steps else None
        if kv_bytes_per_token is not None:
            out["decode_kv_read_bytes_total"] = (out["decode_kv_read_tokens_total"]
                                                 * kv_bytes_per_token)
            out["prefill_kv_written_bytes_total"] = (out["prefill_kv_written_tokens_total"]
                                                     * kv_bytes_per_token)
        return out

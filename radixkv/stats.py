"""Engine counters (cumulative since start) and the ``/stats`` snapshot (DESIGN.md §7).

Rates are derived per token from counters, never averaged per request: a token hit rate is
``cached_prompt_tokens_total / prompt_tokens_total``. Each request's lookup is recorded once,
at its first admission; a preempted request's resume is not a second lookup.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol


class _CacheGauges(Protocol):
    block_size: int
    num_blocks: int
    eviction_policy: str
    enable_prefix_caching: bool
    num_free_blocks: int
    num_cached_evictable_blocks: int
    num_in_use_blocks: int
    num_tree_nodes: int
    num_cached_blocks: int
    evicted_blocks_total: int


class EngineStats:
    """Counters written by the engine thread; ``snapshot`` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_total = 0
        self.requests_with_hit_total = 0
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.requests_aborted_total = 0
        self.preemptions_total = 0
        self.resumed_cached_tokens_total = 0

    def record_admission(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        with self._lock:
            self.requests_total += 1
            self.prompt_tokens_total += num_prompt_tokens
            self.cached_prompt_tokens_total += num_cached_tokens
            if num_cached_tokens > 0:
                self.requests_with_hit_total += 1

    def record_abort(self) -> None:
        with self._lock:
            self.requests_aborted_total += 1

    def record_preemption(self) -> None:
        with self._lock:
            self.preemptions_total += 1

    def record_resume(self, num_cached_tokens: int) -> None:
        """A preempted request re-admitted: its hit is not a new lookup, so it is kept apart."""
        with self._lock:
            self.resumed_cached_tokens_total += num_cached_tokens

    def record_generated(self, num_tokens: int) -> None:
        with self._lock:
            self.generated_tokens_total += num_tokens

    def snapshot(self, cache: _CacheGauges, bytes_per_block: int) -> dict[str, Any]:
        """The ``/stats`` JSON object: counters plus pool and tree gauges."""
        with self._lock:
            prompt = self.prompt_tokens_total
            cached = self.cached_prompt_tokens_total
            requests = self.requests_total
            out: dict[str, Any] = {
                "requests_total": requests,
                "requests_with_hit_total": self.requests_with_hit_total,
                "requests_aborted_total": self.requests_aborted_total,
                "prompt_tokens_total": prompt,
                "cached_prompt_tokens_total": cached,
                "computed_prompt_tokens_total": prompt - cached,
                "generated_tokens_total": self.generated_tokens_total,
                "token_hit_rate": cached / prompt if prompt else 0.0,
                "request_hit_rate": self.requests_with_hit_total / requests if requests else 0.0,
                "preemptions_total": self.preemptions_total,
                "resumed_cached_tokens_total": self.resumed_cached_tokens_total,
            }
        out["evicted_blocks_total"] = cache.evicted_blocks_total
        out["miss_tokens"] = dict(cache.miss_tokens)
        out["pool"] = {
            "block_size_tokens": cache.block_size,
            "bytes_per_block": bytes_per_block,
            "total_blocks": cache.num_blocks,
            "free_blocks": cache.num_free_blocks,
            "cached_evictable_blocks": cache.num_cached_evictable_blocks,
            "in_use_blocks": cache.num_in_use_blocks,
        }
        out["tree"] = {"nodes": cache.num_tree_nodes, "cached_blocks": cache.num_cached_blocks}
        out["eviction_policy"] = cache.eviction_policy
        out["prefix_caching"] = cache.enable_prefix_caching
        return out

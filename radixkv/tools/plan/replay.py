"""Replay of tokenized agent sessions through radixkv's own cache (``CacheManager``: the radix
tree and the block pool, no model), for ``radixkv plan --trace``.

The load is ``bench serve``'s closed loop in waves: ``concurrency`` sessions are in flight; in
each wave every one of them sends its next turn: ``begin`` (match under the hit cap, lock),
``allocate`` the prompt plus ``max_tokens - 1`` output slots (evicting through the policy: the
engine writes K/V for every token but the last sampled one), and
the wave's requests are live together, which is when the pool is read. Each publishes its prompt
blocks as soon as it is allocated (the scheduler defers a request whose prefix another is
prefilling until that prefill is published, so a later request of the same wave hits it), and
after the wave its output blocks (output tokens are unique to the request: the next turn's prompt
carries the transcript's reply, not the generated one, so generated blocks are never hit) and
releases. A session that ends hands its slot to the next one, in order. An allocation that
fails (free + evictable blocks short) is counted and served with no cache hit and no blocks.

What this leaves out: the timing of a real server (a session's next turn is sent when its
previous one ends, not in lockstep), chunked prefill, preemption and the publish interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReplayResult", "replay_sessions", "percentile"]

#: Output token ids start here: above every vocabulary, so a generated block never matches.
_OUTPUT_TOKEN_BASE = 1 << 30


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks; None
    for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured.

    Attributes:
        num_blocks, block_size: the pool (M blocks of B tokens).
        concurrency: sessions in flight; max_tokens: output tokens per request.
        num_sessions, num_requests: replayed.
        num_prompt_tokens, num_cached_tokens: over every request (cached: the matched prefix).
        token_hit_rate: ``num_cached_tokens / num_prompt_tokens``.
        request_hit_rate_p50 / _p90: per request, matched ÷ prompt tokens.
        peak_used_blocks: most blocks not free (live + cached in the tree) at a wave's peak.
        peak_live_blocks: most distinct blocks in the block tables of a wave's live requests.
        live_blocks_p50 / _p99: over waves.
        tail_waste_fraction: over every served request, unused slots in its last block ÷ its
            allocated slots (``ceil(n / B) × B − n`` over ``ceil(n / B) × B``, n = prompt +
            max_tokens − 1).
        allocation_failures: requests whose blocks could not be allocated.
    """

    num_blocks: int
    block_size: int
    concurrency: int
    max_tokens: int
    num_sessions: int
    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    token_hit_rate: float
    request_hit_rate_p50: float | None
    request_hit_rate_p90: float | None
    peak_used_blocks: int
    peak_live_blocks: int
    live_blocks_p50: float | None
    live_blocks_p99: float | None
    tail_waste_fraction: float
    allocation_failures: int


def replay_sessions(sessions: Sequence[Sequence[Sequence[int]]], *, num_blocks: int,
                    block_size: int, concurrency: int = 1, max_tokens: int = 16,
                    eviction_policy: str = "lru") -> ReplayResult:
    """Replay ``sessions`` (module docstring) on a pool of ``num_blocks`` blocks.

    Args:
        sessions: per session, per turn, the prompt's token ids (what the server tokenizes).
        num_blocks: pool blocks (M >= 1); block_size: tokens per block (B).
        concurrency: sessions in flight (>= 1); max_tokens: output tokens per request (>= 0).
        eviction_policy: a registered online policy.

    Raises:
        ValueError: naming ``num_blocks``, ``concurrency``, ``max_tokens`` or the cache's
            own fields.
    """
    from radixkv.cache.hashing import CacheIdentity
    from radixkv.cache.manager import CacheManager

    for name, value, low in (("num_blocks", num_blocks, 1), ("concurrency", concurrency, 1),
                             ("max_tokens", max_tokens, 0)):
        if type(value) is not int or value < low:
            raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
    cache = CacheManager(num_blocks, block_size, eviction_policy=eviction_policy)
    root = cache.identity_root(CacheIdentity(model_revision="radixkv-plan", block_size=block_size,
                                             kv_dtype="none", rope="none"))
    queue = [list(s) for s in sessions if s]
    active: list[tuple[int, list[Sequence[int]]]] = []
    next_session = 0
    prompt_tokens = cached_tokens = failures = requests = 0
    waste_slots = allocated_slots = 0
    hit_rates: list[float] = []
    live_per_wave: list[int] = []
    peak_used = peak_live = 0
    while active or next_session < len(queue):
        while len(active) < concurrency and next_session < len(queue):
            active.append((next_session, queue[next_session]))
            next_session += 1
        wave: list[tuple[str, list[int], int]] = []
        for index, turns in active:
            prompt = list(turns.pop(0))
            request_id = f"s{index}r{requests}"
            requests += 1
            # The engine computes (and so holds K/V for) every token but the last sampled one.
            total = len(prompt) + max(max_tokens - 1, 0)
            matched = cache.begin(request_id, root, prompt)
            if cache.allocate(request_id, total):
                output = [_OUTPUT_TOKEN_BASE + requests * max_tokens + i
                          for i in range(total - len(prompt))]
                # The scheduler defers a request whose prefix another one is prefilling until
                # that prefill is published; so later requests of a wave match it.
                cache.publish(request_id, prompt, len(prompt))
                wave.append((request_id, prompt + output, total))
                slots = -(-total // block_size) * block_size
                waste_slots += slots - total
                allocated_slots += slots
            else:
                failures += 1
                matched = 0
                cache.release(request_id)
            prompt_tokens += len(prompt)
            cached_tokens += matched
            hit_rates.append(matched / len(prompt))
        # Distinct blocks: requests of one wave share their locked common prefix.
        live = len({b for request_id, _, _ in wave for b in cache.block_table(request_id)})
        peak_used = max(peak_used, num_blocks - cache.pool.num_free_blocks)
        peak_live = max(peak_live, live)
        live_per_wave.append(live)
        for request_id, tokens, total in wave:
            cache.publish(request_id, tokens, total)
            cache.release(request_id)
        active = [(i, t) for i, t in active if t]
    return ReplayResult(
        num_blocks=num_blocks, block_size=block_size, concurrency=concurrency,
        max_tokens=max_tokens, num_sessions=len(queue), num_requests=requests,
        num_prompt_tokens=prompt_tokens, num_cached_tokens=cached_tokens,
        token_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        request_hit_rate_p50=percentile(hit_rates, 50), request_hit_rate_p90=percentile(hit_rates, 90),
        peak_used_blocks=peak_used, peak_live_blocks=peak_live,
        live_blocks_p50=percentile(live_per_wave, 50), live_blocks_p99=percentile(live_per_wave, 99),
        tail_waste_fraction=waste_slots / allocated_slots if allocated_slots else 0.0,
        allocation_failures=failures)

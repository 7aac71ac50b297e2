"""Retention: client-controlled TTL pins on cached prefixes.

A *retention* is a prefix of one identity root (a chain of full blocks from the root) with an
expiry. Until it expires its blocks stay in the cache hierarchy: in the device pool they are
pinned (the retention holds a lock on the node where the prefix ends, like a request cursor, so
no eviction policy ever sees them as evictable); under pressure, with a store tier attached,
they are *demoted* (written to the store, then evicted; a later hit loads them back and pins
them again). A hit on a retained prefix refreshes its expiry; an expired retention unpins and
its blocks become ordinary cached blocks for the policy.

Bounds: the blocks pinned by all retentions (counted once however many retentions share them)
stay within ``max_retained_fraction`` of the pool, and a tenant's within its
``max_retained_tokens``. A retention that does not fit is honoured as far as it fits (a shorter
prefix). Running requests always get blocks: an allocation that free and evictable blocks
cannot cover unpins retentions (soonest expiry first) — demoted with a store tier, dropped
without one — rather than fail or wait.

Time comes from the tree's clock (``RadixTree.now``), so tests and replays move it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["TTL_CLASSES", "RetentionBreakpoint", "RetentionInfo", "check_breakpoints",
           "MAX_PROMPT_BREAKPOINTS"]

#: TTL classes a retention may ask for, in seconds.
TTL_CLASSES: dict[str, float] = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}
#: Prompt breakpoints one request may carry (Anthropic's limit), besides one whole-sequence (-1).
MAX_PROMPT_BREAKPOINTS = 4


@dataclass(frozen=True)
class RetentionBreakpoint:
    """Retain the prompt prefix of ``num_tokens`` tokens (rounded down to a block boundary) for
    ``ttl_class``. ``num_tokens == -1``: the whole sequence (prompt + generated) at finish.

    Attributes:
        num_tokens: Prompt tokens from the start (1 … N), or -1.
        ttl_class: A key of :data:`TTL_CLASSES` (``"5m"``, ``"1h"``, ``"24h"``).
    """

    num_tokens: int
    ttl_class: str


@dataclass(frozen=True)
class RetentionInfo:
    """One live retention, as listed by the operator route.

    Attributes:
        retention_id: Stable id (``ret_<first 12 bytes of the prefix's chained hash, hex>_<ttl>``).
        tenant: Tenant that made it (None: no tenant).
        num_tokens: Tokens retained (a multiple of the block size).
        ttl_class: Its TTL class.
        expires_in_s: Seconds until it expires (cache clock), ≥ 0.
        num_refreshes: Hits (and repeated retains) that refreshed it.
    """

    retention_id: str
    tenant: str | None
    num_tokens: int
    ttl_class: str
    expires_in_s: float
    num_refreshes: int


def check_breakpoints(retention: object, num_prompt_tokens: int) -> tuple[RetentionBreakpoint, ...]:
    """Validate a request's breakpoints; return them as a tuple.

    Args:
        retention: A sequence of :class:`RetentionBreakpoint` (empty: nothing retained).
        num_prompt_tokens: N, the prompt's length.

    Returns:
        The breakpoints, as given (a tuple).

    Raises:
        ValueError: naming ``retention``: not a sequence of ``RetentionBreakpoint``, more than
            ``MAX_PROMPT_BREAKPOINTS`` prompt breakpoints or more than one ``-1``, a
            ``num_tokens`` that is not an int in ``[1, N]`` or -1, or an unknown ``ttl_class``.
    """
    if retention is None:
        return ()
    if isinstance(retention, (str, bytes)) or not isinstance(retention, Sequence):
        raise ValueError(f"retention: must be a sequence of RetentionBreakpoint, got "
                         f"{type(retention).__name__}")
    out = tuple(retention)
    num_prompt = num_whole = 0
    for i, bp in enumerate(out):
        if not isinstance(bp, RetentionBreakpoint):
            raise ValueError(f"retention[{i}]: must be a RetentionBreakpoint, got "
                             f"{type(bp).__name__}")
        n = bp.num_tokens
        if type(n) is not int or not (n == -1 or 1 <= n <= num_prompt_tokens):
            raise ValueError(f"retention[{i}].num_tokens: must be an int in [1, "
                             f"{num_prompt_tokens}] (the prompt's length) or -1, got {n!r}")
        if bp.ttl_class not in TTL_CLASSES:
            raise ValueError(f"retention[{i}].ttl_class: must be one of "
                             f"{', '.join(TTL_CLASSES)}, got {bp.ttl_class!r}")
        if n == -1:
            num_whole += 1
        else:
            num_prompt += 1
    if num_prompt > MAX_PROMPT_BREAKPOINTS:
        raise ValueError(f"retention: at most {MAX_PROMPT_BREAKPOINTS} prompt breakpoints, got "
                         f"{num_prompt}")
    if num_whole > 1:
        raise ValueError(f"retention: at most one whole-sequence breakpoint (-1), got {num_whole}")
    return out

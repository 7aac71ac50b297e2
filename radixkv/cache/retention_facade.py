"""The cache manager's retention calls (client TTL pins, ``radixkv.cache.retention``): a mixin
of ``CacheManager``, as ``CacheGauges`` is. It reads the manager's tree, retention table, active
requests and their tenants, and tells the store tier which chains retentions hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from radixkv.cache.retention import TTL_CLASSES, RetentionInfo, RetentionTable
from radixkv.cache.tree.node import split_hashes
from radixkv.config import check_int

if TYPE_CHECKING:
    from radixkv.cache.pool import BlockPool
    from radixkv.cache.request_state import RequestState
    from radixkv.cache.store.tier import StoreTier
    from radixkv.cache.tree.radix_tree import RadixTree

__all__ = ["CacheRetention", "RetainResult"]


class RetainResult(NamedTuple):
    """What :meth:`CacheManager.retain` did (see there)."""

    created: dict[str, int]
    num_retained_tokens: int
    retention_ids: tuple[str, ...]


class CacheRetention:
    """Retention calls over ``retention``, ``tree``, ``_requests``, ``_tenants`` and ``store``
    (set by ``CacheManager``)."""

    block_size: int
    pool: BlockPool
    tree: RadixTree
    retention: RetentionTable
    store: StoreTier | None
    _requests: dict[str, RequestState]
    _tenants: dict[str, str | None]

    def _expire_retentions(self, now: float | None = None) -> int:
        """Drop expired retentions and tell the store tier (:meth:`_sync_store_marks`)."""
        num = self.retention.expire(now)
        if num:
            self._sync_store_marks()
        return num

    def _sync_store_marks(self) -> None:
        """Tell the store tier the blocks retentions no longer hold (released, expired or
        dropped since the last call: kept longest no more), then the chains retentions pinned
        or refreshed since (their deepest node per TTL class, until its expiry). Within one
        cache call retentions are forgotten before any is pinned or refreshed, so clearing
        first never undoes a mark."""
        cleared = self.retention.cleared
        if cleared and self.store is not None:
            for root_hash, hashes in cleared:
                self.store.unmark_retained(root_hash, hashes)
        if cleared:
            cleared.clear()
        touched = self.retention.touched
        if not touched or self.store is None:
            return
        for node, until_s in touched.values():
            parts: list[bytes] = []
            n = node
            while n.parent is not None:
                parts.append(bytes(n.hash_bytes))
                n = n.parent
            if not n.root_hash or not parts:  # detached since (evicted): nothing to mark
                continue
            buf = b"".join(reversed(parts))
            self.store.mark_retained(n.root_hash, split_hashes(buf, node.hash_size), until_s)
        touched.clear()

    def retain(self, request_id: str, breakpoints: Sequence[tuple[int, str]], *,
               num_prompt_tokens: int | None = None, refresh: bool = True,
               num_cached_tokens: int | None = None) -> RetainResult:
        """Refresh the live retentions the request's published path covers (the request's
        tenant's: a hit on a retained prefix), then retain prefixes of that path (its prompt's
        breakpoints once they are cached, or the whole sequence at its end), as far as the
        budgets allow. The engine calls it once every prompt is cached, breakpoints or not.

        Args:
            request_id: An active request.
            breakpoints: ``(num_tokens, ttl_class)`` pairs: each retains the first
                ``num_tokens // B`` blocks (at most the published ones) for ``ttl_class``.
            num_prompt_tokens: N; tokens at or past it are not counted as created (None: all
                count).
            refresh: Refresh the retentions on the path first (False at a request's end: its
                prompt did already).
            num_cached_tokens: The request's cache hit ``m`` as reported to its client (the
                engine's: its first admission's, which a resume after preemption may not
                match); None: this cache's ``m`` from the latest ``begin``.

        Returns:
            A :class:`RetainResult`: ``created``, tokens newly retained by these breakpoints
            per TTL class (tokens past both the request's cache hit ``m`` and what live
            retentions already covered, and before ``num_prompt_tokens``: so ``m`` +
            the sum ≤ N; each token under the first breakpoint that reaches it);
            ``num_retained_tokens``, the tokens of the request's path under a live
            retention now; ``retention_ids``, the id of the retention each breakpoint made or
            refreshed, in the order given (breakpoints that retained nothing have none).

        The cache clock is read once for the whole call: a hit refreshes a retention once,
        however the clock moves meanwhile.

        Raises:
            KeyError: unknown ``request_id``.
            ValueError: naming ``ttl_class`` for an unknown TTL class, or
                ``num_cached_tokens`` if not an int ≥ 0 (nothing retained).
        """
        req = self._requests[request_id]
        if num_cached_tokens is not None:
            check_int("num_cached_tokens", num_cached_tokens)
        bs = self.block_size
        cursor, root = req.cursor, req.root
        if cursor is None or root is None or not (breakpoints or len(self.retention)):
            return RetainResult({}, 0, ())
        for _, ttl_class in breakpoints:
            if ttl_class not in TTL_CLASSES:
                raise ValueError(f"ttl_class: must be one of {', '.join(TTL_CLASSES)}, got "
                                 f"{ttl_class!r}")
        now = self.tree.now()
        self._expire_retentions(now)
        tenant = self._tenants.get(request_id)
        # Demoted retentions whose prefix is back in the pool (a store load, or computed
        # again) are pinned again (or, kept out by the budgets, refreshed); then the tenant's
        # retentions on the path are refreshed.
        self.retention.on_path(cursor, root.root_hash, tenant, now=now, refresh=refresh)
        if refresh:
            self.retention.on_hit(cursor, tenant, now)
        hit = req.num_cached_tokens if num_cached_tokens is None else num_cached_tokens
        prev = max(hit, self.retention.retained_depth_blocks(cursor) * bs)
        limit = num_prompt_tokens if num_prompt_tokens is not None else 1 << 62
        created: dict[str, int] = {}
        ids: dict[int, str] = {}
        for i, (num_tokens, ttl_class) in sorted(enumerate(breakpoints), key=lambda b: b[1][0]):
            blocks, rid = self.retention.retain(cursor, root.root_hash, num_tokens // bs,
                                                ttl_class, tenant, now)
            if rid is not None:
                ids[i] = rid
            end = min(blocks * bs, limit)
            if end > prev:
                created[ttl_class] = created.get(ttl_class, 0) + end - prev
                prev = end
        self._sync_store_marks()
        return RetainResult(created, self.retention.retained_depth_blocks(cursor) * bs,
                            tuple(ids[i] for i in sorted(ids)))

    def retained_tokens(self, request_id: str) -> int:
        """Tokens of an active request's path under a live retention (KeyError: unknown)."""
        cursor = self._requests[request_id].cursor
        return self.retention.retained_depth_blocks(cursor) * self.block_size if cursor else 0

    def expire_retentions(self) -> int:
        """Drop the retentions whose expiry passed (the engine calls it when idle too);
        returns how many."""
        return self._expire_retentions()

    def list_retentions(self, tenant: str | None, *, all_tenants: bool = False
                        ) -> list[RetentionInfo]:
        """Live retentions of ``tenant`` (all tenants' when ``all_tenants``), soonest expiry
        first."""
        self._expire_retentions()
        return self.retention.list(tenant, all_tenants=all_tenants)

    def release_retentions(self, tenant: str | None, retention_id: str | None = None, *,
                           all_tenants: bool = False) -> int:
        """Release ``tenant``'s retentions (only ``retention_id`` when given; any tenant's
        when ``all_tenants``); returns how many were released. Their blocks become ordinary
        cached blocks (a store tier that keeps retained blocks longest is told)."""
        self._expire_retentions()
        num = self.retention.release(tenant, retention_id, all_tenants=all_tenants)
        self._sync_store_marks()
        return num

    @property
    def num_retained_blocks(self) -> int:
        """Blocks pinned by live retentions (part of ``num_in_use_blocks``: locked)."""
        return self.tree.num_retained_blocks

    def num_obtainable_blocks(self) -> int:
        """Blocks an allocation could get now: free, evictable, and retained blocks no
        request holds (an allocation unpins retentions rather than fail)."""
        room = self.pool.num_free_blocks + self.tree.num_evictable_blocks
        return room + self.retention.reclaimable_blocks() if self.tree.num_retained_blocks \
            else room

    def retention_snapshot(self) -> dict[str, Any]:
        """The ``retention`` object of ``/stats`` (:meth:`RetentionTable.snapshot`); expired
        retentions are dropped first."""
        self._expire_retentions()
        return self.retention.snapshot()

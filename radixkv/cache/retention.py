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
cannot cover unpins retentions (soonest expiry first, skipping those whose unpinning frees no
block: a path a running request holds, a prefix a deeper retention also pins) — demoted with a
store tier that is up, dropped (counted) otherwise — rather than fail or wait. Demoted blocks
count against no retention budget: they live in the store under the store's own capacity
policy (a disk tier evicts blocks marked retained last), and a tenant keeps at most
``MAX_DEMOTED_PER_TENANT`` demoted retentions (its oldest one is dropped, counted). A demoted
retention keeps only the chained hash of its prefix's last block, which names the identity
root, every token and every multimodal extra before it; a returning path is matched by that
hash.

Time comes from the tree's clock (``RadixTree.now``), so tests and replays move it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixkv.cache.tree.node import Node
    from radixkv.cache.tree.radix_tree import RadixTree

__all__ = ["TTL_CLASSES", "RetentionBreakpoint", "RetentionInfo", "RetentionTable",
           "check_breakpoints", "retention_id", "MAX_PROMPT_BREAKPOINTS",
           "MAX_DEMOTED_PER_TENANT", "clamp_created"]

#: TTL classes a retention may ask for, in seconds.
TTL_CLASSES: dict[str, float] = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}
#: Prompt breakpoints one request may carry (Anthropic's limit), besides one whole-sequence (-1).
MAX_PROMPT_BREAKPOINTS = 4
#: Demoted retentions one tenant may keep (beyond: its oldest demoted one is dropped and its
#: tokens counted in ``preempted_tokens_total``).
MAX_DEMOTED_PER_TENANT = 256


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


def clamp_created(created: Mapping[str, int], max_tokens: int) -> dict[str, int]:
    """``created`` (tokens newly retained per TTL class, in the order the cache gave them:
    the class of the shallowest breakpoint first) cut to ``max_tokens`` in all, the last
    classes first (a class left with 0 is omitted; ``max_tokens`` < 0 counts as 0): with
    ``max_tokens = N - num_cached_tokens``, ``num_cached_tokens + sum(result) <= N``."""
    if sum(created.values()) <= max_tokens:
        return dict(created)
    out: dict[str, int] = {}
    left = max(0, max_tokens)
    for ttl_class, tokens in created.items():
        take = min(tokens, left)
        if take > 0:
            out[ttl_class] = take
        left -= take
    return out


def retention_id(end_hash: bytes, ttl_class: str, tenant: str | None) -> str:
    """The stable id of a retention: its prefix (the chained hash of its last block, which
    names the identity root and every token before), TTL class and tenant, hashed
    (``ret_`` + 24 hex digits; reveals nothing of the prompt or the tenant)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(end_hash)
    h.update(b"\0" + ttl_class.encode())
    h.update(b"\0" if tenant is None else b"\1" + tenant.encode())
    return "ret_" + h.hexdigest()


class _Retention:
    """One retention (mutable; the table's)."""

    __slots__ = ("retention_id", "root_hash", "tenant", "ttl_class", "expires_s", "num_blocks",
                 "num_refreshes", "node", "end_hash", "entry")

    def __init__(self, rid: str, root_hash: bytes, tenant: str | None, ttl_class: str,
                 num_blocks: int, node: Node) -> None:
        self.retention_id = rid
        self.root_hash = root_hash
        self.tenant = tenant
        self.ttl_class = ttl_class
        self.expires_s = 0.0
        self.num_blocks = num_blocks
        self.num_refreshes = 0
        #: The pinned node (end of the prefix) while in the pool; None once demoted.
        self.node: Node | None = node
        #: Chained hash of the prefix's last block (matched against a returning path while
        #: demoted: it names the root, every token and every extra before it).
        self.end_hash = node.end_hash
        self.entry: tuple[float, int, str] | None = None


class RetentionTable:
    """Every live retention of one cache, pinned in its radix tree (engine thread only).

    Args:
        tree: The cache's radix tree (its clock is the retention clock).
        num_pool_blocks: Blocks in the device pool.
        max_retained_fraction: Share of the pool that retentions may pin, in ``[0, 1]``.
        tenant_max_retained_tokens: Per-tenant cap on retained tokens (rounded down to
            blocks); a tenant not named has only the pool-wide cap.

    Raises:
        ValueError: naming ``max_retained_fraction`` or ``max_retained_tokens``.
    """

    def __init__(self, tree: RadixTree, num_pool_blocks: int, *,
                 max_retained_fraction: float = 0.5,
                 tenant_max_retained_tokens: Mapping[str, int] | None = None) -> None:
        if (isinstance(max_retained_fraction, bool)
                or not isinstance(max_retained_fraction, (int, float))
                or not 0.0 <= max_retained_fraction <= 1.0):
            raise ValueError(f"max_retained_fraction: must be a number in [0, 1], got "
                             f"{max_retained_fraction!r}")
        self.tree = tree
        self.block_size = tree.block_size
        self.max_retained_fraction = float(max_retained_fraction)
        #: Blocks all retentions together may pin (counted once however many share them).
        self.max_blocks = int(max_retained_fraction * num_pool_blocks)
        self.tenant_max_blocks: dict[str | None, int] = {}
        for tenant, tokens in (tenant_max_retained_tokens or {}).items():
            if type(tokens) is not int or tokens < 0:
                raise ValueError(f"max_retained_tokens: tenant {tenant!r}: must be an int >= 0, "
                                 f"got {tokens!r}")
            self.tenant_max_blocks[tenant] = tokens // self.block_size
        self._by_id: dict[str, _Retention] = {}
        self._at_node: dict[int, list[_Retention]] = {}  # pinned node uid -> its retentions
        self._demoted: dict[bytes, dict[str, _Retention]] = {}  # root hash -> id -> demoted
        # tenant -> id -> demoted, oldest demoted first (bounded by max_demoted_per_tenant)
        self._demoted_by_tenant: dict[str | None, OrderedDict[str, _Retention]] = {}
        #: Demoted retentions one tenant may keep (:data:`MAX_DEMOTED_PER_TENANT`).
        self.max_demoted_per_tenant = MAX_DEMOTED_PER_TENANT
        self._expiry: SortedList = SortedList()  # (expires_s, seq, id) of every retention
        self._seq = itertools.count()
        # Pinned retentions and their tokens by TTL class and by tenant (gauges).
        self._pinned_by_ttl: dict[str, list[int]] = {c: [0, 0] for c in TTL_CLASSES}
        self._pinned_by_tenant: dict[str | None, int] = {}
        self.counters: dict[str, int] = dict.fromkeys((
            "created_total", "refreshes_total", "expired_total", "released_total",
            "demoted_blocks_total", "repinned_total", "preempted_tokens_total",
            "refused_tokens_total"), 0)
        self.expired_by_ttl = dict.fromkeys(TTL_CLASSES, 0)
        self.refused_tokens_by_tenant: dict[str | None, int] = {}
        #: When not None (a store tier that keeps retained blocks longest is attached): the
        #: deepest node pinned or refreshed per TTL class since the owner last took it, with
        #: its expiry (the owner tells the store; a chain's deepest node covers the rest).
        self.touched: dict[str, tuple[Node, float]] | None = None
        #: When not None (as ``touched``): ``(root hash, chained hashes)`` of blocks that a
        #: released, expired or dropped retention left retained by none, since the owner last
        #: took them (the owner tells the store to keep them no longer). Not recorded while a
        #: demoted retention of the same root lives: its blocks in the store may be among them.
        self.cleared: list[tuple[bytes, list[bytes]]] | None = None

    # ---- gauges -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Live retentions (pinned and demoted)."""
        return len(self._by_id)

    @property
    def num_pinned(self) -> int:
        """Retentions pinned in the device pool."""
        return len(self._by_id) - sum(len(d) for d in self._demoted.values())

    def now(self) -> float:
        return self.tree.now()

    # ---- making, refreshing, expiring ---------------------------------------------------
    def retain(self, cursor: Node, root_hash: bytes, num_blocks: int, ttl_class: str,
               tenant: str | None, now: float | None = None) -> tuple[int, str | None]:
        """Retain the first ``num_blocks`` blocks of the path ending at ``cursor`` (a request's
        cursor: the path is in the tree and locked) for ``ttl_class``, as far as the budgets
        allow; the same prefix, class and tenant retained again is refreshed (not when
        :meth:`on_hit` refreshed it already at the same ``now``: once per request).

        ``now``: the cache clock's reading for the caller's whole operation (None: read it);
        one reading per request keeps the once-per-request guard exact on a clock that moves.

        Returns:
            ``(blocks retained (≤ num_blocks; 0: nothing), its retention id or None)``.

        Raises:
            ValueError: naming ``ttl_class`` if it is not a key of :data:`TTL_CLASSES`.
        """
        if ttl_class not in TTL_CLASSES:
            raise ValueError(f"ttl_class: must be one of {', '.join(TTL_CLASSES)}, got "
                             f"{ttl_class!r}")
        tree = self.tree
        depth = (cursor.depth_tokens + cursor.num_tokens) // self.block_size
        want = min(num_blocks, depth)
        if want <= 0:
            return 0, None
        node = tree.node_at(cursor, want)
        allowed = self._fits(node, want, tenant)
        if allowed < want:
            refused = (want - allowed) * self.block_size
            self.counters["refused_tokens_total"] += refused
            self.refused_tokens_by_tenant[tenant] = (
                self.refused_tokens_by_tenant.get(tenant, 0) + refused)
            if allowed <= 0:
                return 0, None
            node = tree.node_at(node, allowed)
        if now is None:
            now = self.now()
        rid = retention_id(node.end_hash, ttl_class, tenant)
        ret = self._by_id.get(rid)
        if ret is None:
            ret = _Retention(rid, root_hash, tenant, ttl_class, allowed, node)
            self._by_id[rid] = ret
            self._pin(ret, node)
            self.counters["created_total"] += 1
            self._set_expiry(ret, now)
            return allowed, rid
        if ret.node is None:  # demoted, and its prefix is back in the pool
            self._repin(ret, node)
        if ret.expires_s != now + TTL_CLASSES[ttl_class]:  # once per request (on_hit first)
            self._refresh(ret, now)
        return allowed, rid

    def _fits(self, node: Node, want: int, tenant: str | None) -> int:
        """The longest prefix (blocks, ≤ ``want``) of the path ending at ``node`` that the
        pool-wide and the tenant's budgets allow pinning (blocks already retained are free)."""
        tree = self.tree
        retained = tree.retained_depth_blocks(node)
        allowed = min(want, retained + max(0, self.max_blocks - tree.num_retained_blocks))
        cap = self.tenant_max_blocks.get(tenant) if tenant is not None else None
        if cap is not None:
            mine = tree.retained_depth_blocks(node, tenant, any_tenant=False)
            used = tree.retained_blocks_by_tenant.get(tenant, 0)
            allowed = min(allowed, mine + max(0, cap - used))
        return allowed

    def _pin(self, ret: _Retention, node: Node) -> None:
        self.tree.pin(node, ret.tenant)
        ret.node = node
        self._touch(ret)
        self._at_node.setdefault(node.uid, []).append(ret)
        counts = self._pinned_by_ttl[ret.ttl_class]
        counts[0] += 1
        counts[1] += ret.num_blocks * self.block_size
        self._pinned_by_tenant[ret.tenant] = self._pinned_by_tenant.get(ret.tenant, 0) + 1

    def _unpin(self, ret: _Retention) -> None:
        node = ret.node
        assert node is not None
        here = self._at_node[node.uid]
        here.remove(ret)
        if not here:
            del self._at_node[node.uid]
        self.tree.unpin(node, ret.tenant)
        ret.node = None
        counts = self._pinned_by_ttl[ret.ttl_class]
        counts[0] -= 1
        counts[1] -= ret.num_blocks * self.block_size
        left = self._pinned_by_tenant[ret.tenant] - 1
        if left:
            self._pinned_by_tenant[ret.tenant] = left
        else:
            del self._pinned_by_tenant[ret.tenant]

    def _set_expiry(self, ret: _Retention, now: float) -> None:
        if ret.entry is not None:
            self._expiry.remove(ret.entry)
        ret.expires_s = now + TTL_CLASSES[ret.ttl_class]
        ret.entry = (ret.expires_s, next(self._seq), ret.retention_id)
        self._expiry.add(ret.entry)
        self._touch(ret)

    def _touch(self, ret: _Retention, node: Node | None = None) -> None:
        """Record ``ret``'s chain (ending at ``node``, default its pinned node) for the store
        (``touched``)."""
        touched = self.touched
        if node is None:
            node = ret.node
        if touched is None or node is None:
            return
        seen = touched.get(ret.ttl_class)
        if seen is None or (seen[0].depth_tokens + seen[0].num_tokens
                            < node.depth_tokens + node.num_tokens):
            touched[ret.ttl_class] = (node, ret.expires_s)
        elif seen[1] < ret.expires_s:
            touched[ret.ttl_class] = (seen[0], ret.expires_s)

    def _refresh(self, ret: _Retention, now: float) -> None:
        ret.num_refreshes += 1
        self.counters["refreshes_total"] += 1
        self._set_expiry(ret, now)

    def _forget(self, ret: _Retention) -> None:
        """Drop ``ret`` wholly (unpinned first when pinned; the blocks it leaves retained by
        none are recorded in ``cleared``)."""
        node = ret.node
        if node is not None:
            self._unpin(ret)
            self._note_cleared(ret.root_hash, node)
        else:
            self._undemote(ret)
        if ret.entry is not None:
            self._expiry.remove(ret.entry)
            ret.entry = None
        del self._by_id[ret.retention_id]

    def _note_cleared(self, root_hash: bytes, node: Node) -> None:
        """``node``'s path was just unpinned: record the chained hashes of its blocks that no
        retention holds any more (a suffix of the path) in ``cleared``."""
        if self.cleared is None or self._demoted.get(root_hash):
            return
        parts: list[bytes] = []
        n: Node | None = node
        while n is not None and n.parent is not None and n.retain_refs is None:
            parts.append(bytes(n.hash_bytes))
            n = n.parent
        if parts:
            buf = b"".join(reversed(parts))
            w = node.hash_size
            self.cleared.append((root_hash, [buf[i : i + w] for i in range(0, len(buf), w)]))

    def on_hit(self, node: Node, tenant: str | None, now: float | None = None) -> int:
        """A request of ``tenant`` holds the path ending at ``node`` (its prompt's cached
        blocks): refresh the tenant's retentions whose prefix the path covers (``now``: the
        caller's clock reading, None: read it). Returns how many."""
        if not self._at_node:
            return 0
        if now is None:
            now = self.now()
        num = 0
        n: Node | None = node
        while n is not None and n.parent is not None:
            if n.pins:
                for ret in self._at_node.get(n.uid, ()):
                    if ret.tenant == tenant:
                        self._refresh(ret, now)
                        num += 1
            n = n.parent
        return num

    def expire(self, now: float | None = None) -> int:
        """Drop every retention whose expiry has passed at ``now`` (None: the clock now; its
        blocks become ordinary cached blocks); returns how many."""
        expiry = self._expiry
        if not expiry:
            return 0
        if now is None:
            now = self.now()
        if expiry[0][0] > now:
            return 0
        num = 0
        while expiry and expiry[0][0] <= now:
            ret = self._by_id[expiry[0][2]]
            self._forget(ret)
            self.counters["expired_total"] += 1
            self.expired_by_ttl[ret.ttl_class] += 1
            num += 1
        return num

    def retained_depth_blocks(self, cursor: Node) -> int:
        """Blocks of the path ending at ``cursor`` under a live retention."""
        return self.tree.retained_depth_blocks(cursor) if self._at_node else 0

    # ---- pressure -----------------------------------------------------------------------
    def reclaimable_blocks(self) -> int:
        """Blocks that would become evictable if every pin were released (retained blocks
        no request holds)."""
        seen: set[int] = set()
        total = 0
        for rets in self._at_node.values():
            n: Node | None = rets[0].node
            while n is not None and n.parent is not None and n.uid not in seen:
                seen.add(n.uid)
                refs = n.retain_refs
                if refs is not None and n.lock_ref == sum(refs.values()):
                    total += len(n.block_ids)
                n = n.parent
        return total

    def make_room(self, num_evictable: int, *, demote: bool) -> int:
        """Unpin retentions until the tree has ``num_evictable`` evictable blocks — only when
        that is reachable (else nothing changes: the request would wait for running requests
        anyway). Soonest expiry first, each retention whose unpinning alone makes a block
        evictable (:meth:`_gain`); one that frees nothing (its path held by a running request,
        or its prefix pinned by a deeper retention too) is kept. Only when no single retention
        frees a block (two retentions ending at one node) is the soonest-expiring one whose
        path no request holds unpinned, and the walk starts again.

        ``demote``: keep them (the store tier, up, has or gets their blocks as they are
        evicted; they live there under the store's own capacity policy, and a later hit pins
        them again), except a path holding multimodal blocks (the store never holds those):
        dropped; else drop them. Dropped retentions' tokens are counted in
        ``preempted_tokens_total``. Returns the retentions unpinned."""
        tree = self.tree
        if (not self._at_node or tree.num_evictable_blocks >= num_evictable
                or tree.num_evictable_blocks + self.reclaimable_blocks() < num_evictable):
            return 0
        expiry = self._expiry
        num = 0
        while tree.num_evictable_blocks < num_evictable:
            freed = False
            i = 0
            while i < len(expiry) and tree.num_evictable_blocks < num_evictable:
                entry = expiry[i]
                ret = self._by_id[entry[2]]
                if ret.node is not None and self._gain(ret.node) > 0:
                    self._give_up(ret, demote)
                    num += 1
                    freed = True
                i = expiry.bisect_right(entry)  # entries before it may have gone meanwhile
            if freed or tree.num_evictable_blocks >= num_evictable:
                continue
            for entry in expiry:
                ret = self._by_id[entry[2]]
                if ret.node is not None and self._held_only_by_retentions(ret.node):
                    break
            else:
                break  # nothing left that could free a block
            self._give_up(ret, demote)
            num += 1
        return num

    @staticmethod
    def _gain(node: Node) -> int:
        """Blocks that unpinning the one retention pinned at ``node`` would make evictable:
        the nodes of its path that nothing else holds (``lock_ref`` 1: neither a request nor
        another retention at or below; locks only grow towards the root)."""
        total = 0
        n: Node | None = node
        while n is not None and n.parent is not None and n.lock_ref == 1:
            total += len(n.block_ids)
            n = n.parent
        return total

    @staticmethod
    def _held_only_by_retentions(node: Node) -> bool:
        """No request holds ``node`` or a node below it (its locks are all retention pins)."""
        refs = node.retain_refs
        return refs is not None and node.lock_ref == sum(refs.values())

    def _give_up(self, ret: _Retention, demote: bool) -> None:
        """Unpin ``ret`` under pressure: demoted when ``demote`` and its path holds no
        multimodal block, else dropped (counted)."""
        node = ret.node
        assert node is not None
        if demote and not self._has_extras(node):
            self._demote(ret)
        else:
            self.counters["preempted_tokens_total"] += ret.num_blocks * self.block_size
            self._forget(ret)

    @staticmethod
    def _has_extras(node: Node) -> bool:
        n: Node | None = node
        while n is not None and n.parent is not None:
            if n.extras is not None:
                return True
            n = n.parent
        return False

    def _demote(self, ret: _Retention) -> None:
        """Unpin ``ret`` and keep it listed (its blocks go to the store); the tenant's oldest
        demoted retentions past ``max_demoted_per_tenant`` are dropped, counted."""
        self._unpin(ret)
        self._demoted.setdefault(ret.root_hash, {})[ret.retention_id] = ret
        mine = self._demoted_by_tenant.setdefault(ret.tenant, OrderedDict())
        mine[ret.retention_id] = ret
        self.counters["demoted_blocks_total"] += ret.num_blocks
        while len(mine) > self.max_demoted_per_tenant:
            oldest = next(iter(mine.values()))
            self.counters["preempted_tokens_total"] += oldest.num_blocks * self.block_size
            self._forget(oldest)  # removes it from ``mine``

    def _undemote(self, ret: _Retention) -> None:
        """Remove demoted ``ret`` from the demoted indexes."""
        demoted = self._demoted[ret.root_hash]
        del demoted[ret.retention_id]
        if not demoted:
            del self._demoted[ret.root_hash]
        mine = self._demoted_by_tenant[ret.tenant]
        del mine[ret.retention_id]
        if not mine:
            del self._demoted_by_tenant[ret.tenant]

    def _repin(self, ret: _Retention, node: Node) -> None:
        self._undemote(ret)
        self._pin(ret, node)
        self.counters["repinned_total"] += 1

    def on_path(self, cursor: Node, root_hash: bytes, tenant: str | None = None, *,
                now: float | None = None, refresh: bool = False) -> int:
        """A request's path (ending at ``cursor``) is in the pool: pin again the demoted
        retentions of its root whose prefix it holds (the chained hash of the path's block at
        the retention's end equals the retention's; budgets allowing; not refreshed here:
        :meth:`on_hit` does that for the request's ``tenant``). With ``refresh``, a demoted
        retention of ``tenant`` on the path that the budgets keep from being pinned again is
        refreshed here (expiry = ``now`` + TTL). One walk up the path: O(path nodes +
        demoted retentions of the root). Returns how many were pinned again."""
        demoted = self._demoted.get(root_hash)
        if not demoted:
            return 0
        bs = self.block_size
        depth = (cursor.depth_tokens + cursor.num_tokens) // bs
        rets = sorted((r for r in demoted.values() if r.num_blocks <= depth),
                      key=lambda r: -r.num_blocks)
        matched: list[_Retention] = []
        n = cursor
        for ret in rets:  # deepest first: the walk only goes up
            end = ret.num_blocks * bs
            while n.parent is not None and n.depth_tokens >= end:
                n = n.parent
            if n.parent is not None and n.block_hash((end - n.depth_tokens) // bs - 1) \
                    == ret.end_hash:
                matched.append(ret)
        num = 0
        for ret in matched:  # after the walk: node_at may split nodes of the path
            node = self.tree.node_at(cursor, ret.num_blocks)
            if self._fits(node, ret.num_blocks, ret.tenant) >= ret.num_blocks:
                self._repin(ret, node)
                num += 1
            elif refresh and ret.tenant == tenant:
                self._refresh(ret, self.now() if now is None else now)
                self._touch(ret, node)
        return num

    # ---- operator -----------------------------------------------------------------------
    def _visible(self, tenant: str | None, all_tenants: bool) -> list[_Retention]:
        rets = [self._by_id[rid] for _, _, rid in self._expiry]
        return rets if all_tenants else [r for r in rets if r.tenant == tenant]

    def list(self, tenant: str | None, *, all_tenants: bool = False) -> list[RetentionInfo]:
        """Live retentions of ``tenant`` (every tenant's when ``all_tenants``), soonest expiry
        first."""
        now = self.now()
        return [RetentionInfo(r.retention_id, r.tenant, r.num_blocks * self.block_size,
                              r.ttl_class, max(0.0, r.expires_s - now), r.num_refreshes)
                for r in self._visible(tenant, all_tenants)]

    def release(self, tenant: str | None, retention_id: str | None = None, *,
                all_tenants: bool = False) -> int:
        """Release ``tenant``'s retentions (only ``retention_id`` when given; any tenant's
        when ``all_tenants``): their blocks become ordinary cached blocks. Returns how many."""
        rets = self._visible(tenant, all_tenants)
        if retention_id is not None:
            rets = [r for r in rets if r.retention_id == retention_id]
        for ret in rets:
            self._forget(ret)
        self.counters["released_total"] += len(rets)
        return len(rets)

    # ---- stats / integrity --------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The ``retention`` object of ``/stats``: gauges (retained blocks and tokens in the
        pool, by TTL class and tenant; ``retained_tokens`` of a class sums its retentions,
        so a prefix shared by two counts twice there) and counters since start."""
        bs = self.block_size
        tree = self.tree
        by_tenant: dict[str, dict[str, int | None]] = {}
        for tenant in set(tree.retained_blocks_by_tenant) | set(self._pinned_by_tenant) | set(
                self.refused_tokens_by_tenant):
            blocks = tree.retained_blocks_by_tenant.get(tenant, 0)
            cap = self.tenant_max_blocks.get(tenant)
            by_tenant["" if tenant is None else tenant] = {
                "retentions": self._pinned_by_tenant.get(tenant, 0),
                "retained_blocks": blocks, "retained_tokens": blocks * bs,
                "max_retained_tokens": cap * bs if cap is not None else None,
                "refused_tokens_total": self.refused_tokens_by_tenant.get(tenant, 0)}
        num_demoted = sum(len(d) for d in self._demoted.values())
        out: dict[str, Any] = {
            "retentions": len(self._by_id) - num_demoted,
            "demoted_retentions": num_demoted,
            "retained_blocks": tree.num_retained_blocks,
            "retained_tokens": tree.num_retained_blocks * bs,
            "max_retained_blocks": self.max_blocks,
            "max_retained_fraction": self.max_retained_fraction,
            "by_ttl": {c: {"retentions": n, "retained_tokens": t,
                           "retained_blocks": t // bs, "expired_total": self.expired_by_ttl[c]}
                       for c, (n, t) in self._pinned_by_ttl.items()},
            "by_tenant": by_tenant,
        }
        out.update(self.counters)
        return out

    def check(self) -> None:
        """Verify every retention against the tree: pinned ones on an attached path of their
        root with the pins and ``retain_refs`` they account for, demoted ones unpinned, the
        expiry index and the budgets.

        Raises:
            AssertionError: describing the first violated invariant.
        """
        tree = self.tree
        bs = self.block_size
        assert len(self._expiry) == len(self._by_id), "expiry index size disagrees"
        for entry in self._expiry:
            ret = self._by_id.get(entry[2])
            assert ret is not None and ret.entry == entry, f"stale expiry entry {entry}"
        refs: dict[int, dict[str | None, int]] = {}
        nodes: dict[int, Node] = {}
        pins: dict[int, int] = {}
        demoted = {rid for d in self._demoted.values() for rid in d}
        by_tenant = {rid for d in self._demoted_by_tenant.values() for rid in d}
        assert by_tenant == demoted, f"demoted by tenant {by_tenant} != by root {demoted}"
        for tenant, theirs in self._demoted_by_tenant.items():
            assert 0 < len(theirs) <= self.max_demoted_per_tenant, (
                f"tenant {tenant!r}: {len(theirs)} demoted retentions")
            assert all(r.tenant == tenant for r in theirs.values()), (
                "demoted under another tenant")
        for rid, ret in self._by_id.items():
            node = ret.node
            if node is None:
                assert rid in demoted, f"{rid}: neither pinned nor demoted"
                assert retention_id(ret.end_hash, ret.ttl_class, ret.tenant) == rid, (
                    f"{rid}: demoted with an end hash that is not its prefix's")
                continue
            assert rid not in demoted, f"{rid}: pinned and demoted"
            assert ret in self._at_node.get(node.uid, ()), f"{rid}: not indexed at its node"
            assert node.depth_tokens + node.num_tokens == ret.num_blocks * bs, (
                f"{rid}: pinned at {node!r}, not at {ret.num_blocks} blocks")
            assert retention_id(node.end_hash, ret.ttl_class, ret.tenant) == rid, (
                f"{rid}: id does not match its prefix")
            assert ret.end_hash == node.end_hash, f"{rid}: end hash is not its node's"
            pins[node.uid] = pins.get(node.uid, 0) + 1
            n: Node | None = node
            while n is not None and n.parent is not None:
                nodes[n.uid] = n
                mine = refs.setdefault(n.uid, {})
                mine[ret.tenant] = mine.get(ret.tenant, 0) + 1
                n = n.parent
            assert n is not None and tree.roots.get(ret.root_hash) is n, (
                f"{rid}: pinned under a detached or foreign root")
        assert sum(len(v) for v in self._at_node.values()) == len(self._by_id) - len(demoted), (
            "node index holds retentions that are not pinned")
        for node in tree.iter_nodes():
            assert node.pins == pins.get(node.uid, 0), (
                f"{node!r}: {node.pins} pins, {pins.get(node.uid, 0)} retentions pinned there")
            assert (node.retain_refs or {}) == refs.get(node.uid, {}), (
                f"{node!r}: retain_refs {node.retain_refs} != {refs.get(node.uid, {})}")
        assert set(nodes) <= {n.uid for n in tree.iter_nodes()}, "a pinned path left the tree"
        assert tree.num_retained_blocks <= self.max_blocks, (
            f"{tree.num_retained_blocks} retained blocks past the budget {self.max_blocks}")
        for tenant, cap in self.tenant_max_blocks.items():
            used = tree.retained_blocks_by_tenant.get(tenant, 0)
            assert used <= cap, f"tenant {tenant!r}: {used} retained blocks past its {cap}"
        by_ttl = {c: [0, 0] for c in TTL_CLASSES}
        for ret in self._by_id.values():
            if ret.node is not None:
                by_ttl[ret.ttl_class][0] += 1
                by_ttl[ret.ttl_class][1] += ret.num_blocks * bs
        assert by_ttl == self._pinned_by_ttl, f"by-TTL gauges {self._pinned_by_ttl} != {by_ttl}"

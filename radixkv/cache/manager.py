"""The cache facade the engine talks to: match + lock, allocate (+ evict), publish, release, fork,
and the store tier's loads (``store_begin`` → ``store_ready`` → ``store_finish``).

A request's life (engine thread): ``begin`` (match under the identity root, cap the hit at
floor(min(match, N-1)/B)*B, lock the path, classify the missed tokens) → ``allocate`` (grow
the block table, evicting leaves; all-or-nothing; the first success admits the lookup into the
policy fields) → ``record_admission`` (count the miss causes once) → ``begin_step`` … forward …
``end_step`` (blocks released meanwhile are freed after it) → ``publish`` (insert full computed
blocks, hashed once) → ``fork`` (n > 1) → ``release`` (unlock; published blocks stay
cached-evictable). Block states, lifetimes and the layers: ``radixkv/cache/README.md``.
"""

from __future__ import annotations

import time
from array import array
from typing import Callable, Mapping, Sequence

from radixkv.cache.check import block_states, check_manager
from radixkv.cache.events import KVEventLog
from radixkv.cache.evict_path import evict, make_ghost_list, stamp_request_end, take_blocks
from radixkv.cache.fork import fork
from radixkv.cache.gauges import CacheGauges
from radixkv.cache.hashing import BlockHasher, CacheIdentity, HashFn
from radixkv.cache.identity_memo import IdentityMemo
from radixkv.cache.lookup import lookup_inputs
from radixkv.cache.miss_causes import classify_miss, empty_breakdown, move_to_window_evicted
from radixkv.cache.pool import BlockPool
from radixkv.cache.publish import publish
from radixkv.cache.request_state import RequestState
from radixkv.cache.retention import RetentionTable
from radixkv.cache.retention_facade import CacheRetention
from radixkv.cache.store import bridge
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.tree.node import BLOCK_ID_TYPECODE
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.cache.window_cache import (
    WindowBlocks,
    WindowTable,
    register_published,
    shared_prefix_hashes,
    table_for_hit,
)
from radixkv.config import check_block_size, check_int
from radixkv.eviction import make_policy

#: Identities whose root hash is memoised (least recently used dropped first): a client may
#: send a new cache salt with every request, so nothing here may grow per identity.
IDENTITY_MEMO_SIZE = 4096


class CacheManager(CacheGauges, CacheRetention):
    """Radix-tree prefix cache over a paged KV block pool.

    Args:
        num_blocks: M, physical KV blocks in the pool (> 0).
        block_size: B, tokens per block (> 0).
        eviction_policy: Registry name of the eviction policy (``radixkv.eviction``).
        enable_prefix_caching: When False, nothing is matched or published.
        hash_algo: ``"xxh3_128"`` or ``"sha256"``.
        hash_fn: Test hook replacing the hash function ``H`` (e.g. a tiny-digest hash).
        clock: Time source for policy fields (seconds); tests inject a counter.
        ghost_capacity: Evicted block hashes remembered for the ``evicted`` miss cause (≥ 1;
            default ``num_blocks`` clamped to [1024, 131072]; ~200 bytes each).
        model_shape: The served model's shape (``radixkv.model.ModelShape``, a cost-model
            preset name or ``CostShape``) for cost-aware policies (``gdsf``, ``cost``); None
            uses their default shape. Other policies ignore it.
        max_retained_fraction: Share of the pool that retentions may pin, in ``[0, 1]``
            (``radixkv.cache.retention``).
        tenant_max_retained_tokens: Per-tenant cap on retained tokens (None: no tenant capped).
        window_num_blocks: With window KV groups (window-bounded residency,
            ``radixkv.cache.window_cache``): blocks of each window group's pool, null block 0
            included (≥ 2); None: one pool for every layer (``keep-all``).
        window_tokens: W of the largest window group (with ``window_num_blocks``).

    Raises:
        ValueError: naming the offending argument.
    """

    def __init__(self, num_blocks: int, block_size: int, *, eviction_policy: str = "lru",
                 enable_prefix_caching: bool = True, hash_algo: str = "xxh3_128",
                 hash_fn: HashFn | None = None, clock: Callable[[], float] = time.monotonic,
                 ghost_capacity: int | None = None, model_shape: object | None = None,
                 max_retained_fraction: float = 0.5,
                 tenant_max_retained_tokens: Mapping[str, int] | None = None,
                 window_num_blocks: int | None = None,
                 window_tokens: int | None = None) -> None:
        self.block_size = check_block_size(block_size)
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        if type(enable_prefix_caching) is not bool:
            raise ValueError(f"enable_prefix_caching: must be a bool, got "
                             f"{enable_prefix_caching!r}")
        if ghost_capacity is not None and (type(ghost_capacity) is not int
                                           or ghost_capacity < 1):
            raise ValueError(f"ghost_capacity: must be an int >= 1 or None, got "
                             f"{ghost_capacity!r}")
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(hash_algo, hash_fn)
        self.hash_algo = self.hasher.algo
        self.pool = BlockPool(num_blocks)
        self.tree = RadixTree(block_size, make_policy(eviction_policy, model_shape=model_shape),
                              clock)
        self.ghost = make_ghost_list(self.tree.policy, ghost_capacity if ghost_capacity
                                     is not None else min(max(1024, num_blocks), 1 << 17))
        self._evicted_blocks_total = 0
        self._miss_tokens = empty_breakdown()
        self.identities = IdentityMemo(self.hasher, block_size, IDENTITY_MEMO_SIZE)
        self._root_bytes = len(self.hasher.hash_fn(b""))  # a root is one digest
        self._requests: dict[str, RequestState] = {}
        #: Set by an engine that publishes KV events (``radixkv.cache.events``); None: off.
        self.events: KVEventLog | None = None
        #: The store tier under the tree (``attach_store``); None: no store.
        self.store: StoreTier | None = None
        #: Live retentions (TTL pins), on the tree's clock.
        self.retention = RetentionTable(self.tree, num_blocks,
                                        max_retained_fraction=max_retained_fraction,
                                        tenant_max_retained_tokens=tenant_max_retained_tokens)
        self._tenants: dict[str, str | None] = {}  # active request id -> its tenant
        # Counters of forks (CacheGauges): children started, blocks they share, tail blocks
        # copied (copy-on-write).
        self._forks_total = 0
        self._fork_shared_blocks_total = 0
        self._cow_copied_blocks_total = 0
        #: The window groups' pool (window-bounded residency); None: keep-all.
        self.window: WindowBlocks | None = None
        if window_num_blocks is not None or window_tokens is not None:
            if window_num_blocks is None or window_tokens is None:
                raise ValueError("window_num_blocks: window_tokens and window_num_blocks go "
                                 "together")
            self.window = WindowBlocks(window_num_blocks, window_tokens, self.block_size)

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Use ``clock`` for policy fields and retention expiry from now on (tests, replays)."""
        self.tree.set_clock(clock)

    # ---- identity -----------------------------------------------------------------------
    def identity_root(self, identity: CacheIdentity) -> bytes:
        """Return the root hash of ``identity`` through the one identity memo (LRU-bounded by
        ``IDENTITY_MEMO_SIZE``: see :mod:`radixkv.cache.identity_memo`).

        Raises:
            ValueError: naming ``block_size`` if the identity's block size is not this cache's.
        """
        root = self.identities.root(identity)
        if self.events is not None and identity.cache_salt is None:  # salted: never published
            self.events.allow_root(root, identity.adapter[0] if identity.adapter else None)
        return root

    # ---- lookup -------------------------------------------------------------------------
    def begin(self, request_id: str, root: bytes, prompt_token_ids: Sequence[int] | bytes, *,
              mm_items: Sequence[Sequence] | None = None, session_key: str | None = None,
              tenant: str | None = None) -> int:
        """Match, cap and lock the cached prefix of a prompt; seed the request's block table.

        Policy fields (``hit_count``, ``last_access_s``) are not touched here: the hit is
        recorded when the request is admitted (first successful :meth:`allocate`, or
        :meth:`record_admission`), so a lookup that is released unadmitted (waiting for blocks)
        leaves no trace but a possible split. The miss breakdown is computed and stored for
        :meth:`record_admission` / :meth:`miss_breakdown`.

        Args:
            request_id: Unique id of a request not currently active.
            root: Identity root hash from :meth:`identity_root`.
            prompt_token_ids: The prompt, N ≥ 1 token ids in ``[0, 2**32)``, or the same
                already packed as uint32-LE ``bytes`` (what ``hashing.pack_tokens`` returns:
                an engine that packs each request's tokens once as they arrive saves the
                per-lookup packing, the largest part of a lookup's cost).
            mm_items: Multimodal items of the prompt, each ``(token_offset, num_tokens,
                media_digest)``; a block's extras are derived from the items overlapping it.
            session_key: The request's session hint (``prompt_cache_key`` / ``user``), stored
                as ``session_key`` on the nodes it hits (at admission) and publishes into.
            tenant: The request's tenant: its retentions' owner, and whose retentions its hit
                refreshes (at admission).

        Returns:
            m = num_cached_tokens, a multiple of B with m ≤ N - 1 (0 when caching is off).

        Raises:
            ValueError: naming ``request_id`` if already active, ``prompt_token_ids`` if empty
                or holding a bad id, ``root`` if not bytes, ``mm_items`` if malformed.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already active")
        pb, num_prompt_tokens, items, cap_blocks, extras = lookup_inputs(
            root, prompt_token_ids, mm_items, self.block_size, self._root_bytes)
        self._expire_retentions()
        if tenant is not None:
            self._tenants[request_id] = tenant
        if not self.enable_prefix_caching:
            state = self._requests[request_id] = RequestState(
                None, None, root, array(BLOCK_ID_TYPECODE), 0, 0, items, session_key=session_key)
            if self.window is not None:
                state.window = WindowTable(0, set())
            return 0
        root_node = self.tree.root(root, self.identities.tenant(root))
        result = self.tree.match(root_node, pb, cap_blocks, extras=extras, touch=False)
        num_blocks = len(result.block_ids)
        window_evicted = 0
        if self.window is not None and num_blocks:
            # The deepest boundary whose window K/V is cached too; the rest of the token match
            # is computed again (miss cause window_evicted).
            hit = self.window.resume_point(result.node, num_blocks)
            if hit < num_blocks:
                window_evicted = (num_blocks - hit) * self.block_size
                result = self.tree.match(root_node, pb, hit, extras=extras, touch=False)
                num_blocks = hit
        self.tree.lock(result.node)
        miss, known, notes = classify_miss(self.tree, root_node, pb, extras, num_prompt_tokens,
                                           num_blocks, result.last_hash, self.ghost)
        if window_evicted:
            move_to_window_evicted(miss, window_evicted)
        state = self._requests[request_id] = RequestState(
            root_node, result.node, result.last_hash, result.block_ids,
            num_blocks * self.block_size, num_blocks, items, miss=miss, known_hashes=known,
            known_start=num_blocks, known_tokens=pb if known else b"",
            num_computed_tokens=num_blocks * self.block_size,
            match_node=result.node if num_blocks else None, ghost_notes=notes,
            session_key=session_key)
        if self.window is not None:
            state.window = table_for_hit(self.window, result.node, num_blocks,
                                         num_prompt_tokens)
            if num_blocks:
                self.window.touch(shared_prefix_hashes(result.node, num_blocks,
                                                       self.window.need))
        return num_blocks * self.block_size

    def peek(self, root: bytes, prompt_token_ids: Sequence[int] | bytes, *,
             mm_items: Sequence[Sequence] | None = None) -> int:
        """Return what :meth:`begin` would return, changing nothing (no split, touch or lock);
        under window KV groups the token match only (an upper bound: ``begin`` may stop earlier
        where window blocks are gone)."""
        pb, _, _, cap_blocks, extras = lookup_inputs(root, prompt_token_ids, mm_items,
                                                   self.block_size, self._root_bytes)
        root_node = self.tree.roots.get(root)
        if not self.enable_prefix_caching or root_node is None:
            return 0
        num_blocks = self.tree.match_length(root_node, pb, cap_blocks, extras=extras)
        return num_blocks * self.block_size

    def record_admission(self, request_id: str) -> None:
        """Count the request's lookup once: add its miss breakdown to :attr:`miss_tokens`.

        Idempotent per request (a forked child never counts). Also records the hit on the
        matched path if no allocation did yet.

        Raises:
            KeyError: unknown ``request_id``.
        """
        req = self._requests[request_id]
        self._admit(req)
        if not req.counted:
            req.counted = True
            for cause, num_tokens in req.miss.items():
                self._miss_tokens[cause] += num_tokens

    def miss_breakdown(self, request_id: str) -> dict[str, int]:
        """Missed prompt tokens of this request's lookup by cause (sums to N - m).

        With prefix caching off no lookup runs: every cause is 0 (docs/design.md §7's causes
        explain what a cache missed; nothing was looked up).
        """
        return dict(self._requests[request_id].miss)

    def _admit(self, req: RequestState) -> None:
        if not req.admitted:
            req.admitted = True
            if req.match_node is not None and req.match_node.parent is not None:
                self.tree.touch_path(req.match_node, req.session_key)

    # ---- blocks -------------------------------------------------------------------------
    def _take_blocks(self, num: int) -> list[int] | None:
        """``num`` private blocks, evicting if the free list is short; None changes nothing.

        Retention never blocks an allocation: when free and evictable blocks cannot cover it
        but unpinning retentions can, retentions are unpinned (soonest expiry first, those
        that free no block kept; demoted to the store tier when one is attached and up, else
        dropped) before the eviction.
        """
        short = num - self.pool.num_free_blocks
        if short > self.tree.num_evictable_blocks and len(self.retention):
            self.retention.expire()
            self.retention.make_room(short, demote=self.store is not None
                                     and not self.store.down)
            self._sync_store_marks()
        return take_blocks(self.pool, self.tree, self._evict, num)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the block table to cover token slots ``[0, num_tokens)``.

        Evicts cached-evictable blocks through the policy when the free list is short (blocks
        whose free is deferred by an in-flight step are not free yet). All-or-nothing: when
        free + evictable blocks cannot cover the need, returns False and changes nothing.

        Raises:
            KeyError: unknown ``request_id``.
            ValueError: naming ``num_tokens`` if not an int ≥ 0.
        """
        req = self._requests[request_id]
        check_int("num_tokens", num_tokens)
        need = -(-num_tokens // self.block_size) - len(req.block_table)
        table, window = req.window, self.window
        window_need = 0
        if table is not None and window is not None:  # a block per new position there too
            window_need = -(-num_tokens // self.block_size) - len(table.ids)
            if window_need > window.room():
                return False
        if need > 0:
            ids = self._take_blocks(need)
            if ids is None:
                return False
            req.block_table.extend(ids)
        if window_need > 0 and table is not None and window is not None:
            taken = window.take(window_need)
            assert taken is not None  # room() covered it above
            table.ids.extend(taken)
        if num_tokens > req.num_slot_tokens:
            req.num_slot_tokens = num_tokens
        self._admit(req)
        return True

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached-evictable blocks now (memory pressure, tests);
        return how many were (back on the free list). ValueError naming ``num_blocks`` if not
        an int ≥ 0."""
        check_int("num_blocks", num_blocks)
        return self._evict(num_blocks)

    def _evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` blocks (:func:`radixkv.cache.evict_path.evict`)."""
        num = evict(self.tree, self.pool, self.ghost, self.events, num_blocks, self.window)
        self._evicted_blocks_total += num
        return num

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no running request holds (vLLM's ``reset_prefix_cache``),
        and empty a per-replica store tier (``host``; :meth:`StoreTier.reset`), as SGLang's
        ``flush_cache`` empties its host tier: the cache is cold afterwards in every tier this
        replica owns, and the one ``AllBlocksCleared`` says so. A shared store (Mooncake) is
        kept: it is other replicas' cache too, and its blocks are never announced.

        With KV events on, one ``cleared`` event replaces the removals, followed by the blocks
        still held (see :meth:`~radixkv.cache.events.KVEventLog.cleared`).

        Returns: Device blocks evicted (the store tier counts its own: ``reset_blocks_total``).
        """
        mark = self.events.mark() if self.events is not None else 0
        evicted = self._evict(self.tree.num_evictable_blocks)
        if self.window is not None:
            self.window.evict(self.window.num_evictable_blocks)
        if self.store is not None:  # after the eviction: in evict mode it writes to the tier
            self.store.reset()
        if self.events is not None:
            self.events.cleared(self.tree.roots, mark)
        return evicted

    def publish(self, request_id: str, token_ids: Sequence[int] | bytes, num_computed_tokens: int, *,
                mm_items: Sequence[Sequence] | None = None) -> None:
        """Insert every full, computed block not yet published into the tree.

        Args:
            request_id: An active request.
            token_ids: The sequence so far (prompt + generated), at least
                ``num_computed_tokens`` long; ids, or packed uint32-LE ``bytes``.
            num_computed_tokens: Tokens whose K/V sit in the pool; blocks fully inside
                ``[0, num_computed_tokens)`` are published, each hashed exactly once.
            mm_items: Multimodal items of ``token_ids``; None keeps those given to ``begin``.

        Raises:
            KeyError: unknown ``request_id``.
            ValueError: naming ``num_computed_tokens`` if not an int ≥ 0 or it exceeds the
                tokens given or the allocated block table, ``token_ids`` if packed bytes are
                not a multiple of 4, ``mm_items`` if malformed; nothing is changed then.
        """
        req = self._requests[request_id]
        back = publish(self, req, token_ids, num_computed_tokens, mm_items)
        if back:
            self.ghost.came_back(back)
        if req.window is not None and self.window is not None and req.cursor is not None:
            register_published(self.window, req.window, req.cursor, req.num_published_blocks)

    def release_window_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Let go of the request's window blocks that left its window: those wholly before
        ``num_computed_tokens - W + 1`` (the next token's window), keeping one block of slack
        so a hit one block short of the sequence's end stays servable. Published ones stay
        cached (anchors where the request resumes: ``radixkv.cache.window_cache``), the rest
        are freed. No-op without window KV groups.

        Raises:
            KeyError: unknown ``request_id``.
        """
        req = self._requests[request_id]
        if req.window is None or self.window is None:
            return
        first_kept = (num_computed_tokens - self.window.window_tokens + 1) // self.block_size - 1
        if first_kept > req.window.start:
            self.window.release_before(req.window, first_kept)

    def window_room_tokens(self, request_id: str, start: int, reserve_blocks: int = 0
                           ) -> int | None:
        """Most tokens from ``start`` the request's next chunk can compute with the window
        blocks free or evictable now, less ``reserve_blocks`` kept for others (None without
        window KV groups; KeyError: unknown ``request_id``). The scheduler shrinks a chunk to
        it rather than preempt a request for window blocks."""
        table = self._requests[request_id].window
        if table is None or self.window is None:
            return None
        room = max(0, self.window.room() - reserve_blocks)
        return max(0, (len(table.ids) + room) * self.block_size - start)

    def window_table(self, request_id: str) -> list[int]:
        """A copy of the request's window-group block table (0 = released; KeyError: unknown
        ``request_id``; ValueError without window KV groups)."""
        table = self._requests[request_id].window
        if table is None:
            raise ValueError("window_table: this cache has no window KV groups")
        return table.ids.tolist()

    # ---- store tier (radixkv.cache.store.bridge has the rules) ---------------------------
    def attach_store(self, tier: StoreTier) -> None:
        """Put ``tier`` under the tree: lookups past the device match ask it, published (or,
        in ``evict`` write mode, evicted) blocks are written to it; retained blocks are marked
        there (kept longest) when the backend has the notion (``StoreTier.keeps_retained``)."""
        if self.window is not None:
            raise ValueError("kv_store: the store tier does not carry window KV groups "
                             "(--sliding-window-kv window)")
        self.store = tier
        self.tree.trim_hook = lambda node, take: bridge.write_trimmed(tier, node, take)
        if tier.keeps_retained:
            self.retention.touched = {}
            self.retention.cleared = []

    def store_begin(self, request_id: str, prompt_token_ids: bytes) -> bool:
        """After ``begin``: queue the store lookup of the blocks past the device match (packed
        prompt); True when the request must wait for ``store_ready`` before ``store_finish``."""
        req = self._requests[request_id]
        if self.store is None or not self.enable_prefix_caching:
            return False
        return bridge.start_load(self.store, req, request_id, self.hasher.hash_blocks,
                                 prompt_token_ids, len(prompt_token_ids) >> 2, self.block_size)

    def store_ready(self, request_id: str) -> bool:
        """The request's store load finished or passed its deadline."""
        tier = self.store
        assert tier is not None  # only for a load store_begin queued: a tier is attached
        return tier.is_ready(request_id)

    def store_finish(self, request_id: str, prompt_token_ids: bytes) -> tuple[int, int, bool]:
        """Insert what the load verified (pool blocks + tree, as published). Returns the
        request's cached tokens now (device + store, the new m), the tokens this load added,
        and whether a further load was queued (the load was full: the store may hold more;
        wait for ``store_ready`` again)."""
        req = self._requests[request_id]
        tier = self.store
        assert tier is not None  # as in store_ready
        loaded = bridge.finish_load(
            tier, req, request_id, self._take_blocks,
            lambda: self.pool.num_free_blocks + self.tree.num_evictable_blocks,
            lambda n: self.publish(request_id, prompt_token_ids, n), self.block_size)
        req.num_store_tokens += loaded
        more = loaded == tier.max_blocks_per_load * self.block_size and bridge.start_load(
            tier, req, request_id, self.hasher.hash_blocks, prompt_token_ids,
            len(prompt_token_ids) >> 2, self.block_size)
        return req.num_cached_tokens, loaded, more

    def store_loaded_blocks(self, request_id: str) -> int:
        """Verified blocks the request's finished load holds in staging (0 while running)."""
        return self.store.loaded_blocks(request_id) if self.store is not None else 0

    def store_wait(self, timeout_s: float) -> None:
        """Block until a store load finishes or ``timeout_s`` passes (nothing else can run)."""
        if self.store is not None:
            self.store.wait(timeout_s)

    def fork(self, parent_request_id: str, child_request_id: str, *,
             num_computed_tokens: int | None = None) -> list[tuple[int, int]] | None:
        """Start ``child_request_id`` as a copy of a running request (``n > 1`` sampling).

        The child shares every full computed block (published: a lock on the parent's path;
        unpublished: pool reference counts). The partial tail block is copied: the caller
        copies the K/V of every returned ``(src_block, dst_block)`` in every layer before the
        child's next step. The child's lookup is not counted again.

        Args:
            parent_request_id: An active request whose full computed blocks are published
                (call ``publish`` after the step, before forking).
            child_request_id: A new request id.
            num_computed_tokens: Tokens of the parent with K/V in the pool (default: the most
                given to ``publish``, or ``begin``'s m).

        Returns:
            The copy pairs (empty when the computed tokens end on a block boundary), or None
            when no block can be found for the tail copy (nothing changed then).

        Raises:
            KeyError: unknown ``parent_request_id``.
            ValueError: naming ``child_request_id`` if already active, ``num_computed_tokens``
                if not an int or outside the parent's table, or ``parent_request_id`` if full
                computed blocks are not published yet.
        """
        parent = self._requests[parent_request_id]
        if self.window is not None:
            # A child's window tail would need copying in every window group; it starts from
            # a prefix hit on the parent's published prompt instead.
            return None
        if num_computed_tokens is not None:
            check_int("num_computed_tokens", num_computed_tokens)
        if child_request_id in self._requests:
            raise ValueError(f"child_request_id: {child_request_id!r} is already active")
        forked = fork(parent, self.tree, self.pool, self.block_size, self.enable_prefix_caching,
                      num_computed_tokens, self._take_blocks)
        if forked is None:
            return None
        child, copies = forked
        self._requests[child_request_id] = child
        self._forks_total += 1
        self._cow_copied_blocks_total += len(copies)
        self._fork_shared_blocks_total += len(child.block_table) - len(copies)
        return copies

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (physical id per block position); KeyError
        for an unknown ``request_id``."""
        return self._requests[request_id].block_table.tolist()

    def num_cached_tokens(self, request_id: str) -> int:
        """Return m as returned by ``begin`` for this request."""
        return self._requests[request_id].num_cached_tokens

    # ---- release / steps ---------------------------------------------------------------
    def release(self, request_id: str, *, end_s: float | None = None) -> None:
        """Unlock the request's path and free its private blocks.

        Published blocks stay cached-evictable (matchable until an allocation evicts them).
        Inside a step (:meth:`begin_step`), freed private blocks are deferred to
        :meth:`end_step`. A request never admitted leaves ``last_access_s`` alone. Every node
        of the held path gets ``request_end_s`` = ``end_s`` (the cache clock when None; a
        replay passes its modelled end) before it is unlocked.

        Raises:
            KeyError: unknown ``request_id`` (including a second release).
        """
        req = self._requests.pop(request_id)
        self._tenants.pop(request_id, None)
        if self.store is not None:
            self.store.cancel(request_id)
        if req.cursor is not None:
            stamp_request_end(req.cursor, self.tree.now() if end_s is None else end_s)
            self.tree.unlock(req.cursor, touch=req.admitted)
        self.pool.free(req.duplicate_ids)
        self.pool.free(req.block_table[req.num_published_blocks :])
        if req.window is not None and self.window is not None:
            self.window.release(req.window, req.num_computed_tokens // self.block_size
                                - self.window.need - 1)

    def begin_step(self) -> None:
        """Mark a forward step in flight: blocks released from now on are freed at ``end_step``.

        The engine calls it after scheduling and before launching the forward (after
        ``allocate``, which cannot hand out a deferred block anyway). Published blocks waiting
        for a store write slot are gathered here.
        """
        self.pool.begin_step()
        if self.window is not None:
            self.window.begin_step()
        if self.store is not None:
            self.store.pump()

    def end_step(self) -> int:
        """The in-flight step's K/V writes are complete: free the deferred blocks.

        Returns:
            Blocks returned to the free list.
        """
        if self.window is not None:
            self.window.end_step()
        return len(self.pool.end_step())

    def is_active(self, request_id: str) -> bool:
        """Return whether ``request_id`` began and was not released."""
        return request_id in self._requests

    def block_states(self) -> list[str]:
        """State of every block ("free", "private", "cached_evictable", "cached_locked");
        O(num_blocks + tree size), for tests and debugging."""
        return block_states(self.pool, self.tree)

    def check_integrity(self, *, verify_hashes: bool = False) -> None:
        """Verify pool, tree, and their agreement with every active request.

        Args:
            verify_hashes: Also recompute every stored chained hash (O(cached blocks) hashes).

        Raises:
            AssertionError: describing the first violated invariant.
        """
        check_manager(self.pool, self.tree, self._requests, self.block_size,
                      self.enable_prefix_caching, self.hasher.hash_fn if verify_hashes else None)
        self.retention.check()
        if self.window is not None:
            self.window.check(r.window for r in self._requests.values()
                              if r.window is not None)
        assert self.store is not None or self.retention.num_pinned == len(self.retention), (
            "retentions demoted without a store tier to hold their blocks")
        assert set(self._tenants) <= set(self._requests), "tenant kept for an ended request"
        if not self.enable_prefix_caching:
            assert not len(self.retention), "prefix caching off but retentions are live"

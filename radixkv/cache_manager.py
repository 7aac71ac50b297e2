"""The cache facade the engine talks to: match + lock, allocate (+ evict), publish, release.

A request's life: :meth:`CacheManager.begin` matches its prompt under its identity root
(comparing stored tokens, hashing nothing cached), caps the hit at
``m = floor(min(match, N-1) / B) * B`` and locks the matched path; :meth:`allocate` grows its
block table with private blocks, evicting unlocked leaves through the policy when the free
list is short (all-or-nothing); :meth:`publish` inserts each block once it is full *and*
computed (prompt or generated tokens), hashing it exactly once; :meth:`release` unlocks the
path and frees the private blocks, leaving published blocks cached-evictable.

Block states (DESIGN.md §4): free, cached-evictable, cached-locked, private. The pool knows
free / private / cached; the tree knows which cached blocks are locked.
``in_use = private + cached-locked``, and ``free + cached-evictable + in_use = num_blocks``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from radixkv.block_pool import CACHED, FREE, BlockPool
from radixkv.eviction import get_policy
from radixkv.hashing import BlockHasher, CacheIdentity, HashFn
from radixkv.radix_tree import Node, RadixTree

@dataclasses.dataclass
class _RequestState:
    """Cache-side state of one active request.

    Attributes:
        cursor: Tree node at whose end the request's cached/published prefix ends (it holds one
            lock there); None when prefix caching is off.
        last_hash: Chained hash of the last published/matched block (root hash at first).
        block_table: Physical block per block position.
        num_cached_tokens: m, the capped hit returned by ``begin``.
        num_published_blocks: Leading positions that are in the tree (matched or published).
        duplicate_ids: Private blocks at published positions whose content the tree already had
            (a concurrent request published it first); freed at release.
    """

    cursor: Node | None
    last_hash: bytes
    block_table: list[int]
    num_cached_tokens: int
    num_published_blocks: int
    duplicate_ids: list[int] = dataclasses.field(default_factory=list)


class CacheManager:
    """Radix-tree prefix cache over a paged KV block pool.

    Args:
        num_blocks: M, physical KV blocks in the pool (> 0).
        block_size: B, tokens per block (> 0).
        eviction_policy: Registry name of the eviction policy (``radixkv.eviction``).
        enable_prefix_caching: When False, nothing is matched or published.
        hash_algo: ``"xxh3_128"`` or ``"sha256"``.
        hash_fn: Test hook replacing the hash function ``H`` (e.g. a tiny-digest hash).
        clock: Time source for policy fields (seconds); tests inject a counter.

    Raises:
        ValueError: naming the offending argument.
    """

    def __init__(self, num_blocks: int, block_size: int, *, eviction_policy: str = "lru",
                 enable_prefix_caching: bool = True, hash_algo: str = "xxh3_128",
                 hash_fn: HashFn | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hasher = BlockHasher(hash_algo, hash_fn)
        self.hash_algo = self.hasher.algo
        self.pool = BlockPool(num_blocks)
        self.tree = RadixTree(block_size, get_policy(eviction_policy), clock)
        self._evicted_blocks_total = 0
        self._roots: dict[CacheIdentity, bytes] = {}
        self._requests: dict[str, _RequestState] = {}

    # ---- identity -----------------------------------------------------------------------
    def identity_root(self, identity: CacheIdentity) -> bytes:
        """Return the root hash of ``identity`` (memoised).

        Raises:
            ValueError: naming ``block_size`` if the identity's block size is not this cache's.
        """
        root = self._roots.get(identity)
        if root is None:
            if identity.block_size != self.block_size:
                raise ValueError(f"block_size: identity has {identity.block_size}, "
                                 f"cache uses {self.block_size}")
            root = self.hasher.identity_root(identity)
            self._roots[identity] = root
        return root

    # ---- request lifecycle --------------------------------------------------------------
    def begin(self, request_id: str, root: bytes, prompt_token_ids: Sequence[int]) -> int:
        """Match, cap and lock the cached prefix of a prompt; seed the request's block table.

        Args:
            request_id: Unique id of a request not currently active.
            root: Identity root hash from :meth:`identity_root`.
            prompt_token_ids: The prompt, N ≥ 1 tokens.

        Returns:
            m = num_cached_tokens, a multiple of B with m ≤ N - 1 (0 when caching is off).

        Raises:
            ValueError: naming ``request_id`` if already active, ``prompt_token_ids`` if empty,
                ``root`` if not bytes.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already active")
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids: must hold at least one token")
        if not isinstance(root, bytes):
            raise ValueError(f"root: must be bytes from identity_root(), got {type(root).__name__}")
        if not self.enable_prefix_caching:
            self._requests[request_id] = _RequestState(None, root, [], 0, 0)
            return 0
        root_node = self.tree.root(root)
        # Hit cap: at least the last prompt token is computed, and a block boundary ends the hit.
        max_blocks = (num_prompt_tokens - 1) // self.block_size
        result = self.tree.match(root_node, tuple(prompt_token_ids), max_blocks)
        self.tree.lock(result.node)
        num_cached_tokens = len(result.block_ids) * self.block_size
        self._requests[request_id] = _RequestState(
            cursor=result.node, last_hash=result.last_hash, block_table=result.block_ids,
            num_cached_tokens=num_cached_tokens, num_published_blocks=len(result.block_ids))
        return num_cached_tokens

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the block table to cover token slots ``[0, num_tokens)``.

        Evicts cached-evictable blocks through the policy when the free list is short.
        All-or-nothing: when free + evictable blocks cannot cover the need, returns False and
        changes nothing (no eviction either).

        Raises:
            KeyError: unknown ``request_id``.
            ValueError: naming ``num_tokens`` if negative.
        """
        req = self._requests[request_id]
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        need = -(-num_tokens // self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        short = need - self.pool.num_free_blocks
        if short > 0:
            if short > self.tree.num_evictable_blocks:
                return False
            freed = self.tree.evict(short)
            self.pool.free_cached(freed)
            self._evicted_blocks_total += len(freed)
        ids = self.pool.allocate(need)
        if ids is None:  # pragma: no cover - guarded by the evictable count above
            raise RuntimeError(f"allocate: {need} blocks not free after evicting {short}")
        req.block_table.extend(ids)
        return True

    def block_table(self, request_id: str) -> list[int]:
        """Return a copy of the request's block table (physical id per block position).

        Raises:
            KeyError: unknown ``request_id``.
        """
        return list(self._requests[request_id].block_table)

    def num_cached_tokens(self, request_id: str) -> int:
        """Return m as returned by ``begin`` for this request."""
        return self._requests[request_id].num_cached_tokens

    def publish(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Insert every full, computed block not yet published into the tree.

        Args:
            request_id: An active request.
            token_ids: The sequence so far (prompt + generated), at least
                ``num_computed_tokens`` long.
            num_computed_tokens: Tokens whose K/V sit in the pool; blocks fully inside
                ``[0, num_computed_tokens)`` are published, each hashed exactly once.

        Raises:
            KeyError: unknown ``request_id``.
            ValueError: naming ``num_computed_tokens`` if it exceeds the tokens given or the
                allocated block table.
        """
        req = self._requests[request_id]
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"num_computed_tokens: {num_computed_tokens} exceeds the "
                             f"{len(token_ids)} token_ids given")
        num_full = num_computed_tokens // bs
        if num_full > len(req.block_table):
            raise ValueError(f"num_computed_tokens: {num_computed_tokens} exceeds the "
                             f"{len(req.block_table)} allocated blocks")
        start = req.num_published_blocks
        if num_full <= start:
            return
        blocks = [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(start, num_full)]
        result = self.tree.insert(req.cursor, req.last_hash, blocks,  # type: ignore[arg-type]
                                  req.block_table[start:num_full], self.hasher.block_hash)
        self.pool.to_cached(result.inserted_ids)
        req.duplicate_ids.extend(result.duplicate_ids)
        req.cursor = result.node
        req.last_hash = result.last_hash
        req.num_published_blocks = num_full

    def release(self, request_id: str) -> None:
        """Unlock the request's path and free its private blocks.

        Published blocks stay cached-evictable (matchable until an allocation evicts them).

        Raises:
            KeyError: unknown ``request_id`` (including a second release).
        """
        req = self._requests.pop(request_id)
        if req.cursor is not None:
            self.tree.unlock(req.cursor)
        self.pool.free(req.duplicate_ids)
        self.pool.free(req.block_table[req.num_published_blocks :])

    def is_active(self, request_id: str) -> bool:
        """Return whether ``request_id`` began and was not released."""
        return request_id in self._requests

    # ---- gauges -------------------------------------------------------------------------
    @property
    def evicted_blocks_total(self) -> int:
        """Counter: cached blocks evicted (dropped from the tree) since start."""
        return self._evicted_blocks_total

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held by the tree (evictable + locked)."""
        return self.tree.num_cached_blocks

    @property
    def num_cached_evictable_blocks(self) -> int:
        """Cached blocks no running request holds."""
        return self.tree.num_evictable_blocks

    @property
    def num_in_use_blocks(self) -> int:
        """Blocks held by running requests: private + cached-locked."""
        return self.pool.num_private_blocks + self.tree.num_locked_blocks

    @property
    def num_tree_nodes(self) -> int:
        """Non-root tree nodes."""
        return self.tree.num_nodes

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    def block_states(self) -> list[str]:
        """State of every block: "free", "private", "cached_evictable" or "cached_locked".

        O(num_blocks + tree size); for tests and debugging.
        """
        states = ["private"] * self.num_blocks
        for block_id in range(self.num_blocks):
            if self.pool.state(block_id) == FREE:
                states[block_id] = "free"
        for node in self.tree.iter_nodes():
            label = "cached_locked" if node.lock_ref > 0 else "cached_evictable"
            for block_id in node.block_ids:
                states[block_id] = label
        return states

    def check_integrity(self) -> None:
        """Verify pool, tree, and their agreement with every active request.

        Raises:
            AssertionError: describing the first violated invariant.
        """
        self.pool.check_integrity()
        cursors = [r.cursor for r in self._requests.values() if r.cursor is not None]
        tree_ids = self.tree.check_integrity(cursors)
        pool_cached = {b for b in range(self.num_blocks) if self.pool.state(b) == CACHED}
        assert tree_ids == pool_cached, (
            f"tree holds {sorted(tree_ids ^ pool_cached)} without the pool agreeing")
        private_refs: dict[int, int] = {}
        for request_id, req in self._requests.items():
            table = req.block_table
            assert req.num_published_blocks <= len(table), f"{request_id}: published past table"
            path_ids: list[int] = []
            node = req.cursor
            while node is not None and node.parent is not None:
                path_ids[:0] = node.block_ids
                node = node.parent
            if req.cursor is not None:
                assert len(path_ids) == req.num_published_blocks, (
                    f"{request_id}: cursor path has {len(path_ids)} blocks, "
                    f"published {req.num_published_blocks}")
                assert req.last_hash == req.cursor.end_hash, f"{request_id}: chain hash drifted"
            dups = set(req.duplicate_ids)
            for pos in range(req.num_published_blocks):
                if table[pos] in dups:
                    continue
                assert table[pos] == path_ids[pos], (
                    f"{request_id}: block position {pos} holds {table[pos]}, tree path "
                    f"has {path_ids[pos]}")
            for block_id in req.duplicate_ids + table[req.num_published_blocks :]:
                private_refs[block_id] = private_refs.get(block_id, 0) + 1
        for block_id in range(self.num_blocks):
            assert self.pool.ref_count(block_id) == private_refs.get(block_id, 0), (
                f"block {block_id}: ref count {self.pool.ref_count(block_id)}, "
                f"held by {private_refs.get(block_id, 0)} requests")
        total = self.num_free_blocks + self.num_cached_evictable_blocks + self.num_in_use_blocks
        assert total == self.num_blocks, (
            f"free + cached_evictable + in_use = {total} != num_blocks {self.num_blocks}")
        if not self.enable_prefix_caching:
            assert self.tree.num_cached_blocks == 0, "prefix caching off but the tree holds blocks"

"""``CacheManager.fork`` (a mixin): start a sequence as a copy of a running one (``n > 1``).

Full computed blocks are shared (published ones through a tree lock, unpublished ones through
pool reference counts); the partial tail block, which both sequences write next, is copied
(copy-on-write): the caller copies the K/V of each returned ``(src, dst)`` pair.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.check import RequestState
from radixkv.cache.publish import count_arg

if TYPE_CHECKING:
    from radixkv.cache.pool import BlockPool
    from radixkv.cache.tree.radix_tree import RadixTree


class CacheFork:
    """``fork`` over the attributes ``CacheManager`` defines (requests, tree, pool)."""

    _requests: dict[str, RequestState]
    tree: RadixTree
    pool: BlockPool
    block_size: int
    enable_prefix_caching: bool

    # Also uses CacheManager._take_blocks (free blocks, evicting if short).

    def fork(self, parent_request_id: str, child_request_id: str, *,
             num_computed_tokens: int | None = None) -> list[tuple[int, int]] | None:
        """Start ``child_request_id`` as a copy of a running request (``n > 1`` sampling).

        The child shares every full computed block of the parent: published ones through a
        lock on the parent's tree path, unpublished ones (prefix caching off) through pool
        reference counts. The partial tail block, which both will write next, is copied: the
        child gets a fresh private block and the caller must copy the K/V of every returned
        pair ``(src_block, dst_block)`` in every layer's K and V pools before the child's next
        forward step. Blocks past the computed tokens are not shared; the child allocates its
        own. The child's lookup is not counted again (its ``record_admission`` adds nothing).

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
        if num_computed_tokens is not None:
            count_arg("num_computed_tokens", num_computed_tokens)
        if child_request_id in self._requests:
            raise ValueError(f"child_request_id: {child_request_id!r} is already active")
        bs = self.block_size
        computed = parent.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if not parent.num_published_blocks * bs <= computed <= len(parent.block_table) * bs:
            raise ValueError(f"num_computed_tokens: {computed} outside the parent's "
                             f"{len(parent.block_table)} blocks / published prefix")
        num_full, has_tail = divmod(computed, bs)
        if self.enable_prefix_caching and parent.num_published_blocks < num_full:
            raise ValueError(f"parent_request_id: publish its {num_full} full computed blocks "
                             f"before forking ({parent.num_published_blocks} published)")
        copies: list[tuple[int, int]] = []
        table = parent.block_table[:num_full]
        if has_tail:
            ids = self._take_blocks(1)
            if ids is None:
                return None
            copies.append((parent.block_table[num_full], ids[0]))
            table.append(ids[0])
        if parent.cursor is not None:
            self.tree.lock(parent.cursor)
        for block_id in [*parent.duplicate_ids,
                         *parent.block_table[parent.num_published_blocks : num_full]]:
            self.pool.incref(block_id)
        self._requests[child_request_id] = RequestState(
            parent.root, parent.cursor, parent.last_hash, table, parent.num_cached_tokens,
            parent.num_published_blocks, parent.mm_items,
            duplicate_ids=list(parent.duplicate_ids), num_computed_tokens=computed,
            admitted=True, counted=True, known_hashes=list(parent.known_hashes),
            known_start=parent.known_start, known_tokens=parent.known_tokens)
        return copies

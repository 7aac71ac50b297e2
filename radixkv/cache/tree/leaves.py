"""Leaf eviction for the radix tree (a mixin of ``RadixTree``): trim blocks off the tails of the
evictable leaves in policy order, in O(k log n) for k blocks, keeping the cached set
prefix-closed, and describe each trimmed run for the ghost list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.cache.tree.node import LeafIndex
    from radixkv.eviction import EvictionPolicy


class LeafEviction:
    """``evict`` over the attributes ``RadixTree`` defines (leaves, policy, counters)."""

    leaves: LeafIndex
    policy: EvictionPolicy
    block_bytes: int
    num_cached_blocks: int
    num_nodes: int
    root_child_keys: dict
    # Also uses RadixTree._drop_bare_root.

    def evict(self, num_blocks: int, evicted: list | None = None) -> list[int]:
        """Evict up to ``num_blocks`` blocks, tail-first from the first leaves in policy order.

        Args:
            num_blocks: Blocks wanted.
            evicted: If given, one ``(key, (tokens, hashes, extras))`` entry per trimmed run is
                appended for the ghost list: ``key`` is the hash input of the run's first
                block (``parent hash || packed tokens || extras``), then the run's packed
                tokens, chained hashes and extras (None for text), in token order.

        Returns:
            Freed block ids in eviction order (fewer than asked when nothing is evictable).
        """
        freed: list[int] = []
        leaves = self.leaves
        by_priority = leaves.by_priority
        bb = self.block_bytes
        while len(freed) < num_blocks:
            victim = leaves.first()
            if victim is None:
                break
            ids = victim.block_ids
            take = min(num_blocks - len(freed), len(ids))
            # A priority-keyed leaf trimmed only in part stays indexed and is re-keyed below
            # (one decode allocation under pressure trims one block: usually no re-sort).
            keep = take < len(ids) and by_priority
            if not keep:
                leaves.remove(victim)
            freed.extend(reversed(ids[-take:]))
            if evicted is not None:
                first, hs, x = len(ids) - take, victim.hashes, victim.extras
                parent_hash = hs[first - 1] if first else victim.parent.end_hash  # type: ignore[union-attr]
                run_tokens = bytes(victim.tokens[first * bb :])
                run_x = x[first:] if x is not None else None
                evicted.append((parent_hash + run_tokens[:bb] + (run_x[0] if run_x else b""),
                                (run_tokens, hs[first:], run_x)))
            del victim.tokens[-take * bb :], victim.hashes[-take:], ids[-take:]
            if victim.extras is not None:
                del victim.extras[-take:]
            self.num_cached_blocks -= take
            self.policy.on_evict(victim, take)
            if ids:  # partially trimmed: still the same leaf
                if keep:
                    leaves.reposition(victim)
                else:
                    leaves.add(victim)
                continue
            parent = victim.parent
            del parent.children[victim.key]  # type: ignore[union-attr]
            if parent.parent is None:  # type: ignore[union-attr]
                holders = self.root_child_keys[victim.key]
                del holders[parent]
                if not holders:
                    del self.root_child_keys[victim.key]
                if not parent.children and not parent.lock_ref:  # type: ignore[union-attr]
                    self._drop_bare_root(parent)  # type: ignore[arg-type]
            victim.parent = None
            self.num_nodes -= 1
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                leaves.add(parent)  # type: ignore[arg-type]
        return freed

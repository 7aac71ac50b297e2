"""The one identity memo: cache identity -> root hash, bounded, least recently used dropped first.

A client may send a new cache salt with every request, so nothing here grows per identity: the
memo holds at most ``capacity`` identities, and with each the tenant label (its cache salt) a
new tree root of that identity is given. The engine resolves every request's root through it
(``CacheManager.identity_root``); an identity dropped from the memo hashes to the same root
again when it comes back.
"""

from __future__ import annotations

from collections import OrderedDict

from radixkv.cache.hashing import BlockHasher, CacheIdentity


class IdentityMemo:
    """Bounded LRU of identity roots.

    Args:
        hasher: Computes a root on a memo miss (``identity_root``).
        block_size: B; an identity of another block size is refused.
        capacity: Most identities kept (≥ 1).
    """

    def __init__(self, hasher: BlockHasher, block_size: int, capacity: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self.capacity = capacity
        self._roots: OrderedDict[CacheIdentity, bytes] = OrderedDict()
        self._tenants: dict[bytes, str | None] = {}  # root hash -> cache salt, same entries

    def __len__(self) -> int:
        """Identities memoised."""
        return len(self._roots)

    def root(self, identity: CacheIdentity) -> bytes:
        """The root hash of ``identity``, now the most recently used entry.

        Raises:
            ValueError: naming ``block_size`` if the identity's block size is not the cache's.
        """
        roots = self._roots
        root = roots.get(identity)
        if root is not None:
            roots.move_to_end(identity)
            return root
        if identity.block_size != self.block_size:
            raise ValueError(f"block_size: identity has {identity.block_size}, "
                             f"cache uses {self.block_size}")
        root = self.hasher.identity_root(identity)
        roots[identity] = root
        self._tenants[root] = identity.cache_salt
        if len(roots) > self.capacity:
            self._tenants.pop(roots.popitem(last=False)[1], None)
        return root

    def tenant(self, root: bytes) -> str | None:
        """The cache salt of the memoised identity with root ``root`` (None if not memoised)."""
        return self._tenants.get(root)

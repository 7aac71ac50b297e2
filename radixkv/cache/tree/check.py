"""``check_integrity`` for the radix tree: every structural invariant, verified by a full walk.

Tests call it after every operation; the engine may call it when idle. It is O(tree size) (plus
one hash per block when ``hash_fn`` is given) and changes nothing.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from radixkv.cache.tree.leaves import LeafIndex
from radixkv.cache.tree.node import Node, child_key


class CheckedTree(Protocol):
    """What the check reads of a ``RadixTree`` (which imports this module, not the reverse)."""

    @property
    def block_bytes(self) -> int: ...
    @property
    def roots(self) -> dict[bytes, Node]: ...
    @property
    def root_child_keys(self) -> dict[object, dict[Node, None]]: ...
    @property
    def leaves(self) -> LeafIndex[Node]: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_locked_blocks(self) -> int: ...
    @property
    def num_retained_blocks(self) -> int: ...
    @property
    def retained_blocks_by_tenant(self) -> dict[str | None, int]: ...


def check_tree(tree: CheckedTree, cursors: Iterable[Node] | None = None,
               hash_fn: Callable[[bytes], bytes] | None = None) -> set[int]:
    """Verify structure, lock counts, leaf index, root-key index and counters.

    Args:
        tree: The tree to check.
        cursors: When given, every request cursor (one entry per request); lock counts are
            then checked exactly (``lock_ref`` = cursors here + retention pins here +
            children's ``lock_ref``).
        hash_fn: When given, every stored hash is recomputed from the parent's chain value,
            the block's packed tokens and extras (the chain is intact).

    Returns:
        The set of block ids the tree holds.

    Raises:
        AssertionError: describing the first violated invariant.
    """
    bb = tree.block_bytes
    cursors = list(cursors) if cursors is not None else None
    here: dict[int, int] = {}
    for c in cursors or ():
        here[c.uid] = here.get(c.uid, 0) + 1
    owned: set[int] = set()
    num_nodes = num_blocks = num_locked = num_retained = 0
    retained_by_tenant: dict[str | None, int] = {}
    leaves: set[int] = set()
    root_keys: dict[object, dict[Node, None]] = {}
    for root_hash, root in tree.roots.items():
        assert root.root_hash == root_hash and not root.block_ids and not root.tokens, (
            f"bad root {root!r}")
        for key in root.children:
            root_keys.setdefault(key, {})[root] = None
    assert {k: set(v) for k, v in root_keys.items()} == {
        k: set(v) for k, v in tree.root_child_keys.items()}, "root child-key index disagrees"
    stack = list(tree.roots.values())
    while stack:
        node = stack.pop()
        child_locks = 0
        child_refs: dict[str | None, int] = {}
        for key, child in node.children.items():
            assert child.parent is node, f"{child!r}: parent pointer disagrees"
            assert child.key == key == child_key(bytes(child.tokens[:bb]), child.block_extras(0)), (
                f"{child!r}: key is not its first block")
            assert child.depth_tokens == node.depth_tokens + node.num_tokens, (
                f"{child!r}: depth_tokens should be {node.depth_tokens + node.num_tokens}")
            assert child.tenant == node.tenant, f"{child!r}: tenant differs from its parent's"
            child_locks += child.lock_ref
            for tenant, count in (child.retain_refs or {}).items():
                child_refs[tenant] = child_refs.get(tenant, 0) + count
            stack.append(child)
        assert node.pins >= 0, f"{node!r}: negative pins"
        assert node.lock_ref >= child_locks + node.pins, (
            f"{node!r}: lock below its children's and its retention pins")
        if cursors is not None:
            assert node.lock_ref == child_locks + here.get(node.uid, 0) + node.pins, (
                f"{node!r}: lock_ref != {here.get(node.uid, 0)} cursors + {node.pins} pins + "
                f"{child_locks} below")
        refs = node.retain_refs
        if node.parent is None:
            assert not node.pins and refs is None, f"{node!r}: a root is never pinned"
            continue
        assert refs is None or (refs and all(c > 0 for c in refs.values())), (
            f"{node!r}: empty or non-positive retain_refs {refs}")
        below = sum(child_refs.values())
        assert sum((refs or {}).values()) == below + node.pins, (
            f"{node!r}: retain_refs {refs} != {node.pins} pins + {below} below")
        assert all((refs or {}).get(t, 0) >= c for t, c in child_refs.items()), (
            f"{node!r}: a tenant's retain_refs below its children's")
        num_nodes += 1
        n = node.num_blocks
        assert n >= 1, f"{node!r}: empty non-root node"
        assert len(node.tokens) == n * bb, f"{node!r}: {len(node.tokens)} token bytes for {n} blocks"
        assert node.hash_size > 0 and len(node.hash_bytes) == n * node.hash_size, (
            f"{node!r}: ragged hashes")
        assert node.extras is None or len(node.extras) == n, f"{node!r}: ragged extras"
        if hash_fn is not None:
            h = node.parent.end_hash
            stored = node.hashes
            for j in range(n):
                h = hash_fn(h + bytes(node.tokens[j * bb : (j + 1) * bb]) + node.block_extras(j))
                assert stored[j] == h, f"{node!r}: block {j} hash breaks the chain"
        for block_id in node.block_ids:
            assert block_id not in owned, f"block {block_id} held by two tree positions"
            owned.add(block_id)
        num_blocks += n
        if node.lock_ref > 0:
            num_locked += n
        if refs:
            assert node.lock_ref > 0, f"{node!r}: retained but not locked"
            num_retained += n
            for tenant in refs:
                retained_by_tenant[tenant] = retained_by_tenant.get(tenant, 0) + n
        is_leaf = node.lock_ref == 0 and not node.children
        assert (node.uid in tree.leaves.nodes) == is_leaf, (
            f"{node!r}: evictable-leaf membership should be {is_leaf}")
        assert (node.leaf_entry is not None) == is_leaf, f"{node!r}: stale leaf entry"
        if is_leaf:
            leaves.add(node.uid)
            if tree.leaves.by_priority:
                assert node.leaf_entry == (tree.leaves.ranking.priority(node), node.uid), (
                    f"{node!r}: leaf key is stale")
    for c in cursors or ():
        n2: Node | None = c
        while n2 is not None and n2.parent is not None:
            n2 = n2.parent
        assert n2 is not None and tree.roots.get(n2.root_hash) is n2, f"cursor {c!r} detached"
    assert leaves == set(tree.leaves.nodes), "leaf index holds nodes that are not leaves"
    if tree.leaves.by_priority:
        assert len(tree.leaves.sorted) == len(leaves), "sorted leaf index size disagrees"
    assert num_nodes == tree.num_nodes, f"num_nodes {tree.num_nodes} != {num_nodes}"
    assert num_blocks == tree.num_cached_blocks, (
        f"num_cached_blocks {tree.num_cached_blocks} != {num_blocks}")
    assert num_locked == tree.num_locked_blocks, (
        f"num_locked_blocks {tree.num_locked_blocks} != {num_locked}")
    assert num_retained == tree.num_retained_blocks, (
        f"num_retained_blocks {tree.num_retained_blocks} != {num_retained}")
    assert retained_by_tenant == tree.retained_blocks_by_tenant, (
        f"retained_blocks_by_tenant {tree.retained_blocks_by_tenant} != {retained_by_tenant}")
    return owned

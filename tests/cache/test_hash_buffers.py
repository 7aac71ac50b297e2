"""Chained hashes kept as one buffer per node and per ghost run (``hash_bytes``, ``hash_size``
bytes each): the list views, the per-block reads and ``HashRun`` agree with hashing the chain
again, through inserts, splits and trims."""

from __future__ import annotations

import pytest

from radixkv.cache.hashing import BlockHasher, pack_tokens
from radixkv.cache.tree.node import HashRun, hash_buffer, split_hashes
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import make_policy

B = 4


def chain(root_hash: bytes, tokens: list[int]) -> list[bytes]:
    return BlockHasher().hash_blocks(root_hash, pack_tokens(tokens), B)


def test_node_hash_views_follow_inserts_splits_and_trims() -> None:
    tree = RadixTree(B, make_policy("lru"), clock=lambda: 0.0)
    root_hash = b"r" * 16
    root = tree.root(root_hash)
    tokens = list(range(1, 6 * B + 1))
    want = chain(root_hash, tokens)
    tree.lock(root)
    node = tree.insert(root, tokens, [10, 11, 12, 13, 14, 15], BlockHasher()).node
    assert (node.hash_size, bytes(node.hash_bytes)) == (16, b"".join(want))
    assert node.hashes == want and node.hash_list(4) == want[4:]
    assert [node.block_hash(j) for j in (0, 5, -1, -6)] == [want[0], want[5], want[5], want[0]]
    assert node.end_hash == want[5] and type(node.end_hash) is bytes
    with pytest.raises(IndexError, match="block 6 of a node with 6 blocks"):
        node.block_hash(6)
    # A second request diverging after block 2 splits the node: head blocks 0-1, tail 2-5.
    other = tokens[: 2 * B] + [99] * B
    tree.unlock(node)
    tree.lock(root)
    tree.unlock(tree.insert(root, other, [20, 21, 22], BlockHasher()).node)
    head = node.parent
    assert head.hashes == want[:2] and node.hashes == want[2:] and node.hash_size == 16
    tree.check_integrity(None, BlockHasher().hash_fn)
    # Two blocks off the tail of the tail node (LRU: the first leaf is the older one).
    assert tree.evict(2) == [15, 14]
    assert node.hashes == want[2:4] and node.end_hash == want[3]
    tree.check_integrity(None, BlockHasher().hash_fn)


def test_hash_run_reads_like_a_list_of_hashes() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    run = HashRun(b"".join(hashes), 16)
    assert len(run) == 5 and list(run) == hashes and run == hashes
    assert run[1] == hashes[1] and run[-1] == hashes[4]
    sub = run[1:3]
    assert type(sub) is HashRun and list(sub) == hashes[1:3] and run[4:9] == hashes[4:]
    assert len(run[3:1]) == 0 and not run[3:1]
    assert hash_buffer(sub) == hashes[1] + hashes[2] and hash_buffer(hashes[:2]) == hashes[0] + hashes[1]
    assert split_hashes(b"".join(hashes), 16, 3) == hashes[3:]
    with pytest.raises(IndexError, match="hash 5 of 5"):
        run[5]
    with pytest.raises(ValueError, match="step 1"):
        run[::2]

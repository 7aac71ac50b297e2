"""The eviction path's fast paths (what ``bench tree``'s evict ratio times) make the same choices and
records as the reference path: the tree's one-block and one-slice paths against its trim_tail
path (taken while a store tier's ``trim_hook`` is set), the pool's unchecked ``free_cached``
against its every-block check, the ghost list's entries after re-evictions."""

from __future__ import annotations

import random

import pytest

from radixkv.cache import evict_path
from radixkv.cache.ghost import GhostList
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.pool import BlockPool
from radixkv.cache.tree.node import GhostRun
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import make_policy

B = 4


def make_tree(policy_name: str, seed: int, hook: bool) -> RadixTree:
    """A tree fed a seeded mix of shared prefixes, branches, hits and extended leaves (each
    request's blocks numbered from a counter, so two trees built alike hold the same ids)."""
    now = [0.0]
    tree = RadixTree(B, make_policy(policy_name), clock=lambda: now[0])
    if hook:
        tree.trim_hook = lambda leaf, take: None  # forces the trim_tail path
    rng = random.Random(seed)
    hasher = BlockHasher()
    roots = [tree.root(b"text"), tree.root(b"multimodal")]
    prefixes = [[rng.randrange(50) for _ in range(B * rng.randint(1, 6))] for _ in range(4)]
    next_id = 0
    for step in range(40):
        now[0] = float(step)
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(B * rng.randint(0, 9))]
        if rng.random() < 0.3:
            prefixes.append(prompt)  # a later request extends this one
        num_blocks = len(prompt) // B
        mm = step % 4 == 3  # under the second identity, blocks opening on a multiple of 3
        extras = ([b"img" if prompt[j * B] % 3 == 0 else b"" for j in range(num_blocks)]
                  if mm else None)  # carry an image key
        m = tree.match(roots[mm], prompt + [0], num_blocks, extras=extras)
        tree.lock(m.node)
        node = m.node
        done = len(m.block_ids)
        if num_blocks > done:
            ids = list(range(next_id, next_id + num_blocks - done))
            next_id += num_blocks - done
            node = tree.insert(node, prompt[done * B :], ids, hasher,
                               extras=extras[done:] if mm else None).node
        tree.unlock(node)
    return tree


def records(evicted: list) -> list[tuple]:
    """Ghost-list entries as plain values (the trim_tail path gives plain 4-tuples)."""
    return [(bytes(key), bytes(run.tokens), run.hashes, run.extras, run.note, run.hash_size)
            for key, run in evicted]


@pytest.mark.parametrize("policy_name", ["lru", "fifo", "lfu", "gdsf", "cost"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_paths_match_the_trim_tail_path(policy_name: str, seed: int) -> None:
    fast, ref = make_tree(policy_name, seed, False), make_tree(policy_name, seed, True)
    assert fast.num_cached_blocks == ref.num_cached_blocks > 20
    sizes = random.Random(seed).choices([1, 1, 1, 2, 5, 13], k=200)
    for size in sizes:
        got, want = [], []
        assert fast.evict(size, got) == ref.evict(size, want)
        assert records(got) == records(want)
        assert ({n.uid: list(n.block_ids) for n in fast.iter_nodes()}
                == {n.uid: list(n.block_ids) for n in ref.iter_nodes()})
        fast.check_integrity()
        if not fast.num_cached_blocks:
            break
    assert fast.num_cached_blocks == 0 and fast.evict(1) == []


def test_one_block_path_takes_the_tail_and_records_it() -> None:
    tree = RadixTree(B, make_policy("lru"), clock=lambda: 0.0)
    root = tree.root(b"r" * 16)
    tree.lock(root)
    node = tree.insert(root, list(range(3 * B)), [7, 8, 9], BlockHasher()).node
    tree.unlock(node)
    hashes = list(node.hashes)
    evicted: list = []
    assert tree.evict(1, evicted) == [9]
    # Tokens 8..11, packed uint32-LE, keyed after the hash of the block before them.
    tail = b"".join(t.to_bytes(4, "little") for t in range(2 * B, 3 * B))
    assert evicted == [(hashes[1] + tail, GhostRun(tail, hashes[2], None, None, 16))]
    assert list(node.block_ids) == [7, 8] and node.hashes == hashes[:2]
    assert bytes(node.hash_bytes) == hashes[0] + hashes[1]
    assert bytes(node.tokens) == b"".join(t.to_bytes(4, "little") for t in range(2 * B))
    assert tree.num_cached_blocks == 2
    tree.check_integrity()


def test_free_cached_unchecked_path_checks_the_ends(monkeypatch) -> None:
    monkeypatch.setattr(BlockPool, "check_every_block", False)
    pool = BlockPool(6)
    ids = pool.allocate(5)
    pool.to_cached(ids[:4])  # 0..3 cached, 4 private, 5 free
    with pytest.raises(RuntimeError, match="block 5: expected owned, found free"):
        pool.free_cached([5])
    with pytest.raises(RuntimeError, match="block 5: expected owned, found free"):
        pool.free_cached([1, 5])
    with pytest.raises(RuntimeError, match="5 blocks given, 4 cached"):
        pool.free_cached([3, 2, 1, 0, 4])
    assert (pool.num_free_blocks, pool.num_private_blocks, pool.num_cached_blocks) == (1, 1, 4)
    pool.free_cached([3])
    pool.free_cached([2, 1, 0])
    assert (pool.num_free_blocks, pool.num_private_blocks, pool.num_cached_blocks) == (5, 1, 0)
    assert pool.allocate(5) == [5, 3, 2, 1, 0]  # eviction order, after the never-used block
    pool.check_integrity()


def test_ghost_list_re_evicted_block_replaces_its_entry() -> None:
    ghost = GhostList(100)
    h = [bytes([i]) * 2 for i in range(5)]
    tok = [bytes([10 + i]) * 8 for i in range(5)]
    ghost.add([(h[2] + tok[3], (tok[3], [h[3]], None))])
    ghost.add([(h[1] + tok[2], (tok[2], [h[2]], None))])  # extends the entry in front
    assert len(ghost) == 1 and ghost.num_blocks == 2
    # Block 2 came back and is evicted again alone: its old entry (blocks 2, 3) is replaced.
    ghost.add([(h[1] + tok[2], (tok[2], [h[2]], None))])
    assert len(ghost) == 1 and ghost.num_blocks == 1
    assert ghost.get(h[1] + tok[2]).hashes == [h[2]]
    # The entry still grows in front, and the oldest entries go first beyond the capacity.
    ghost.add([(h[0] + tok[1], (tok[1], [h[1]], None))])
    assert ghost.get(h[0] + tok[1]).hashes == [h[1], h[2]] and ghost.num_blocks == 2
    small = GhostList(2)
    small.add([(h[0] + tok[1], (tok[1], [h[1]], None))])
    small.add([(h[3] + tok[4], (tok[4], [h[4]], None))])
    small.add([(h[2] + tok[3], (tok[3], [h[3]], None))])  # extends the second: 3 blocks held
    assert len(small) == 1 and small.num_blocks == 2
    assert small.get(h[2] + tok[3]).hashes == [h[3], h[4]]


def cached_pool(tree: RadixTree) -> BlockPool:
    """A pool holding every block of ``tree`` as cached (ids 0..n-1 as make_tree numbers them)."""
    ids = sorted(i for n in tree.iter_nodes() for i in n.block_ids)
    pool = BlockPool(ids[-1] + 1)
    pool.to_cached(pool.allocate(ids[-1] + 1))
    pool.free_cached([i for i in range(ids[-1] + 1) if i not in set(ids)])
    return pool


def ghost_state(ghost: GhostList) -> list:
    return [(key, ghost.parts(key)) for key in ghost.keys()] + [sorted(ghost._by_parent.items()),
                                                              ghost.num_blocks]


@pytest.mark.parametrize("policy_name", ["lru", "lfu", "cost"])
@pytest.mark.parametrize("seed", [0, 3])
def test_cache_one_block_path_matches_the_general_path(policy_name: str, seed: int) -> None:
    """``evict_path.evict(…, 1)`` through ``take_tail_block`` / ``free_one_cached`` /
    ``add_block`` leaves the tree, the pool and the ghost list exactly as ``tree.evict`` /
    ``free_cached`` / ``add`` do (``cost`` reports ``on_evict``: never the fast path)."""
    fast, ref = make_tree(policy_name, seed, False), make_tree(policy_name, seed, False)
    ref.take_tail_block = lambda: None  # the general path only
    pools = cached_pool(fast), cached_pool(ref)
    ghosts = GhostList(12), GhostList(12)  # small: entries are forgotten along the way
    real_take, taken = fast.take_tail_block, []
    fast.take_tail_block = lambda: taken.append(real_take()) or taken[-1]
    while fast.num_cached_blocks:
        n = [evict_path.evict(t, p, g, None, 1) for t, p, g in zip((fast, ref), pools, ghosts)]
        assert n == [1, 1]
        assert pools[0].free_block_ids() == pools[1].free_block_ids()
        assert ghost_state(ghosts[0]) == ghost_state(ghosts[1])
        assert ({n.uid: list(n.block_ids) for n in fast.iter_nodes()}
                == {n.uid: list(n.block_ids) for n in ref.iter_nodes()})
    fast.check_integrity()
    pools[0].check_integrity()
    # Every eviction asked; 123 of the 214 / 223 blocks were a text leaf's tail off a longer
    # leaf under a policy that needs no call, so they took the fast path.
    fast_taken = sum(t is not None for t in taken)
    assert (len(taken), fast_taken) == ({0: 214, 3: 223}[seed],
                                        0 if policy_name == "cost" else 123)
    assert pools[0].num_cached_blocks == 0 and evict_path.evict(fast, pools[0], ghosts[0], None,
                                                                1) == 0


def test_take_tail_block_applies_only_where_no_policy_call_is_needed() -> None:
    tree = RadixTree(B, make_policy("lru"), clock=lambda: 0.0)
    root = tree.root(b"r" * 16)
    tree.lock(root)
    node = tree.insert(root, list(range(2 * B)), [3, 4], BlockHasher()).node
    tree.unlock(node)
    hashes = list(node.hashes)
    tail = b"".join(t.to_bytes(4, "little") for t in range(B, 2 * B))
    assert tree.take_tail_block() == (4, hashes[0], tail, hashes[1])
    assert tree.take_tail_block() is None  # a one-block leaf would go whole: evict() does it
    assert tree.num_cached_blocks == 1 and list(node.block_ids) == [3]
    tree.trim_hook = lambda leaf, take: None
    tree.lock(node)
    grown = tree.insert(node, list(range(B, 3 * B)), [5, 6], BlockHasher()).node
    tree.unlock(grown)
    assert tree.take_tail_block() is None  # a store tier must see every trim
    tree.trim_hook = None
    assert tree.take_tail_block()[0] == 6
    for name in ("cost", "gdsf", "predicted-reuse"):  # they key or hear every trim
        other = RadixTree(B, make_policy(name), clock=lambda: 0.0)
        r = other.root(b"r" * 16)
        other.lock(r)
        other.unlock(other.insert(r, list(range(2 * B)), [3, 4], BlockHasher()).node)
        assert other.take_tail_block() is None and other.num_cached_blocks == 2


def test_ghost_add_block_is_add_of_one_block() -> None:
    h = [bytes([i]) * 2 for i in range(5)]
    tok = [bytearray([10 + i]) * 8 for i in range(5)]
    steps = [(2, 3), (1, 2), (1, 2), (0, 1), (3, 4), (2, 3)]  # parent, block
    for capacity in (100, 2):
        one, ref = GhostList(capacity), GhostList(capacity)
        for parent, block in steps:
            one.add_block(h[parent], tok[block], h[block])
            ref.add([(h[parent] + tok[block], (tok[block], [h[block]], None, None))])
            assert ghost_state(one) == ghost_state(ref)

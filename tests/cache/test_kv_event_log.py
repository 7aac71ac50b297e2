"""The cache's KV event log (``radixkv.cache.events``): exact stored / removed / cleared events,
what is never published (salted identities, multimodal blocks), and a subscriber replaying the
events always holding exactly the published blocks the tree holds."""

from __future__ import annotations

import itertools
import random

import pytest

from radixkv.cache.events import KVEventLog, decode_event, event_block_id
from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager

B = 4
ROPE = "theta=100000.0;scaling=None"


def make(num_blocks: int = 16) -> CacheManager:
    ticks = itertools.count()
    cm = CacheManager(num_blocks, B, clock=lambda: float(next(ticks)))
    cm.events = KVEventLog(B)
    return cm


def drained(cm: CacheManager) -> list[tuple]:
    """The pending events with event ids and token ids (as the publisher sends them)."""
    return [decode_event(e) for e in cm.events.drain()]


def root_of(cm: CacheManager, salt: str | None = None, adapter: tuple[str, str] | None = None) -> bytes:
    return cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt=salt, adapter=adapter))


def run(cm: CacheManager, root: bytes, rid: str, tokens: list[int], *, release: bool = True) -> int:
    m = cm.begin(rid, root, tokens)
    assert cm.allocate(rid, len(tokens))
    cm.publish(rid, tokens, len(tokens))
    if release:
        cm.release(rid)
    cm.check_integrity()
    return m


def ids_of(cm: CacheManager, root: bytes, tokens: list[int]) -> list[int]:
    """Event ids of the tree's blocks along ``tokens`` under ``root`` (walking the nodes)."""
    node, out, pos = cm.tree.roots[root], [], 0
    while pos < len(tokens) // B * B:
        key_bytes = b"".join(t.to_bytes(4, "little") for t in tokens[pos:pos + B])
        node = node.children[key_bytes]
        out += [event_block_id(h) for h in node.hashes]
        pos += node.num_blocks * B
    return out


def test_stored_runs_are_exact_and_chain_through_parents() -> None:
    cm = make()
    root = root_of(cm)
    first = list(range(1, 11))  # 2 full blocks + a partial tail (never published)
    run(cm, root, "a", first)
    ids = ids_of(cm, root, first)
    assert drained(cm) == [("stored", ids, None, list(range(1, 9)), None, "GPU")]
    # Diverging after block 1: the node is split; the new run's parent is block 0.
    second = [1, 2, 3, 4, 50, 51, 52, 53, 54, 55, 56, 57]
    run(cm, root, "b", second)
    new_ids = ids_of(cm, root, second)
    assert new_ids[0] == ids[0] and new_ids[1] != ids[1]
    assert drained(cm) == [("stored", new_ids[1:], ids[0], list(range(50, 58)), None, "GPU")]
    # Extending a cached prefix (the fast path: a request's own leaf) chains on its last block.
    cm.begin("c", root, second + [60, 61, 62, 63])
    assert cm.allocate("c", 16)
    cm.publish("c", second + [60, 61, 62, 63], 16)
    last = ids_of(cm, root, second + [60, 61, 62, 63])
    assert drained(cm) == [("stored", last[3:], new_ids[2], [60, 61, 62, 63], None, "GPU")]
    cm.release("c")
    # Blocks already in the tree are not stored again.
    run(cm, root, "d", first)
    assert drained(cm) == []
    assert cm.events.num_published_blocks == 5


def test_salted_identities_are_never_published_and_adapters_carry_lora_name() -> None:
    cm = make()
    run(cm, root_of(cm, salt="tenant:a"), "s", list(range(1, 9)))
    run(cm, root_of(cm, salt=""), "e", list(range(1, 9)))  # "" is a salt too
    assert drained(cm) == []
    lora_root = root_of(cm, adapter=("sql", "d1"))
    run(cm, lora_root, "l", list(range(1, 5)))
    (event,) = drained(cm)
    assert event[0] == "stored" and event[2:] == (None, [1, 2, 3, 4], "sql", "GPU")
    # Evicting salted blocks publishes nothing; the adapter's block is removed.
    assert cm.evict(16) == 5
    assert drained(cm) == [("removed", event[1], "GPU")]


def test_evictions_publish_removed_for_exactly_the_dropped_blocks() -> None:
    cm = make(num_blocks=6)
    root = root_of(cm)
    a = list(range(100, 116))  # 4 blocks
    run(cm, root, "a", a)
    a_ids = ids_of(cm, root, a)
    drained(cm)
    run(cm, root, "b", list(range(200, 212)))  # needs 3 blocks: 2 free, so a's tail goes
    events = drained(cm)
    assert events[0] == ("removed", [a_ids[3]], "GPU")
    assert events[1][0] == "stored" and events[1][2] is None


def test_reset_publishes_one_cleared_then_the_blocks_still_held() -> None:
    cm = make()
    root = root_of(cm)
    run(cm, root, "a", list(range(1, 9)))
    held = list(range(20, 29))
    run(cm, root, "h", held, release=False)  # a running request holds 2 published blocks
    held_ids = ids_of(cm, root, held)
    drained(cm)
    assert cm.reset_prefix_cache() == 2
    assert drained(cm) == [("cleared",), ("stored", held_ids, None, list(range(20, 28)), None, "GPU")]
    assert cm.events.num_published_blocks == 2
    cm.release("h")
    cm.check_integrity()


def test_multimodal_blocks_and_their_descendants_are_not_published() -> None:
    cm = make()
    root = root_of(cm)
    tokens = list(range(1, 13))
    cm.begin("m", root, tokens, mm_items=[(4, 4, b"\x01" * 16)])  # an image in block 1
    assert cm.allocate("m", 12)
    cm.publish("m", tokens, 12)
    cm.release("m")
    (event,) = drained(cm)  # block 0 only: block 1 has extras, block 2 chains on it
    assert event == ("stored", ids_of(cm, root, tokens)[:1], None, [1, 2, 3, 4], None, "GPU")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_subscriber_replaying_the_events_holds_exactly_the_published_tree(seed: int) -> None:
    """Random requests over shared prefixes under pressure (evictions, splits, duplicates,
    held requests, resets): a router-like index fed only by the events equals, after every
    operation, the set of (block id, parent id) of every unsalted block in the tree."""
    rng = random.Random(seed)
    cm = make(num_blocks=24)
    roots = [root_of(cm), root_of(cm, salt="t"), root_of(cm, adapter=("x", "d"))]
    index: dict[int, int | None] = {}
    running: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.05:
            cm.reset_prefix_cache()
        elif op < 0.25 and running:
            cm.release(running.pop(rng.randrange(len(running))))
        else:
            root = rng.choice(roots)
            stem = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            tokens = stem + [rng.randrange(30) for _ in range(rng.randrange(1, 14))]
            rid = f"r{step}"
            cm.begin(rid, root, tokens)
            if not cm.allocate(rid, len(tokens)):
                cm.release(rid)
            else:
                cm.publish(rid, tokens, len(tokens))
                running.append(rid)
                if len(running) > 3:
                    cm.release(running.pop(0))
        for event in drained(cm):
            if event[0] == "cleared":
                index.clear()
            elif event[0] == "removed":
                for i in event[1]:
                    del index[i]
            else:
                parent = event[2]
                assert parent is None or parent in index
                for i in event[1]:
                    index[i], parent = parent, i
        cm.check_integrity()
        expected: dict[int, int | None] = {}
        for node in cm.tree.iter_nodes():
            top = node
            while top.parent.parent is not None:
                top = top.parent
            if top.parent.root_hash == roots[1]:
                continue
            parent = (event_block_id(node.parent.hashes[-1])
                      if node.parent.parent is not None else None)
            for h in node.hashes:
                expected[event_block_id(h)], parent = parent, event_block_id(h)
        assert index == expected, f"step {step}"

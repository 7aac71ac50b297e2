"""Per-node history the cache keeps for learned policies: session key, end of the
latest request holding the node, gaps between its accesses, most children, and the ghost
list's "forgotten without coming back" labels (``on_ghost_drop``)."""

from __future__ import annotations

import pytest

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.cache.tree.node import MAX_ACCESS_GAPS
from radixkv.eviction.cost_aware import CostAwarePolicy
from radixkv.eviction.cost_model import CostShape

B = 4
TINY = CostShape("tiny", num_layers=1, hidden_size=1, intermediate_size=1, num_q_heads=1,
                 num_kv_heads=1, head_dim=1)


class Cache:
    """A CacheManager on a settable clock, serving whole requests."""

    def __init__(self, num_blocks: int = 32, **kwargs) -> None:
        self.now = [0.0]
        self.cm = CacheManager(num_blocks, B, clock=lambda: self.now[0], **kwargs)
        self.root = self.cm.identity_root(CacheIdentity("rev", B, "float32", "rope"))

    def serve(self, t: float, tokens: list[int], *, session_key: str | None = None,
              end_s: float | None = None, rid: str = "r", release: bool = True) -> None:
        self.now[0] = t
        prompt = tokens + [0]
        self.cm.begin(rid, self.root, prompt, session_key=session_key)
        assert self.cm.allocate(rid, len(prompt))
        self.cm.publish(rid, prompt, len(prompt))
        if release:
            self.cm.release(rid, end_s=end_s)

    def nodes(self) -> dict[tuple[int, ...], object]:
        """Nodes by the first token of each of their blocks."""
        return {tuple(b[0] for b in n.blocks): n for n in self.cm.tree.iter_nodes()}


def test_access_gaps_keep_the_last_four_newest_last() -> None:
    c = Cache()
    c.serve(1.0, [1] * 8)  # inserted at 1
    node = c.nodes()[1, 1]
    assert node.access_gaps == () and node.hit_count == 0
    for t in (3.0, 4.0, 10.0, 11.0):
        c.serve(t, [1] * 8)
    assert node.access_gaps == (2.0, 1.0, 6.0, 1.0) and node.hit_count == 4
    c.serve(20.0, [1] * 8)
    assert MAX_ACCESS_GAPS == 4
    assert node.access_gaps == (1.0, 6.0, 1.0, 9.0) and node.last_hit_s == 20.0


def test_a_request_never_admitted_records_no_gap() -> None:
    c = Cache()
    c.serve(1.0, [1] * 8)
    c.now[0] = 5.0
    c.cm.begin("w", c.root, [1] * 8 + [0])  # looked up, released before any allocation
    c.cm.release("w")
    assert c.nodes()[1, 1].access_gaps == () and c.nodes()[1, 1].hit_count == 0


def test_split_copies_history_to_both_halves() -> None:
    c = Cache()
    c.serve(1.0, [1] * 4 + [5] * 4, session_key="s1", end_s=2.5)
    c.serve(4.0, [1] * 4 + [5] * 4, session_key="s1", end_s=6.0)  # a hit: gap 3
    c.serve(7.0, [1] * 4 + [2] * 4, session_key="s2")  # splits it after its first block
    nodes = c.nodes()
    head, tail, new = nodes[(1,)], nodes[(5,)], nodes[(2,)]
    assert tail.parent is head and new.parent is head
    assert tail.access_gaps == (3.0,) and tail.request_end_s == 6.0 and tail.session_key == "s1"
    # The head was hit at 7 after the split (gap 3 more) by s2, whose request ended at 7.
    assert head.access_gaps == (3.0, 3.0) and head.session_key == "s2"
    assert head.request_end_s == 7.0 and new.request_end_s == 7.0
    assert (head.max_children, tail.max_children, new.max_children) == (2, 0, 0)


def test_max_children_is_the_most_ever() -> None:
    c = Cache()
    for i in range(3):  # a trunk [1]*4 with leaves [10], [11], [12] (the first one split off)
        c.serve(1.0 + i, [1] * 4 + [10 + i] * 4)
    trunk = c.nodes()[(1,)]
    assert trunk.max_children == 3 and len(trunk.children) == 3
    assert c.cm.tree.roots[c.root].max_children == 1
    assert c.cm.evict(2) == 2  # LRU: the two oldest leaves
    assert c.nodes().keys() == {(1,), (12,)} and trunk.max_children == 3


def test_session_key_follows_the_latest_request_to_publish_or_hit() -> None:
    c = Cache()
    c.serve(1.0, [1] * 8, session_key="alice")
    node = c.nodes()[1, 1]
    assert node.session_key == "alice"
    c.serve(2.0, [1] * 8, session_key="bob")  # a hit only
    assert node.session_key == "bob"
    c.serve(3.0, [1] * 8 + [2] * 4, session_key="carol")  # grows the leaf: published into
    assert c.nodes()[1, 1, 2] is node and node.session_key == "carol"
    c.serve(4.0, [1] * 8)  # a request without a hint: splits the node before the [2] block
    head = c.nodes()[1, 1]
    assert node.blocks == [(2,) * 4] and head.session_key is None and node.session_key == "carol"


def test_release_stamps_the_end_on_the_whole_held_path() -> None:
    c = Cache()
    c.serve(1.0, [1] * 8)
    c.serve(2.0, [1] * 8 + [2] * 4, rid="a", release=False)  # grows the leaf in place
    c.serve(2.0, [1] * 4 + [3] * 4, rid="b", release=False)  # splits: head [1]*4
    nodes = c.nodes()
    head, tail, new = nodes[(1,)], nodes[(1, 2)], nodes[(3,)]
    assert (head.request_end_s, tail.request_end_s, new.request_end_s) == (1.0, 1.0, None)
    c.now[0] = 9.0
    c.cm.release("b", end_s=8.5)  # a replay's modelled end
    assert (head.request_end_s, new.request_end_s, tail.request_end_s) == (8.5, 8.5, 1.0)
    c.cm.release("a")  # the cache clock
    assert (head.request_end_s, tail.request_end_s) == (9.0, 9.0)
    assert c.cm.tree.roots[c.root].request_end_s is None  # roots are not stamped


def test_ghost_drop_labels_runs_forgotten_without_coming_back(monkeypatch) -> None:
    """Capacity 2 blocks: P1's run is forgotten when P2's is evicted (label P1's note); P2
    comes back (its note goes to on_ghost_hit), so when P3's eviction pushes P2's entry out
    no label is given for it."""
    dropped: list = []
    monkeypatch.setattr(CostAwarePolicy, "on_ghost_drop",
                        lambda self, notes: dropped.append(list(notes)), raising=False)
    c = Cache(num_blocks=16, eviction_policy="cost", model_shape=TINY, ghost_capacity=2)
    cm = c.cm
    c.serve(1.0, [1] * 8)
    assert cm.evict(2) == 2 and dropped == []
    (run1,) = cm.ghost.parts(cm.ghost.keys()[0])
    assert run1.note == (0, 1.0)  # (reuses, last access) of P1
    c.serve(2.0, [2] * 8)
    assert cm.evict(2) == 2
    assert dropped == [[(0, 1.0)]] and len(cm.ghost) == 1
    c.serve(3.0, [2] * 8)  # P2 comes back from the ghost list (whole run: its note is used)
    assert cm.tree.num_cached_blocks == 2 and len(cm.ghost._noted) == 0
    c.serve(4.0, [3] * 8)
    assert cm.evict(2) == 2  # P2 goes again (last access 3 < 4): its entry is replaced
    assert c.nodes().keys() == {(3, 3)}
    assert dropped == [[(0, 1.0)]]  # nothing for P2's first run: it came back
    (run2,) = cm.ghost.parts(cm.ghost.keys()[0])
    assert run2.note == (1, 3.0)  # P2 again, one reuse inherited from its first run
    c.serve(5.0, [4] * 8)
    assert cm.evict(2) == 2  # P3 goes; P2's second run is forgotten without coming back
    assert dropped == [[(0, 1.0)], [(1, 3.0)]]


@pytest.mark.parametrize("policy_name", ["lru", "s3fifo"])
def test_no_drop_hook_for_policies_without_notes(policy_name: str) -> None:
    c = Cache(num_blocks=16, eviction_policy=policy_name, ghost_capacity=2)
    assert c.cm.ghost.on_drop is None
    for i in range(3):
        c.serve(float(i), [5 + i] * 8)
        assert c.cm.evict(2) == 2
    assert len(c.cm.ghost) == 1 and c.cm.ghost._noted == {}

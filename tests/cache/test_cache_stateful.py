"""Stateful property test of CacheManager against a plain-Python reference model.

The machine plays the engine over a tiny pool (10 blocks of B=2): it writes each computed
token's "K/V" into the block the block table names (the value is everything the real K/V
depends on: identity, the token prefix, the images so far), forks running requests and copies
the tail as told, finishes or cancels requests (also inside a step, where freeing is deferred),
evicts, and switches identities (two cache salts, two images). The reference model keeps the
cached set as ``{(identity, block-content prefix): block id}`` and the content of every block.

After every step it checks that the manager agrees with the model:

* a lookup returns exactly the longest cached prefix (capped at floor((N-1)/B)*B) and every
  matched block holds *this* request's K/V (never another identity's, image's or prompt's);
* only private blocks are written; a block freed inside a step is not handed out before
  ``end_step``; an allocation that fails changes nothing;
* the tree holds exactly the model's cached set, which stays prefix-closed; evictions free
  exactly the blocks needed and never a held one;
* ``check_integrity`` (with the hash chain recomputed) passes and the gauges add up.

At least 10,000 steps run in CI (``test_machine_runs_enough_steps``), over three policies and
with a deliberately colliding hash.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager

B = 2
NUM_BLOCKS = 10
MAX_ACTIVE = 4
ALPHABET = st.integers(min_value=1, max_value=3)
#: image digest -> its placeholder length (the digest fixes the image, hence its token count)
IMAGES = {b"img-one": 2, b"img-two": 3}
STEPS = {"count": 0}


class CacheMachine(RuleBasedStateMachine):
    hash_fn = None  # None: production xxh3-128
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        ticks = itertools.count()
        self.cm = CacheManager(NUM_BLOCKS, B, clock=lambda: float(next(ticks)),
                               hash_fn=self.hash_fn, eviction_policy=self.policy)
        self.roots = [self.cm.identity_root(CacheIdentity("r1", B, "float32", "rope", cache_salt=s))
                      for s in (None, "t")]
        self.written: dict[int, tuple] = {}  # block id -> K/V content of each written slot
        self.cached: dict[tuple, int] = {}  # (root index, content prefix) -> block id
        self.reqs: dict[str, dict] = {}
        self.ids = itertools.count()
        self.in_step = False
        self.deferred: set[int] = set()
        self.checked_initial_state = False

    # ---- model helpers ------------------------------------------------------------------
    @staticmethod
    def kv(req: dict, pos: int) -> tuple:
        """What the K/V at ``pos`` depends on: identity, token prefix, images started so far."""
        images = tuple(item for item in req["mm"] if item[0] <= pos)
        return (req["root"], tuple(req["tokens"][: pos + 1]), images)

    def block_key(self, req: dict, k: int) -> tuple:
        """Model key of the request's first ``k`` blocks."""
        return (req["root"], tuple(self.kv(req, p) for p in range(k * B)))

    def model_hit(self, req: dict) -> int:
        cap = (len(req["tokens"]) - 1) // B
        k = 0
        while k < cap and self.block_key(req, k + 1) in self.cached:
            k += 1
        return k * B

    def tree_set(self) -> dict[tuple, int]:
        """The tree's cached set, walked independently of the manager's bookkeeping."""
        out: dict[tuple, int] = {}
        for node in self.cm.tree.iter_nodes():
            chain = []
            n = node
            while n.parent is not None:
                chain[:0] = list(zip(n.blocks, n.block_ids))
                n = n.parent
            root = self.roots.index(n.root_hash)
            for tokens, block_id in chain:  # the tree's tokens are what was written there
                assert tuple(kv[1][-1] for kv in self.written[block_id]) == tokens
            contents = [kv for _, block_id in chain for kv in self.written[block_id]]
            for k in range(len(chain) - len(node.block_ids), len(chain)):
                out[(root, tuple(contents[: (k + 1) * B]))] = chain[k][1]
        return out

    def sync_evictions(self) -> None:
        """Drop model entries whose block the manager evicted (checked by the invariants)."""
        states = self.cm.block_states()
        for key, block_id in list(self.cached.items()):
            if not states[block_id].startswith("cached"):  # evicted (maybe reallocated since)
                del self.cached[key]
        # Prefix-closed: every cached prefix's parent is cached.
        for root, prefix in self.cached:
            assert len(prefix) == B or (root, prefix[:-B]) in self.cached, "cached set has a hole"

    # ---- rules --------------------------------------------------------------------------
    @precondition(lambda self: len(self.reqs) < MAX_ACTIVE)
    @rule(data=st.data(), tail=st.lists(ALPHABET, min_size=1, max_size=8),
          which=st.integers(0, 1), image=st.sampled_from([None, *IMAGES]),
          gen=st.integers(0, 4), admit=st.booleans())
    def begin(self, data, tail, which, image, gen, admit) -> None:
        """A new request, often re-sending part of a cached prefix or an active sequence."""
        sources = [()] + [tuple(r["tokens"]) for r in self.reqs.values()]
        sources += [tuple(kv[-1][1]) for (_, kv) in self.cached]
        base = data.draw(st.sampled_from(sources))
        prompt = list(base[: data.draw(st.integers(len(base) // 2, len(base)))]) + tail
        mm = ()
        if image is not None and len(prompt) >= IMAGES[image]:
            offset = data.draw(st.integers(0, len(prompt) - IMAGES[image]))
            mm = ((offset, IMAGES[image], image),)
        rid = f"r{next(self.ids)}"
        req = {"root": which, "tokens": prompt, "mm": mm, "gen_left": gen, "prompt_len": len(prompt)}
        expected = self.model_hit(req)
        assert self.cm.peek(self.roots[which], prompt, mm_items=mm) == expected
        m = self.cm.begin(rid, self.roots[which], prompt, mm_items=mm)
        assert m == expected
        table = self.cm.block_table(rid)
        assert len(table) == m // B
        for pos in range(m):  # every matched block holds this request's K/V
            assert self.written[table[pos // B]][pos % B] == self.kv(req, pos)
        assert sum(self.cm.miss_breakdown(rid).values()) == len(prompt) - m
        if admit:
            self.cm.record_admission(rid)
        req["computed"] = m
        self.reqs[rid] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 5), sampled=ALPHABET)
    def compute(self, data, chunk, sampled) -> None:
        """Allocate, write the K/V of a chunk, publish; sample a token at the end."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        tokens, start = req["tokens"], req["computed"]
        end = min(start + chunk, len(tokens))
        if end > start:
            before = (self.cm.block_states(), self.cm.block_table(rid), self.cm.evicted_blocks_total)
            free_before = self.cm.num_free_blocks
            need = -(-end // B) - len(before[1])
            if not self.cm.allocate(rid, end):
                assert need > free_before + self.cm.num_cached_evictable_blocks
                assert (self.cm.block_states(), self.cm.block_table(rid),
                        self.cm.evicted_blocks_total) == before
                return
            evicted = self.cm.evicted_blocks_total - before[2]
            assert evicted == max(0, need - free_before)
            for block_id, state in enumerate(before[0]):
                if state == "cached_locked" or state == "private":
                    assert self.cm.block_states()[block_id] == state, "a held block was evicted"
            self.sync_evictions()
            table = self.cm.block_table(rid)
            assert not set(table[len(before[1]):]) & self.deferred, "deferred block handed out"
            states = self.cm.block_states()
            for pos in range(start, end):
                block_id = table[pos // B]
                assert states[block_id] == "private", f"write into a {states[block_id]} block"
                slots = list(self.written.get(block_id, ()))[: pos % B]
                self.written[block_id] = tuple(slots) + (self.kv(req, pos),)
            req["computed"] = end
            self.cm.publish(rid, tokens, end)
            for k in range(1, end // B + 1):
                self.cached.setdefault(self.block_key(req, k), table[k - 1])
        if req["computed"] == len(tokens) and req["gen_left"] > 0:
            tokens.append(sampled)  # its K/V is computed by a later step
            req["gen_left"] -= 1

    @precondition(lambda self: self.reqs and len(self.reqs) < MAX_ACTIVE)
    @rule(data=st.data(), gen=st.integers(0, 3))
    def fork(self, data, gen) -> None:
        """n > 1: the child shares the parent's full blocks and gets a copy of its tail."""
        parent_id = data.draw(st.sampled_from(sorted(self.reqs)))
        parent = self.reqs[parent_id]
        computed = parent["computed"]
        parent_table = self.cm.block_table(parent_id)
        rid = f"r{next(self.ids)}"
        copies = self.cm.fork(parent_id, rid)
        if copies is None:
            assert computed % B and self.cm.num_free_blocks + self.cm.num_cached_evictable_blocks == 0
            return
        self.sync_evictions()
        child_table = self.cm.block_table(rid)
        assert child_table[: computed // B] == parent_table[: computed // B]
        if computed % B:
            assert copies == [(parent_table[computed // B], child_table[-1])]
            assert child_table[-1] not in self.deferred
            src, dst = copies[0]
            self.written[dst] = self.written[src][: computed % B]
        else:
            assert copies == [] and len(child_table) == computed // B
        self.reqs[rid] = {**parent, "tokens": parent["tokens"][: max(computed, 1)],
                          "gen_left": gen}
        if computed == 0:
            self.reqs[rid]["tokens"] = list(parent["tokens"][: parent["prompt_len"]])
        else:
            self.reqs[rid]["tokens"] = list(parent["tokens"][:computed])
            self.reqs[rid]["tokens"].append(4)  # the child samples its own next token

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data) -> None:
        """Finish or cancel a request in any phase (inside a step its blocks are deferred)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        states = self.cm.block_states()
        private = {b for b in self.cm.block_table(rid) if states[b] == "private"}
        still_held = {b for r in self.reqs if r != rid for b in self.cm.block_table(r)}
        self.cm.release(rid)
        del self.reqs[rid]
        if self.in_step:  # the step may still write them: not free before end_step
            self.deferred |= private - still_held

    @precondition(lambda self: not self.in_step)
    @rule()
    def begin_step(self) -> None:
        self.cm.begin_step()
        self.in_step = True

    @precondition(lambda self: self.in_step)
    @rule()
    def end_step(self) -> None:
        assert self.cm.num_deferred_blocks == len(self.deferred)
        free_before = self.cm.num_free_blocks
        assert self.cm.end_step() == len(self.deferred)
        assert self.cm.num_free_blocks == free_before + len(self.deferred)
        self.in_step = False
        self.deferred = set()

    @rule(num=st.integers(1, 4))
    def evict(self, num) -> None:
        evictable = self.cm.num_cached_evictable_blocks
        states = self.cm.block_states()
        assert self.cm.evict(num) == min(num, evictable)
        for block_id, state in enumerate(states):
            if state != "cached_evictable":
                assert self.cm.block_states()[block_id] == state
        self.sync_evictions()

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        if self.checked_initial_state:
            STEPS["count"] += 1  # one rule step done (and checked)
        self.checked_initial_state = True
        cm = self.cm
        cm.check_integrity(verify_hashes=True)
        assert self.tree_set() == self.cached
        states = cm.block_states()
        assert states.count("free") == cm.num_free_blocks
        assert states.count("cached_evictable") == cm.num_cached_evictable_blocks
        assert states.count("cached_locked") + states.count("private") == cm.num_in_use_blocks
        for block_id in self.deferred:
            assert states[block_id] == "private" and cm.pool.ref_count(block_id) == 0
        if not self.reqs:
            assert cm.num_in_use_blocks == len(self.deferred)


class CollidingHashMachine(CacheMachine):
    """A colliding H (sum of bytes mod 7): tokens decide, never hashes."""

    hash_fn = staticmethod(lambda data: bytes([sum(data) % 7]))


class LFUMachine(CacheMachine):
    policy = "lfu"


class FIFOMachine(CacheMachine):
    policy = "fifo"


_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))
_MACHINES = [(CacheMachine, 200), (CollidingHashMachine, 100), (LFUMachine, 50), (FIFOMachine, 50)]


def test_machine_runs_enough_steps() -> None:
    """400 examples x up to 50 steps: at least 10,000 rule steps, every invariant holds."""
    STEPS["count"] = 0
    for machine, examples in _MACHINES:
        run_state_machine_as_test(machine, settings=settings(_SETTINGS, max_examples=examples))
    assert STEPS["count"] >= 10_000, STEPS["count"]

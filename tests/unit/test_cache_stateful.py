"""Stateful property test of CacheManager against an independent content model.

The model plays the engine: it writes each computed token's "K/V" (here: the token itself) into
the physical block the block table names, and checks that

* begin's hit equals the longest cached block-prefix (found by walking the tree independently)
  capped at floor((N-1)/B)*B, and every matched block *holds* the prompt's tokens;
* only private blocks are ever written (a published block is never modified);
* every tree block holds exactly the tokens its node says;
* ``check_integrity`` passes and the gauges add up after every step.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.cache_manager import CacheManager
from radixkv.hashing import CacheIdentity

B = 2
NUM_BLOCKS = 10
ALPHABET = st.integers(min_value=1, max_value=3)


class CacheMachine(RuleBasedStateMachine):
    hash_fn = None  # None: production xxh3-128

    def __init__(self) -> None:
        super().__init__()
        ticks = itertools.count()
        self.cm = CacheManager(NUM_BLOCKS, B, clock=lambda: float(next(ticks)),
                               hash_fn=self.hash_fn)
        self.roots = [self.cm.identity_root(CacheIdentity("r1", B, "float32", "rope", cache_salt=s))
                      for s in (None, "t")]
        self.written: dict[int, tuple[int, ...]] = {}  # block id -> tokens written into it
        self.reqs: dict[str, dict] = {}
        self.ids = itertools.count()

    def cached_prefixes(self, root: bytes) -> set[tuple[int, ...]]:
        """Every token prefix (whole blocks) the tree holds under ``root``, by a fresh walk."""
        out: set[tuple[int, ...]] = set()
        start = self.cm.tree.roots.get(root)
        stack = [(start, ())] if start is not None else []
        while stack:
            node, prefix = stack.pop()
            for tokens in node.blocks:
                prefix = prefix + tokens
                out.add(prefix)
            stack.extend((child, prefix) for child in node.children.values())
        return out

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(prompt=st.lists(ALPHABET, min_size=1, max_size=10), which=st.integers(0, 1),
          gen=st.integers(0, 4))
    def begin(self, prompt: list[int], which: int, gen: int) -> None:
        self._begin(prompt, which, gen)

    @precondition(lambda self: len(self.reqs) < 4 and (self.reqs or self.cm.num_cached_blocks))
    @rule(data=st.data(), tail=st.lists(ALPHABET, max_size=4), which=st.integers(0, 1),
          gen=st.integers(0, 4))
    def begin_shared(self, data: st.DataObject, tail: list[int], which: int, gen: int) -> None:
        """Re-send (part of) an active sequence or a cached prefix, as agent turns do."""
        sources = sorted(self.cached_prefixes(self.roots[which])) + [
            tuple(r["tokens"]) for r in self.reqs.values()] or [()]
        base = data.draw(st.sampled_from(sources))
        cut = data.draw(st.integers(len(base) // 2, len(base)))
        prompt = list(base[:cut]) + tail
        if prompt:
            self._begin(prompt, which, gen)

    def _begin(self, prompt: list[int], which: int, gen: int) -> None:
        root = self.roots[which]
        prefixes = self.cached_prefixes(root)
        cap_blocks = (len(prompt) - 1) // B
        expected = 0
        for k in range(1, cap_blocks + 1):
            if tuple(prompt[: k * B]) not in prefixes:
                break
            expected = k * B
        rid = f"r{next(self.ids)}"
        m = self.cm.begin(rid, root, prompt)
        assert m == expected
        table = self.cm.block_table(rid)
        assert len(table) == m // B
        for i, block_id in enumerate(table):
            assert self.written[block_id] == tuple(prompt[i * B : (i + 1) * B])
        self.reqs[rid] = {"tokens": list(prompt), "computed": m, "gen_left": gen}

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 5), sampled=ALPHABET)
    def step(self, data: st.DataObject, chunk: int, sampled: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        tokens = req["tokens"]
        start = req["computed"]
        end = min(start + chunk, len(tokens))
        if end > start:
            before = (self.cm.block_states(), self.cm.block_table(rid), self.cm.evicted_blocks_total)
            if not self.cm.allocate(rid, end):
                assert (self.cm.block_states(), self.cm.block_table(rid),
                        self.cm.evicted_blocks_total) == before
                return
            table = self.cm.block_table(rid)
            states = self.cm.block_states()
            for pos in range(start // B, (end - 1) // B + 1):
                block_id = table[pos]
                assert states[block_id] == "private", f"write into {states[block_id]} block"
                self.written[block_id] = tuple(tokens[pos * B : min((pos + 1) * B, end)])
            req["computed"] = end
            self.cm.publish(rid, tokens, end)
        if req["computed"] == len(tokens) and req["gen_left"] > 0:
            tokens.append(sampled)  # its K/V is computed by a later step
            req["gen_left"] -= 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.cm.release(rid)
        del self.reqs[rid]

    @invariant()
    def consistent(self) -> None:
        cm = self.cm
        cm.check_integrity()
        for node in cm.tree.iter_nodes():
            for tokens, block_id in zip(node.blocks, node.block_ids):
                assert self.written[block_id] == tokens
        states = cm.block_states()
        assert states.count("free") == cm.num_free_blocks
        assert states.count("cached_evictable") == cm.num_cached_evictable_blocks
        assert states.count("cached_locked") + states.count("private") == cm.num_in_use_blocks
        if not self.reqs:
            assert cm.num_in_use_blocks == 0


class CollidingHashMachine(CacheMachine):
    """Same properties with C01's colliding H (sum of bytes mod 7): tokens decide, not hashes."""

    hash_fn = staticmethod(lambda data: bytes([sum(data) % 7]))


_SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = _SETTINGS
TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = settings(_SETTINGS, max_examples=60)

"""``PrefixMemory``: the longest remembered prefix wins, scopes stay apart, every bound holds;
``tokenize_with_memory`` falls back to plain encoding when the join would change the text."""

from __future__ import annotations

import asyncio

import pytest

from radixkv.server.prefix_memory import PrefixMemory, tokenize_with_memory


def test_longest_remembered_prefix_wins_and_only_prefixes_match():
    mem = PrefixMemory()
    mem.record("s", "Hello", [1, 2])
    mem.record("s", "Hello world", [1, 2, 3])
    mem.record("s", "Hello world, and more", [1, 2, 3, 4, 5])
    assert mem.longest_prefix("s", "Hello world, and more text") == (21, [1, 2, 3, 4, 5])
    assert mem.longest_prefix("s", "Hello world!") == (11, [1, 2, 3])
    assert mem.longest_prefix("s", "Hello") == (5, [1, 2])
    assert mem.longest_prefix("s", "Hell") is None
    assert mem.longest_prefix("s", "Jello world") is None
    # Same length and same last 64 characters, different start: the full comparison decides.
    tail = "x" * 70
    mem.record("s", "A" + tail, [7])
    mem.record("s", "B" + tail, [8])
    assert mem.longest_prefix("s", "B" + tail + "!") == (71, [8])
    assert mem.longest_prefix("s", "A" + tail) == (71, [7])
    assert mem.longest_prefix("s", "C" + tail) is None


def test_scopes_are_kept_apart():
    mem = PrefixMemory()
    mem.record("tenant-a", "shared text", [1, 2, 3])
    mem.record(None, "shared", [9])
    assert mem.longest_prefix("tenant-b", "shared text and more") is None
    assert mem.longest_prefix(None, "shared text and more") == (6, [9])
    assert mem.longest_prefix("tenant-a", "shared text and more") == (11, [1, 2, 3])


def test_recording_a_text_again_replaces_its_ids():
    mem = PrefixMemory()
    mem.record("s", "abc", [1, 2])
    mem.record("s", "abc", [3])
    assert len(mem) == 1 and mem.num_tokens == 1 and mem.num_chars == 3
    assert mem.longest_prefix("s", "abcd") == (3, [3])


def test_bounds_evict_least_recently_used():
    mem = PrefixMemory(max_entries=3)
    for i in range(3):
        mem.record("s", f"text {i}", [i])
    assert mem.longest_prefix("s", "text 0 more") == (6, [0])  # 0 is now most recent
    mem.record("s", "text 3", [3])
    assert len(mem) == 3 and mem.longest_prefix("s", "text 1") is None
    assert [mem.longest_prefix("s", f"text {i}") for i in (0, 2, 3)] == [(6, [0]), (6, [2]), (6, [3])]

    per_scope = PrefixMemory(max_per_scope=2)
    for i in range(3):
        per_scope.record("a", f"a{i}", [i])
    per_scope.record("b", "b0", [9])
    assert per_scope.longest_prefix("a", "a0") is None
    assert len(per_scope) == 3 and per_scope.longest_prefix("b", "b0") == (2, [9])

    chars = PrefixMemory(max_chars=10)
    chars.record("s", "12345", [1])
    chars.record("s", "678901", [2])  # 11 chars in all: the older one goes
    assert len(chars) == 1 and chars.num_chars == 6
    chars.record("s", "x" * 11, [3])  # longer than the whole bound: ignored
    assert len(chars) == 1 and chars.longest_prefix("s", "x" * 11) is None

    tokens = PrefixMemory(max_tokens=4)
    tokens.record("s", "a", [1, 2, 3])
    tokens.record("s", "b", [4, 5])
    assert len(tokens) == 1 and tokens.num_tokens == 2 and tokens.longest_prefix("s", "a") is None
    tokens.record("s", "c", [1, 2, 3, 4, 5])
    assert tokens.longest_prefix("s", "c") is None


def test_empty_inputs_and_bad_bounds():
    mem = PrefixMemory()
    mem.record("s", "", [1])
    mem.record("s", "abc", [])
    assert len(mem) == 0 and mem.longest_prefix("s", "abc") is None
    with pytest.raises(ValueError, match="max_per_scope: must be >= 1, got 0"):
        PrefixMemory(max_per_scope=0)


class SentencePieceLike:
    """A word-level codec of our own tokenizer interface that, like SentencePiece, marks each
    encoded text's first word with a leading space that decoding keeps inside a text (and
    drops at its start): ``encode(rest)`` joined after other ids puts a space in."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.calls: list[str] = []

    def _id(self, piece: str) -> int:
        return self.vocab.setdefault(piece, len(self.vocab))

    def encode(self, text: str) -> list[int]:
        self.calls.append(text)
        words = text.split(" ")
        if not words[0]:  # a leading space is the first word's own marker
            words = words[1:]
        return [self._id(" " + w) for w in words]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        pieces = {i: p for p, i in self.vocab.items()}
        text = "".join(pieces[i] for i in ids)
        return text[1:] if text.startswith(" ") else text

    # The AsyncEngine surface tokenize_with_memory uses: plain encoding, and pool jobs that
    # get a tokenizer (this codec itself).
    async def tokenize_text(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.encode(text)  # a codec without a BOS: the flag changes nothing

    @property
    def tokenize_pool(self) -> SentencePieceLike:
        return self

    async def run(self, fn, *, key=None):
        return fn(self)


def test_a_join_that_changes_the_text_falls_back_to_plain_encoding():
    codec = SentencePieceLike()
    mem = PrefixMemory()

    async def run() -> tuple[list[int], list[int]]:
        mem.record(None, "hello big", [codec._id(" hello big")])  # as a model may sample it
        joined = await tokenize_with_memory(codec, mem, None, "hello big world")  # type: ignore[arg-type]
        glued = await tokenize_with_memory(codec, mem, None, "hello bigworld")  # type: ignore[arg-type]
        return joined, glued

    joined, glued = asyncio.run(run())
    # " world" after the remembered ids decodes back: the remembered ids are kept.
    assert joined == [codec.vocab[" hello big"], codec.vocab[" world"]]
    assert codec.calls == [" world", "world", "hello bigworld"]
    # "world" glued to "big" would decode as "big world": plain encoding of the whole text.
    assert glued == [codec.vocab[" hello"], codec.vocab[" bigworld"]]

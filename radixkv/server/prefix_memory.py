"""Text-append reuse for ``/v1/completions``: a prompt that extends an earlier prompt + reply
is tokenized as those ids followed by the new text, so it hits the prefix cache token for token.

A completions client keeps a conversation as one growing text: it sends ``p1``, receives
``t1``, then sends ``p1 + t1 + new``. The engine cached ``p1``'s ids followed by the *sampled*
ids of ``t1``, but re-tokenizing the whole text gives other ids at ``p1``'s end (BPE merges
across the boundary) and inside ``t1`` (sampled ids are not canonical BPE), so only ``p1``'s
first blocks hit. ``PrefixMemory`` remembers, per cache scope (the request's cache salt, as for
chat replies in ``radixkv.server.output_memory``), the text ``p1 + t1`` with ids that decode
to exactly that text: ``p1``'s ids, then ``ids_for_text`` of the reply. A new text prompt
takes the longest remembered text that is a prefix of it: its ids, then the rest encoded.

Scopes keep tenants apart: a lookup only sees texts recorded under its own scope.
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from radixkv.engine.tokenize_pool import TOKENIZE_KEY
from radixkv.server.output_memory import ids_for_text, off_engine_thread

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine

__all__ = ["PrefixMemory", "remember_texts", "tokenize_with_memory"]

_TAIL = 64  # characters: the cheap key checked before a full prefix comparison
_BOUNDARY_IDS = 8  # remembered ids decoded again with the new text's ids, to check the join


class PrefixMemory:
    """Bounded LRU of ``(scope, text) → token ids`` that later prompts may extend (thread-safe).

    A lookup costs one dict probe per distinct remembered length in the scope (at most
    ``max_per_scope``), each keyed by the text's length and its last ``_TAIL`` characters,
    plus one C-speed ``startswith`` per probe that matches.

    Args:
        max_entries: most texts remembered over all scopes.
        max_per_scope: most texts remembered per scope (the least recently used go first).
        max_chars: most characters held over all texts.
        max_tokens: most token ids held over all texts.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_entries: int = 2048, max_per_scope: int = 512,
                 max_chars: int = 32 << 20, max_tokens: int = 8 << 20) -> None:
        for name, value in (("max_entries", max_entries), ("max_per_scope", max_per_scope),
                            ("max_chars", max_chars), ("max_tokens", max_tokens)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.max_entries, self.max_per_scope = max_entries, max_per_scope
        self.max_chars, self.max_tokens = max_chars, max_tokens
        self._lru: OrderedDict[tuple[Hashable, str], array] = OrderedDict()
        self._index: dict[Hashable, dict[tuple[int, str], list[str]]] = {}
        self._lengths: dict[Hashable, Counter] = {}  # scope -> remembered lengths (counts)
        self._num_chars = 0
        self._num_tokens = 0
        self._lock = threading.Lock()  # recorded in a worker thread, looked up on the loop

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_chars(self) -> int:
        return self._num_chars

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @staticmethod
    def _key(text: str, length: int) -> tuple[int, str]:
        return length, text[max(0, length - _TAIL):length]

    def record(self, scope: Hashable, text: str, token_ids: Sequence[int]) -> None:
        """Remember that ``text`` is ``token_ids`` under ``scope`` (replacing an earlier
        record of the same text). Empty texts and texts past a bound are ignored."""
        if not text or not token_ids or len(text) > self.max_chars \
                or len(token_ids) > self.max_tokens:
            return
        ids = array("l", token_ids)
        with self._lock:
            self._drop((scope, text))
            self._lru[(scope, text)] = ids
            self._index.setdefault(scope, {}).setdefault(self._key(text, len(text)), []).append(text)
            self._lengths.setdefault(scope, Counter())[len(text)] += 1
            self._num_chars += len(text)
            self._num_tokens += len(ids)
            if sum(self._lengths[scope].values()) > self.max_per_scope:
                self._drop(next(k for k in self._lru if k[0] == scope))
            while (len(self._lru) > self.max_entries or self._num_chars > self.max_chars
                   or self._num_tokens > self.max_tokens):
                self._drop(next(iter(self._lru)))

    def _drop(self, key: tuple[Hashable, str]) -> None:
        ids = self._lru.pop(key, None)
        if ids is None:
            return
        scope, text = key
        index = self._index[scope]
        slot = self._key(text, len(text))
        index[slot].remove(text)
        if not index[slot]:
            del index[slot]
        lengths = self._lengths[scope]
        lengths[len(text)] -= 1
        if not lengths[len(text)]:
            del lengths[len(text)]
        if not index:
            del self._index[scope], self._lengths[scope]
        self._num_chars -= len(text)
        self._num_tokens -= len(ids)

    def longest_prefix(self, scope: Hashable, text: str) -> tuple[int, list[int]] | None:
        """``(length, ids)`` of the longest text remembered under ``scope`` that ``text``
        starts with (marked recently used), or None."""
        with self._lock:
            index = self._index.get(scope)
            if index is None:
                return None
            for length in sorted(self._lengths[scope], reverse=True):
                if length > len(text):
                    continue
                for known in index.get(self._key(text, length), ()):
                    if text.startswith(known):
                        self._lru.move_to_end((scope, known))
                        return length, self._lru[(scope, known)].tolist()
        return None


async def tokenize_with_memory(engine: AsyncEngine, memory: PrefixMemory, scope: Hashable,
                               text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a text prompt: the longest remembered prefix's ids, then the rest encoded
    (plain encoding when nothing is remembered, or when the join does not decode back to the
    text, e.g. a SentencePiece tokenizer that puts a space in front of the rest). With
    ``add_special_tokens`` a plain encoding starts with the tokenizer's BOS; remembered ids
    already hold what their request sent, so ``scope`` must tell the two apart (the server
    scopes by ``(cache salt, add_special_tokens)``)."""
    hit = memory.longest_prefix(scope, text)
    if hit is None:
        return await engine.tokenize_text(text, add_special_tokens=add_special_tokens)
    length, ids = hit
    if length == len(text):
        return ids
    rest, tail = text[length:], ids[-_BOUNDARY_IDS:]

    def join(tok: Any) -> list[int]:  # one pool job: one wait in the tenant's queue
        rest_ids = tok.encode(rest)
        joined = tok.decode(tail + rest_ids, skip_special_tokens=False)
        if joined != tok.decode(tail, skip_special_tokens=False) + rest:
            return tok.encode_prompt(text) if add_special_tokens else tok.encode(text)
        return ids + rest_ids

    return await engine.tokenize_pool.run(join, key=TOKENIZE_KEY.get())


def remember_texts(engine: AsyncEngine, memory: PrefixMemory, scope: Hashable,
                   prompts: Sequence[tuple[str | None, list[int]]], n: int
                   ) -> Callable | None:
    """A ``remember(ids, texts)`` (see ``radixkv.server.generation.Remember``) that records,
    for choice ``i`` of text prompt ``p = i // n``, the text ``prompt + reply`` with the
    prompt's ids and ids that decode to the reply, if together they decode to exactly that
    text. ``prompts[p] = (text or None for a token-id prompt, ids sent to the engine)``.
    None when no prompt is text (token-id clients extend ids themselves)."""
    if all(text is None for text, _ in prompts):
        return None

    def record(tokenizer: Any, ids: dict[int, list[int]], texts: dict[int, str]) -> None:
        for index, reply in texts.items():
            prompt_text, prompt_ids = prompts[index // n]
            if prompt_text is None or not reply:
                continue
            exact = ids_for_text(tokenizer, ids[index], reply, tokenizer.eos_token_ids)
            if exact is None:
                continue
            full = prompt_ids + exact
            if tokenizer.decode(full, skip_special_tokens=False) == prompt_text + reply:
                memory.record(scope, prompt_text + reply, full)

    return off_engine_thread(engine, record)

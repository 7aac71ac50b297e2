"""Token ids of recent outputs, so that a reply sent back as history hits the prefix cache.

An agent re-sends the model's reply as an assistant message on its next turn. The engine
cached the prompt followed by the *sampled* token ids, but rendering the next chat
re-tokenizes the reply's text, and that can give other ids:

- BPE is not canonical for sampled sequences: the model may emit ``"ab"`` as ``"a" + "b"``,
  which re-tokenizes as the single token ``"ab"``;
- the text is tokenized together with the template text before it, so a reply starting with
  whitespace merges with the ``"\\n"`` that ended the generation prompt
  (``"assistant\\n" + "\\n\\nHi"`` → ``…, "ĊĊ", "Ċ", "Hi"`` where the prompt ended in ``"Ċ"``);
- a stop string or ``max_tokens`` cuts the text inside a token or a UTF-8 character (the cut
  reply ends in U+FFFD), and special tokens in the output are dropped from the text.

Each such difference ends the cache hit at that token, and everything after it (the rest of
the reply, the new message) is recomputed. ``OutputMemory`` remembers, per cache scope, the
text returned to a client and ids that decode to exactly that text: the sampled ids for the
longest prefix whose decoding is a prefix of the text, then the remainder re-encoded.
``ChatTokenizer.apply_chat_template(known_outputs=...)`` splices those ids in place of the
assistant content when the same text comes back, so the new prompt extends the earlier prompt
+ generated ids token for token.

Scopes keep tenants apart: a lookup only sees outputs recorded under the same scope (the
request's cache salt), otherwise a tenant could learn from its token counts whether another
tenant was shown a given text.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine

__all__ = ["OutputMemory", "ids_for_text", "off_engine_thread"]


class _Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def ids_for_text(tokenizer: _Codec, generated_ids: Sequence[int], text: str,
                 eos_token_ids: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
    """Token ids that decode to exactly ``text`` and share the longest prefix with the output.

    Args:
        tokenizer: ``encode(text)`` without special tokens and ``decode(ids,
            skip_special_tokens)`` (a ``ChatTokenizer``).
        generated_ids: the ids the engine sampled for this choice, in order (may end in EOS).
        text: the text the client received for this choice.
        eos_token_ids: ids that ended generation; trailing ones are dropped (the template
            writes its own end-of-turn token after the content).

    Returns:
        ``generated_ids[:j] + encode(text[len(decode(generated_ids[:j])):])`` for the largest
        ``j`` whose decoding (special tokens kept) is a prefix of ``text`` not ending in a
        partial character; None if no such ids decode back to ``text`` (then the caller keeps
        plain re-tokenization).
    """
    ids = list(generated_ids)
    while ids and ids[-1] in eos_token_ids:
        ids.pop()

    def decoded_prefix(j: int) -> str | None:
        piece = tokenizer.decode(ids[:j], skip_special_tokens=False)
        if text.startswith(piece) and not piece.endswith("\ufffd"):
            return piece
        return None

    if tokenizer.decode(ids, skip_special_tokens=False) == text:
        return ids
    # Binary search for the longest good prefix. Whether a prefix is good is monotone except
    # next to multi-token characters, where the search may stop a token or two short: the
    # result is still exact (checked below), it only shares a little less with the cache.
    lo, hi = 0, len(ids)  # prefix lo is good (the empty one always is), hi is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if decoded_prefix(mid) is not None:
            lo = mid
        else:
            hi = mid
    head = decoded_prefix(lo) or ""  # lo is good: the loop only ever moves it to a good j
    out = ids[:lo] + (tokenizer.encode(text[len(head):]) if len(head) < len(text) else [])
    if tokenizer.decode(out, skip_special_tokens=False) != text:
        return None
    return out


class OutputMemory:
    """Bounded LRU map ``(scope, text) → token ids`` of recent outputs (thread-safe).

    Args:
        max_entries: most remembered outputs (>= 1).
        max_tokens: most token ids held over all entries (>= 1); the least recently used
            entries go first. An output longer than this is not remembered.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_entries: int = 4096, max_tokens: int = 1 << 20) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[Hashable, str], array] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()  # recorded on the event loop, read in the tokenizer thread

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Token ids held over all entries."""
        return self._num_tokens

    def record(self, scope: Hashable, text: str, token_ids: Sequence[int]) -> None:
        """Remember that ``text`` was produced as ``token_ids`` under ``scope``.

        Empty texts and outputs longer than ``max_tokens`` are ignored. Recording a text again
        replaces its ids (the latest generation wins) and makes it most recent.
        """
        if not text or not token_ids or len(token_ids) > self.max_tokens:
            return
        ids = array("l", token_ids)
        key = (scope, text)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old)
            self._entries[key] = ids
            self._num_tokens += len(ids)
            while len(self._entries) > self.max_entries or self._num_tokens > self.max_tokens:
                _, dropped = self._entries.popitem(last=False)
                self._num_tokens -= len(dropped)

    def lookup(self, scope: Hashable, text: str) -> list[int] | None:
        """The ids remembered for ``text`` under ``scope`` (marks it recently used), or None."""
        key = (scope, text)
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                return None
            self._entries.move_to_end(key)
            return ids.tolist()

    def lookup_in(self, scope: Hashable) -> Callable[[str], list[int] | None]:
        """A ``text → ids | None`` function bound to one scope (``known_outputs`` of
        ``ChatTokenizer.apply_chat_template``)."""
        return lambda text: self.lookup(scope, text)


def off_engine_thread(engine: AsyncEngine, record: Callable[..., None]
                      ) -> Callable[[dict[int, list[int]], dict[int, str]], Awaitable[None]]:
    """``remember`` running ``record(tokenizer, ids, texts)`` in a worker thread with the
    engine's ``side_tokenizer``: never the engine thread's tokenizer (its lock is taken by the
    detokenizer every step), and not queued behind other tenants' prompts on the fair pool,
    since the response ends only once its reply is remembered."""

    async def remember(ids: dict[int, list[int]], texts: dict[int, str]) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: record(engine.side_tokenizer, ids, texts))

    return remember

"""Incremental detokenisation with stop-string handling for one request.

Decoding the whole output on every step costs O(n^2); instead a short window of already
emitted tokens is re-decoded so that multi-token characters (UTF-8 split across byte-level BPE
tokens) and tokenizer-level merges come out right. Text that could be the start of a stop
string is held back until it is known not to be one, so a stream never shows a stop string.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True)``.
        stop: stop strings; when one appears, ``stopped`` becomes True and the text is cut
            before it.
    """

    def __init__(self, tokenizer: _Decoder, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""            # all decoded text so far (stop string cut once found)
        self._emitted_chars = 0   # how much of `text` has been handed out
        self.stopped = False

    def add(self, output_ids: Sequence[int], *, final: bool = False) -> str:
        """Account for newly appended ids in ``output_ids`` and return the text to emit now.

        Args:
            output_ids: every output token id so far (the list the request owns).
            final: the request is finishing: flush held-back text.
        """
        if not self.stopped:
            prefix = self._tokenizer.decode(output_ids[self._prefix_offset:self._read_offset])
            full = self._tokenizer.decode(output_ids[self._prefix_offset:])
            # A trailing U+FFFD means a character is still incomplete: wait for more tokens.
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(output_ids)
            elif final and full.endswith("\ufffd") and len(full) > len(prefix):
                self.text += full[len(prefix):]
            if self._stop:
                self._check_stop()
        if self.stopped or final:
            limit = len(self.text)
        else:
            limit = max(self._emitted_chars, len(self.text) - self._hold_chars)
        delta = self.text[self._emitted_chars:limit]
        self._emitted_chars = limit
        return delta

    def _check_stop(self) -> None:
        # Only the region that could contain a new match needs scanning.
        start = max(0, self._emitted_chars - self._hold_chars)
        best = -1
        for s in self._stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best == -1 or idx < best):
                best = idx
        if best != -1:
            self.text = self.text[:best]
            self.stopped = True

"""The rules of window-bounded residency, on block indices (torch-free, no tree state).

A window layer of W tokens: a query at position p attends to ``[p - W + 1, p]``. After a prefix
hit at a block boundary of h blocks (``m = h * B`` tokens), the first token computed is m, so a
window group needs the blocks overlapping ``[m - W + 1, m)`` resident: the last
``ceil((W - 1) / B)`` blocks before the boundary (fewer when the boundary is that close to 0).
A full-attention group needs every block before it.

These are the decisions the grouped layout of ``docs/sliding-window.md`` makes: which boundary
a match may claim (:func:`deepest_window_hit`) and which window blocks the tree keeps when a
request ends (:func:`anchor_blocks`). The pool today keeps every block of every layer
(``keep-all``), where every matched boundary is a valid hit; these rules are for the layout
that frees out-of-window blocks, and the tests pin them down before it is wired in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["anchor_blocks", "deepest_window_hit", "window_blocks_needed"]


def window_blocks_needed(window_tokens: int, block_size: int) -> int:
    """Blocks before a hit boundary a window group needs resident: ``ceil((W - 1) / B)``.

    Raises:
        ValueError: naming ``window_tokens`` or ``block_size`` when not a positive int.
    """
    for name, value in (("window_tokens", window_tokens), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return -(-(window_tokens - 1) // block_size)


def deepest_window_hit(num_matched_blocks: int, live: Mapping[int, Sequence[bool]],
                       block_size: int) -> int:
    """The deepest hit, in blocks, that every window group can serve.

    Args:
        num_matched_blocks: blocks the token match covers (the full group has all of them).
        live: per window group, keyed by its W in tokens, whether each matched block's window
            K/V is resident (at least ``num_matched_blocks`` entries; a tombstoned block is
            False).
        block_size: tokens per block (B).

    Returns:
        The largest ``h <= num_matched_blocks`` such that, in every group, the
        ``min(h, ceil((W - 1) / B))`` blocks before boundary h are live; 0 when none is (a
        hit of 0 blocks needs nothing). Never a boundary whose window K/V is gone.

    Raises:
        ValueError: a group with fewer than ``num_matched_blocks`` entries, or a bad W / B.
    """
    valid = [True] * (num_matched_blocks + 1)  # valid[h]: boundary h served by every group
    for window_tokens, flags in live.items():
        need = window_blocks_needed(window_tokens, block_size)
        if len(flags) < num_matched_blocks:
            raise ValueError(f"live: {len(flags)} entries for window {window_tokens}, "
                             f"{num_matched_blocks} matched blocks")
        run = 0  # live blocks ending at the boundary
        for h in range(1, num_matched_blocks + 1):
            run = run + 1 if flags[h - 1] else 0
            if run < min(h, need):
                valid[h] = False
    return max(h for h in range(num_matched_blocks + 1) if valid[h])


def anchor_blocks(end_tokens: Iterable[int], window_tokens: int, block_size: int) -> set[int]:
    """Window blocks the tree keeps when a request ends, for resuming at each of ``end_tokens``.

    An end at token t (a published leaf's end, the prompt's end, a shared-prefix junction)
    is resumed by a hit at boundary ``floor(t / B)``, or one block earlier when the next
    request diverges inside the last aligned block; both stay servable, so the kept run is
    ``ceil((W - 1) / B) + 1`` blocks before ``floor(t / B)`` (clipped at block 0).

    Returns:
        The block indices to keep in that window group; every other window block of the
        path can be freed (tombstoned) at once.

    Raises:
        ValueError: a negative end, or a bad W / B.
    """
    need = window_blocks_needed(window_tokens, block_size)
    keep: set[int] = set()
    for end in end_tokens:
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ValueError(f"end_tokens: must be ints >= 0, got {end!r}")
        boundary = end // block_size
        keep.update(range(max(0, boundary - need - 1), boundary))
    return keep

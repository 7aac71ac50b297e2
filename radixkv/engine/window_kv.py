"""What a prefix hit can reuse on a model with sliding-window layers: its layer groups.

Layers group by attention kind: full attention, or a sliding window of W tokens (a query at
position p attends to keys ``[p - W + 1, p]``). The K/V of a cached position depends on every
token before it whatever the window (the layers below carry it forward), so a block computed
for a prefix is the right K/V for that prefix under any layer kind; what differs per group is
which blocks a later suffix *reads*: a full layer every block of ``[0, m)``, a window layer
only those overlapping ``[m - W + 1, m)``.

The pool keeps every block of every layer for the whole sequence (one block table indexes all
layers: ``keep-all``), so a prefix hit on a window model has all the K/V it reads, and a hit
ends at any multiple of the block size, as on a full-attention model. ``docs/sliding-window.md``
describes this and the window-bounded layout that would keep fewer window blocks.
"""

from __future__ import annotations

from typing import Any

from radixkv.model.config import ModelShape

__all__ = ["WINDOW_KV_KEEP_ALL", "hit_granularity", "layer_groups"]

#: The residency rule of the pool: every block of every layer stays for the whole sequence and
#: while cached (window layers' out-of-window blocks included).
WINDOW_KV_KEEP_ALL = "keep-all"


def layer_groups(shape: ModelShape) -> list[dict[str, Any]]:
    """The model's layers grouped by attention kind, full attention first, then windows by size.

    Returns:
        One dict per group: ``attention`` (``"full"`` or ``"sliding"``), ``window_tokens``
        (W, tokens a query sees including itself; None for full attention) and ``num_layers``.
        E.g. Gemma 3 270M (18 layers, window 512, five sliding layers to one full):
        ``[{"attention": "full", "window_tokens": None, "num_layers": 3},
        {"attention": "sliding", "window_tokens": 512, "num_layers": 15}]``.
    """
    counts: dict[int, int] = {}
    for window_left in shape.layer_window_lefts:  # -1 = full; else W - 1
        counts[window_left] = counts.get(window_left, 0) + 1
    return [{"attention": "full" if left < 0 else "sliding",
             "window_tokens": None if left < 0 else left + 1, "num_layers": counts[left]}
            for left in sorted(counts)]


def hit_granularity(shape: ModelShape, block_size: int) -> dict[str, Any]:
    """Where a prefix hit can end and what it needs resident, for the startup log and ``/stats``.

    Args:
        shape: the served model's shape.
        block_size: tokens per KV block (B).

    Returns:
        ``block_size_tokens`` (a hit covers whole blocks: it ends at a multiple of B, below the
        prompt's last token), ``window_kv`` (the residency rule, :data:`WINDOW_KV_KEEP_ALL`)
        and ``layer_groups`` (:func:`layer_groups`).
    """
    return {"block_size_tokens": block_size, "window_kv": WINDOW_KV_KEEP_ALL,
            "layer_groups": layer_groups(shape)}

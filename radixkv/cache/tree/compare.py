"""Block-run comparison: how many leading blocks of a stored run equal a prompt's, and the walk.

The one place where runs of blocks are compared, for a lookup (:func:`walk`, used by
``RadixTree.match`` / ``insert`` and the isolated-miss check) and for the ghost list
(``radixkv.cache.miss_causes.classify_miss``). Tokens are compared as packed uint32-LE bytes, a
whole run in one ``memcmp`` (``bytes.startswith``), and a binary search over block ranges finds
a mismatch inside a run; extras (multimodal keys) are compared block by block. Nothing here
hashes or changes anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from radixkv.cache.tree.node import Node


def extras_agree(stored: list[bytes] | None, px: Sequence[bytes] | None, first: int,
                 limit: int) -> int:
    """Leading blocks (of ``limit``) whose extras agree: stored blocks vs prompt blocks ``first…``.

    Args:
        stored: Extras of the stored run's blocks, or None when all are text.
        px: Extras of the prompt's blocks, or None when all are text.
        first: Prompt block of the run's block 0.
        limit: Blocks to compare at most.
    """
    if stored is None:
        if px is None:
            return limit
        for j in range(limit):
            if px[first + j]:
                return j
        return limit
    if px is None:
        for j in range(limit):
            if stored[j]:
                return j
        return limit
    for j in range(limit):
        if stored[j] != px[first + j]:
            return j
    return limit


def common_blocks(pb: bytes, pos: int, stored: bytes | bytearray, limit: int, bb: int,
                  known: int = 1) -> int:
    """Leading equal blocks of ``pb[pos:]`` and ``stored`` among the first ``limit``.

    Binary search over block ranges: O(log limit) ``memcmp`` calls, O(limit) bytes compared.

    Args:
        pb: Packed prompt tokens.
        pos: Byte offset in ``pb`` of the first block to compare.
        stored: Packed tokens of a stored run.
        limit: Blocks to compare at most (≥ ``known``).
        bb: Bytes per block (4 * B).
        known: Leading blocks already known equal (1 when block 0 matched a child key).
    """
    lo, hi = known, limit  # blocks [0, lo) are equal; the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pb.startswith(stored[lo * bb : mid * bb], pos + lo * bb):
            lo = mid
        else:
            hi = mid - 1
    return lo


def matching_blocks(pb: bytes, pos: int, tokens: bytes | bytearray, extras: list[bytes] | None,
                    px: Sequence[bytes] | None, limit: int, bb: int, known: int = 1) -> int:
    """Leading blocks of a stored run (``tokens``, ``extras``) equal to the prompt's at ``pos``.

    Tokens and extras both must agree. The usual case, a whole run equal to the prompt, costs
    one ``memcmp``.

    Args:
        pb: Packed prompt tokens (at least ``pos + limit * bb`` bytes).
        pos: Byte offset in ``pb`` of the run's block 0 (a multiple of ``bb``).
        tokens: Packed tokens of the stored run (at least ``limit`` blocks).
        extras: Extras of the stored run's blocks, or None when all are text.
        px: Extras of the prompt's blocks, or None.
        limit: Blocks to compare at most (≥ 1).
        bb: Bytes per block (4 * B).
        known: Leading blocks whose tokens are already known equal (1 when block 0 matched a
            child or ghost key, 0 otherwise).

    Returns:
        The number of leading equal blocks, in ``[0, limit]``.
    """
    n = limit * bb
    if not pb.startswith(tokens if len(tokens) == n else tokens[:n], pos):
        if known == 0 and not pb.startswith(tokens[:bb], pos):
            return 0
        limit = common_blocks(pb, pos, tokens, limit, bb)
    if px is not None or extras is not None:
        return extras_agree(extras, px, pos // bb, limit)
    return limit


def walk(start: Node, pb: bytes, px: Sequence[bytes] | None, max_blocks: int,
         bb: int) -> tuple[list[tuple[Node, int]], int]:
    """Follow the cached prefix of packed tokens ``pb`` below ``start``; change nothing.

    Children are found by their first block's exact bytes (plus extras), then each child's run
    is compared with :func:`matching_blocks`.

    Args:
        start: Node whose end the tokens continue (an identity root for a lookup).
        pb: Packed tokens (at least ``max_blocks`` full blocks).
        px: Extras per block of ``pb`` or None for text.
        max_blocks: Most blocks to match.
        bb: Bytes per block (4 * B).

    Returns:
        ``(path, num_blocks)``: each visited child with the number of its leading blocks that
        matched (only the last entry can be short of the node), and the total.
    """
    end = max_blocks * bb
    node, pos = start, 0
    path: list[tuple[Node, int]] = []
    while pos < end:
        key: object = pb[pos : pos + bb]
        if px is not None and px[pos // bb]:
            key = (key, px[pos // bb])
        child = node.children.get(key)
        if child is None:
            break
        ct = child.tokens
        n = len(ct)
        j = matching_blocks(pb, pos, ct, child.extras, px, (n if n <= end - pos else end - pos) // bb,
                            bb)
        path.append((child, j))
        pos += j * bb
        if j * bb < n:
            break
        node = child
    return path, pos // bb

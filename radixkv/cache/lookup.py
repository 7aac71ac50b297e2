"""A lookup's inputs: the validated, packed prompt, its hit cap and its blocks' extras.

``CacheManager.begin`` and ``peek`` call :func:`lookup_inputs` once per lookup; it is the one
place their arguments are validated (the tree trusts what it is given).
"""

from __future__ import annotations

from typing import Sequence

from radixkv.cache.hashing import MMItem, as_packed_tokens, block_extras, validate_mm_items


def lookup_inputs(root: bytes, prompt_token_ids: Sequence[int] | bytes,
                  mm_items: Sequence[Sequence] | None, block_size: int,
                  root_bytes: int,
                  ) -> tuple[bytes, int, tuple[MMItem, ...], int, list[bytes] | None]:
    """Validate and pack a lookup's arguments (see ``CacheManager.begin``).

    Args:
        root: Identity root hash (``root_bytes`` bytes).
        prompt_token_ids: Token ids, or the same packed as uint32-LE ``bytes``.
        mm_items: Multimodal items ``(token_offset, num_tokens, media_digest)`` or None.
        block_size: B.
        root_bytes: Digest size of the cache's hash.

    Returns:
        ``(pb, num_prompt_tokens, mm_items, cap_blocks, extras)`` (a plain tuple: this runs per
        lookup): the prompt packed as uint32-LE ``bytes``, N ≥ 1, the validated items (``()``
        for text), the hit cap ``(N - 1) // B`` in blocks (at least the last prompt token is
        computed; a block boundary ends the hit), and each capped block's extras (None: text).

    Raises:
        ValueError: naming ``root``, ``prompt_token_ids`` (empty, or a bad id) or ``mm_items``.
    """
    if type(root) is not bytes or len(root) != root_bytes:
        raise ValueError(f"root: must be the {root_bytes} bytes identity_root() "
                         f"returns, got {type(root).__name__} of length "
                         f"{len(root) if isinstance(root, (bytes, bytearray)) else '-'}")
    if type(prompt_token_ids) is bytes and not mm_items and not len(prompt_token_ids) & 3:
        # Fast path: tokens already packed, text only.
        num_prompt_tokens = len(prompt_token_ids) >> 2
        if num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids: must hold at least one token")
        return (prompt_token_ids, num_prompt_tokens, (),
                (num_prompt_tokens - 1) // block_size, None)
    pb = as_packed_tokens(prompt_token_ids)
    num_prompt_tokens = len(pb) >> 2
    if num_prompt_tokens == 0:
        raise ValueError("prompt_token_ids: must hold at least one token")
    items = validate_mm_items(mm_items, num_prompt_tokens)
    # Hit cap: at least the last prompt token is computed; a block boundary ends the hit.
    cap_blocks = (num_prompt_tokens - 1) // block_size
    extras = block_extras(items, cap_blocks, block_size) if items else None
    return pb, num_prompt_tokens, items, cap_blocks, extras

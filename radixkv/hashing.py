"""Cache identity, its typed encoding, and chained block hashes.

Two requests may share KV only when they run under the same *cache identity* (model revision,
KV layout, RoPE config, cache salt, adapter) and start with the same tokens. Each identity gets
a root hash and every full block of B tokens a chained hash::

    root = H(b"radixkv/v1" || enc(identity))
    h_i  = H(h_{i-1} || uint32-LE tokens of block i || extras of block i)

``enc`` is typed and length-prefixed: every value is ``tag (1 byte) || length (uint32-LE) ||
payload``, so ``None`` and ``""`` differ and no two field lists encode alike. Nothing uses
Python's ``hash()``, so hashes are identical across processes and runs (golden vectors in
``tests/unit/test_hashing.py`` pin the derivation).

``H`` is xxh3-128 by default (16-byte digest) or SHA-256. The radix tree never trusts a hash
alone: a lookup compares the stored block tokens, so a collision cannot return foreign KV.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from typing import Callable, Sequence

import xxhash

HashFn = Callable[[bytes], bytes]

#: Domain-separation prefix of every identity root; bump the version when the derivation changes.
ROOT_DOMAIN = b"radixkv/v1"

HASH_FUNCTIONS: dict[str, HashFn] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest(),
}

# Token packing: array('I') is a C-speed uint32 packer; pick the typecode whose item is 4 bytes
# and byte-swap on big-endian hosts so the bytes are always little-endian.
_U32_CODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
_LEN = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32.

    Args:
        token_ids: Token ids, each in ``[0, 2**32)``.

    Returns:
        ``4 * len(token_ids)`` bytes.

    Raises:
        ValueError: naming ``token_ids`` if an id is negative, too large or not an int.
    """
    try:
        packed = array(_U32_CODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token_ids: every token id must be an int in [0, 2**32): {exc}") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _enc(value: object) -> bytes:
    """Typed, length-prefixed encoding of one value: tag || uint32-LE length || payload."""
    if value is None:
        return b"N" + _LEN.pack(0)
    if isinstance(value, bool):  # before int: bool is an int subclass
        return b"b" + _LEN.pack(1) + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"I" + _LEN.pack(8) + _I64.pack(value)
    if isinstance(value, float):
        return b"F" + _LEN.pack(8) + _F64.pack(value)
    if isinstance(value, str):
        payload = value.encode("utf-8")
        return b"S" + _LEN.pack(len(payload)) + payload
    if isinstance(value, (bytes, bytearray)):
        return b"B" + _LEN.pack(len(value)) + bytes(value)
    if isinstance(value, tuple):
        # Length = item count; each item is itself self-delimiting.
        return b"T" + _LEN.pack(len(value)) + b"".join(_enc(item) for item in value)
    raise ValueError(f"value: cannot encode {type(value).__name__} in a cache identity")


@dataclasses.dataclass(frozen=True)
class CacheIdentity:
    """Everything that decides whether KV computed for one request may serve another.

    Attributes:
        model_revision: Digest of the model weight files (non-empty).
        block_size: Tokens per KV block (> 0).
        kv_dtype: KV pool dtype name, e.g. ``"float32"``.
        rope: Canonical text of the RoPE config, e.g. ``"theta=100000.0;scaling=None"``.
        cache_salt: Tenant / client namespace; ``None`` (no salt) differs from ``""``.
        adapter: ``(name, weights digest)`` of a LoRA adapter, or ``None`` for the base model.
    """

    model_revision: str
    block_size: int
    kv_dtype: str
    rope: str
    cache_salt: str | None = None
    adapter: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_revision, str) or not self.model_revision:
            raise ValueError("model_revision: must be a non-empty string")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise ValueError(f"block_size: must be a positive int, got {self.block_size!r}")
        if not isinstance(self.kv_dtype, str) or not self.kv_dtype:
            raise ValueError("kv_dtype: must be a non-empty string")
        if not isinstance(self.rope, str):
            raise ValueError("rope: must be a string")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError("cache_salt: must be a string or None")
        if self.adapter is not None and not (
            isinstance(self.adapter, tuple)
            and len(self.adapter) == 2
            and all(isinstance(part, str) for part in self.adapter)
        ):
            raise ValueError("adapter: must be None or a (name, weights_digest) tuple of strings")

    def encode(self) -> bytes:
        """Return the typed encoding: for each field in order, enc(name) || enc(value)."""
        return b"".join(
            _enc(field.name) + _enc(getattr(self, field.name)) for field in dataclasses.fields(self)
        )


class BlockHasher:
    """Computes identity roots and chained block hashes with a pluggable hash function.

    Args:
        algo: ``"xxh3_128"`` (default) or ``"sha256"``; ignored when ``hash_fn`` is given.
        hash_fn: Optional ``bytes -> bytes`` replacing ``H`` (tests inject tiny-digest or
            byte-counting functions).

    Attributes:
        algo: Name of the algorithm (``"custom"`` when ``hash_fn`` was injected).
        hash_fn: The function ``H``.
        num_block_hashes: Blocks hashed so far (counter for tests and stats).

    Raises:
        ValueError: naming ``hash_algo`` for an unknown algorithm.
    """

    def __init__(self, algo: str = "xxh3_128", hash_fn: HashFn | None = None) -> None:
        if hash_fn is None:
            try:
                hash_fn = HASH_FUNCTIONS[algo]
            except KeyError:
                raise ValueError(
                    f"hash_algo: unknown hash {algo!r} (known: {', '.join(sorted(HASH_FUNCTIONS))})"
                ) from None
        else:
            algo = "custom"
        self.algo = algo
        self.hash_fn: HashFn = hash_fn
        self.num_block_hashes = 0

    def identity_root(self, identity: CacheIdentity) -> bytes:
        """Return ``H(b"radixkv/v1" || enc(identity))``."""
        return self.hash_fn(ROOT_DOMAIN + identity.encode())

    def block_hash(self, parent_hash: bytes, token_ids: Sequence[int], extras: bytes = b"") -> bytes:
        """Return the chained hash of one block.

        Args:
            parent_hash: Hash of the previous block, or the identity root for block 0.
            token_ids: The block's B token ids.
            extras: Self-delimiting encoding of the block's extra keys (multimodal items);
                empty for text.

        Returns:
            ``H(parent_hash || uint32-LE tokens || extras)``.
        """
        self.num_block_hashes += 1
        return self.hash_fn(parent_hash + pack_tokens(token_ids) + extras)

    def chain(self, parent_hash: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """Return the chained hashes of every full block of ``token_ids``.

        Args:
            parent_hash: Root (or hash of the block before ``token_ids[0]``).
            token_ids: Tokens; a partial tail block is ignored.
            block_size: B, tokens per block (> 0).

        Returns:
            ``len(token_ids) // block_size`` digests.
        """
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        hashes: list[bytes] = []
        h = parent_hash
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            h = self.block_hash(h, token_ids[start : start + block_size])
            hashes.append(h)
        return hashes

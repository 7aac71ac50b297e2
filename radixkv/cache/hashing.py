"""Cache identity, its typed encoding, and chained block hashes.

Two requests may share KV only when they run under the same *cache identity* (model revision,
KV layout and format, RoPE config, cache salt, adapter) and start with the same tokens. Each identity gets
a root hash and every full block of B tokens a chained hash::

    root = H(b"radixkv/v1" || enc(identity))
    h_i  = H(h_{i-1} || uint32-LE tokens of block i || extras of block i)

``enc`` is typed and length-prefixed: every value is ``tag (1 byte) || length (uint32-LE) ||
payload``, so ``None`` and ``""`` differ and no two field lists encode alike. Nothing uses
Python's ``hash()``, so hashes are identical across processes and runs (golden vectors in
``tests/cache/test_hashing.py`` pin the derivation).

Extras of a block are the multimodal items overlapping it: ``enc(((digest, offset), ...))``
with ``offset`` the item's first token relative to the block start (negative when the item began
in an earlier block), items sorted by (offset, digest); a text block's extras are empty, so its
hash is ``H(h_{i-1} || tokens)``. A media digest is ``H(b"radixkv/media/v1" || enc(format) ||
enc(shape) || enc(bytes))``: two images with the same placeholder tokens never share KV.

``H`` is xxh3-128 by default (16-byte digest) or SHA-256. The radix tree never trusts a hash
alone: a lookup compares the stored block tokens and extras, so a collision cannot return
foreign KV.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from array import array
from typing import Callable, NamedTuple, Sequence

import xxhash

from radixkv.config import check_block_size

HashFn = Callable[[bytes], bytes]

#: Domain-separation prefix of every identity root; bump the version when the derivation changes.
ROOT_DOMAIN = b"radixkv/v1"
#: Domain-separation prefix of media digests.
MEDIA_DOMAIN = b"radixkv/media/v1"

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
_I64_MAX = (1 << 63) - 1


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


def as_packed_tokens(token_ids: Sequence[int] | bytes | bytearray) -> bytes:
    """Token ids as packed uint32-LE bytes: ``bytes``/``bytearray`` are taken as already packed
    (the engine may pack a request's tokens once, as they arrive), anything else is packed.

    Raises:
        ValueError: naming ``token_ids`` for a packed buffer whose length is not a multiple of
            4, or an id outside ``[0, 2**32)``.
    """
    if isinstance(token_ids, (bytes, bytearray)):
        if len(token_ids) % 4:
            raise ValueError(f"token_ids: packed tokens need a multiple of 4 bytes, got "
                             f"{len(token_ids)}")
        return bytes(token_ids)
    return pack_tokens(token_ids)


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    """Inverse of :func:`pack_tokens`: little-endian uint32 bytes back to a tuple of ids."""
    arr = array(_U32_CODE)
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return tuple(arr)


def _check_bytes(name: str, value: object) -> None:
    if type(value) is not bytes:
        raise ValueError(f"{name}: must be bytes, got {type(value).__name__}")


class MMItem(NamedTuple):
    """One multimodal input inside a prompt (an image's placeholder run).

    Attributes:
        token_offset: Index of the item's first placeholder token in the prompt (≥ 0).
        num_tokens: Placeholder tokens the item occupies (≥ 1).
        media_digest: :func:`media_digest` of the item's content (non-empty bytes).
    """

    token_offset: int
    num_tokens: int
    media_digest: bytes


def validate_mm_items(mm_items: Sequence[Sequence] | None, num_tokens: int) -> tuple[MMItem, ...]:
    """Normalise ``mm_items`` to sorted :class:`MMItem` tuples lying inside ``num_tokens``.

    Raises:
        ValueError: naming ``mm_items`` for a malformed item or one outside the prompt.
    """
    if not mm_items:
        return ()
    items = []
    for raw in mm_items:
        try:
            offset, length, digest = raw
        except (TypeError, ValueError):
            raise ValueError("mm_items: each item must be (token_offset, num_tokens, media_digest)"
                             ) from None
        if (not isinstance(offset, int) or not isinstance(length, int) or isinstance(offset, bool)
                or offset < 0 or length < 1 or offset + length > num_tokens):
            raise ValueError(f"mm_items: item at offset {offset!r} with {length!r} tokens must lie "
                             f"inside the {num_tokens}-token prompt")
        if not isinstance(digest, (bytes, bytearray)) or not digest:
            raise ValueError("mm_items: media_digest must be non-empty bytes")
        items.append(MMItem(offset, length, bytes(digest)))
    items.sort()
    return tuple(items)


def block_extras(mm_items: Sequence[MMItem], num_blocks: int, block_size: int,
                 first_block: int = 0) -> list[bytes] | None:
    """Extra keys of blocks ``[first_block, num_blocks)``, or None when no item overlaps them.

    Block ``i`` covers tokens ``[i*B, (i+1)*B)``; its extras encode every item overlapping it as
    ``(media_digest, token_offset - i*B)`` (typed, in (offset, digest) order). Blocks no item
    touches get ``b""``.

    Args:
        mm_items: Items from :func:`validate_mm_items` (sorted).
        num_blocks: End (exclusive) of the block range.
        block_size: B.
        first_block: Start of the block range.

    Returns:
        ``num_blocks - first_block`` byte strings, or None if every one would be empty.
    """
    per_block: dict[int, list[tuple[bytes, int]]] = {}
    for offset, length, digest in mm_items:
        first = max(offset // block_size, first_block)
        last = min((offset + length - 1) // block_size, num_blocks - 1)
        for i in range(first, last + 1):
            per_block.setdefault(i, []).append((digest, offset - i * block_size))
    if not per_block:
        return None
    out = [b""] * (num_blocks - first_block)
    for i, entries in per_block.items():
        entries.sort(key=lambda e: (e[1], e[0]))
        out[i - first_block] = _enc(tuple(entries))
    return out


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
        kv_dtype: The KV cache format tag (``radixkv.kernels.kv_quant.KVFormat.tag``): the
            pool dtype name for unquantized K/V (``"float32"``, ``"bfloat16"``: the roots of
            earlier releases, unchanged), the quantized format with its scale layout and
            version otherwise (``"int8-tokhead-f32-v1"``, ``"fp8_e4m3-tokhead-f32-v1"``), so
            blocks of different formats never share a root, a chained hash, a KV event or a
            store key.
        rope: Canonical text of the RoPE config, e.g. ``"theta=100000.0;scaling=None"``.
        cache_salt: Tenant / client namespace; ``None`` (no salt) differs from ``""``.
        adapter: ``(name, weights digest)`` of a LoRA adapter (both non-empty), or ``None`` for
            the base model.

    Raises:
        ValueError: naming the field: an empty ``model_revision`` or ``kv_dtype``, a
            ``block_size`` outside ``[1, MAX_BLOCK_SIZE]`` (``radixkv.config``), a non-string
            ``rope`` or ``cache_salt``, an ``adapter`` that is not two non-empty strings.
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
        check_block_size(self.block_size)  # well inside the int64 the encoding stores
        if not isinstance(self.kv_dtype, str) or not self.kv_dtype:
            raise ValueError("kv_dtype: must be a non-empty string")
        if not isinstance(self.rope, str):
            raise ValueError("rope: must be a string")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError("cache_salt: must be a string or None")
        if self.adapter is not None and not (
            isinstance(self.adapter, tuple)
            and len(self.adapter) == 2
            and all(isinstance(part, str) and part for part in self.adapter)
        ):
            # An empty digest would let any weights under that name share KV: require both.
            raise ValueError("adapter: must be None or a (name, weights_digest) tuple of "
                             f"non-empty strings, got {self.adapter!r}")

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
        # block_size -> Struct(f"{4B}s").iter_unpack: splits packed tokens into blocks in C.
        self._splitters: dict[int, Callable] = {}

    def identity_root(self, identity: CacheIdentity) -> bytes:
        """Return ``H(b"radixkv/v1" || enc(identity))``."""
        return self.hash_fn(ROOT_DOMAIN + identity.encode())

    def media_digest(self, media_format: str, shape: Sequence[int], data: bytes) -> bytes:
        """Digest of one multimodal input: ``H(b"radixkv/media/v1" || enc(format) || enc(shape)
        || enc(data))``, typed (``shape`` as a tuple of int64, ``data`` as bytes).

        Each argument is encoded by its type, never converted: ``None`` is not ``"None"`` and
        an int is not a run of zero bytes, so they are refused rather than coerced.

        Args:
            media_format: Content type, e.g. ``"image/png"`` or ``"rgb8"`` (a ``str``).
            shape: Dimensions of the decoded input (e.g. ``(height, width, channels)``): a tuple
                or list of ints in ``[0, 2**63)``.
            data: The raw bytes: any bytes-like object (``bytes``, ``bytearray``,
                ``memoryview``, or another buffer, taken in C order).

        Returns:
            The digest (16 bytes for xxh3-128, 32 for SHA-256).

        Raises:
            ValueError: naming ``media_format`` if it is not a str, ``shape`` if it is not a
                tuple or list of ints in ``[0, 2**63)`` (bools refused), ``data`` if it is not
                bytes-like.
        """
        if not isinstance(media_format, str):
            raise ValueError(f"media_format: must be a str, got {type(media_format).__name__}")
        if not isinstance(shape, (tuple, list)) or not all(
                type(d) is int and 0 <= d <= _I64_MAX for d in shape):
            raise ValueError("shape: must be a tuple or list of ints in [0, 2**63), got "
                             f"{shape!r}")
        try:
            raw = memoryview(data).tobytes()
        except TypeError:
            raise ValueError(f"data: must be bytes-like (bytes, bytearray, memoryview), got "
                             f"{type(data).__name__}") from None
        return self.hash_fn(MEDIA_DOMAIN + _enc(media_format) + _enc(tuple(shape)) + _enc(raw))

    def hash_blocks(self, parent_hash: bytes, token_bytes: bytes | bytearray, block_size: int,
                    extras: Sequence[bytes] | None = None) -> list[bytes]:
        """Chained hashes of the packed blocks in ``token_bytes`` (the insert hot path).

        Args:
            parent_hash: Chain value before the first block.
            token_bytes: ``k * block_size`` tokens packed by :func:`pack_tokens`.
            block_size: B.
            extras: Per-block extras (``k`` entries) or None for text.

        Returns:
            ``k`` digests; each block is fed to ``H`` exactly once.

        Raises:
            ValueError: naming ``token_bytes`` if not whole blocks, ``extras`` if given with
                other than ``k`` entries.
        """
        fn = self.hash_fn
        split = self._splitters.get(block_size)
        if split is None:
            split = self._splitters[block_size] = struct.Struct(f"{4 * block_size}s").iter_unpack
        if len(token_bytes) % (4 * block_size):
            raise ValueError(f"token_bytes: {len(token_bytes)} bytes are not whole blocks of "
                             f"{4 * block_size}")
        h = parent_hash
        if extras is None:
            # The tightest Python loop for the chain: blocks split in C (no slice per block),
            # one concatenation and one H call each.
            out = [h := fn(h + block) for (block,) in split(token_bytes)]
        else:
            if len(extras) * 4 * block_size != len(token_bytes):
                raise ValueError(f"extras: {len(extras)} entries for "
                                 f"{len(token_bytes) // (4 * block_size)} blocks")
            out = [h := fn(h + block + x) for (block,), x in zip(split(token_bytes), extras)]
        self.num_block_hashes += len(out)
        return out

    def block_hash(self, parent_hash: bytes, token_ids: Sequence[int], extras: bytes = b"") -> bytes:
        """Return the chained hash of one block.

        Args:
            parent_hash: Hash of the previous block, or the identity root for block 0.
            token_ids: The block's B token ids.
            extras: Self-delimiting encoding of the block's extra keys (multimodal items);
                empty for text.

        Returns:
            ``H(parent_hash || uint32-LE tokens || extras)``.

        Raises:
            ValueError: naming ``parent_hash`` or ``extras`` if not bytes, ``token_ids`` if an
                id is outside ``[0, 2**32)``.
        """
        _check_bytes("parent_hash", parent_hash)
        _check_bytes("extras", extras)
        self.num_block_hashes += 1
        return self.hash_fn(parent_hash + pack_tokens(token_ids) + extras)

    def chain(self, parent_hash: bytes, token_ids: Sequence[int], block_size: int,
              mm_items: Sequence[Sequence] | None = None) -> list[bytes]:
        """Return the chained hashes of every full block of ``token_ids``.

        Args:
            parent_hash: Root (or hash of the block before ``token_ids[0]``).
            token_ids: Tokens; a partial tail block is ignored.
            block_size: B, tokens per block (> 0).
            mm_items: Multimodal items ``(token_offset, num_tokens, media_digest)`` of this
                token sequence (offsets relative to ``token_ids[0]``).

        Returns:
            ``len(token_ids) // block_size`` digests.

        Raises:
            ValueError: naming ``block_size`` outside ``[1, MAX_BLOCK_SIZE]``, ``parent_hash``
                if not bytes, ``token_ids`` or ``mm_items`` if malformed.
        """
        check_block_size(block_size)
        _check_bytes("parent_hash", parent_hash)
        num_blocks = len(token_ids) // block_size
        items = validate_mm_items(mm_items, len(token_ids))
        extras = block_extras(items, num_blocks, block_size) if items else None
        return self.hash_blocks(parent_hash, pack_tokens(token_ids[: num_blocks * block_size]),
                                block_size, extras)

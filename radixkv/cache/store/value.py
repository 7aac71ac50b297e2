"""The store tier's keys and block values: a versioned header, then every layer's K and V.

A block is stored under a key derived from its chained hash, its identity root and the KV layout
(``store_key``); the chained hash already covers the model revision, LoRA adapter, multimodal
extras and cache salt (docs/design.md §3), the root and the layout tag make the key readable and keep
layouts apart. The value is::

    header (HEADER_ALIGN-padded)  magic "RKVB" | version u16 | layout tag | identity root |
                                  block hash | parent hash | block tokens (uint32-LE) |
                                  payload bytes u64 | payload checksum (xxh3-128)
    payload                       K of layer 0, V of layer 0, K of layer 1, … (2·L segments of
                                  B·Hkv·D·itemsize bytes each, the runner's pool layout), then
                                  for a quantized KV format the scales: Ks0, Vs0, Ks1, … (2·L
                                  segments of B·Hkv·4 bytes, one fp32 per token and KV head)

The layout tag names the KV format (``BlockLayout.dtype``: the dtype for unquantized K/V, the
format tag ``kernels.kv_quant.KVFormat.tag`` for quantized ones, e.g.
``L30.H3.D64.int8-tokhead-f32-v1.B16``), so keys and headers differ by format; a value whose
header names another format than the reader's is refused as ``"format"``.

A reader builds the header it expects from what it knows (root, hashes, tokens, layout) and
accepts a value only if every header byte but the checksum matches and the checksum of the
payload it read matches the header's: a corrupt, colliding or stale entry costs a recompute,
never a wrong answer. A backend that keeps values where they can rot (the disk tier) also
checks each value it reads against itself and its key first (``read_header``,
``check_stored_value``), without knowing the layout. Everything here is bytes and ints: no
torch.
"""

from __future__ import annotations

import dataclasses
import re
import struct

import xxhash

MAGIC = b"RKVB"
#: Bump when the header or payload layout changes: older values are then rejected as stale.
VALUE_VERSION = 1
#: The payload starts at a multiple of this many bytes (cache-line aligned copies).
HEADER_ALIGN = 64
CHECKSUM_BYTES = 16
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: What a layout's ``dtype`` (the KV format) may hold: no ``.`` (tag) or ``:`` (key) in it.
_FORMAT_RE = re.compile(r"[A-Za-z0-9_-]+")


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How one block's K/V (and, for a quantized KV format, its scales) sits in the runner's
    pools, and so in a store value.

    Attributes:
        num_layers: L, transformer layers.
        num_kv_heads: Hkv, KV heads per layer.
        head_dim: D.
        dtype: The KV format: the dtype name for unquantized K/V (``"float32"``,
            ``"bfloat16"``), the format tag for quantized ones (``"int8-tokhead-f32-v1"``,
            ``"fp8_e4m3-tokhead-f32-v1"``: ``KVFormat.tag``).
        itemsize: Bytes per K/V element (1 for int8 and fp8).
        block_size: B, tokens per block.
        scale_itemsize: Bytes of one scale (per token slot and KV head): 4 (fp32) for a
            quantized format, 0 (no scale segments) for unquantized K/V.

    Raises:
        ValueError: naming the field that is not a positive int (``scale_itemsize``: not an
            int >= 0; ``dtype``: not a non-empty str of letters, digits, ``_`` and ``-``,
            which keeps it apart in the ``.``-separated tag and the ``:``-separated key).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    block_size: int
    scale_itemsize: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "itemsize", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if type(self.scale_itemsize) is not int or self.scale_itemsize < 0:
            raise ValueError(f"scale_itemsize: must be an int >= 0, got {self.scale_itemsize!r}")
        if not isinstance(self.dtype, str) or not _FORMAT_RE.fullmatch(self.dtype):
            raise ValueError(f"dtype: must be a non-empty str of letters, digits, '_' and '-', "
                             f"got {self.dtype!r}")

    @property
    def segment_bytes(self) -> int:
        """Bytes of one layer's K (or V) values of one block: ``B * Hkv * D * itemsize``."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def scale_segment_bytes(self) -> int:
        """Bytes of one layer's K (or V) scales of one block: ``B * Hkv * scale_itemsize``
        (0 for unquantized K/V)."""
        return self.block_size * self.num_kv_heads * self.scale_itemsize

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        """Bytes of each payload segment, in payload (and ``runner.kv_segments()``) order:
        K0, V0, K1, V1, … (``segment_bytes`` each), then for a quantized format Ks0, Vs0, Ks1,
        … (``scale_segment_bytes`` each)."""
        values = (self.segment_bytes,) * (2 * self.num_layers)
        if not self.scale_itemsize:
            return values
        return values + (self.scale_segment_bytes,) * (2 * self.num_layers)

    @property
    def num_segments(self) -> int:
        """2·L (K and V of every layer), 4·L with the scale segments of a quantized format."""
        return (4 if self.scale_itemsize else 2) * self.num_layers

    @property
    def payload_bytes(self) -> int:
        """K and V (and their scales) of every layer of one block."""
        return sum(self.segment_sizes)

    @property
    def tag(self) -> str:
        """Short layout tag used in keys and headers, e.g. ``L30.H3.D64.float32.B16`` or
        ``L30.H3.D64.int8-tokhead-f32-v1.B16`` (the KV format sits between ``D`` and ``B``)."""
        return (f"L{self.num_layers}.H{self.num_kv_heads}.D{self.head_dim}.{self.dtype}"
                f".B{self.block_size}")

    def header_bytes(self, digest_bytes: int) -> int:
        """Size of the (padded) header for hashes of ``digest_bytes`` bytes."""
        raw = (len(MAGIC) + 2 + 2 + len(self.tag) + 3 * (1 + digest_bytes)
               + 4 * self.block_size + 8 + CHECKSUM_BYTES)
        return -(-raw // HEADER_ALIGN) * HEADER_ALIGN

    def value_bytes(self, digest_bytes: int) -> int:
        """Header + payload of one stored block."""
        return self.header_bytes(digest_bytes) + self.payload_bytes


def store_key(layout: BlockLayout, root: bytes, block_hash: bytes) -> str:
    """The store key of a block: ``rkv1:<layout tag>:<root hex>:<chained hash hex>`` (ASCII)."""
    return f"rkv{VALUE_VERSION}:{layout.tag}:{root.hex()}:{block_hash.hex()}"


def encode_header(layout: BlockLayout, root: bytes, block_hash: bytes, parent_hash: bytes,
                  token_bytes: bytes | memoryview, checksum: bytes) -> bytes:
    """The padded header of one block's value.

    Args:
        layout: KV layout of the payload.
        root: Identity root hash; ``block_hash`` and ``parent_hash`` have its length.
        block_hash: The block's chained hash.
        parent_hash: The previous block's chained hash (``root`` for the first block).
        token_bytes: The block's B tokens packed uint32-LE (4·B bytes).
        checksum: ``payload_checksum`` of the payload (16 bytes; zeros in an expected header).

    Raises:
        ValueError: naming ``token_bytes``, ``block_hash``, ``parent_hash`` or ``checksum`` when
            their lengths do not fit the layout and root.
    """
    n = len(root)
    if not 1 <= n <= 255:
        raise ValueError(f"root: must be 1..255 bytes, got {n}")
    for name, value in (("block_hash", block_hash), ("parent_hash", parent_hash)):
        if len(value) != n:
            raise ValueError(f"{name}: must be {n} bytes like root, got {len(value)}")
    if len(token_bytes) != 4 * layout.block_size:
        raise ValueError(f"token_bytes: must be {4 * layout.block_size} bytes, got "
                         f"{len(token_bytes)}")
    if len(checksum) != CHECKSUM_BYTES:
        raise ValueError(f"checksum: must be {CHECKSUM_BYTES} bytes, got {len(checksum)}")
    tag = layout.tag.encode()
    raw = b"".join((MAGIC, _U16.pack(VALUE_VERSION), _U16.pack(len(tag)), tag,
                    bytes((n,)), root, bytes((n,)), block_hash, bytes((n,)), parent_hash,
                    bytes(token_bytes), _U64.pack(layout.payload_bytes), checksum))
    return raw.ljust(layout.header_bytes(n), b"\0")


def payload_checksum(payload: bytes | memoryview) -> bytes:
    """xxh3-128 digest of a payload (16 bytes); one C call over the contiguous bytes."""
    return xxhash.xxh3_128_digest(payload)


def tag_format(tag: str) -> str | None:
    """The KV format a layout tag names (``BlockLayout.dtype``: ``"float32"``,
    ``"int8-tokhead-f32-v1"``, …), or None when ``tag`` is not ``L<n>.H<n>.D<n>.<format>.B<n>``."""
    parts = tag.split(".")
    if len(parts) != 5 or not _FORMAT_RE.fullmatch(parts[3]):
        return None
    return parts[3]


def other_format(expected_tag: str, tag: str) -> bool:
    """Whether layout tag ``tag`` is ``expected_tag`` with another KV format (the same L, Hkv,
    D and B): a block written under another ``--kv-cache-dtype``."""
    mine, theirs = tag_format(expected_tag), tag_format(tag)
    if mine is None or theirs is None or mine == theirs:
        return False
    a, b = expected_tag.split("."), tag.split(".")
    return a[:3] == b[:3] and a[4] == b[4]


def _mismatch_reason(expected_header: bytes, value: memoryview, reason: str) -> str:
    """``"format"`` when ``value``'s header parses and names the expected layout in another
    KV format, else ``reason``."""
    header = read_header(value)
    if isinstance(header, str):
        return reason
    (tag_len,) = _U16.unpack_from(expected_header, 6)
    expected_tag = bytes(expected_header[8 : 8 + tag_len]).decode("ascii")
    return "format" if other_format(expected_tag, header.tag) else reason


def check_value(expected_header: bytes, value: memoryview) -> str | None:
    """Why ``value`` must be rejected, or None when it is the block the reader expects.

    Args:
        expected_header: ``encode_header(...)`` with a zero checksum for the block wanted.
        value: The bytes read: header then payload (``value_bytes`` long when it is the
            block wanted; any length is checked).

    Returns:
        ``"format"`` (a well-formed value of this layout in another KV format: written under
        another ``--kv-cache-dtype``), ``"header"`` (magic, version, layout, identity, hashes
        or tokens differ: a stale or colliding entry), ``"size"`` (wrong length) or
        ``"checksum"`` (corrupt payload).
    """
    h = len(expected_header)
    if len(value) < h:
        return _mismatch_reason(expected_header, value, "size")
    cut = _checksum_offset(expected_header)
    if value[:cut] != expected_header[:cut]:
        return _mismatch_reason(expected_header, value, "header")
    end = cut + CHECKSUM_BYTES
    if value[end:h] != expected_header[end:h]:
        return "header"
    (payload_len,) = _U64.unpack_from(expected_header, cut - 8)
    if len(value) != h + payload_len:
        return "size"
    if payload_checksum(value[h:]) != bytes(value[cut:end]):
        return "checksum"
    return None


def _checksum_offset(header: bytes) -> int:
    """Offset of the checksum field in a header built by :func:`encode_header` (after the
    tag, the three length-prefixed hashes, B tokens and the payload length)."""
    (tag_len,) = _U16.unpack_from(header, 6)
    n = header[8 + tag_len]
    block_size = int(header[8 : 8 + tag_len].decode().rsplit(".B", 1)[1])
    return 8 + tag_len + 3 * (1 + n) + 4 * block_size + 8


@dataclasses.dataclass(frozen=True)
class ValueHeader:
    """The fields of a stored value's header, as read back (:func:`read_header`).

    Attributes:
        version: Header format version (``VALUE_VERSION`` when written by this build).
        tag: Layout tag (``BlockLayout.tag``).
        root: Identity root hash.
        block_hash: The block's chained hash.
        parent_hash: The previous block's chained hash (``root`` for a first block).
        token_bytes: The block's tokens, packed uint32-LE.
        payload_bytes: Payload length the header declares.
        checksum: xxh3-128 of the payload (16 bytes).
        header_bytes: Size of the padded header (the payload's offset).
    """

    version: int
    tag: str
    root: bytes
    block_hash: bytes
    parent_hash: bytes
    token_bytes: bytes
    payload_bytes: int
    checksum: bytes
    header_bytes: int

    @property
    def key(self) -> str:
        """The store key this value belongs under (``store_key`` of its layout, root, hash)."""
        return f"rkv{self.version}:{self.tag}:{self.root.hex()}:{self.block_hash.hex()}"

    @property
    def parent_key(self) -> str | None:
        """The store key of the previous block of the chain; None for a first block."""
        if self.parent_hash == self.root:
            return None
        return f"rkv{self.version}:{self.tag}:{self.root.hex()}:{self.parent_hash.hex()}"


def read_header(value: bytes | memoryview) -> ValueHeader | str:
    """Parse the header at the start of ``value`` without knowing what it should hold.

    Args:
        value: A stored value (header then payload) or at least its header.

    Returns:
        The header's fields, or why it cannot be one: ``"size"`` (shorter than the header it
        starts) or ``"header"`` (wrong magic or version, a malformed layout tag, a hash length
        out of range, non-zero padding).
    """
    view = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
    if len(view) < 8:
        return "size"
    if bytes(view[:4]) != MAGIC:
        return "header"
    (version,) = _U16.unpack_from(view, 4)
    (tag_len,) = _U16.unpack_from(view, 6)
    if version != VALUE_VERSION or not 0 < tag_len < 512:
        return "header"
    at = 8 + tag_len
    if len(view) < at + 1:
        return "size"
    try:
        tag = bytes(view[8:at]).decode("ascii")
        block_size = int(tag.rsplit(".B", 1)[1])
    except (UnicodeDecodeError, IndexError, ValueError):
        return "header"
    n = view[at]
    if not 1 <= n <= 255 or not 0 < block_size <= 1 << 20:
        return "header"
    raw = at + 3 * (1 + n) + 4 * block_size + 8 + CHECKSUM_BYTES
    header_bytes = -(-raw // HEADER_ALIGN) * HEADER_ALIGN
    if len(view) < header_bytes:
        return "size"
    fields = []
    pos = at
    for _ in range(3):
        if view[pos] != n:
            return "header"
        fields.append(bytes(view[pos + 1 : pos + 1 + n]))
        pos += 1 + n
    token_bytes = bytes(view[pos : pos + 4 * block_size])
    pos += 4 * block_size
    (payload_bytes,) = _U64.unpack_from(view, pos)
    pos += 8
    checksum = bytes(view[pos : pos + CHECKSUM_BYTES])
    if any(view[raw:header_bytes]):
        return "header"
    return ValueHeader(version, tag, fields[0], fields[1], fields[2], token_bytes,
                       payload_bytes, checksum, header_bytes)


def check_stored_value(key: str, value: bytes | memoryview) -> str | None:
    """Why a value read back under ``key`` must be refused, checked against itself and its key
    only (a backend's own check, before the tier compares it with the block it expects).

    Returns:
        None when the header parses, names ``key`` (layout tag, identity root, block hash), the
        length is the header's plus its payload's and the payload's checksum matches; otherwise
        ``"size"`` (truncated or extended), ``"header"`` (not a header of this format),
        ``"format"`` (a well-formed value of the key's layout in another KV format),
        ``"foreign"`` (a well-formed value of another key: another layout, identity —
        model revision, adapter, salt — or block) or ``"checksum"`` (corrupt payload).
    """
    header = read_header(value)
    if isinstance(header, str):
        return header
    if header.key != key:
        return foreign_reason(key, header)
    view = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
    if len(view) != header.header_bytes + header.payload_bytes:
        return "size"
    if payload_checksum(view[header.header_bytes:]) != header.checksum:
        return "checksum"
    return None


def foreign_reason(key: str, header: ValueHeader) -> str:
    """Why a well-formed value whose header names another key than ``key`` is refused:
    ``"format"`` when its layout tag is the key's layout in another KV format (written under
    another ``--kv-cache-dtype``; as :func:`check_value` tells it), else ``"foreign"``."""
    parts = key.split(":")
    if len(parts) == 4 and other_format(parts[1], header.tag):
        return "format"
    return "foreign"

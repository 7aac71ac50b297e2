"""Block hashes and cache identity: golden vectors, typed encoding, collisions
answered by stored tokens, hashes reproducible across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixkv.cache.hashing import (
    BlockHasher,
    CacheIdentity,
    MMItem,
    as_packed_tokens,
    block_extras,
    pack_tokens,
    unpack_tokens,
    validate_mm_items,
)

ROPE = "theta=100000.0;scaling=None"
IDENT = CacheIdentity("r1", 4, "float32", ROPE)

# Golden vectors: computed once from the derivation in radixkv/cache/hashing.py. If these change,
# every persisted or exported hash changes meaning: bump ROOT_DOMAIN instead of editing them.
GOLDEN_ENCODING = (
    "530e0000006d6f64656c5f7265766973696f6e53020000007231530a000000626c6f636b5f73697a6549080000"
    "00040000000000000053080000006b765f64747970655307000000666c6f617433325304000000726f7065531b"
    "00000074686574613d3130303030302e303b7363616c696e673d4e6f6e65530a00000063616368655f73616c74"
    "4e000000005307000000616461707465724e00000000"
)
GOLDEN = {
    "xxh3_128": {
        "root": "2ac3a5858109c23108a2187185f68cb8",
        "blocks": ["efa019377ec6ad38188a776e7f1fadef", "dc474534685a79a9d86fa3565a8e2080"],
        "root_salt_empty": "930c1f491a15a5685a896fa8c9569988",
        "root_adapter": "59ebf005fcab724efbef6a2aae6c0271",
    },
    "sha256": {
        "root": "5510bdb9d059fc2b3f9224d744257a535b49d2640054ce0eec559c8939dbf142",
        "blocks": [
            "f424ddc53d742bc2d5f81450d09f9b51c08262bd69a74bfce052624659d54331",
            "9837e7a34aee2a9a25427cef3ee3fe07bc39b77cb5f0b761bfe4c58645195a72",
        ],
        "root_salt_empty": "d577cbfd4018953ba7e33e19a951505556cb1e2df44915f9deab47bce7d94ac0",
        "root_adapter": "6c06f5443dd41f51d69986329bde588e60ba58837c38b77bb3b08d2530766aa0",
    },
}


def test_identity_encoding_golden() -> None:
    assert IDENT.encode().hex() == GOLDEN_ENCODING


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_golden_vectors(algo: str) -> None:
    hasher = BlockHasher(algo)
    root = hasher.identity_root(IDENT)
    assert root.hex() == GOLDEN[algo]["root"]
    assert [h.hex() for h in hasher.chain(root, list(range(1, 9)), 4)] == GOLDEN[algo]["blocks"]
    salted = CacheIdentity("r1", 4, "float32", ROPE, cache_salt="")
    assert hasher.identity_root(salted).hex() == GOLDEN[algo]["root_salt_empty"]
    adapted = CacheIdentity("r1", 4, "float32", ROPE, adapter=("a", "d"))
    assert hasher.identity_root(adapted).hex() == GOLDEN[algo]["root_adapter"]


def test_production_digest_sizes_not_truncated() -> None:
    assert len(BlockHasher("xxh3_128").identity_root(IDENT)) == 16
    assert len(BlockHasher("sha256").identity_root(IDENT)) == 32
    assert len(BlockHasher().block_hash(b"\x00" * 16, [1, 2, 3, 4])) == 16


def test_every_identity_field_changes_the_root() -> None:
    hasher = BlockHasher()
    variants = [
        IDENT,
        CacheIdentity("r2", 4, "float32", ROPE),
        CacheIdentity("r1", 8, "float32", ROPE),
        CacheIdentity("r1", 4, "bfloat16", ROPE),
        CacheIdentity("r1", 4, "float32", "theta=10000.0;scaling=None"),
        CacheIdentity("r1", 4, "float32", ROPE, cache_salt=""),
        CacheIdentity("r1", 4, "float32", ROPE, cache_salt="t1"),
        CacheIdentity("r1", 4, "float32", ROPE, adapter=("a", "d1")),
        CacheIdentity("r1", 4, "float32", ROPE, adapter=("a", "d2")),
        # Field boundaries are length-prefixed: moving a character between fields differs.
        CacheIdentity("r1", 4, "float32", ROPE, adapter=("ad", "1")),
    ]
    roots = {hasher.identity_root(v) for v in variants}
    assert len(roots) == len(variants)


def test_pack_tokens_little_endian_uint32() -> None:
    assert pack_tokens([1, 256, 2**32 - 1]) == bytes([1, 0, 0, 0, 0, 1, 0, 0, 255, 255, 255, 255])
    with pytest.raises(ValueError, match="token_ids"):
        pack_tokens([-1])
    with pytest.raises(ValueError, match="token_ids"):
        pack_tokens([2**32])


def test_parent_is_chained() -> None:
    hasher = BlockHasher()
    root = hasher.identity_root(IDENT)
    h1, h2 = hasher.chain(root, [7, 7, 7, 7, 7, 7, 7, 7], 4)
    assert h1 != h2  # same tokens, different parent
    assert h2 == hasher.block_hash(h1, [7, 7, 7, 7])
    assert hasher.num_block_hashes == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model_revision": ""}, "model_revision"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"kv_dtype": ""}, "kv_dtype"),
        ({"cache_salt": 3}, "cache_salt"),
        ({"adapter": ("only-name",)}, "adapter"),
        ({"adapter": ("a", "")}, "adapter"),
        ({"adapter": ("", "d")}, "adapter"),
        ({"adapter": ("", "")}, "adapter"),
        ({"block_size": 2**63}, "block_size"),
    ],
)
def test_identity_validation_names_field(kwargs: dict, field: str) -> None:
    base = {"model_revision": "r1", "block_size": 4, "kv_dtype": "float32", "rope": ROPE}
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        CacheIdentity(**base)


def test_unknown_algo_names_field() -> None:
    with pytest.raises(ValueError, match="hash_algo"):
        BlockHasher("md5")


def tiny_hash(data: bytes) -> bytes:
    """A deliberately colliding H: sum of the input bytes mod 7."""
    return bytes([sum(data) % 7])


def test_c01_tiny_digest_chain() -> None:
    hasher = BlockHasher(hash_fn=tiny_hash)
    assert hasher.algo == "custom"
    root = hasher.identity_root(IDENT)
    # A's and C's first blocks collide under this H ...
    assert hasher.block_hash(root, [1, 2, 3, 4]) == hasher.block_hash(root, [4, 3, 2, 1])
    # ... and D's two identical-token blocks still differ because the parent is chained in.
    d1, d2 = hasher.chain(root, [5, 5, 5, 5, 5, 5, 5, 5, 1], 4)
    assert d1 != d2


_C02_SCRIPT = (
    "from radixkv.cache.hashing import BlockHasher, CacheIdentity\n"
    "h = BlockHasher()\n"
    "root = h.identity_root(CacheIdentity('r1', 4, 'float32', 'theta=100000.0;scaling=None'))\n"
    "print(','.join(x.hex() for x in h.chain(root, list(range(1, 9)), 4)))\n"
)


def test_c02_reproducible_across_processes() -> None:
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", _C02_SCRIPT], env=env, capture_output=True,
                              text=True, check=True, timeout=60)
        outputs.append(proc.stdout.strip().split(","))
    assert outputs[0] == outputs[1] == GOLDEN["xxh3_128"]["blocks"]


# Multimodal golden vectors: a 2x2 RGB image (bytes 0..11) at prompt offset 2 for 4 tokens,
# B=4, prompt [1, 2, 999, 999, 999, 999, 3, 4, 5] under IDENT.
MM_PROMPT = [1, 2, 999, 999, 999, 999, 3, 4, 5]
GOLDEN_MM = {
    "xxh3_128": {
        "media": "a4bfc9e04578603e1f7648b318190b12",
        "extras": [
            "540100000054020000004210000000a4bfc9e04578603e1f7648b318190b12"
            "49080000000200000000000000",
            "540100000054020000004210000000a4bfc9e04578603e1f7648b318190b12"
            "4908000000feffffffffffffff",
        ],
        "blocks": ["d3d3abc08fe3d8edfb8d0ffd464c8b28", "4096f02220e3ed01cf507330763dc893"],
    },
    "sha256": {
        "media": "c2b9c37ace5c5ff4a14ecdaa63598c848490e19c1b312409fc82548c569597a9",
        "blocks": [
            "8ce151de2933c5eb14e084ee5191367e25aae1f60aed78439dc5846065d34335",
            "0499f80c7f3f793f79723677407b8693588cc32c0148e291447a3b35014c8c52",
        ],
    },
}


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_multimodal_golden_vectors(algo: str) -> None:
    hasher = BlockHasher(algo)
    digest = hasher.media_digest("rgb8", (2, 2, 3), bytes(range(12)))
    assert digest.hex() == GOLDEN_MM[algo]["media"]
    items = [MMItem(2, 4, digest)]
    if "extras" in GOLDEN_MM[algo]:
        extras = block_extras(validate_mm_items(items, 9), 2, 4)
        assert [e.hex() for e in extras] == GOLDEN_MM[algo]["extras"]
    root = hasher.identity_root(IDENT)
    got = [h.hex() for h in hasher.chain(root, MM_PROMPT, 4, mm_items=items)]
    assert got == GOLDEN_MM[algo]["blocks"]
    # Text blocks keep the text derivation (empty extras): the golden text vectors still hold.
    assert hasher.chain(root, list(range(1, 9)), 4, mm_items=[]) == hasher.chain(
        root, list(range(1, 9)), 4)


def test_media_digest_covers_format_shape_and_bytes() -> None:
    hasher = BlockHasher()
    base = hasher.media_digest("rgb8", (2, 2, 3), bytes(12))
    assert len({base, hasher.media_digest("bgr8", (2, 2, 3), bytes(12)),
                hasher.media_digest("rgb8", (1, 4, 3), bytes(12)),
                hasher.media_digest("rgb8", (2, 2, 3), bytes(11) + b"\x01")}) == 4
    with pytest.raises(ValueError, match="shape"):
        hasher.media_digest("rgb8", (2.0, 2), bytes(4))


def test_identity_messages_exact() -> None:
    with pytest.raises(ValueError) as exc:
        CacheIdentity("r1", 4, "float32", ROPE, adapter=("a", ""))
    assert str(exc.value) == ("adapter: must be None or a (name, weights_digest) tuple of "
                              "non-empty strings, got ('a', '')")
    with pytest.raises(ValueError) as exc:
        CacheIdentity("r1", 2**63, "float32", ROPE)
    assert str(exc.value) == f"block_size: must be an int in [1, 1024], got {2**63}"
    # The largest block size encodes, as an int64 (tag "I", 8 bytes, little-endian).
    top = CacheIdentity("r1", 1024, "float32", ROPE).encode()
    assert bytes.fromhex("49080000000004000000000000") in top


def test_media_digest_encodes_by_type_no_coercion() -> None:
    hasher = BlockHasher()
    want = GOLDEN_MM["xxh3_128"]["media"]
    # Equivalent containers of the same values keep the golden digest (derivation unchanged).
    data = bytes(range(12))
    for shape, raw in (([2, 2, 3], data), ((2, 2, 3), bytearray(data)),
                       ((2, 2, 3), memoryview(data))):
        assert hasher.media_digest("rgb8", shape, raw).hex() == want
    # Dimensions in [0, 2**63) are accepted, a zero dimension included.
    assert len(hasher.media_digest("rgb8", (0, 2**63 - 1), b"")) == 16
    cases = [
        ((None, (1,), b"x"), "media_format: must be a str, got NoneType"),
        ((b"png", (1,), b"x"), "media_format: must be a str, got bytes"),
        (("png", (1,), 5), "data: must be bytes-like (bytes, bytearray, memoryview), got int"),
        (("png", (1,), "x"), "data: must be bytes-like (bytes, bytearray, memoryview), got str"),
        (("png", (1,), None),
         "data: must be bytes-like (bytes, bytearray, memoryview), got NoneType"),
        (("png", (-1,), b"x"), "shape: must be a tuple or list of ints in [0, 2**63), got (-1,)"),
        (("png", (2**64,), b"x"),
         f"shape: must be a tuple or list of ints in [0, 2**63), got ({2**64},)"),
        (("png", (True,), b"x"),
         "shape: must be a tuple or list of ints in [0, 2**63), got (True,)"),
        (("png", "12", b"x"), "shape: must be a tuple or list of ints in [0, 2**63), got '12'"),
        (("png", 3, b"x"), "shape: must be a tuple or list of ints in [0, 2**63), got 3"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as exc:
            hasher.media_digest(*args)
        assert str(exc.value) == message


def test_block_extras_offsets_relative_to_block_start() -> None:
    d1, d2 = b"\x01" * 16, b"\x02" * 16
    items = validate_mm_items([(9, 2, d2), (2, 4, d1)], 12)
    assert items == (MMItem(2, 4, d1), MMItem(9, 2, d2))  # sorted by offset
    extras = block_extras(items, 3, 4)
    # Block 0 sees d1 at +2, block 1 sees d1 at -2 (began earlier), block 2 sees d2 at +1.
    assert extras[0] != extras[1] and extras[2] != b""
    assert block_extras(items, 3, 4, first_block=1) == extras[1:]
    assert block_extras(validate_mm_items([(8, 4, d1)], 12), 2, 4) is None  # no full block
    for bad in ([(0, 0, d1)], [(10, 4, d1)], [(-1, 2, d1)], [(0, 2, b"")], [(0, 2)]):
        with pytest.raises(ValueError, match="mm_items"):
            validate_mm_items(bad, 12)


def test_c04_blocks_keyed_by_digest_and_offset() -> None:
    hasher = BlockHasher()
    root = hasher.identity_root(IDENT)
    h1 = hasher.media_digest("rgb8", (1,), b"image-1")
    h2 = hasher.media_digest("rgb8", (1,), b"image-2")
    r1 = hasher.chain(root, MM_PROMPT, 4, mm_items=[(2, 4, h1)])
    r2 = hasher.chain(root, MM_PROMPT, 4, mm_items=[(2, 4, h2)])
    text = hasher.chain(root, MM_PROMPT, 4)
    assert r1[0] != r2[0] and r1[0] != text[0]  # block 0 already covers part of the image
    shifted = hasher.chain(root, MM_PROMPT, 4, mm_items=[(3, 3, h1)])
    assert shifted[0] != r1[0]  # same image at another offset


def test_packed_tokens_round_trip() -> None:
    data = pack_tokens([0, 1, 70000, 2**32 - 1])
    assert unpack_tokens(data) == (0, 1, 70000, 2**32 - 1)
    assert as_packed_tokens(data) == data and as_packed_tokens([0, 1, 70000, 2**32 - 1]) == data
    with pytest.raises(ValueError, match="token_ids"):
        as_packed_tokens(b"\x00" * 5)


def test_block_hasher_refuses_bad_arguments() -> None:
    h = BlockHasher()
    root = h.identity_root(IDENT)
    for bad in (True, "4", 0, 2.0):
        with pytest.raises(ValueError, match=r"block_size: must be an int in \[1, 1024\]"):
            h.chain(root, [1, 2, 3, 4], bad)
    for bad in (None, "root", bytearray(16)):
        with pytest.raises(ValueError, match="parent_hash: must be bytes"):
            h.chain(bad, [1, 2, 3, 4], 4)
        with pytest.raises(ValueError, match="parent_hash: must be bytes"):
            h.block_hash(bad, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="extras: must be bytes, got str"):
        h.block_hash(root, [1, 2, 3, 4], "e")
    with pytest.raises(ValueError, match="extras: 1 entries for 2 blocks"):
        h.hash_blocks(root, pack_tokens(range(8)), 4, [b""])
    with pytest.raises(ValueError, match="token_bytes: 28 bytes are not whole blocks of 16"):
        h.hash_blocks(root, pack_tokens(range(7)), 4)
    assert h.num_block_hashes == 0  # nothing was hashed by the refused calls

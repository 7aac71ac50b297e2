"""Block hashes and cache identity: golden vectors, typed encoding, C01 and C02."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixkv.hashing import BlockHasher, CacheIdentity, pack_tokens

ROPE = "theta=100000.0;scaling=None"
IDENT = CacheIdentity("r1", 4, "float32", ROPE)

# Golden vectors: computed once from the derivation in radixkv/hashing.py. If these change,
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
    """C01's deliberately colliding H: sum of the input bytes mod 7."""
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
    "from radixkv.hashing import BlockHasher, CacheIdentity\n"
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

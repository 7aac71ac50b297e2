"""Store values: layout sizes, keys, headers and the reader's checks (radixkv.cache.store.value)."""

from __future__ import annotations

import pytest

from radixkv.cache.store.backend import KVStoreSpec, parse_kv_store
from radixkv.cache.store.value import (
    BlockLayout,
    check_value,
    encode_header,
    payload_checksum,
    store_key,
)

SMOLLM2 = BlockLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", itemsize=4,
                      block_size=16)
ROOT, H1, H0 = b"r" * 16, b"h" * 16, b"p" * 16
TOKENS = bytes(range(64))  # 16 tokens, packed


def test_smollm2_layout_sizes_and_key():
    assert SMOLLM2.segment_bytes == 16 * 3 * 64 * 4 == 12288
    assert SMOLLM2.num_segments == 60
    assert SMOLLM2.payload_bytes == 737280
    assert SMOLLM2.tag == "L30.H3.D64.float32.B16"
    # magic 4 + version 2 + tag len 2 + tag 22 + 3 * 17 + tokens 64 + payload len 8 + csum 16
    assert SMOLLM2.header_bytes(16) == 192
    assert SMOLLM2.value_bytes(16) == 192 + 737280
    assert store_key(SMOLLM2, ROOT, H1) == ("rkv1:L30.H3.D64.float32.B16:" + "72" * 16 + ":"
                                            + "68" * 16)


def _value(layout=SMOLLM2, payload=None, **fields):
    payload = payload if payload is not None else bytes(range(256)) * (layout.payload_bytes // 256)
    args = dict(root=ROOT, block_hash=H1, parent_hash=H0, token_bytes=TOKENS) | fields
    header = encode_header(layout, args["root"], args["block_hash"], args["parent_hash"],
                           args["token_bytes"], payload_checksum(payload))
    return bytearray(header + payload)


def _expected(**fields):
    args = dict(root=ROOT, block_hash=H1, parent_hash=H0, token_bytes=TOKENS) | fields
    return encode_header(SMOLLM2, args["root"], args["block_hash"], args["parent_hash"],
                         args["token_bytes"], bytes(16))


def test_a_matching_value_passes():
    assert check_value(_expected(), memoryview(_value())) is None


@pytest.mark.parametrize("field,other", [("root", b"R" * 16), ("block_hash", b"H" * 16),
                                         ("parent_hash", b"P" * 16),
                                         ("token_bytes", bytes(63) + b"\x01")])
def test_a_value_for_another_block_is_rejected_by_its_header(field, other):
    assert check_value(_expected(**{field: other}), memoryview(_value())) == "header"


def test_other_layout_or_version_is_rejected():
    # Another shape (head dim 32): a header mismatch. Another KV format of the same shape
    # (bf16 values read by an fp32 reader): refused by name as "format".
    other_shape = BlockLayout(30, 3, 32, "float32", 4, 16)
    expected = encode_header(SMOLLM2, ROOT, H1, H0, TOKENS, bytes(16))
    assert check_value(expected, memoryview(_value(other_shape))) == "header"
    bf16 = BlockLayout(30, 3, 64, "bfloat16", 2, 16)
    assert check_value(expected, memoryview(_value(bf16))) == "format"
    stale = _value()
    stale[4] = 0  # version 0
    assert check_value(_expected(), memoryview(stale)) == "header"


def test_one_flipped_payload_byte_fails_the_checksum_and_a_short_value_the_size():
    value = _value()
    value[SMOLLM2.header_bytes(16) + 1000] ^= 0x01
    assert check_value(_expected(), memoryview(value)) == "checksum"
    assert check_value(_expected(), memoryview(_value())[:-1]) == "size"
    assert check_value(_expected(), memoryview(_value())[:10]) == "size"


def test_header_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="token_bytes: must be 64 bytes"):
        encode_header(SMOLLM2, ROOT, H1, H0, TOKENS[:60], bytes(16))
    with pytest.raises(ValueError, match="parent_hash: must be 16 bytes"):
        encode_header(SMOLLM2, ROOT, H1, H0[:8], TOKENS, bytes(16))
    with pytest.raises(ValueError, match="num_kv_heads: must be an int >= 1"):
        BlockLayout(30, 0, 64, "float32", 4, 16)


def test_parse_kv_store_specs():
    assert parse_kv_store("host:2") == KVStoreSpec("host", capacity_bytes=2 << 30)
    assert parse_kv_store("host:0.5?policy=lfu").policy == "lfu"
    spec = parse_kv_store("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata"
                          "&local=127.0.0.1:17001&segment_gib=0.25")
    assert (spec.kind, spec.master, spec.metadata_url, spec.local_hostname, spec.segment_bytes) \
        == ("mooncake", "127.0.0.1:50051", "http://127.0.0.1:8080/metadata", "127.0.0.1:17001",
            1 << 28)
    assert spec.describe() == "mooncake://127.0.0.1:50051"
    for bad, match in (("host:0", "positive number"), ("host:x", "positive number"),
                       ("mooncake://h:1", "needs metadata=URL"), ("redis://x", "expected host"),
                       ("mooncake://h?metadata=http://m", "HOST:PORT"),
                       ("host:1?size=2", "unknown option 'size'")):
        with pytest.raises(ValueError, match=f"kv_store.*{match}"):
            parse_kv_store(bad)

"""Request bodies sent with ``Content-Encoding``: gzip and deflate are decoded (and counted
against ``--max-body-bytes`` after decoding), a corrupt body is a 400, an encoding the server
does not decode is a 415 — all in OpenAI's error shape with ``X-Request-Id``, none counted as a
server error (one tiny-model server for the module)."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.conftest import MAX_BODY_BYTES
from tests.server.helpers import get

TOKENIZE = "/tokenize"
BODY = orjson.dumps({"prompt": "Hello there, general Kenobi"})


def deflate(data: bytes) -> bytes:
    return zlib.compress(data)


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


async def send(server, data: bytes, encoding: str | None, request_id: str = "enc-test-1"
               ) -> tuple[int, Any, Any]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.post(server.url + TOKENIZE, data=data, headers=headers) as resp:
            raw = await resp.read()
            try:
                body: dict | str = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = raw.decode(errors="replace")
            return resp.status, body, resp.headers.copy()


async def server_errors(server) -> int:
    status, stats = await get(server.url, "/stats")
    assert status == 200
    return stats["server_errors_total"]


DECODED = [
    pytest.param(BODY, None, id="no-header"),
    pytest.param(BODY, "identity", id="identity"),
    pytest.param(gzip.compress(BODY), "gzip", id="gzip"),
    pytest.param(gzip.compress(BODY), "x-gzip", id="x-gzip"),
    pytest.param(gzip.compress(BODY), "GZip", id="gzip-any-case"),
    pytest.param(deflate(BODY), "deflate", id="deflate-zlib"),
    pytest.param(raw_deflate(BODY), "deflate", id="deflate-raw"),
    # Applied in the order listed: gzip first, then deflate; decoded in reverse.
    pytest.param(deflate(gzip.compress(BODY)), "gzip, deflate", id="gzip-then-deflate"),
    pytest.param(gzip.compress(BODY), "identity, gzip", id="identity-then-gzip"),
    # RFC 9110 §5.6.1.2: empty list elements are ignored.
    pytest.param(gzip.compress(BODY), " gzip ,, ", id="gzip-with-empty-elements"),
    pytest.param(gzip.compress(BODY) + gzip.compress(b""), "gzip", id="gzip-two-members"),
]


@pytest.mark.parametrize(("data", "encoding"), DECODED)
async def test_decodable_bodies_are_served(server, data, encoding):
    status, plain, _ = await send(server, BODY, None)
    assert status == 200, plain
    status, body, headers = await send(server, data, encoding)
    assert status == 200, body
    assert body == plain
    assert body["count"] == len(body["tokens"]) > 0
    assert headers["X-Request-Id"] == "enc-test-1"


REFUSED = [
    # (body, encoding, status, code)
    pytest.param(BODY, "gzip", 400, "invalid_content_encoding", id="gzip-not-gzip"),
    pytest.param(gzip.compress(BODY)[:-12], "gzip", 400, "invalid_content_encoding",
                 id="gzip-truncated"),
    pytest.param(gzip.compress(BODY) + b"trailing", "gzip", 400, "invalid_content_encoding",
                 id="gzip-trailing-garbage"),
    pytest.param(b"\x78\x9c" + b"\xff" * 40, "deflate", 400, "invalid_content_encoding",
                 id="deflate-corrupt"),
    pytest.param(b"", "gzip", 400, "invalid_content_encoding", id="gzip-empty"),
    pytest.param(b"\x8b\x00" * 20, "br", 415, "unsupported_content_encoding", id="br"),
    pytest.param(b"(\xb5/\xfd" + b"\x00" * 20, "zstd", 415, "unsupported_content_encoding",
                 id="zstd"),
    pytest.param(BODY, "compress", 415, "unsupported_content_encoding", id="compress"),
    pytest.param(BODY, "snappy-ish", 415, "unsupported_content_encoding", id="unknown"),
    pytest.param(gzip.compress(BODY), "gzip, br", 415, "unsupported_content_encoding",
                 id="gzip-then-br"),
    pytest.param(BODY, "gzip,,", 400, "invalid_content_encoding", id="not-gzip-in-a-list"),
]


@pytest.mark.parametrize(("data", "encoding", "status", "code"), REFUSED)
async def test_undecodable_bodies_get_the_openai_error_shape(server, data, encoding, status,
                                                             code):
    errors_before = await server_errors(server)
    got, body, headers = await send(server, data, encoding, request_id="enc-refused-7")
    assert (got, isinstance(body, dict)) == (status, True), body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == code
    assert body["error"]["param"] is None
    assert "Content-Encoding" in body["error"]["message"]
    assert headers["X-Request-Id"] == "enc-refused-7"
    assert headers["Content-Type"].startswith("application/json")
    if status == 415:  # RFC 9110 §15.5.16: say which codings would have been accepted
        assert headers["Accept-Encoding"] == "gzip, deflate, identity"
    assert await server_errors(server) == errors_before
    assert await get(server.url, "/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("wrap", [gzip.compress, deflate], ids=["gzip", "deflate"])
async def test_a_compression_bomb_gets_413_not_memory(server, wrap):
    # 64x the limit once decoded, a few KiB on the wire: the limit applies to what is decoded.
    bomb = wrap(b"{" + b" " * (64 * MAX_BODY_BYTES) + b"}")
    assert len(bomb) < MAX_BODY_BYTES // 8
    errors_before = await server_errors(server)
    status, body, headers = await send(server, bomb, "gzip" if wrap is gzip.compress
                                       else "deflate", request_id="enc-bomb-3")
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error"
    assert str(MAX_BODY_BYTES) in body["error"]["message"]
    assert headers["X-Request-Id"] == "enc-bomb-3"
    assert await server_errors(server) == errors_before


def padded(size: int) -> bytes:
    """``{"prompt": "Hello there"}`` padded with JSON whitespace to exactly ``size`` bytes."""
    head, tail = b'{"prompt": "Hello there"', b"}"
    return head + b" " * (size - len(head) - len(tail)) + tail


async def test_the_limit_is_exact_on_the_decoded_size(server):
    status, plain, _ = await send(server, orjson.dumps({"prompt": "Hello there"}), None)
    assert status == 200, plain
    status, body, _ = await send(server, gzip.compress(padded(MAX_BODY_BYTES)), "gzip")
    assert (status, body) == (200, plain)
    status, body, _ = await send(server, gzip.compress(padded(MAX_BODY_BYTES + 1)), "gzip")
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"

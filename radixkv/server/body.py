"""Request bodies: read, decode their ``Content-Encoding``, hold them to the size limit.

The application turns off aiohttp's own decompression (``HANDLER_ARGS``) and decodes here, so
every outcome is one of ours in OpenAI's error shape (``radixkv.server.errors``):

- ``identity``, ``gzip`` (also ``x-gzip``) and ``deflate`` (zlib-wrapped, or raw as some
  clients send it) are decoded, a list of them in reverse order of application (RFC 9110
  §8.4); names are case-insensitive and empty list elements are ignored.
- a body that does not decode as labelled: 400 ``invalid_content_encoding``.
- any other coding (``br``, ``zstd``, ``compress``, ...): 415 ``unsupported_content_encoding``
  with ``Accept-Encoding`` naming the codings the server decodes (RFC 9110 §15.5.16).
- the limit (``--max-body-bytes``) holds for the body on the wire and again for the body once
  decoded, which is never inflated past limit + 1 bytes: a compression bomb is a 413
  ``request_too_large`` that costs at most the limit in memory.

None of these is a server fault: they are logged at info and not counted in
``server_errors_total``.
"""

from __future__ import annotations

import zlib

from aiohttp import web

from radixkv.server.errors import APIError

__all__ = ["ACCEPTED_ENCODINGS", "HANDLER_ARGS", "decode_body", "read_body"]

# web.Application(handler_args=...): bodies reach the handlers as sent (decoded in read_body).
HANDLER_ARGS = {"auto_decompress": False}
ACCEPTED_ENCODINGS = "gzip, deflate, identity"
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_DEFLATE_WBITS = -zlib.MAX_WBITS
_GZIP_MAGIC = b"\x1f\x8b"


def too_large(limit: int, detail: str = "") -> APIError:
    """413 ``request_too_large`` for a body over ``limit`` bytes."""
    return APIError(413, f"request body exceeds the server's limit of {limit} bytes{detail}",
                    code="request_too_large")


def _corrupt(coding: str, why: str) -> APIError:
    return APIError(400, f"request body is not valid {coding} data (Content-Encoding: "
                         f"{coding}): {why}", code="invalid_content_encoding")


def _unsupported(coding: str) -> APIError:
    return APIError(415, f"Content-Encoding {coding!r} is not supported; send the body "
                         f"uncompressed or as {ACCEPTED_ENCODINGS}",
                    code="unsupported_content_encoding",
                    headers={"Accept-Encoding": ACCEPTED_ENCODINGS})


def _codings(header_values: list[str]) -> list[str]:
    """The codings in the order they were applied (lower case, ``identity`` dropped).

    Raises:
        APIError: 415 naming the first coding not decoded here.
    """
    names = [name.strip().lower() for value in header_values for name in value.split(",")]
    codings = [name for name in names if name and name != "identity"]
    for coding in codings:
        if coding not in ("gzip", "x-gzip", "deflate"):
            raise _unsupported(coding)
    return codings


def _inflate(data: bytes, wbits: int, coding: str, limit: int) -> bytes:
    """Decode one zlib-family stream (gzip members back to back are one body, as ``gzip -d``
    reads them), never holding more than ``limit + 1`` decoded bytes."""
    out = bytearray()
    unpacker = zlib.decompressobj(wbits)
    pending = data
    try:
        while True:
            # max_length bounds what one call inflates: the bomb never lands in memory.
            chunk = unpacker.decompress(pending, limit + 1 - len(out))
            out += chunk
            if len(out) > limit:
                raise too_large(limit, f" once decoded (Content-Encoding: {coding})")
            if unpacker.eof:
                rest = unpacker.unused_data
                if not rest:
                    return bytes(out)
                if wbits == _GZIP_WBITS and rest.startswith(_GZIP_MAGIC):
                    unpacker, pending = zlib.decompressobj(wbits), rest
                    continue
                raise _corrupt(coding, f"{len(rest)} bytes follow the end of the stream")
            progressed = bool(chunk) or len(unpacker.unconsumed_tail) < len(pending)
            pending = unpacker.unconsumed_tail
            if not progressed:
                raise _corrupt(coding, "the stream ends before its end marker (truncated)")
    except zlib.error as exc:
        raise _corrupt(coding, str(exc)) from None


def decode_body(raw: bytes, header_values: list[str], limit: int) -> bytes:
    """Undo ``Content-Encoding`` on a request body.

    Args:
        raw: The body as received, at most ``limit`` bytes.
        header_values: Every ``Content-Encoding`` header value of the request (comma lists).
        limit: Largest decoded body in bytes.

    Returns:
        The decoded body (``raw`` itself when there is no coding to undo).

    Raises:
        APIError: 415 for a coding not decoded here (checked before any decoding), 400 for a
            body that does not decode as labelled, 413 when a decoded stage exceeds ``limit``.
    """
    codings = _codings(header_values)
    body = raw
    for coding in reversed(codings):
        if not body:
            raise _corrupt(coding, "the body is empty")
        if coding == "deflate":
            # RFC 9110 says zlib-wrapped; some clients send raw deflate (no zlib header, whose
            # low nibble is the method, 8): accept both, as aiohttp and browsers do.
            wbits = _ZLIB_WBITS if body[0] & 0x0F == 8 else _RAW_DEFLATE_WBITS
        else:
            wbits = _GZIP_WBITS
        body = _inflate(body, wbits, coding, limit)
    return body


async def read_body(request: web.Request) -> bytes:
    """The request's body, decoded, within ``request.client_max_size`` (see the module doc).

    Raises:
        APIError: 413, 415 or 400 as ``decode_body`` (413 also for a body over the limit on
            the wire, from its ``Content-Length`` before reading anything).
    """
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body of {request.content_length} bytes exceeds the "
                            f"server's limit of {limit} bytes", code="request_too_large")
    header_values = request.headers.getall("Content-Encoding", [])
    codings = _codings(header_values)  # an unknown coding: 415 before reading the body
    raw = await request.read()  # aiohttp itself raises 413 past client_max_size (chunked)
    return decode_body(raw, header_values, limit) if codings else raw

"""``GET /version``: vLLM's route, ``{"version": "<radixkv's package version>"}``."""

from __future__ import annotations

import functools
import importlib.metadata

from aiohttp import web

from radixkv.server.errors import json_response


@functools.cache
def package_version() -> str:
    """The installed radixkv distribution's version ("0+unknown" when not installed)."""
    try:
        return importlib.metadata.version("radixkv")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


async def version(request: web.Request) -> web.Response:
    return json_response({"version": package_version()})

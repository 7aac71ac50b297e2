"""API keys, tenants, and the cache salt derived from them (docs/design.md §3, §6).

``--api-keys FILE`` holds a JSON object ``{"<key>": {"tenant": "<name>", "admin": false,
"max_retained_tokens": N}}`` (``admin`` and ``max_retained_tokens`` optional: the tenant's
budget of prompt tokens under client-requested retention, None = only the server-wide bound).
With keys configured every route but ``/health`` and ``/openapi.json`` needs
``Authorization: Bearer <key>`` or, as Anthropic's clients send it, ``x-api-key: <key>``; a
missing or unknown key is 401. Keys are compared with
``hmac.compare_digest`` against *every* configured key (no early exit), so the time taken does
not depend on which key, or how much of one, matched.

The tenant is part of the cache identity: the server derives the salt ``tenant:<name>`` and a
client ``cache_salt`` can only narrow it (``tenant:<name>|salt:<client salt>``). Tenant names
are restricted to ``[A-Za-z0-9_.-]``, so no tenant name, with or without a client salt, can
spell another tenant's salt. Without keys the server is single-tenant: the client
``cache_salt`` (or none) is the salt, exactly as before.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from radixkv.server.errors import APIError

TENANT_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Routes anyone may call, keys configured or not.
# The routers' discovery endpoints say nothing about any tenant (model id, block size, where
# the KV events are published); vllm-router calls them without a key.
# The dashboard page holds no data (its data routes need a key; a browser opening a URL cannot
# send one).
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/version", "/get_server_info",
                          "/kv_event_sources", "/dashboard"})
# Routes that expose global (cross-tenant) numbers or change what the server serves: admin
# keys only.
ADMIN_PATHS = frozenset({"/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                         "/reset_prefix_cache", "/flush_cache"})


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller. ``name`` None: the single tenant of a server without keys.

    Attributes:
        name: The tenant's name (``TENANT_NAME``), or None without keys.
        admin: May call the admin routes and see every tenant.
        max_retained_tokens: Most prompt tokens this tenant may keep under retention
            (``cache_control`` / ``prompt_cache_retention``) at once; None: no per-tenant
            bound (the server-wide ``--max-retained-fraction`` still applies).
    """

    name: str | None
    admin: bool
    max_retained_tokens: int | None = None


SINGLE_TENANT = Tenant(name=None, admin=True)
# Request-scoped key set by the middleware (web.RequestKey from aiohttp 3.12, a str before).
_REQUEST_KEY = getattr(web, "RequestKey", None)
REQUEST_TENANT: Any = _REQUEST_KEY("radixkv_tenant") if _REQUEST_KEY else "radixkv_tenant"


def load_api_keys(path: str | Path) -> dict[str, Tenant]:
    """Read an API-key file.

    Raises:
        ValueError: unreadable file, not a JSON object, an empty key, a bad tenant name, a
            non-boolean ``admin`` or a ``max_retained_tokens`` that is not a non-negative
            integer (the message names the entry and the field, never the key itself).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"api keys: cannot read {path}: {exc.strerror}") from exc
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"api keys: {path} is not valid JSON: {exc}") from exc
    return parse_api_keys(data, str(path))


def parse_api_keys(data: object, source: str = "api keys") -> dict[str, Tenant]:
    """Validate the decoded key file (see ``load_api_keys``)."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"api keys: {source} must be a non-empty JSON object "
                         '{"<key>": {"tenant": "<name>", "admin": false}}')
    keys: dict[str, Tenant] = {}
    for i, (key, entry) in enumerate(data.items()):
        where = f"api keys: entry {i + 1} of {source}"
        if not key or len(key) < 8 or not key.isprintable() or not key.isascii():
            raise ValueError(f"{where}: a key must be at least 8 printable ASCII characters")
        if not isinstance(entry, dict) or set(entry) - {"tenant", "admin", "max_retained_tokens"}:
            raise ValueError(f'{where}: must be {{"tenant": "<name>", "admin": false, '
                             '"max_retained_tokens": <int>}} (admin and max_retained_tokens '
                             'optional)')
        name = entry.get("tenant")
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{where}: 'tenant' must match {TENANT_NAME.pattern}")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: 'admin' must be true or false")
        budget = entry.get("max_retained_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                                   or budget < 0):
            raise ValueError(f"{where}: 'max_retained_tokens' must be a non-negative integer "
                             f"(tokens), got {budget!r}")
        keys[key] = Tenant(name=name, admin=admin, max_retained_tokens=budget)
    return keys


class KeyStore:
    """Maps bearer keys to tenants in constant time per configured key."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._keys = [(k.encode("ascii"), t) for k, t in keys.items()]
        self.tenant_names = sorted({t.name for t in keys.values() if t.name is not None})

    def lookup(self, presented: str) -> Tenant | None:
        try:
            given = presented.encode("utf-8", "surrogatepass")
        except UnicodeError:
            given = b""
        found = None
        for key, tenant in self._keys:  # no early exit: every key is compared
            if hmac.compare_digest(given, key):
                found = tenant
        return found


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="radixkv"'})


def authenticate(store: KeyStore, header: str | None, api_key: str | None = None) -> Tenant:
    """The tenant of an ``Authorization`` header value, else of an ``x-api-key`` header value
    (Anthropic's clients send the key there).

    Raises:
        APIError: 401 for a missing, malformed or unknown key.
    """
    if not header and api_key is not None:
        tenant = store.lookup(api_key.strip()) if api_key.strip() else None
        if tenant is None:
            raise _unauthorized("Incorrect API key provided")
        return tenant
    if not header:
        raise _unauthorized("You didn't provide an API key: send 'Authorization: Bearer <key>' "
                            "or 'x-api-key: <key>'")
    scheme, _, key = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("The Authorization header must be 'Bearer <key>'")
    tenant = store.lookup(key.strip())
    if tenant is None:
        raise _unauthorized("Incorrect API key provided")
    return tenant


def auth_middleware(store: KeyStore | None):
    """Middleware that puts the caller's ``Tenant`` in ``request[REQUEST_TENANT]``."""

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if store is None:
            request[REQUEST_TENANT] = SINGLE_TENANT
        elif request.path in PUBLIC_PATHS:
            request[REQUEST_TENANT] = None
        else:
            tenant = authenticate(store, request.headers.get("Authorization"),
                                  request.headers.get("x-api-key"))
            if request.path in ADMIN_PATHS and not tenant.admin:
                raise APIError(403, f"{request.path} needs an admin key",
                               code="insufficient_permissions")
            request[REQUEST_TENANT] = tenant
        return await handler(request)

    return middleware


def cache_salt_for(tenant: Tenant | None, client_salt: str | None) -> str | None:
    """The salt that enters the cache identity: tenant-derived, narrowed by the client's."""
    if tenant is None or tenant.name is None:
        return client_salt
    if client_salt is None:
        return f"tenant:{tenant.name}"
    return f"tenant:{tenant.name}|salt:{client_salt}"

"""The live dashboard: one page and the two JSON routes it polls (docs/operations.md#dashboard).

Routes (radixkv's own):

    GET /dashboard              the page: HTML with its script and style inlined from
                                ``radixkv/server/static/dashboard/`` (no network at run time;
                                its Content-Security-Policy allows requests to this origin only)
    GET /dashboard/api/summary  ``/stats`` for the caller's scope, stamped with the server time,
                                plus the pool's occupancy split (``occupancy_blocks``)
    GET /dashboard/api/tree     the radix-tree explorer: top prefixes, drill-down by node
                                (``radixkv.server.dashboard_tree``)

Access: the page holds no data and is public (a browser cannot send a bearer key when it opens
a URL); it reads the key from the URL fragment (``/dashboard#key=<key>``, never sent to the
server) or a form, and sends it as ``Authorization: Bearer`` on every data request. With
``--api-keys`` the data routes need a key: an admin key sees the whole server, every tenant and
the decoded text of a prefix; any other key sees its own tenant's counters and prefixes only
(no pool gauges, no cache salts, no token ids or text), as ``/stats`` does.

Query parameters are validated before anything is read: an unknown or repeated parameter or a
bad value is a 400 naming it, a non-admin key naming another tenant a 403, an unknown node a
404 — all in the OpenAI error shape.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from radixkv.errors import EngineDeadError
from radixkv.server.auth import REQUEST_TENANT, TENANT_NAME, Tenant
from radixkv.server.dashboard_tree import SORT_KEYS, TreeQuery, tree_view
from radixkv.server.errors import APIError, bad_request, json_response
from radixkv.server.generation import engine_dead
from radixkv.server.tokenization import tokenize_errors

if TYPE_CHECKING:
    from radixkv.server.generation import ServerState

__all__ = ["DASHBOARD_PATH", "SUMMARY_PATH", "TREE_PATH", "add_dashboard_routes",
           "occupancy_blocks", "openapi_paths", "parse_tree_query"]

DASHBOARD_PATH = "/dashboard"
SUMMARY_PATH = "/dashboard/api/summary"
TREE_PATH = "/dashboard/api/tree"
ASSETS_DIR = Path(__file__).parent / "static" / "dashboard"
DEFAULT_TOP = 20
MAX_TOP = 500
_UINT = re.compile(r"[0-9]{1,18}")
_TREE_PARAMS = ("top", "sort", "node", "tenant")
_SUMMARY_PARAMS = ("tenant",)


def _tenant(request: web.Request) -> Tenant:
    tenant = request.get(REQUEST_TENANT)
    assert tenant is not None  # the data routes are not public (auth_middleware)
    return tenant


def _single(query: Mapping[str, str], allowed: tuple[str, ...]) -> dict[str, str]:
    """The query as a dict of single values.

    Raises:
        APIError: 400 naming an unknown parameter, or one given more than once.
    """
    out: dict[str, str] = {}
    for name, value in query.items():
        if name not in allowed:
            raise bad_request(f"unknown query parameter {name!r}; allowed: "
                              f"{', '.join(allowed)}", name)
        if name in out:
            raise bad_request(f"query parameter {name!r} is given more than once", name)
        out[name] = value
    return out


def _scope(tenant: Tenant, wanted: str | None) -> str | None:
    """The tenant a request may read: a non-admin key its own only; an admin key (and a server
    without keys) every tenant (None) or the one it names.

    Raises:
        APIError: 400 naming ``tenant`` for a malformed name; 403 when a non-admin key names
            another tenant.
    """
    if wanted is not None and not TENANT_NAME.fullmatch(wanted):
        raise bad_request(f"'tenant' must match {TENANT_NAME.pattern}", "tenant")
    if tenant.admin:
        return wanted
    if wanted is not None and wanted != tenant.name:
        raise APIError(403, "only an admin key can name another tenant", param="tenant",
                       code="insufficient_permissions")
    return tenant.name


def parse_tree_query(query: Mapping[str, str], tenant: Tenant) -> TreeQuery:
    """Validate ``GET /dashboard/api/tree``'s query: ``top`` (1 to ``MAX_TOP``, default
    ``DEFAULT_TOP``), ``sort`` (one of ``SORT_KEYS``, default ``blocks``), ``node`` (a node id,
    a non-negative integer) and ``tenant`` (admin keys: one tenant only).

    Raises:
        APIError: 400 naming the parameter (unknown, repeated, malformed or out of range);
            403 for a non-admin key naming another tenant.
    """
    params = _single(query, _TREE_PARAMS)
    top = DEFAULT_TOP
    if "top" in params:
        raw = params["top"]
        if not _UINT.fullmatch(raw) or not 1 <= int(raw) <= MAX_TOP:
            raise bad_request(f"'top' must be an integer from 1 to {MAX_TOP}, got {raw!r}", "top")
        top = int(raw)
    sort = params.get("sort", "blocks")
    if sort not in SORT_KEYS:
        raise bad_request(f"'sort' must be one of {', '.join(SORT_KEYS)}, got {sort!r}", "sort")
    node = None
    if "node" in params:
        if not _UINT.fullmatch(params["node"]):
            raise bad_request(f"'node' must be a node id (a non-negative integer), got "
                              f"{params['node']!r}", "node")
        node = int(params["node"])
    return TreeQuery(top=top, sort=sort, node=node, tenant=_scope(tenant, params.get("tenant")),
                     admin=tenant.admin)


def occupancy_blocks(stats: Mapping[str, Any]) -> dict[str, int | None]:
    """The pool split the dashboard draws, in blocks, from a ``/stats`` object.

    ``live``: held by running requests (``in_use_blocks - retained_blocks``; retained blocks
    are pinned, so ``in_use_blocks`` counts them); ``cached``: cached and evictable;
    ``retained``: pinned by retentions; ``free``; ``total``; ``store``: values held by the
    store tier (its backend's ``num_blocks``; None without a store or when the backend does not
    count them). ``live + cached + retained + free == total`` for a consistent snapshot.
    """
    pool = stats.get("pool") or {}
    retained = int(pool.get("retained_blocks", 0))
    store = stats.get("store")
    store_blocks = store.get("num_blocks") if isinstance(store, Mapping) else None
    return {
        "live": int(pool.get("in_use_blocks", 0)) - retained,
        "cached": int(pool.get("cached_evictable_blocks", 0)),
        "retained": retained,
        "free": int(pool.get("free_blocks", 0)),
        "total": int(pool.get("total_blocks", 0)),
        "store": int(store_blocks) if isinstance(store_blocks, int) else None,
    }


@functools.lru_cache(maxsize=1)
def _page() -> tuple[bytes, str]:
    """The page with its script and style inlined, and the Content-Security-Policy that lets
    only those two run (by hash) and only this origin be fetched."""
    html = (ASSETS_DIR / "index.html").read_text(encoding="utf-8")
    css = (ASSETS_DIR / "dashboard.css").read_text(encoding="utf-8")
    js = (ASSETS_DIR / "dashboard.js").read_text(encoding="utf-8")

    def digest(text: str) -> str:
        return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")

    page = html.replace("<!--style-->", f"<style>{css}</style>").replace(
        "<!--script-->", f"<script>{js}</script>")
    csp = (f"default-src 'none'; script-src 'sha256-{digest(js)}'; "
           f"style-src 'sha256-{digest(css)}'; connect-src 'self'; img-src 'self' data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page.encode("utf-8"), csp


async def dashboard_page(request: web.Request) -> web.Response:
    body, csp = _page()
    return web.Response(body=body, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": csp, "Cache-Control": "no-store",
                                 "X-Content-Type-Options": "nosniff"})


def add_dashboard_routes(app: web.Application,
                         state_of: Callable[[web.Request], ServerState]) -> None:
    """Register ``/dashboard`` and its data routes on ``app``."""

    async def summary(request: web.Request) -> web.Response:
        tenant = _tenant(request)
        wanted = _scope(tenant, _single(request.query, _SUMMARY_PARAMS).get("tenant"))
        state = state_of(request)
        engine = state.engine
        now_s = round(time.time(), 3)
        if wanted is not None:  # one tenant: its counters, rates and latency (as /stats)
            return json_response({"time_s": now_s, "scope": "tenant", "tenant": wanted,
                                  "stats": engine.tenant_stats(wanted)})
        stats = engine.stats()
        out: dict[str, Any] = {"time_s": now_s, "scope": "server", "tenant": None,
                               "stats": stats, "occupancy_blocks": occupancy_blocks(stats)}
        if state.keys is not None:
            names = sorted(set(state.keys.tenant_names) | set(engine.engine_stats.tenant_names()))
            out["tenants"] = {name: engine.tenant_stats(name) for name in names}
        return json_response(out)

    async def tree(request: web.Request) -> web.Response:
        tenant = _tenant(request)
        query = parse_tree_query(request.query, tenant)
        engine = state_of(request).engine
        try:
            view = await engine.read_cache(functools.partial(
                tree_view, query=query, cost_shape=engine.engine_stats.cost_shape))
        except EngineDeadError:
            raise engine_dead() from None
        detail = view["node"]
        if detail is not None and detail.get("missing"):
            raise APIError(404, f"no cached prefix with node id {query.node}"
                           + ("" if tenant.admin else " of this tenant"), param="node",
                           code="node_not_found")
        if detail is not None and "token_ids" in detail:  # admin only (tree_view)
            with tokenize_errors():  # decoded on the tokenizer pool, off the event loop
                detail["text"] = await engine.detokenize(detail["token_ids"],
                                                         skip_special_tokens=False)
        return json_response({"object": "dashboard.tree", "time_s": round(time.time(), 3),
                              "tenant": query.tenant, "sort": query.sort, **view})

    app.router.add_get(DASHBOARD_PATH, dashboard_page)
    app.router.add_get(SUMMARY_PATH, summary)
    app.router.add_get(TREE_PATH, tree)


def openapi_paths() -> dict[str, Any]:
    """The three routes' entries for ``radixkv.server.openapi``."""
    error = {"$ref": "#/components/schemas/Error"}

    def err(description: str) -> dict:
        return {"description": description, "content": {"application/json": {"schema": error}}}

    def query(name: str, schema: dict, description: str) -> dict:
        return {"name": name, "in": "query", "required": False, "schema": schema,
                "description": description}

    tenant = query("tenant", {"type": "string", "pattern": TENANT_NAME.pattern},
                   "Admin keys: one tenant only; a non-admin key may name only its own.")
    auth_errors = {"400": err("An unknown, repeated or malformed query parameter (``param``)."),
                   "401": err("A missing or unknown key (with --api-keys)."),
                   "403": err("A non-admin key naming another tenant.")}
    return {
        DASHBOARD_PATH: {"get": {
            "summary": "The live dashboard page (public: it holds no data; its data routes need "
                       "a key)", "security": [],
            "responses": {"200": {"description": "HTML, script and style inlined",
                                  "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        SUMMARY_PATH: {"get": {
            "summary": "/stats for the caller's scope, with the server time and the pool split "
                       "(docs/operations.md#dashboard)",
            "parameters": [tenant],
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"type": "object", "required": ["time_s", "scope", "stats"]}}}},
                **auth_errors}}},
        TREE_PATH: {"get": {
            "summary": "Radix-tree explorer: top prefixes by blocks, hits or saved FLOPs; one "
                       "node's detail (docs/operations.md#dashboard)",
            "parameters": [
                query("top", {"type": "integer", "minimum": 1, "maximum": MAX_TOP,
                              "default": DEFAULT_TOP}, "Rows in the top list."),
                query("sort", {"enum": list(SORT_KEYS), "default": "blocks"},
                      "Largest first: subtree blocks, hit count or saved prefill FLOPs."),
                query("node", {"type": "integer", "minimum": 0}, "A node id to drill into."),
                tenant],
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"type": "object", "required": ["object", "top", "node"]}}}},
                **auth_errors,
                "404": err("No visible node with that id (another tenant's too)."),
                "503": err("The engine is not running, or the tokenizer queue is full.")}}},
    }

"""The dashboard's routes over HTTP: the page, the summary, the radix-tree explorer, tenant
scoping and the validation of every query parameter (4xx in the OpenAI error shape, never 5xx).

One server for the module: tiny model, B = 16, 256 blocks, three keys (two tenants, one admin).
The browser drives the same routes in ``test_dashboard_browser.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from radixkv.server import dashboard
from radixkv.server.auth import load_api_keys
from radixkv.server.dashboard import ASSETS_DIR, MAX_TOP, occupancy_blocks
from radixkv.server.dashboard_tree import tenant_of_salt, tree_view
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import bearer, cached_tokens, complete, get, post_json, wait_idle

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

B = 16
T1_KEY, T2_KEY, ADMIN_KEY = "key-tenant-one", "key-tenant-two", "key-the-admin"
KEYS = {T1_KEY: {"tenant": "t1", "admin": False}, T2_KEY: {"tenant": "t2", "admin": False},
        ADMIN_KEY: {"tenant": "ops", "admin": True}}
REPO = Path(__file__).resolve().parents[2]
# Three full blocks both prompts share, then 20 tokens of their own: each 68-token prompt
# publishes 4 full blocks, the second matches the first 3 (48 cached tokens) and splits the
# first's node there, leaving the shared prefix as a 3-block node with two 1-block children.
SHARED = [1000 + i for i in range(3 * B)]


def tail(seed: int) -> list[int]:
    return [5000 + 50 * seed + i for i in range(20)]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    engine = make_async_engine(tiny_model, block_size=B, num_blocks=256)
    yield from run_server_in_thread(engine, api_keys=load_api_keys(path))


@pytest.fixture(scope="module")
def shared_prefix(server) -> dict:
    """t1 sends two prompts sharing ``SHARED``; t2 sends one of its own. Returns the shared
    prefix's node and t1's tree as the admin sees them."""
    return asyncio.run(send_shared_prefix(server.url))


async def send_shared_prefix(url: str) -> dict:
    status, first = await complete(url, SHARED + tail(0), T1_KEY)
    assert status == 200 and cached_tokens(first) == 0
    status, second = await complete(url, SHARED + tail(1), T1_KEY)
    assert status == 200 and cached_tokens(second) == 3 * B
    status, other = await complete(url, [9000 + i for i in range(2 * B + 3)], T2_KEY)
    assert status == 200
    await wait_idle(url, ADMIN_KEY)
    status, tree = await get(url, "/dashboard/api/tree?top=500&tenant=t1", ADMIN_KEY)
    assert status == 200, tree
    nodes = [row for row in tree["top"] if row["depth_tokens"] == 0]
    assert len(nodes) == 1, tree["top"]
    return {"node": nodes[0], "tree": tree}


async def get_raw(url: str, path: str, key: str | None = None) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path, headers=bearer(key)) as resp:
            return resp.status, await resp.read(), dict(resp.headers)


# ------------------------------------------------------------------ the page


async def test_page_is_public_self_contained_and_locked_to_this_origin(server):
    status, body, headers = await get_raw(server.url, "/dashboard")  # no key: it holds no data
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert "<script>" in page and "<style>" in page and "<!--script-->" not in page
    assert "radixkvDashboard" in page and 'id="chart-occupancy"' in page
    # Nothing loaded from elsewhere: the only absolute URL is the SVG namespace.
    assert set(re.findall(r"https?://[^\s\"'<>)]+", page)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet", page)
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'", csp)
    assert headers["Cache-Control"] == "no-store"


async def test_data_routes_need_a_key(server):
    for path in ("/dashboard/api/summary", "/dashboard/api/tree"):
        status, body = await get(server.url, path)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)


def test_assets_are_package_data():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = REPO / "radixkv" / "server"
    patterns = setuptools["package-data"]["radixkv.server"]
    declared = {p for pattern in patterns for p in package_dir.glob(pattern) if p.is_file()}
    assets = {p for p in ASSETS_DIR.iterdir() if p.is_file()}
    assert {p.name for p in assets} == {"index.html", "dashboard.js", "dashboard.css"}
    assert assets <= declared


# ------------------------------------------------------------------ summary


async def test_summary_admin_sees_the_pool_split_and_every_tenant(server, shared_prefix):
    stats = await wait_idle(server.url, ADMIN_KEY)
    status, summary = await get(server.url, "/dashboard/api/summary", ADMIN_KEY)
    assert status == 200 and summary["scope"] == "server" and summary["tenant"] is None
    pool = stats["pool"]
    occ = summary["occupancy_blocks"]
    # Idle: no live block; what the tree holds is cached (nothing retained here).
    assert occ == {"live": 0, "cached": stats["tree"]["cached_blocks"], "retained": 0,
                   "free": pool["free_blocks"], "total": 256, "store": None}
    assert occ["live"] + occ["cached"] + occ["retained"] + occ["free"] == occ["total"]
    assert summary["stats"]["requests_total"] == stats["requests_total"]
    assert set(summary["tenants"]) == {"ops", "t1", "t2"}
    assert summary["tenants"]["t1"]["cached_prompt_tokens_total"] == 3 * B


async def test_summary_tenant_key_sees_its_own_counters_only(server, shared_prefix):
    status, summary = await get(server.url, "/dashboard/api/summary", T1_KEY)
    assert status == 200
    assert (summary["scope"], summary["tenant"]) == ("tenant", "t1")
    assert "occupancy_blocks" not in summary and "tenants" not in summary
    assert "pool" not in summary["stats"]
    assert summary["stats"]["requests_total"] == 2
    assert summary["stats"]["cached_prompt_tokens_total"] == 3 * B
    status, mine = await get(server.url, "/dashboard/api/summary?tenant=t1", T1_KEY)
    assert status == 200 and mine["stats"]["requests_total"] == 2
    status, admin_view = await get(server.url, "/dashboard/api/summary?tenant=t2", ADMIN_KEY)
    assert status == 200 and admin_view["stats"]["requests_total"] == 1


# ------------------------------------------------------------------ tree explorer


async def test_tree_shows_the_shared_prefix_with_its_exact_blocks(server, shared_prefix):
    node = shared_prefix["node"]
    assert node["tenant"] == "t1"
    assert (node["num_blocks"], node["num_tokens"], node["prefix_tokens"]) == (3, 3 * B, 3 * B)
    assert (node["num_children"], node["subtree_blocks"]) == (2, 5)
    assert node["hit_count"] == 1  # t1's second prompt
    assert node["parent_id"] is None and node["cache_salt"] == "tenant:t1"
    assert node["saved_prefill_flops"] > 0
    assert node["evictable"] is False and node["policy_key"] is None  # it has children
    status, tree = await get(server.url, f"/dashboard/api/tree?node={node['id']}", ADMIN_KEY)
    assert status == 200
    detail = tree["node"]
    assert detail["id"] == node["id"] and detail["path"] == []
    assert detail["token_ids"] == SHARED and detail["tokens_truncated"] is False
    status, text = await post_json(server.url, "/detokenize", {"tokens": SHARED}, ADMIN_KEY)
    assert status == 200 and detail["text"] == text["prompt"]
    children = detail["children"]
    assert [(c["num_blocks"], c["depth_tokens"], c["parent_id"]) for c in children] == [
        (1, 3 * B, node["id"]), (1, 3 * B, node["id"])]
    for child in children:  # an idle leaf: evictable, with the LRU key
        assert child["evictable"] is True and child["subtree_blocks"] == 1
        assert isinstance(child["policy_key"], list) and child["policy_key"]
    status, leaf = await get(server.url, f"/dashboard/api/tree?node={children[0]['id']}",
                             ADMIN_KEY)
    assert status == 200 and leaf["node"]["path"] == [node["id"]]
    assert leaf["node"]["token_ids"] == tail(0)[:B] or leaf["node"]["token_ids"] == tail(1)[:B]


async def test_tree_sorts_and_cuts(server, shared_prefix):
    status, by_blocks = await get(server.url, "/dashboard/api/tree?top=1", ADMIN_KEY)
    assert status == 200 and len(by_blocks["top"]) == 1
    assert by_blocks["top"][0]["id"] == shared_prefix["node"]["id"]  # 5 blocks under it
    assert by_blocks["num_blocks"] == (await wait_idle(server.url, ADMIN_KEY))["tree"][
        "cached_blocks"]
    status, by_hits = await get(server.url, "/dashboard/api/tree?sort=hits&top=1", ADMIN_KEY)
    assert status == 200 and by_hits["top"][0]["id"] == shared_prefix["node"]["id"]
    status, by_flops = await get(server.url, "/dashboard/api/tree?sort=saved_flops&top=2",
                                 ADMIN_KEY)
    assert status == 200 and by_flops["top"][0]["id"] == shared_prefix["node"]["id"]
    assert by_flops["top"][1]["saved_prefill_flops"] == 0.0  # nothing else was hit


async def test_tenant_key_sees_only_its_own_prefixes(server, shared_prefix):
    url = server.url
    status, everything = await get(url, "/dashboard/api/tree?top=500", ADMIN_KEY)
    assert status == 200
    assert {row["tenant"] for row in everything["top"]} == {"t1", "t2"}
    t2_nodes = [row["id"] for row in everything["top"] if row["tenant"] == "t2"]
    assert len(t2_nodes) == 1  # 35 tokens + 1 generated: two full blocks, one node
    status, mine = await get(url, "/dashboard/api/tree?top=500", T1_KEY)
    assert status == 200 and mine["tenant"] == "t1"
    assert {row["tenant"] for row in mine["top"]} == {"t1"}
    assert {row["id"] for row in mine["top"]} == {
        row["id"] for row in everything["top"] if row["tenant"] == "t1"}
    assert mine["num_blocks"] == 5
    assert all("cache_salt" not in row for row in mine["top"])
    # Another tenant's node is unknown to t1, as a missing one is.
    status, body = await get(url, f"/dashboard/api/tree?node={t2_nodes[0]}", T1_KEY)
    assert status == 404 and body["error"]["param"] == "node"
    assert body["error"]["code"] == "node_not_found"
    # Its own node: the detail, without token ids or text.
    own = shared_prefix["node"]["id"]
    status, detail = await get(url, f"/dashboard/api/tree?node={own}", T1_KEY)
    assert status == 200 and detail["node"]["num_blocks"] == 3
    assert not {"token_ids", "text", "cache_salt"} & set(detail["node"])
    status, theirs = await get(url, "/dashboard/api/tree?top=500", T2_KEY)
    assert status == 200 and [row["id"] for row in theirs["top"]] == t2_nodes


def test_tenant_of_salt():
    assert tenant_of_salt("tenant:t1") == "t1"
    assert tenant_of_salt("tenant:t1|salt:tenant:t2") == "t1"
    assert tenant_of_salt("x") is None and tenant_of_salt(None) is None


# ------------------------------------------------------------------ bad input

BAD_TREE = [
    ("top=0", "top"), (f"top={MAX_TOP + 1}", "top"), ("top=abc", "top"), ("top=1.5", "top"),
    ("top=", "top"), ("top=-3", "top"), ("top=99999999999999999999999", "top"),
    ("sort=size", "sort"), ("sort=", "sort"), ("node=-1", "node"), ("node=x", "node"),
    ("node=", "node"), ("node=1e3", "node"), ("node=9999999999999999999999", "node"),
    ("tenant=bad%20name", "tenant"), ("tenant=", "tenant"), ("foo=1", "foo"),
    ("top=1&top=2", "top"),
]


@pytest.mark.parametrize(("query", "param"), BAD_TREE)
async def test_tree_refuses_each_bad_parameter(server, query, param):
    status, body = await get(server.url, f"/dashboard/api/tree?{query}", ADMIN_KEY)
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("query", "param"), [("foo=1", "foo"), ("tenant=a|b", "tenant"),
                                              ("tenant=t1&tenant=t1", "tenant")])
async def test_summary_refuses_each_bad_parameter(server, query, param):
    status, body = await get(server.url, f"/dashboard/api/summary?{query}", ADMIN_KEY)
    assert status == 400 and body["error"]["param"] == param, body


async def test_a_tenant_key_cannot_name_another_tenant(server):
    for path in ("/dashboard/api/tree?tenant=t2", "/dashboard/api/summary?tenant=t2"):
        status, body = await get(server.url, path, T1_KEY)
        assert status == 403, body
        assert (body["error"]["param"], body["error"]["code"]) == (
            "tenant", "insufficient_permissions")


async def test_unknown_node_is_404(server, shared_prefix):
    status, body = await get(server.url, "/dashboard/api/tree?node=123456789", ADMIN_KEY)
    assert status == 404 and body["error"]["param"] == "node"


async def test_the_openapi_document_lists_the_routes_and_their_parameters(server):
    status, raw, _ = await get_raw(server.url, "/openapi.json")
    doc = orjson.loads(raw)
    tree = doc["paths"]["/dashboard/api/tree"]["get"]
    assert [p["name"] for p in tree["parameters"]] == ["top", "sort", "node", "tenant"]
    assert doc["paths"]["/dashboard"]["get"]["security"] == []


# ------------------------------------------------------------------ threads, no keys, store


async def test_the_tree_is_read_on_the_engine_thread(server, shared_prefix, monkeypatch):
    threads = []

    def recording(cache, **kwargs):
        threads.append(threading.current_thread().name)
        return tree_view(cache, **kwargs)

    monkeypatch.setattr(dashboard, "tree_view", recording)
    status, tree = await get(server.url, "/dashboard/api/tree?top=1", ADMIN_KEY)
    assert status == 200 and tree["top"][0]["id"] == shared_prefix["node"]["id"]
    assert threads == ["radixkv-engine"]


@pytest.fixture(scope="module")
def keyless_server(tiny_model) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=B, num_blocks=64))


async def test_without_keys_everything_is_visible_without_a_key(keyless_server):
    url = keyless_server.url
    status, _ = await complete(url, SHARED + tail(0), cache_salt="abc")
    assert status == 200
    await wait_idle(url)
    status, summary = await get(url, "/dashboard/api/summary")
    assert status == 200 and summary["scope"] == "server" and "tenants" not in summary
    assert summary["occupancy_blocks"]["cached"] == 4
    status, tree = await get(url, "/dashboard/api/tree")
    assert status == 200 and tree["tenant"] is None
    [row] = tree["top"]
    assert (row["num_blocks"], row["tenant"], row["cache_salt"]) == (4, None, "abc")
    status, detail = await get(url, f"/dashboard/api/tree?node={row['id']}")
    assert status == 200 and detail["node"]["token_ids"] == (SHARED + tail(0))[:4 * B]


def test_occupancy_blocks_takes_the_store_from_its_backend_count():
    stats = {"pool": {"total_blocks": 10, "free_blocks": 3, "cached_evictable_blocks": 2,
                      "in_use_blocks": 5, "retained_blocks": 1},
             "store": {"backend": "host", "num_blocks": 7}}
    assert occupancy_blocks(stats) == {"live": 4, "cached": 2, "retained": 1, "free": 3,
                                       "total": 10, "store": 7}
    del stats["store"]["num_blocks"]  # a backend that does not count its values
    assert occupancy_blocks(stats)["store"] is None

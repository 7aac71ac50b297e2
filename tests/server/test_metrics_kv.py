"""The KV metrics over HTTP, and the Grafana dashboard against them.

One tiny-model server for the module (block 16, 64 blocks, a host store tier, API keys, the idle
leak self-check at every idle moment). ``/metrics`` carries the KV families with the values
``/stats`` has (a fork's copy-on-write, cancels, prefill bytes, a clean leak check), and every
PromQL expression of ``examples/grafana/radixkv.json`` names only series this server exports
(histograms through ``_bucket``/``_sum``/``_count``, counters through ``_total``), with the
labels its ``by (...)`` clauses group on.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.auth import load_api_keys
from tests.factories import engine_config
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import bearer, complete, get, wait_idle

B = 16
TENANT_KEY, ADMIN_KEY = "key-metrics-tenant", "key-metrics-admin"
KEYS = {TENANT_KEY: {"tenant": "t1", "admin": False},
        ADMIN_KEY: {"tenant": "ops", "admin": True}}
DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "radixkv.json"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    engine = AsyncEngine(engine_config(block_size=B, num_blocks=64, kv_store="host:0.01"),
                         tiny_model, check_integrity_when_idle=True, leak_check_interval_s=0)
    yield from run_server_in_thread(engine, api_keys=load_api_keys(path))


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    status, text = await get(url, "/metrics", ADMIN_KEY)
    assert status == 200
    return samples(text)


async def cancel_a_stream(url: str, prompt: list[int]) -> None:
    """Start a long streamed completion and close it after its first event (an abort)."""
    body = {"prompt": prompt, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body,
                             headers=bearer(TENANT_KEY)) as resp:
            assert resp.status == 200
            await resp.content.readline()


async def test_kv_families_agree_with_stats(server: RunningServer):
    url = server.url
    before = await scrape(url)
    # n = 2 on a 17-token prompt: the second choice is a fork sharing block 0 and copying the
    # 1-token tail block (copy-on-write).
    status, body = await complete(url, [300 + i for i in range(17)], TENANT_KEY, n=2,
                                  max_tokens=3, temperature=0.8, seed=1)
    assert status == 200 and len(body["choices"]) == 2
    await cancel_a_stream(url, [700 + i for i in range(20)])
    deadline = time.monotonic() + 60
    while (await get(url, "/stats", ADMIN_KEY))[1]["requests_aborted_total"] < 1:
        assert time.monotonic() < deadline, "the closed stream was never aborted"
        await asyncio.sleep(0.05)
    stats = await wait_idle(url, ADMIN_KEY)
    after = await scrape(url)

    def moved(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert moved("radixkv_kv_forked_sequences_total") == 1
    assert moved("radixkv_kv_fork_shared_blocks_total") == 1
    assert moved("radixkv_kv_cow_copied_blocks_total") == 1
    assert moved("radixkv_kv_cow_copied_bytes_total") == after[("radixkv_kv_block_size_bytes",
                                                                ())]
    assert stats["fork"]["forks_total"] == after[("radixkv_kv_forked_sequences_total", ())]
    aborted = after[("radixkv_aborted_requests_total", ())]
    assert aborted >= 1 and after[("radixkv_cancel_release_seconds_count", ())] == aborted
    assert after[("radixkv_cancel_release_seconds_bucket", (("le", "+Inf"),))] == aborted
    # Prefill writes the K/V of every computed prompt token once (no preemption here).
    assert after[("radixkv_prefill_kv_written_bytes_total", ())] == (
        after[("radixkv_computed_prompt_tokens_total", ())] * stats["kv_bytes_per_token"])
    assert after[("radixkv_prefix_cache_lookup_seconds_count", ())] == after[
        ("radixkv_admitted_requests_total", ())]
    steps = after[("radixkv_engine_steps_total", ())]
    assert steps > 0 and after[("radixkv_scheduler_step_seconds_count", ())] == steps
    assert after[("radixkv_block_table_prepare_seconds_count", ())] == steps
    assert after[("radixkv_decode_kv_read_bytes_total", ())] > 0
    # Attention time on the CPU: every step that ran a forward is in exactly one
    # (phase, context) histogram; the prompts here are < 1024 tokens, so all in that bucket.
    attention = {labels: value for (name, labels), value in after.items()
                 if name == "radixkv_attention_seconds_count"}
    assert len(attention) == 10 and sum(attention.values()) == steps
    small = {dict(labels)["phase"]: value for labels, value in attention.items()
             if dict(labels)["context_tokens_le"] == "1024"}
    assert small["prefill"] >= 2 and small["decode"] >= 2
    assert small["prefill"] + small["decode"] == steps
    assert after[("radixkv_attention_seconds_sum", (("context_tokens_le", "1024"),
                                                    ("phase", "decode")))] > 0
    by_context = stats["kv_activity"]["attention_by_context"]
    assert by_context["decode"]["1024"]["steps"] == small["decode"]
    assert by_context["decode"]["1024"]["ms_mean"] > 0
    # Idle: no live block, no tail waste; every block not free is a full cached one.
    free, total = after[("radixkv_kv_free_blocks", ())], after[("radixkv_kv_total_blocks", ())]
    assert after[("radixkv_kv_live_blocks", ())] == 0
    assert after[("radixkv_kv_live_tail_waste_tokens", ())] == 0
    assert after[("radixkv_kv_occupied_tokens", ())] == (total - free) * B
    assert after[("radixkv_kv_capacity_tokens", ())] == total * B
    assert (after[("radixkv_kv_allocated_blocks_total", ())]
            - after[("radixkv_kv_freed_blocks_total", ())]) == total - free
    # The idle self-check ran in the serving process and found nothing.
    assert after[("radixkv_kv_leak_checks_total", ())] >= 1
    assert after[("radixkv_kv_leak_check_failures_total", ())] == 0
    assert stats["leak_check"]["failures_total"] == 0


_NAME = re.compile(r"\b(radixkv_[a-z0-9_]+)\b")
_BY = re.compile(r"\bby \(([a-z_, ]+)\)")


def dashboard_queries() -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every panel target and templating query."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        out += [(panel["title"], target["expr"]) for target in panel["targets"]]
    out += [(var["name"], var["definition"]) for var in dash["templating"]["list"]
            if var["type"] == "query"]
    return out


def test_the_dashboard_is_grafana_json_with_a_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "radixkv-kv-cache" and dash["schemaVersion"] >= 36
    names = {var["name"] for var in dash["templating"]["list"]}
    assert names == {"datasource", "job", "instance"}
    ids = [panel["id"] for panel in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert len(dashboard_queries()) >= 30


async def test_every_dashboard_query_names_exported_series(server: RunningServer):
    # Tenant families appear once a tenant was served; store families with the store tier.
    status, _ = await complete(server.url, [900 + i for i in range(20)], TENANT_KEY)
    assert status == 200
    await wait_idle(server.url, ADMIN_KEY)
    exported = await scrape(server.url)
    labels: dict[str, set[str]] = {}
    for name, pairs in exported:
        labels.setdefault(name, set()).update(k for k, _ in pairs)
    missing = []
    for title, expr in dashboard_queries():
        names = _NAME.findall(expr)
        assert names, (title, expr)
        for name in names:
            if name not in labels:
                missing.append((title, name))
        for group in _BY.findall(expr):
            for label in (part.strip() for part in group.split(",")):
                if label == "le":
                    continue
                assert any(label in labels.get(name, ()) for name in names), (title, label)
    assert missing == []

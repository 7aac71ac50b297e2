"""The store tier seen over HTTP: a store hit is reported as cached tokens, ``/stats``
has the tier split and the ``store`` counters, ``/metrics`` the same families, and ``/health``
stays 200 while the store is down. One in-process tiny-model server, ``--kv-store host``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from radixkv.errors import StoreError
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import cached_tokens, complete, get, post_json

B = 16


NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=B,
                                                      num_blocks=NUM_BLOCKS,
                                                      kv_store="host:0.01"))


async def push_out_of_the_device(server: RunningServer, first: int) -> None:
    """A prompt of every block but one, so that nothing cached before stays in the device
    pool (the host tier keeps it)."""
    status, _ = await complete(server.url, [first + i for i in range((NUM_BLOCKS - 1) * B + 1)])
    assert status == 200


async def test_a_store_hit_over_http_is_counted_in_stats_and_metrics(server: RunningServer):
    tier = server.engine._engine.store
    prompt = [300 + i for i in range(4 * B + 1)]  # hit cap: 4 blocks
    status, first = await complete(server.url, prompt)
    assert status == 200 and cached_tokens(first) == 0
    await push_out_of_the_device(server, 1000)
    assert await asyncio.get_running_loop().run_in_executor(None, tier.flush)
    status, second = await complete(server.url, prompt)
    assert status == 200 and cached_tokens(second) == 4 * B
    _, stats = await get(server.url, "/stats")
    assert stats["cached_prompt_tokens_by_tier"] == {"device": 0, "store": 4 * B}
    store = stats["store"]
    assert (store["backend"], store["hit_blocks_total"], store["down"]) == ("host", 4, False)
    assert store["read_bytes_total"] == 4 * tier.value_bytes
    _, metrics = await get(server.url, "/metrics")
    assert 'radixkv_cached_prompt_tokens_by_tier_total{tier="store"} 64.0' in metrics
    assert 'radixkv_cached_prompt_tokens_by_tier_total{tier="device"} 0.0' in metrics
    assert "radixkv_kv_store_hit_blocks_total 4.0" in metrics
    assert 'radixkv_kv_store_rejected_blocks_total{reason="checksum"} 0.0' in metrics
    assert "radixkv_kv_store_down_bool 0.0" in metrics
    assert "radixkv_kv_store_fetch_seconds_count 3.0" in metrics  # the pusher looked too
    assert 'radixkv_prefix_cache_miss_tokens_total{cause="store_timeout"} 0.0' in metrics


async def test_a_reset_over_http_empties_the_host_tier_too(server: RunningServer):
    tier = server.engine._engine.store
    prompt = [600 + i for i in range(4 * B + 1)]
    status, first = await complete(server.url, prompt)
    assert status == 200 and cached_tokens(first) == 0
    assert await asyncio.get_running_loop().run_in_executor(None, tier.flush)
    held = tier.backend.stats()["num_blocks"]
    assert held >= 4
    _, stats = await get(server.url, "/stats")
    store_before = stats["cached_prompt_tokens_by_tier"]["store"]
    status, reset = await post_json(server.url, "/reset_prefix_cache", {})
    assert (status, reset["success"]) == (200, True)
    assert tier.backend.stats()["num_blocks"] == 0
    status, second = await complete(server.url, prompt)
    assert status == 200 and cached_tokens(second) == 0  # cold in every tier
    _, stats = await get(server.url, "/stats")
    assert stats["cached_prompt_tokens_by_tier"]["store"] == store_before
    assert stats["store"]["reset_blocks_total"] == held
    _, metrics = await get(server.url, "/metrics")
    assert f"radixkv_kv_store_reset_blocks_total {float(held)}" in metrics


async def test_health_stays_200_while_the_store_is_down(server: RunningServer):
    tier = server.engine._engine.store
    tier.mark_down("test", StoreError("store unreachable"))
    assert (await get(server.url, "/health"))[0] == 200
    status, body = await complete(server.url, [900 + i for i in range(2 * B + 1)])
    assert status == 200 and cached_tokens(body) == 0
    _, stats = await get(server.url, "/stats")
    assert stats["store"]["down"] is True and stats["store"]["errors_total"] == 1
    assert stats["store"]["loads_skipped_down_total"] >= 1
    # The host backend answers again at once: the writer's next reconnect brings the tier back.
    deadline = time.monotonic() + 10
    while tier.down:
        assert time.monotonic() < deadline, "the tier did not come back"
        await asyncio.sleep(0.05)
    assert tier.snapshot()["reconnects_total"] == 1

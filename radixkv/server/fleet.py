"""What a KV-aware router asks of a replica beyond the OpenAI API.

Routes (``docs/routers-and-kv-events.md`` §1, §2.6):
    GET  /get_server_info     ``{"model_id", "instance_id", "kv_block_size", ...}``: vllm-router's
                              discovery keys a replica's index by it (a new ``instance_id``
                              means a restarted replica); sglang-router reads the model id
    GET  /kv_event_sources    where this replica publishes KV events, keyed by DP rank
                              (``radixkv.engine.kv_events``); ``{}`` when events are off
    POST /reset_prefix_cache  vLLM's name: evict every cached block no running request holds
                              and empty a host store tier (a shared Mooncake store is kept);
                              subscribers get one ``AllBlocksCleared``
    POST /flush_cache         SGLang's name for the same (both routers fan it out)

Discovery is public (it names no tenant's data); the two resets need an admin key when API
keys are configured.
"""

from __future__ import annotations

from aiohttp import web

from radixkv.engine.async_engine import AsyncEngine
from radixkv.errors import EngineDeadError
from radixkv.server.errors import json_response
from radixkv.server.generation import engine_dead

__all__ = ["add_routes"]


def add_routes(app: web.Application, engine_of) -> None:
    """Register the routes; ``engine_of(request)`` returns the serving ``AsyncEngine``."""

    async def get_server_info(request: web.Request) -> web.Response:
        engine: AsyncEngine = engine_of(request)
        return json_response({
            "model_id": engine.model_name, "instance_id": engine.instance_id,
            "kv_block_size": engine.block_size, "max_model_len": engine.max_model_len,
            "enable_kv_cache_events": engine.kv_events is not None})

    async def kv_event_sources(request: web.Request) -> web.Response:
        engine: AsyncEngine = engine_of(request)
        return json_response(engine.kv_events.sources() if engine.kv_events is not None else {})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        try:
            evicted = await engine_of(request).reset_prefix_cache()
        except EngineDeadError:
            raise engine_dead() from None
        return json_response({"success": True, "num_evicted_blocks": evicted})

    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/flush_cache", reset_prefix_cache)

"""The tests' engine factory: one place that turns keyword arguments into an engine config.

``make_engine`` builds the synchronous ``LLMEngine`` (stepped by hand in integration tests);
``make_async_engine`` the ``AsyncEngine`` a test server runs, with the cache manager's
``check_integrity()`` run whenever it idles. Both take the same keywords (``engine_config``).
The defaults are a small pool of small blocks (B = 4, 256 blocks); every other default is the
config's own, so a test names what it depends on.
"""

from __future__ import annotations

from radixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.kv_events import KVEventsConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.model.loader import LoadedModel


def engine_config(*, block_size: int = 4, num_blocks: int = 256, prefix_cache: bool = True,
                  publish_interval_blocks: int = 16, max_num_seqs: int = 32,
                  max_num_batched_tokens: int = 8192, prefill_chunk_tokens: int | None = None,
                  admission_policy: str = "lpm", max_bypass: int = 8,
                  lora_adapters: tuple[tuple[str, str], ...] = (), kv_store: str | None = None,
                  kv_store_write: str = "all", kv_store_timeout_s: float = 2.0,
                  sliding_window_kv: str = "keep-all", window_num_blocks: int | None = None
                  ) -> EngineConfig:
    """An ``EngineConfig`` from the fields tests vary (the model is passed in already loaded)."""
    return EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=prefix_cache,
                          publish_interval_blocks=publish_interval_blocks,
                          kv_store=kv_store, kv_store_write=kv_store_write,
                          kv_store_timeout_s=kv_store_timeout_s,
                          sliding_window_kv=sliding_window_kv,
                          window_num_blocks=window_num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  prefill_chunk_tokens=prefill_chunk_tokens,
                                  admission_policy=admission_policy, max_bypass=max_bypass),
        lora_adapters=lora_adapters)


def make_engine(model: LoadedModel, **config: object) -> LLMEngine:
    """A synchronous engine over ``model``; ``config`` as for ``engine_config``."""
    return LLMEngine(engine_config(**config), model)  # type: ignore[arg-type]


def make_async_engine(model: LoadedModel, *, max_queue: int | None = None,
                      kv_events: KVEventsConfig | None = None, **config: object) -> AsyncEngine:
    """An ``AsyncEngine`` over ``model`` that checks the cache's integrity when idle (not
    started); ``max_queue`` and ``kv_events`` as for ``AsyncEngine``, ``config`` as for
    ``engine_config``."""
    return AsyncEngine(engine_config(**config), model,  # type: ignore[arg-type]
                       check_integrity_when_idle=True, max_queue=max_queue, kv_events=kv_events)

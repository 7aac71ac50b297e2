"""Build the store tier an engine's ``CacheConfig.kv_store`` asks for and put it under the cache.

Here the engine's knowledge (the runner's pool addresses, the model's KV layout, the stats
object) meets the torch-free tier of ``radixkv.cache.store``. The tier is built only with
prefix caching on (a store keyed by chained hashes needs the tree's hashes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.store.backend import StoreBackend, parse_kv_store
from radixkv.cache.store.factory import make_backend
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.store.value import BlockLayout
from radixkv.log import get_logger

if TYPE_CHECKING:
    from radixkv.cache.manager import CacheManager
    from radixkv.config import CacheConfig
    from radixkv.engine.stats import EngineStats
    from radixkv.model.runner import ModelRunner

log = get_logger(__name__)


def attach_store(config: CacheConfig, runner: ModelRunner, cache: CacheManager,
                 stats: EngineStats, cost_shape: object | None = None, *,
                 backend: StoreBackend | None = None) -> StoreTier | None:
    """Create the configured store tier and attach it to ``cache``; None when not configured.
    ``backend``: the spec's backend, built already (None: built here).

    Raises:
        ValueError: naming ``kv_store`` for a malformed spec or a pool not in host memory.
        StoreError: the backend could not be created (Mooncake missing or unreachable).
    """
    if config.kv_store is None:
        return None
    spec = parse_kv_store(config.kv_store)
    if not cache.enable_prefix_caching:
        log.warning("kv_store_off_without_prefix_caching", kv_store=spec.describe())
        if backend is not None:
            backend.close()
        return None
    bases = runner.kv_segment_bases()
    shape = runner.shape
    itemsize = runner.bytes_per_block // (2 * shape.num_layers * runner.block_size
                                          * shape.num_kv_heads * shape.head_dim)
    layout = BlockLayout(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, dtype=str(runner.dtype).removeprefix("torch."),
                         itemsize=itemsize, block_size=runner.block_size)
    if backend is None:
        backend = make_backend(spec, block_size=runner.block_size,
                               default_policy=config.eviction_policy, model_shape=cost_shape)
    digest_bytes = len(cache.hasher.hash_fn(b""))
    tier = StoreTier(backend, layout, digest_bytes=digest_bytes,
                     write_mode=config.kv_store_write, timeout_s=config.kv_store_timeout_s,
                     on_fetch_latency=stats.observe_store_fetch)
    tier.attach_pool(bases)
    cache.attach_store(tier)
    log.info("kv_store_ready", kv_store=spec.describe(), write_mode=config.kv_store_write,
             layout=layout.tag, value_bytes=tier.value_bytes)
    return tier

"""Build the store tier an engine's ``CacheConfig.kv_store`` asks for and put it under the cache.

Here the engine's knowledge (the runner's pool segments, the model's KV layout and format, the
stats object) meets the torch-free tier of ``radixkv.cache.store``. The tier is built only with
prefix caching on (a store keyed by chained hashes needs the tree's hashes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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


def block_layout(runner: ModelRunner) -> BlockLayout:
    """The store layout of ``runner``'s blocks: its model shape, block size and KV format
    (``runner.kv_format``: the dtype name for unquantized K/V, the format tag with one fp32
    scale per token slot and KV head for int8 / fp8_e4m3), e.g. ``L30.H3.D64.float32.B16`` or
    ``L30.H3.D64.int8-tokhead-f32-v1.B16``."""
    shape, fmt = runner.shape, runner.kv_format
    itemsize = torch.empty((), dtype=fmt.storage_dtype).element_size()
    return BlockLayout(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                       head_dim=shape.head_dim, dtype=fmt.tag, itemsize=itemsize,
                       block_size=runner.block_size, scale_itemsize=4 if fmt.quantized else 0)


def attach_store(config: CacheConfig, runner: ModelRunner, cache: CacheManager,
                 stats: EngineStats, cost_shape: object | None = None, *,
                 backend: StoreBackend | None = None) -> StoreTier | None:
    """Create the configured store tier and attach it to ``cache``; None when not configured.
    ``backend``: the spec's backend, built already (None: built here).

    The tier's values hold every pool segment of a block (``runner.kv_segments()``: K and V
    of every layer, then the scales of a quantized format), under keys and headers naming the
    KV format (:func:`block_layout`).

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
    layout = block_layout(runner)
    segments = runner.kv_segments()
    if backend is None:
        backend = make_backend(spec, block_size=runner.block_size,
                               default_policy=config.eviction_policy, model_shape=cost_shape)
    digest_bytes = len(cache.hasher.hash_fn(b""))
    tier = StoreTier(backend, layout, digest_bytes=digest_bytes,
                     write_mode=config.kv_store_write, timeout_s=config.kv_store_timeout_s,
                     on_fetch_latency=stats.observe_store_fetch)
    tier.attach_pool(segments)
    cache.attach_store(tier)
    log.info("kv_store_ready", kv_store=spec.describe(), write_mode=config.kv_store_write,
             layout=layout.tag, value_bytes=tier.value_bytes)
    return tier

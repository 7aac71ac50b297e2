"""Build the backend a ``--kv-store`` spec names (kept apart from ``backend.py``, which every
backend imports, so that no import cycle forms)."""

from __future__ import annotations

from radixkv.cache.store.backend import KVStoreSpec, StoreBackend


def make_backend(spec: KVStoreSpec, *, block_size: int, default_policy: str,
                 model_shape: object | None = None, connect_timeout_s: float = 0.0
                 ) -> StoreBackend:
    """Build the backend ``spec`` names (imports Mooncake only when asked for);
    ``connect_timeout_s``: how long a Mooncake master not up yet is waited for (0: look once).

    Raises:
        StoreError: the Mooncake client is not installed or could not connect.
        ValueError: naming ``kv_store`` for an unknown policy.
    """
    if spec.kind == "host":
        from radixkv.cache.store.host import HostStore

        return HostStore(spec.capacity_bytes, block_size=block_size,
                         eviction_policy=spec.policy or default_policy, model_shape=model_shape)
    from radixkv.cache.store.mooncake import MooncakeStore

    return MooncakeStore(spec, connect_timeout_s=connect_timeout_s)

"""Build the backend a ``--kv-store`` spec names (kept apart from ``backend.py``, which every
backend imports, so that no import cycle forms)."""

from __future__ import annotations

from radixkv.cache.store.backend import KVStoreSpec, StoreBackend


def make_backend(spec: KVStoreSpec, *, block_size: int, default_policy: str,
                 model_shape: object | None = None, connect_timeout_s: float = 0.0
                 ) -> StoreBackend:
    """Build the backend ``spec`` names (imports Mooncake only when asked for);
    ``connect_timeout_s``: how long a Mooncake master not up yet is waited for (0: look once).
    A stack's tiers are built front first; one that fails closes those built before it.

    Raises:
        StoreError: the Mooncake client is not installed or could not connect; the disk
            directory is in use by another process.
        ValueError: naming ``kv_store`` for an unknown policy, or a disk directory that
            cannot be created, is not a directory or is not private to the service user.
    """
    if spec.kind == "host":
        from radixkv.cache.store.host import HostStore

        return HostStore(spec.capacity_bytes, block_size=block_size,
                         eviction_policy=spec.policy or default_policy, model_shape=model_shape)
    if spec.kind == "disk":
        from radixkv.cache.store.disk import DiskStore

        return DiskStore(spec.path, spec.capacity_bytes)
    if spec.kind == "stack":
        from radixkv.cache.store.stack import StackStore

        tiers: list[StoreBackend] = []
        try:
            for tier in spec.tiers:
                tiers.append(make_backend(tier, block_size=block_size,
                                          default_policy=default_policy,
                                          model_shape=model_shape,
                                          connect_timeout_s=connect_timeout_s))
        except BaseException:
            for built in tiers:
                built.close()
            raise
        return StackStore(tiers)
    from radixkv.cache.store.mooncake import MooncakeStore

    return MooncakeStore(spec, connect_timeout_s=connect_timeout_s)

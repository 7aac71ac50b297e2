"""Eviction policies for the radix-tree prefix cache (pure Python: no torch, no radixkv).

Installed as ``radixkv.eviction``. Import a policy by name with :func:`get_policy`, or with
:func:`make_policy`, which also hands the cost-model shape to the policies that use one
(``gdsf``, ``cost``, the oracles) and not to the others.

Registered: ``lru``, ``lfu``, ``fifo``, ``gdsf``, ``s3fifo``, ``cost`` (ours),
``predicted-reuse`` / ``predicted-reuse-prior`` (ours, learned next-use prediction), and the offline
oracles ``belady`` / ``belady-cost`` (benchmarks only: they need the trace's future).
"""

from typing import Any

from . import belady as _belady  # noqa: F401  (registers "belady", "belady-cost")
from . import cost_aware as _cost_aware  # noqa: F401  (registers "cost")
from . import fifo as _fifo  # noqa: F401  (registers "fifo")
from . import gdsf as _gdsf  # noqa: F401  (registers "gdsf")
from . import lfu as _lfu  # noqa: F401  (registers "lfu")
from . import lru as _lru  # noqa: F401  (registers "lru")
from . import predicted_reuse as _predicted_reuse  # noqa: F401  ("predicted-reuse", "-prior")
from . import s3fifo as _s3fifo  # noqa: F401  (registers "s3fifo")
from .base import (
    _REGISTRY,
    EvictionPolicy,
    NodeView,
    PriorityPolicy,
    VictimPolicy,
    available_policies,
    get_policy,
    register,
)
from .cost_model import PRESETS, CostShape, cost_shape_from_model_shape, prefill_flops


def make_policy(name: str, *, model_shape: object = None, **kwargs: Any) -> EvictionPolicy:
    """Instantiate policy ``name``; ``model_shape`` goes only to policies that take one.

    Args:
        name: Registry name.
        model_shape: A cost-model preset name, ``CostShape``, or ``radixkv.model.ModelShape``
            (converted by ``cost_shape_from_model_shape``); None keeps the policy's default.
        **kwargs: Passed to the policy's constructor.

    Raises:
        ValueError: naming ``eviction_policy`` for an unknown name (from :func:`get_policy`).
    """
    factory = _REGISTRY.get(name)
    if model_shape is not None and getattr(factory, "uses_model_shape", False):
        kwargs["model_shape"] = model_shape
    return get_policy(name, **kwargs)


__all__ = [
    "PRESETS",
    "CostShape",
    "EvictionPolicy",
    "NodeView",
    "PriorityPolicy",
    "VictimPolicy",
    "available_policies",
    "cost_shape_from_model_shape",
    "get_policy",
    "make_policy",
    "prefill_flops",
    "register",
]

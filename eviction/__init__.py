"""Eviction policies for the radix-tree prefix cache (pure Python: no torch, no radixkv).

Installed as ``radixkv.eviction``. Import a policy by name with :func:`get_policy`.
"""

from . import fifo as _fifo  # noqa: F401  (registers "fifo")
from . import lfu as _lfu  # noqa: F401  (registers "lfu")
from . import lru as _lru  # noqa: F401  (registers "lru")
from .base import (
    EvictionPolicy,
    NodeView,
    PriorityPolicy,
    VictimPolicy,
    available_policies,
    get_policy,
    register,
)

__all__ = [
    "EvictionPolicy",
    "NodeView",
    "PriorityPolicy",
    "VictimPolicy",
    "available_policies",
    "get_policy",
    "register",
]

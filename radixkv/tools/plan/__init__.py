"""``radixkv plan``: KV capacity planning from a model config, without weights.

Layers of the package (imports go downward only):

- ``layout``: :class:`KVLayout` / :class:`LayerGroup`, a model's layers grouped by per-token
  K/V cost (full attention, sliding window W, MLA latent);
- ``hf_config`` / ``gguf_meta``: build a layout from a ``config.json`` or a GGUF header;
- ``capacity``: bytes per token per group (the formulas and their sources), the memory budget,
  blocks and worst-case concurrency (:func:`plan_capacity` -> :class:`CapacityPlan`);
- ``render``: the table and the JSON; ``command``: the subcommand's flags and exit codes.

Nothing but ``gguf_meta.layout_from_gguf`` (the GGUF reader) imports torch.
"""

from .capacity import (
    GIB,
    KV_DTYPE_BYTES,
    PLAN_KV_CACHE_DTYPES,
    CapacityPlan,
    GroupCost,
    MemoryBudget,
    group_cost,
    kv_heads_per_rank,
    memory_budget,
    plan_capacity,
)
from .hf_config import dense_num_params, layout_from_hf_config, read_config_json
from .layout import FULL, MLA, SLIDING, KVLayout, LayerGroup

__all__ = ["GIB", "KV_DTYPE_BYTES", "PLAN_KV_CACHE_DTYPES", "CapacityPlan", "GroupCost",
           "MemoryBudget", "group_cost", "kv_heads_per_rank", "memory_budget", "plan_capacity",
           "dense_num_params", "layout_from_hf_config", "read_config_json", "FULL", "MLA",
           "SLIDING", "KVLayout", "LayerGroup"]

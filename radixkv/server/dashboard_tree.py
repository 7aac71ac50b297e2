"""The radix-tree explorer's read of the cache: plain rows built on the engine thread.

``tree_view`` runs inside ``AsyncEngine.read_cache`` (the engine thread owns the tree; the event
loop never touches a node) and returns dicts, lists and numbers only, so nothing it hands back
changes after the call. One walk visits every node once: O(nodes), about one node per cached
run of blocks, taken only when a dashboard asks (never on the step's path).

A *prefix* is a node: the tokens from its identity root to the node's last block. Per node:

- ``num_blocks`` / ``num_tokens``: the blocks the node itself holds (``num_tokens = num_blocks
  * block_size``); ``prefix_tokens = depth_tokens + num_tokens``.
- ``subtree_blocks``: its blocks plus every descendant's: what this prefix and its
  continuations hold of the pool (what evicting the whole branch would free).
- ``hit_count``: lookups that matched at least one of its blocks (``Node.hit_count``).
- ``saved_prefill_flops``: ``hit_count * prefill_flops(depth_tokens, num_tokens)`` with the
  engine's cost model (``radixkv.eviction.cost_model.prefill_flops``, the formula behind
  ``/stats`` ``saved_prefill_flops_total``). A lookup that ends inside a node splits it, so
  each hit covered the node's blocks as they were then; a node grown in place after a hit
  counts its later blocks too, so this is an upper bound for such a node.
- ``last_access_age_s``: the tree clock now minus ``Node.last_access_s`` (seconds on a
  serving engine's monotonic clock).
- ``policy_key``: the eviction policy's sort key (lowest evicted first) for an evictable leaf
  under a priority-key policy (``lru``, ``lfu``, ``fifo``, ``gdsf``, ``cost``...); None for a
  node that cannot be evicted now (locked, retained or with children) and under a
  victim-naming policy (``s3fifo``), which keeps its own order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixkv.cache.hashing import unpack_tokens
from radixkv.eviction import PriorityPolicy
from radixkv.eviction.cost_model import CostShape, prefill_flops

if TYPE_CHECKING:
    from radixkv.cache.manager import CacheManager
    from radixkv.cache.tree.node import Node

SORT_KEYS = ("blocks", "hits", "saved_flops")
#: Most token ids a drill-down returns of one node (its decoded text is cut there too).
MAX_NODE_TOKENS = 4096
#: Most children a drill-down lists (largest subtrees first).
MAX_CHILDREN = 50

_TENANT_PREFIX = "tenant:"
_SALT_SEPARATOR = "|salt:"


def tenant_of_salt(salt: str | None) -> str | None:
    """The tenant name in a cache salt ``tenant:<name>[|salt:<client salt>]``
    (``radixkv.server.auth.cache_salt_for``); None for a salt without one (a server without
    keys). Tenant names cannot hold ``|``, so the split is exact."""
    if salt is None or not salt.startswith(_TENANT_PREFIX):
        return None
    return salt[len(_TENANT_PREFIX):].split(_SALT_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class TreeQuery:
    """What one explorer request asks (validated by ``radixkv.server.dashboard``).

    Attributes:
        top: Rows in the top list (≥ 1).
        sort: One of ``SORT_KEYS``: ``blocks`` (``subtree_blocks``), ``hits``
            (``hit_count``) or ``saved_flops`` (``saved_prefill_flops``), largest first; ties
            by node id.
        node: A node id to drill into (None: no drill-down).
        tenant: Only nodes of this tenant (None: every node).
        admin: Whether the caller may see cache salts and token ids.
    """

    top: int
    sort: str = "blocks"
    node: int | None = None
    tenant: str | None = None
    admin: bool = False


def _plain(value: Any) -> Any:
    """A policy key element as JSON: numbers (non-finite as strings), else its ``str``."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return str(value)


def tree_view(cache: CacheManager, query: TreeQuery,
              cost_shape: CostShape | None) -> dict[str, Any]:
    """The explorer's answer, read on the engine thread.

    Args:
        cache: The engine's cache (read only).
        query: The validated request.
        cost_shape: The served model's cost model shape (None: ``saved_prefill_flops`` 0).

    Returns:
        ``{"block_size", "eviction_policy", "policy_kind", "num_nodes", "num_blocks", "top":
        [row, ...], "node": detail or None}``. ``num_nodes`` / ``num_blocks`` count the nodes
        and blocks visible to the query (its tenant's only, when it names one). ``node`` is
        None when ``query.node`` is None; ``{"missing": True}`` when no visible node has that
        id. A detail is a row plus ``path`` (ancestor ids, root side first), ``children`` (rows,
        largest subtree first, at most ``MAX_CHILDREN``) and, for an admin, ``token_ids`` (the
        node's own tokens, at most ``MAX_NODE_TOKENS``) and ``tokens_truncated``.
    """
    tree = cache.tree
    policy = tree.policy
    now = tree.now()
    keyed = policy if isinstance(policy, PriorityPolicy) else None
    visible: list[Node] = []
    for root in tree.roots.values():
        if query.tenant is not None and tenant_of_salt(root.tenant) != query.tenant:
            continue
        stack = list(root.children.values())
        while stack:  # pre-order; bounded by the tree's node count
            node = stack.pop()
            visible.append(node)
            stack.extend(node.children.values())
    subtree: dict[int, int] = {}
    for node in reversed(visible):  # children before parents
        subtree[node.uid] = subtree.get(node.uid, 0) + node.num_blocks
        parent = node.parent
        if parent is not None and parent.parent is not None:
            subtree[parent.uid] = subtree.get(parent.uid, 0) + subtree[node.uid]

    def flops(node: Node) -> float:
        if cost_shape is None or node.hit_count == 0:
            return 0.0
        return node.hit_count * prefill_flops(cost_shape, node.depth_tokens, node.num_tokens)

    def row(node: Node) -> dict[str, Any]:
        out = {
            "id": node.uid,
            "parent_id": None if node.parent is None or node.parent.parent is None
            else node.parent.uid,
            "tenant": tenant_of_salt(node.tenant),
            "depth_tokens": node.depth_tokens,
            "num_blocks": node.num_blocks,
            "num_tokens": node.num_tokens,
            "prefix_tokens": node.depth_tokens + node.num_tokens,
            "subtree_blocks": subtree[node.uid],
            "num_children": len(node.children),
            "hit_count": node.hit_count,
            "saved_prefill_flops": flops(node),
            "last_access_age_s": round(max(0.0, now - node.last_access_s), 3),
            "locks": node.lock_ref,
            "retained": node.retain_refs is not None,
            "evictable": node.leaf_entry is not None,
            "policy_key": (_plain(keyed.priority(node))
                           if keyed is not None and node.leaf_entry is not None else None),
        }
        if query.admin:
            out["cache_salt"] = node.tenant
        return out

    sort_key: Callable[[Node], Any] = {
        "blocks": lambda n: (-subtree[n.uid], n.uid),
        "hits": lambda n: (-n.hit_count, n.uid),
        "saved_flops": lambda n: (-flops(n), n.uid),
    }[query.sort]
    top = sorted(visible, key=sort_key)[:query.top]
    detail: dict[str, Any] | None = None
    if query.node is not None:
        found = next((n for n in visible if n.uid == query.node), None)
        if found is None:
            detail = {"missing": True}
        else:
            detail = row(found)
            path = []
            up = found.parent
            while up is not None and up.parent is not None:
                path.append(up.uid)
                up = up.parent
            detail["path"] = path[::-1]
            kids = sorted(found.children.values(), key=lambda n: (-subtree[n.uid], n.uid))
            detail["children"] = [row(k) for k in kids[:MAX_CHILDREN]]
            if query.admin:
                detail["tokens_truncated"] = found.num_tokens > MAX_NODE_TOKENS
                detail["token_ids"] = list(unpack_tokens(bytes(found.tokens[:4 * MAX_NODE_TOKENS])))
    return {
        "block_size": tree.block_size,
        "eviction_policy": getattr(policy, "name", type(policy).__name__),
        "policy_kind": policy.kind,
        "num_nodes": len(visible),
        "num_blocks": sum(n.num_blocks for n in visible),
        "top": [row(n) for n in top],
        "node": detail,
    }


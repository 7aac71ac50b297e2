"""Eviction policy protocol and registry.

The radix tree keeps every *evictable leaf* (a node with ``lock_ref == 0`` and no children)
in an index ordered by the active policy, and asks that index for victims when the block pool
runs short. This module defines what a policy may see of a node and the two shapes a policy
can take:

* **priority-key** policies (:class:`PriorityPolicy`) map a node's read-only fields to a
  sortable key; the tree keeps leaves in a sorted structure and evicts the *lowest* key first.
  The key of a node must only depend on fields that change on tree events (insert, hit,
  unlock, split, trim), because the tree re-keys a leaf only on those events.
* **victim-naming** policies (:class:`VictimPolicy`) keep their own order (queues, ghost
  lists, as S3-FIFO or ARC do); the tree tells them which leaves are evictable
  (``add_leaf`` / ``remove_leaf``), every hit and insert (``on_hit`` / ``on_insert``) and every
  trim (``on_evict``), and asks them to name the next victim among the evictable leaves.

Registered here: ``lru``, ``lfu``, ``fifo``. Priorities may only read :class:`NodeView`
fields; the tree appends the node ``uid`` to every key, so ties are broken deterministically.

Ghost hits: the cache keeps the one list of recently evicted blocks (its ghost list). A policy
that wants history across an eviction returns a *note* from :meth:`EvictionPolicy.on_evict`; the
cache keeps it with the evicted run and hands it back through
:meth:`EvictionPolicy.on_ghost_hit` when a request brings that very run back into the tree, or
through :meth:`EvictionPolicy.on_ghost_drop` when the ghost list forgets the run.

This package must stay importable without torch and without the rest of radixkv: nodes are
seen only through :class:`NodeView`.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class NodeView(Protocol):
    """Read-only fields of a radix-tree node that a policy may use.

    Attributes:
        uid: Stable unique id of the node (int), usable as a dict key by policies.
        last_access_s: Clock reading (seconds, or ticks of an injected clock) of the last
            hit, insert or unlock touching the node.
        hit_count: Number of lookups that matched at least one block of the node.
        created_s: Clock reading when the node's first block was inserted.
        depth_tokens: Tokens before the node's first block (prefix length at its start).
        num_blocks: Blocks currently held by the node.
        num_tokens: Tokens currently held by the node (``num_blocks * block_size``).
        lock_ref: Number of running requests whose held path goes through the node.
        hashes: Chained hash of each of the node's blocks, in token order (a sequence of
            ``bytes``; stable identities of block contents, e.g. for S3-FIFO's ghost queue or
            an oracle's trace index). A tree node builds this list on each read (it keeps the
            hashes in one buffer); ``block_hash(j)``, where present, reads one (negative
            ``j`` from the end) without it.
        session_key: Session hint (a request's ``prompt_cache_key``, else its ``user``) of the
            latest request that published into or hit the node; None when no request gave one.
        request_end_s: Clock reading when the latest request holding the node released it
            (its end); None before any release. A live agent session's leaf tends to come back
            within its tool-call latency after this time; a finished session's does not.
        access_gaps: The last ≤ 4 gaps between successive hits of the node (clock units,
            oldest first, newest last); empty before its second access.
        max_children: The most children the node ever had at once (fan-out of a shared
            prefix; a leaf that once had children was a branching point).

    Policies should read the last four with ``getattr(node, name, default)``: a node of an
    older tree (or a test fake) may lack them.
    """

    @property
    def uid(self) -> int: ...
    @property
    def last_access_s(self) -> float: ...
    @property
    def hit_count(self) -> int: ...
    @property
    def created_s(self) -> float: ...
    @property
    def depth_tokens(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def lock_ref(self) -> int: ...
    @property
    def hashes(self) -> Sequence[bytes]: ...
    # session_key, request_end_s, access_gaps, max_children: documented above; not declared as
    # protocol members so that isinstance() still accepts views that lack them.


class EvictionPolicy(abc.ABC):  # noqa: B024 - the abstract methods are in its two kinds
    """Common base of every policy.

    Attributes:
        name: Registry name of the policy (e.g. ``"lru"``).
        kind: ``"priority"`` for :class:`PriorityPolicy`, ``"victims"`` for
            :class:`VictimPolicy`; the tree picks its leaf index from it.
    """

    name: str = ""
    kind: str = ""

    def on_evict(self, node: NodeView, num_blocks: int) -> object | None:  # noqa: B027 - optional hook
        """Hook called after ``num_blocks`` blocks were trimmed off ``node``'s tail.

        Args:
            node: The leaf that lost blocks (its fields already reflect the trim).
            num_blocks: Blocks removed from it, ≥ 1.

        Returns:
            A note the cache keeps with the trimmed run in its ghost list and gives back to
            :meth:`on_ghost_hit` if the run returns; None (the default) keeps nothing.
        """

    def on_ghost_hit(self, node: NodeView, notes: list) -> None:  # noqa: B027 - optional hook
        """Hook: blocks just inserted into ``node`` (locked, not yet keyed again) are runs the
        cache evicted recently; ``notes`` are what :meth:`on_evict` returned for them, in token
        order. Called for both policy kinds, only with notes that are not None."""

    def on_ghost_drop(self, notes: list) -> None:  # noqa: B027 - optional hook
        """Hook: the ghost list forgot evicted runs (its capacity) that never came back;
        ``notes`` are what :meth:`on_evict` returned for them (only those not None), oldest
        first. With :meth:`on_ghost_hit` this labels every note: came back, or forgotten
        (a learned policy's positive and negative examples)."""

    def bind_clock(self, clock: Callable[[], float]) -> None:  # noqa: B027 - optional hook
        """Hook: the tree that owns the policy hands over its clock (the one node fields are
        stamped with), once, when it is built. A policy whose keys are absolute times may read
        it when asked for a victim (never to re-key leaves: keys change on tree events only)."""

    def on_hit(self, node: NodeView) -> None:  # noqa: B027 - optional hook
        """Hook (victim-naming policies only): a lookup matched ``node`` (leaf or not).

        Called after ``hit_count`` and ``last_access_s`` were updated. Priority policies are
        re-keyed by the tree instead and never see this call.
        """

    def on_insert(self, node: NodeView, num_blocks: int) -> None:  # noqa: B027 - optional hook
        """Hook (victim-naming policies only): ``num_blocks`` new blocks were published into
        ``node`` (a new node, or an existing one grown in place)."""


class PriorityPolicy(EvictionPolicy):
    """A policy that orders evictable leaves by a sortable key; lowest key is evicted first."""

    kind = "priority"

    @abc.abstractmethod
    def priority(self, node: NodeView) -> Any:
        """Return the sort key of ``node`` (lower is evicted first).

        Args:
            node: An evictable leaf.

        Returns:
            Any totally ordered value (a float or a tuple of numbers). The tree appends the
            node's ``uid`` itself to break ties deterministically.
        """


class VictimPolicy(EvictionPolicy):
    """A policy that keeps its own order over the evictable leaves and names victims."""

    kind = "victims"

    @abc.abstractmethod
    def add_leaf(self, node: NodeView) -> None:
        """``node`` became an evictable leaf (or was re-keyed after an event)."""

    @abc.abstractmethod
    def remove_leaf(self, node: NodeView) -> None:
        """``node`` is no longer an evictable leaf (locked, got a child, or fully evicted)."""

    @abc.abstractmethod
    def choose_victim(self) -> NodeView | None:
        """Return the evictable leaf to trim next, or None when none is known."""


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}


def register(name: str) -> Callable[[Callable[..., EvictionPolicy]], Callable[..., EvictionPolicy]]:
    """Class decorator registering a policy factory under ``name``.

    Raises:
        ValueError: if ``name`` is empty or already registered.
    """
    if not name:
        raise ValueError("name: policy name must be a non-empty string")

    def deco(factory: Callable[..., EvictionPolicy]) -> Callable[..., EvictionPolicy]:
        if name in _REGISTRY:
            raise ValueError(f"name: eviction policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def get_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Instantiate the policy registered as ``name``.

    Args:
        name: Registry name, e.g. ``"lru"``.
        **kwargs: Passed to the policy's constructor.

    Returns:
        A fresh policy instance (policies may keep state, so never share one between trees).

    Raises:
        ValueError: naming ``eviction_policy`` when no policy has that name.
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ValueError(f"eviction_policy: unknown policy {name!r} (known: {known})") from None
    policy = factory(**kwargs)
    policy.name = name
    return policy


def available_policies() -> list[str]:
    """Return the registered policy names, sorted."""
    return sorted(_REGISTRY)

"""LoRA adapter lifecycle: load, replace, unload, and the one in-use rule both engines follow.

``LoRAAdapters`` owns the served adapters (a :class:`radixkv.model.lora.LoRARegistry`) and
counts the requests holding each name. ``LLMEngine`` calls it (``load_lora``, ``unload_lora``,
``prepare_request``, and as requests end); ``AsyncEngine`` calls the same object, only moving the
blocking file read off the event loop.

Rules:

* A name is 1-128 printable characters, is not the base model's, and is not taken unless
  ``replace`` (``check_name``).
* A request holds its adapter's name from ``LLMEngine.prepare_request`` until its last choice
  finishes or it is aborted (``hold`` / ``release``); an adapter is in use while any request
  holds its name.
* ``unload`` refuses an unknown name (``LoRANotFoundError``, the server's 404) and a name in use
  (``LoRAInUseError``, 409). Replacing (``replace=True``) is allowed while in use.
* Requests already made keep the adapter object they resolved: replacing or unloading never
  changes their weights. The cache identity is ``(name, weights digest)``, so KV computed with
  old weights is never matched by the new ones; it stays cached until evicted.

Threads: this registry is the one engine object both threads use. In the server it is read and
changed on the event loop (loading, unloading, ``prepare_request`` resolving and holding a name,
so a 404 or an in-use refusal is answered at once) while requests end on the engine thread,
which releases their holds; a lock guards the hold counts. It holds no cache state: the cache
identity of an adapter is resolved on the engine thread.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

from radixkv.errors import LoRAError, LoRAInUseError, LoRANotFoundError
from radixkv.log import get_logger
from radixkv.model.config import ModelShape
from radixkv.model.lora import LoRAAdapter, LoRARegistry

log = get_logger(__name__)

__all__ = ["LoRAAdapters"]


class LoRAAdapters:
    """The served LoRA adapters and the requests holding them.

    Args:
        shape / device / dtype: the base model's (adapters are read and checked against it).
        base_model_name: the name clients use for the base model; no adapter may take it.
    """

    def __init__(self, shape: ModelShape, *, base_model_name: str, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.base_model_name = base_model_name
        self._registry = LoRARegistry(shape, device=device, dtype=dtype)
        self._holders: Counter[str] = Counter()  # name -> requests holding it
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ loading
    def check_name(self, name: str, *, replace: bool = False) -> None:
        """Refuse a name that is the base model's, or taken (unless ``replace``).

        Raises:
            LoRAError: naming ``lora_name``.
        """
        if name == self.base_model_name:
            raise LoRAError(f"lora_name: '{name}' is the base model's name")
        if name in self._registry and not replace:
            raise LoRAError(f"lora_name: an adapter named '{name}' is already loaded; unload it "
                            "first")

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and validate a PEFT adapter directory without serving it (blocking file I/O;
        safe in a worker thread).

        Raises:
            LoRAError: a bad name or adapter (the message names the file or tensor).
        """
        return self._registry.read(name, path)

    def add(self, adapter: LoRAAdapter, *, replace: bool = False) -> None:
        """Serve an adapter from ``read`` under its name (checked again: another load may have
        taken the name since).

        Raises:
            LoRAError: naming ``lora_name``.
        """
        self.check_name(adapter.name, replace=replace)
        self._registry.add(adapter, replace=replace)
        log.info("lora_loaded", name=adapter.name, path=adapter.path, digest=adapter.digest[:16],
                 rank=adapter.rank, targets=list(adapter.target_modules))

    def load(self, name: str, path: str, *, replace: bool = False) -> LoRAAdapter:
        """``check_name``, ``read`` and ``add`` in this thread.

        Raises:
            LoRAError: a bad name or adapter.
        """
        self.check_name(name, replace=replace)
        adapter = self.read(name, path)
        self.add(adapter, replace=replace)
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Stop serving adapter ``name``; its cached KV stays until evicted (no other adapter
        or version can match it).

        Raises:
            LoRANotFoundError: no such adapter.
            LoRAInUseError: a request holds it.
        """
        if name not in self._registry:
            raise LoRANotFoundError(f"lora_name: no LoRA adapter named '{name}' is loaded")
        num_holders = self.num_holders(name)
        if num_holders:
            raise LoRAInUseError(f"lora_name: adapter '{name}' is in use by {num_holders} "
                                 "request(s); retry once they finish")
        adapter = self._registry.remove(name)
        log.info("lora_unloaded", name=name, digest=adapter.digest[:16])
        return adapter

    # ------------------------------------------------------------------ requests
    def resolve(self, name: str) -> LoRAAdapter:
        """The adapter a request's ``model`` names.

        Raises:
            LoRANotFoundError: naming ``model``.
        """
        adapter = self._registry.get(name)
        if adapter is None:
            raise LoRANotFoundError(f"model: no LoRA adapter named '{name}' is loaded")
        return adapter

    def hold(self, adapter: LoRAAdapter) -> None:
        """A request now holds ``adapter.name`` (until ``release``)."""
        with self._lock:
            self._holders[adapter.name] += 1

    def release(self, adapter: LoRAAdapter) -> None:
        """A request that held ``adapter.name`` ended."""
        with self._lock:
            self._holders[adapter.name] -= 1
            if self._holders[adapter.name] <= 0:
                del self._holders[adapter.name]

    def num_holders(self, name: str) -> int:
        """Requests holding adapter ``name`` now."""
        with self._lock:
            return self._holders.get(name, 0)

    # ------------------------------------------------------------------ views
    def list(self) -> list[LoRAAdapter]:
        """Loaded adapters, in load order."""
        return self._registry.list()

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __len__(self) -> int:
        return len(self._registry)

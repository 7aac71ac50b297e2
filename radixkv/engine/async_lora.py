"""The LoRA adapter part of ``AsyncEngine`` (a mixin over its ``_engine``).

One lifecycle, ``radixkv.engine.adapters.LoRAAdapters`` (the engine's ``adapters``): the
registry is read and changed on the event loop only (generate() resolves names there); the
engine thread only releases the holds of requests as they end.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from radixkv.model.lora import LoRAAdapter

if TYPE_CHECKING:
    from radixkv.engine.llm_engine import LLMEngine


class AsyncLoRAMixin:
    """``lora_adapters`` / ``has_lora`` / ``load_lora`` / ``unload_lora`` of ``AsyncEngine``."""

    _engine: LLMEngine

    def lora_adapters(self) -> list[LoRAAdapter]:
        """Loaded adapters, in load order."""
        return self._engine.adapters.list()

    def has_lora(self, name: str) -> bool:
        return name in self._engine.adapters

    async def load_lora(self, name: str, path: str, *, replace: bool = False) -> LoRAAdapter:
        """Read and validate a PEFT adapter in a worker thread, then serve it as ``name``.

        With ``replace`` an adapter of that name is swapped for the new one: requests already
        made keep the old weights (and old cache identity).

        Raises:
            LoRAError: a bad name or adapter (the message names the file or tensor).
        """
        adapters = self._engine.adapters
        adapters.check_name(name, replace=replace)
        adapter = await asyncio.get_running_loop().run_in_executor(None, adapters.read, name, path)
        adapters.add(adapter, replace=replace)  # checks the name again: another load may have won
        return adapter

    def unload_lora(self, name: str) -> LoRAAdapter:
        """Stop serving adapter ``name`` (``LLMEngine.unload_lora``).

        Raises:
            LoRANotFoundError: no such adapter.
            LoRAInUseError: a request made with it has not finished (or been aborted).
        """
        return self._engine.unload_lora(name)

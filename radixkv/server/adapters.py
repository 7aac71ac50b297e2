"""LoRA adapters over HTTP: model selection, the model list, and vLLM's run-time endpoints.

A request's ``model`` names the base model or a loaded adapter; any other name is 404
``model_not_found``. ``/v1/models`` lists the base model, then each adapter with ``parent`` =
the base model's id (as vLLM does).

    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?: bool}
    POST /v1/unload_lora_adapter  {"lora_name"}

Both are admin-only when API keys are configured (``auth.ADMIN_PATHS``). A bad adapter is a 400
``invalid_lora_adapter`` naming the file or tensor, and the server keeps serving; loading a
name already in use is a 400 unless ``load_inplace`` (then requests already made keep the old
weights and old cache identity); unloading an unknown name is 404 ``lora_not_found`` and one
that an in-flight request uses 409 ``lora_in_use``. Reading and validating the files runs in a
worker thread, never on the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from radixkv.errors import LoRAError, LoRAInUseError, LoRANotFoundError
from radixkv.server.errors import APIError, bad_request, json_response
from radixkv.server.params import opt_bool, refuse_unknown_keys

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine

# vLLM's request bodies also carry an optional ``lora_int_id`` (its internal slot id): accepted
# and ignored (adapters are addressed by name here).
LOAD_KEYS = frozenset({"lora_name", "lora_path", "load_inplace", "lora_int_id"})
UNLOAD_KEYS = frozenset({"lora_name", "lora_int_id"})


def model_names(engine: AsyncEngine) -> tuple[str, ...]:
    """The names a request's ``model`` may take: the base model first, then the adapters."""
    return (engine.model_name, *(a.name for a in engine.lora_adapters()))


def selected_lora(body: dict[str, Any], engine: AsyncEngine) -> str | None:
    """The adapter a (validated) body's ``model`` selects, or None for the base model."""
    model = body.get("model")
    if isinstance(model, str) and model != engine.model_name and engine.has_lora(model):
        return model
    return None


def require_lora(engine: AsyncEngine, name: str | None) -> None:
    """404 if adapter ``name`` was unloaded since the request was validated (call with no
    ``await`` between it and ``engine.generate``)."""
    if name is not None and not engine.has_lora(name):
        raise APIError(404, f"The model '{name}' does not exist any more: the LoRA adapter was "
                            "unloaded", param="model", code="model_not_found")


def model_entries(engine: AsyncEngine, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` data: the base model, then one entry per adapter."""
    base = {"id": engine.model_name, "object": "model", "created": created,
            "owned_by": "radixkv", "max_model_len": engine.max_model_len}
    return [base, *({"id": a.name, "object": "model", "created": created, "owned_by": "radixkv",
                     "parent": engine.model_name, "max_model_len": engine.max_model_len}
                    for a in engine.lora_adapters())]


def _name(body: dict[str, Any]) -> str:
    int_id = body.get("lora_int_id")
    if int_id is not None and (isinstance(int_id, bool) or not isinstance(int_id, int)):
        raise bad_request("'lora_int_id' must be an integer when given", "lora_int_id")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request("'lora_name' must be a non-empty string", "lora_name")
    return name


async def load_adapter(body: dict[str, Any], engine: AsyncEngine) -> web.Response:
    """``POST /v1/load_lora_adapter``: read, validate and serve a PEFT adapter."""
    refuse_unknown_keys(body, LOAD_KEYS)
    name = _name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad_request("'lora_path' must be a non-empty string (a directory on the server)",
                          "lora_path")
    replace = bool(opt_bool(body, "load_inplace"))
    try:
        adapter = await engine.load_lora(name, path, replace=replace)
    except LoRAError as exc:
        message = str(exc)
        param = "lora_name" if message.startswith("lora_name:") else "lora_path"
        raise bad_request(message, param, "invalid_lora_adapter") from exc
    return json_response({"lora_name": adapter.name, "digest": adapter.digest,
                          "rank": adapter.rank, "target_modules": list(adapter.target_modules),
                          "message": f"Success: LoRA adapter '{name}' added successfully."})


async def unload_adapter(body: dict[str, Any], engine: AsyncEngine) -> web.Response:
    """``POST /v1/unload_lora_adapter``: stop serving an adapter no in-flight request uses."""
    refuse_unknown_keys(body, UNLOAD_KEYS)
    name = _name(body)
    try:
        engine.unload_lora(name)
    except LoRANotFoundError as exc:
        raise APIError(404, str(exc), param="lora_name", code="lora_not_found") from exc
    except LoRAInUseError as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_in_use") from exc
    return json_response({"lora_name": name,
                          "message": f"Success: LoRA adapter '{name}' removed successfully."})

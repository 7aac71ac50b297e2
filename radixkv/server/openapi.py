"""The hand-written OpenAPI 3.1 document served at ``GET /openapi.json``.

Written by hand (not generated) so that it states the contract — what is accepted, what is
refused and with which status — rather than whatever the code happens to do. Tests check that
every route of the application is documented and every documented route exists.
"""

from __future__ import annotations

from typing import Any

from radixkv.server.dashboard import openapi_paths as dashboard_paths
from radixkv.server.param_policy import request_schema
from radixkv.server.param_table import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    COUNT_TOKENS_PARAMS,
    MESSAGE_SCHEMA,
    MESSAGES_PARAMS,
    TOKENIZE_PARAMS,
)
from radixkv.server.param_table import int_schema as _int
from radixkv.server.param_table import obj_schema as _obj


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _num(minimum: float, maximum: float, **extra: Any) -> dict:
    return {"type": "number", "minimum": minimum, "maximum": maximum, **extra}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}




_ERRORS = {
    "400": "Invalid or unsupported parameter (``error.param`` names it); prompt + max_tokens "
           "over the context (``code: context_length_exceeded``); a body that does not decode as its "
           "``Content-Encoding`` says (``code: invalid_content_encoding``).",
    "401": "Missing or unknown API key (only when the server runs with --api-keys).",
    "404": "Unknown model (``code: model_not_found``).",
    "409": "The LoRA adapter is in use by an in-flight request (``code: lora_in_use``).",
    "413": "Request body over the server's limit, on the wire or once decoded "
           "(``code: request_too_large``).",
    "415": "A ``Content-Encoding`` other than gzip, deflate or identity "
           "(``code: unsupported_content_encoding``; ``Accept-Encoding`` lists those).",
    "429": "The tenant's concurrency limit is reached (``Retry-After``).",
    "500": "A fault in the server or engine that belongs to this request "
           "(``code: internal_error``); the request is ended and its blocks freed, the engine "
           "keeps serving.",
    "503": "Queue full (``queue_full``), shutting down (``shutting_down``), engine dead "
           "(``engine_dead`` / ``unhealthy``) or request aborted (``aborted``); ``Retry-After`` "
           "on the first two.",
}


def _error_responses(*codes: str) -> dict:
    return {code: {"description": _ERRORS[code],
                   "content": {"application/json": {"schema": _ref("Error")}}}
            for code in codes}


_ANTHROPIC_ERRORS = {
    "400": "invalid_request_error: an invalid or unsupported field (the message names it: "
           "``messages.2.content.0.cache_control.ttl``), more than 4 cache_control "
           "breakpoints, prompt + max_tokens over the context.",
    "401": "authentication_error: missing or unknown key (``x-api-key`` or ``Authorization: "
           "Bearer``; only with --api-keys).",
    "404": "not_found_error: unknown model.",
    "413": "request_too_large: body over the server's limit.",
    "429": "rate_limit_error: the tenant's concurrency limit (``Retry-After``).",
    "500": "api_error: a fault in the server or engine that belongs to this request.",
    "529": "overloaded_error: queue full, shutting down, engine not running or request "
           "aborted (OpenAI routes answer these 503).",
}


def _anthropic_errors(*codes: str) -> dict:
    return {code: {"description": _ANTHROPIC_ERRORS[code],
                   "content": {"application/json": {"schema": _ref("AnthropicError")}}}
            for code in codes}


_A_USAGE = _obj({
    "input_tokens": _int(0, description="Prompt tokens neither read from nor written to the "
                                        "cache."),
    "cache_read_input_tokens": _int(0, description="Prompt tokens served from the prefix "
                                                   "cache."),
    "cache_creation_input_tokens": _int(0, description="Prompt tokens this request newly "
                                                       "retained at its breakpoints."),
    "cache_creation": _obj({"ephemeral_5m_input_tokens": _int(0),
                            "ephemeral_1h_input_tokens": _int(0)}),
    "output_tokens": _int(0)},
    ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens"],
    description="input_tokens + cache_read_input_tokens + cache_creation_input_tokens is the "
                "prompt's length in tokens.")
_A_BLOCK = {"anyOf": [
    _obj({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"]),
    _obj({"type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
          "input": {"type": "object"}}, ["type", "id", "name", "input"])]}
_RETENTION = _obj({
    "id": {"type": "string"}, "object": {"const": "cache.retention"},
    "tenant": _nullable({"type": "string"}), "ttl": {"enum": ["5m", "1h", "24h"]},
    "num_tokens": _int(0, description="Tokens retained (whole blocks)."),
    "expires_in_s": _num(0, 86400), "num_refreshes": _int(0)})

_USAGE = _obj({
    "prompt_tokens": _int(0), "completion_tokens": _int(0), "total_tokens": _int(0),
    "prompt_tokens_details": _obj({"cached_tokens": _int(
        0, description="Prompt tokens served from the prefix cache.")}, ["cached_tokens"]),
}, ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"])

_FINISH = {"enum": ["stop", "length", None]}
# Chat replies read for tool calls (radixkv.server.tool_calls); arguments is a JSON string.
_CHAT_FINISH = {"enum": ["stop", "length", "tool_calls", None]}
_TOOL_CALL = _obj({"id": {"type": "string"}, "type": {"const": "function"},
                   "function": _obj({"name": {"type": "string"}, "arguments": {"type": "string"}},
                                    ["name", "arguments"])}, ["id", "type", "function"])

_SCHEMAS = {
    "Error": _obj({"error": _obj({
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})},
        ["message", "type", "param", "code"])}, ["error"]),
    "ChatCompletionRequest": request_schema(
        CHAT_PARAMS, ["messages"],
        "Tools are rendered by the chat template, or as text for templates without tool "
        "support."),
    "ChatCompletion": _obj({
        "id": {"type": "string"}, "object": {"const": "chat.completion"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": _obj({
            "index": _int(0), "finish_reason": _CHAT_FINISH, "logprobs": {"type": "null"},
            "message": _obj({"role": {"const": "assistant"},
                             "content": _nullable({"type": "string"}),
                             "tool_calls": {"type": "array", "items": _TOOL_CALL}})})},
        "usage": _USAGE}),
    "ChatCompletionChunk": _obj({
        "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": _obj({
            "index": _int(0), "finish_reason": _CHAT_FINISH, "logprobs": {"type": "null"},
            "delta": _obj({"role": {"const": "assistant"}, "content": {"type": "string"},
                           "tool_calls": {"type": "array", "items": _obj(
                               {"index": _int(0), **_TOOL_CALL["properties"]})}})})},
        "usage": _nullable(_USAGE)}, description="One SSE ``data:`` event; the stream ends "
                                                 "with ``data: [DONE]``."),
    "CompletionRequest": request_schema(COMPLETION_PARAMS, ["prompt"],
                                        "max_tokens defaults to 16."),
    "Completion": _obj({
        "id": {"type": "string"}, "object": {"const": "text_completion"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": _obj({
            "index": _int(0), "text": {"type": "string"}, "finish_reason": _FINISH,
            "logprobs": {"type": "null"},
            "prompt_token_ids": _nullable({"type": "array", "items": _int(0)}),
            "token_ids": {"type": "array", "items": _int(0)}})},
        "usage": _nullable(_USAGE)}, description="Also the shape of each streamed chunk "
                                                 "(``usage`` only with include_usage)."),
    "TokenizeRequest": {**request_schema(
        TOKENIZE_PARAMS, [],
        "Exactly one of messages and prompt. With messages, the ids are those a chat request "
        "with the same cache_salt would run: the model's own recent replies, sent back as "
        "assistant messages, keep their generated ids."),
        "oneOf": [{"required": ["messages"]},
                  {"required": ["prompt"], "not": {"anyOf": [
                      {"required": ["tools"]}, {"required": ["chat_template_kwargs"]}]}}]},
    "TokenizeResponse": _obj({"tokens": {"type": "array", "items": _int(0)},
                              "count": _int(0), "max_model_len": _int(1)}),
    "RenderResponse": _obj({"token_ids": {"type": "array", "items": _int(0)}}, ["token_ids"],
                           description="The prompt ids the request would run."),
    "DetokenizeRequest": _obj({"model": {"type": "string"},
                               "tokens": {"type": "array", "items": _int(0)}}, ["tokens"],
                              description="Ids outside the tokenizer's vocabulary: 400 naming "
                                          "tokens[i]."),
    "DetokenizeResponse": _obj({"prompt": {"type": "string"}}, ["prompt"]),
    "Models": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj({
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "max_model_len": _int(1),
        "kv_cache_dtype": {"enum": ["float32", "bfloat16", "int8", "fp8_e4m3"],
                           "description": "The KV pool's format as allocated (--kv-cache-dtype)."},
        "kv_bytes_per_token": _int(1, description="K+V bytes of one cached token over all "
                                                  "layers, scales included."),
        "parent": {"type": "string", "description": "A LoRA adapter's base model."}})}}),
    "LoadLoRAAdapterRequest": _obj({
        "lora_name": {"type": "string", "description": "The name requests send as model."},
        "lora_path": {"type": "string", "description": "PEFT adapter directory on the server "
                                                        "(adapter_config.json + "
                                                        "adapter_model.safetensors)."},
        "load_inplace": {"type": "boolean", "description": "Replace an adapter of that name."}},
        ["lora_name", "lora_path"]),
    "UnloadLoRAAdapterRequest": _obj({"lora_name": {"type": "string"}}, ["lora_name"]),
    "LoRAAdapterResponse": _obj({
        "lora_name": {"type": "string"}, "message": {"type": "string"},
        "digest": {"type": "string", "description": "SHA-256 of the adapter's weights and "
                                                     "scaling (part of the cache identity)."},
        "rank": _int(1), "target_modules": {"type": "array", "items": {"type": "string"}}},
        ["lora_name", "message"]),
    "Latency": _obj({k: _nullable({"type": "number"}) for k in
                     ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")},
                    description="Milliseconds over the most recent samples; null before any."),
    "TenantStats": _obj({
        "tenant": {"type": "string"},
        **{k: _int(0) for k in ("requests_total", "requests_with_hit_total",
                                 "requests_aborted_total", "prompt_tokens_total",
                                 "cached_prompt_tokens_total", "computed_prompt_tokens_total",
                                 "generated_tokens_total", "sequences_total",
                                 "sequences_aborted_total", "requests_failed_total",
                                 "sequences_failed_total", "server_errors_total")},
        "token_hit_rate": _num(0, 1), "request_hit_rate": _num(0, 1), "latency_ms": _ref("Latency"),
    }, description="What a non-admin key sees: its own tenant only."),
    "AnthropicError": _obj({
        "type": {"const": "error"},
        "error": _obj({"type": {"enum": ["invalid_request_error", "authentication_error",
                                         "permission_error", "not_found_error",
                                         "request_too_large", "rate_limit_error", "api_error",
                                         "overloaded_error"]},
                       "message": {"type": "string"}}, ["type", "message"]),
        "request_id": {"type": "string"}}, ["type", "error"],
        description="Anthropic's error shape, on the /v1/messages routes."),
    "AnthropicMessagesRequest": request_schema(
        MESSAGES_PARAMS, ["messages", "max_tokens"],
        "Anthropic's Messages API. Renders to the same token ids as the equivalent chat "
        "request (system → a system message, tool_use → tool_calls, tool_result → tool "
        "messages); cache_control marks retention breakpoints (at most 4; 5m or 1h, longer "
        "TTLs first)."),
    "AnthropicCountTokensRequest": request_schema(
        COUNT_TOKENS_PARAMS, ["messages"], "The prompt fields of a messages request."),
    "AnthropicMessage": _obj({
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string"}, "content": {"type": "array", "items": _A_BLOCK},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
        "stop_sequence": _nullable({"type": "string"}), "usage": _A_USAGE},
        ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"]),
    "AnthropicStreamEvent": {
        "type": "object", "required": ["type"],
        "properties": {"type": {"enum": ["message_start", "ping", "content_block_start",
                                         "content_block_delta", "content_block_stop",
                                         "message_delta", "message_stop", "error"]}},
        "description": "One SSE event (``event: <type>`` then ``data: <JSON>``): "
                       "message_start, ping, per block content_block_start / "
                       "content_block_delta (text_delta, input_json_delta) / "
                       "content_block_stop, then message_delta (stop_reason, usage) and "
                       "message_stop."},
    "AnthropicCountTokens": _obj({"input_tokens": _int(0)}, ["input_tokens"]),
    "RetainRequest": _obj({
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA},
        "tools": CHAT_PARAMS["tools"].schema,
        "chat_template_kwargs": CHAT_PARAMS["chat_template_kwargs"].schema,
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "items": _int(0)}]},
        "ttl": {"enum": ["5m", "1h", "24h"]}, "model": {"type": "string"},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": 1024}}, ["ttl"],
        description="Exactly one of messages (rendered as a chat request renders them) and "
                    "prompt (as /v1/completions encodes it)."),
    "RetainResponse": _obj({
        "id": _nullable({"type": "string"}), "object": {"const": "cache.retention"},
        "ttl": {"enum": ["5m", "1h", "24h"]}, "num_prompt_tokens": _int(1),
        "num_cached_tokens": _int(0), "num_retained_tokens": _int(0),
        "cache_creation_tokens": _int(0), "expires_in_s": _nullable(_num(0, 86400))},
        description="num_retained_tokens below the prompt's whole blocks: a budget refused "
                    "the rest (id null when nothing was retained)."),
    "Retention": _RETENTION,
    "RetentionList": _obj({"object": {"const": "list"},
                           "data": {"type": "array", "items": _ref("Retention")}}),
    "RetentionDeleted": _obj({"id": {"type": "string"},
                              "object": {"const": "cache.retention.deleted"},
                              "deleted": {"const": True}, "num_released": _int(0)}),
    "Stats": _obj({
        "pool": {"type": "object"}, "tree": {"type": "object"}, "miss_tokens": {"type": "object"},
        "latency_ms": _ref("Latency"),
        "tenants": {"type": "object", "additionalProperties": _ref("TenantStats"),
                    "description": "Admin keys only."},
    }, extra=True, description="docs/design.md §7: counters (``*_total``), rates, pool and tree "
                               "gauges, miss causes, eviction policy."),
}


_TENANT_PARAM = {"name": "tenant", "in": "query", "required": False,
                 "schema": {"type": "string"}, "description": "Admin keys: one tenant only."}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(model_name: str) -> dict:
    """The OpenAPI document (``model_name`` appears as the example model)."""
    chat_ok = {"description": "A chat.completion, or with stream: true an SSE stream of "
                              "chat.completion.chunk events.",
               "content": {"application/json": {"schema": _ref("ChatCompletion")},
                           "text/event-stream": {"schema": _ref("ChatCompletionChunk")}}}
    text_ok = {"description": "A text_completion, or with stream: true an SSE stream of them.",
               "content": {"application/json": {"schema": _ref("Completion")},
                           "text/event-stream": {"schema": _ref("Completion")}}}
    bearer: list[dict[str, list[str]]] = [{"bearer": []}]
    anthropic_auth: list[dict[str, list[str]]] = [{"apiKey": []}, {"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixkv", "version": "0.1.0",
                 "description": "OpenAI-compatible LLM server with a radix-tree prefix cache, "
                                "and Anthropic's Messages API. Every error body is "
                                "{\"error\": {message, type, param, code}}, except under "
                                "/v1/messages: Anthropic's {\"type\": \"error\", \"error\": "
                                "{type, message}}; client mistakes are 4xx, never 5xx."},
        "servers": [{"url": "/"}],
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "Needed only when the server runs with --api-keys."},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                           "description": "The same keys, as Anthropic's clients send them."}},
        },
        "security": bearer,
        "paths": {
            "/v1/chat/completions": {"post": {
                "summary": "Chat completion",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("ChatCompletionRequest"),
                    "example": {"model": model_name, "max_tokens": 16,
                                "messages": [{"role": "user", "content": "Hello"}]}}}},
                "responses": {"200": chat_ok,
                              **_error_responses("400", "401", "404", "413", "415", "429", "500",
                                                 "503")}}},
            "/v1/completions": {"post": {
                "summary": "Text completion (prompt as text or token ids)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("CompletionRequest"),
                    "example": {"model": model_name, "prompt": [1, 2, 3], "max_tokens": 8}}}},
                "responses": {"200": text_ok,
                              **_error_responses("400", "401", "404", "413", "415", "429", "500",
                                                 "503")}}},
            "/v1/messages": {"post": {
                "summary": "Anthropic Messages API: a message, or with stream: true Anthropic's "
                           "SSE events",
                "security": anthropic_auth,
                "parameters": [{"name": "anthropic-version", "in": "header", "required": False,
                                "schema": {"type": "string"},
                                "description": "Accepted, any value."}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("AnthropicMessagesRequest"),
                    "example": {"model": model_name, "max_tokens": 16,
                                "system": [{"type": "text", "text": "Be brief.",
                                            "cache_control": {"type": "ephemeral",
                                                              "ttl": "1h"}}],
                                "messages": [{"role": "user", "content": "Hello"}]}}}},
                "responses": {"200": {
                    "description": "A message, or with stream: true an SSE stream.",
                    "content": {"application/json": {"schema": _ref("AnthropicMessage")},
                                "text/event-stream": {"schema": _ref("AnthropicStreamEvent")}}},
                    **_anthropic_errors("400", "401", "404", "413", "429", "500", "529")}}},
            "/v1/messages/count_tokens": {"post": {
                "summary": "The prompt tokens a messages request would run (no generation)",
                "security": anthropic_auth,
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("AnthropicCountTokensRequest")}}},
                "responses": {"200": _json(_ref("AnthropicCountTokens")),
                              **_anthropic_errors("400", "401", "404", "413", "529")}}},
            "/v1/cache/retain": {"post": {
                "summary": "Warm a prefix and retain it for ttl, without generating",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("RetainRequest")}}},
                "responses": {"200": _json(_ref("RetainResponse")),
                              **_error_responses("400", "401", "404", "413", "415", "429",
                                                 "500", "503")}}},
            "/v1/cache/retentions": {
                "get": {"summary": "The caller's live retentions (admin: every tenant's, or "
                                   "?tenant=NAME)",
                        "parameters": [_TENANT_PARAM],
                        "responses": {"200": _json(_ref("RetentionList")),
                                      **_error_responses("401"),
                                      "403": _json(_ref("Error"), "A non-admin key naming "
                                                                  "another tenant.")}},
                "delete": {"summary": "Release the caller's retentions (admin: every tenant's, "
                                      "or ?tenant=NAME)",
                           "parameters": [_TENANT_PARAM],
                           "responses": {"200": _json(_ref("RetentionDeleted")),
                                         **_error_responses("401"),
                                         "403": _json(_ref("Error"), "A non-admin key naming "
                                                                     "another tenant.")}}},
            "/v1/cache/retentions/{retention_id}": {"delete": {
                "summary": "Release one retention of the caller's (admin: anyone's)",
                "parameters": [{"name": "retention_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}, _TENANT_PARAM],
                "responses": {"200": _json(_ref("RetentionDeleted")),
                              **_error_responses("401"),
                              "404": _json(_ref("Error"), "No such retention of the caller's "
                                                          "(another tenant's id too).")}}},
            "/v1/models": {"get": {"summary": "The served model and its loaded LoRA adapters",
                                   "responses": {"200": _json(_ref("Models")),
                                                 **_error_responses("401")}}},
            "/v1/load_lora_adapter": {"post": {
                "summary": "Load a PEFT LoRA adapter (admin key when --api-keys is set)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("LoadLoRAAdapterRequest")}}},
                "responses": {"200": _json(_ref("LoRAAdapterResponse")),
                              **_error_responses("400", "401"),
                              "403": _json(_ref("Error"), "A non-admin key.")}}},
            "/v1/unload_lora_adapter": {"post": {
                "summary": "Unload a LoRA adapter no in-flight request uses (admin key when "
                           "--api-keys is set)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("UnloadLoRAAdapterRequest")}}},
                "responses": {"200": _json(_ref("LoRAAdapterResponse")),
                              **_error_responses("400", "401", "404", "409"),
                              "403": _json(_ref("Error"), "A non-admin key.")}}},
            "/v1/chat/completions/render": {"post": {
                "summary": "The prompt ids a chat request would run (no generation)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("ChatCompletionRequest")}}},
                "responses": {"200": _json(_ref("RenderResponse")),
                              **_error_responses("400", "401", "404", "413", "415", "503")}}},
            "/v1/completions/render": {"post": {
                "summary": "The prompt ids of each prompt of a completions request",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("CompletionRequest")}}},
                "responses": {"200": _json({"type": "array", "items": _ref("RenderResponse")}),
                              **_error_responses("400", "401", "404", "413", "415", "503")}}},
            "/tokenize": {"post": {
                "summary": "Token ids of a chat (as a chat request renders it) or of text",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("TokenizeRequest")}}},
                "responses": {"200": _json(_ref("TokenizeResponse")),
                              **_error_responses("400", "401", "404", "413", "415", "503")}}},
            "/detokenize": {"post": {
                "summary": "Text of token ids (special tokens kept)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("DetokenizeRequest")}}},
                "responses": {"200": _json(_ref("DetokenizeResponse")),
                              **_error_responses("400", "401", "404", "413", "415", "503")}}},
            "/health": {"get": {
                "summary": "Liveness", "security": [],
                "responses": {"200": _json(_obj({"status": {"const": "ok"}})),
                              "503": _json(_obj({"status": {"enum": ["draining", "unhealthy"]}}),
                                           "Shutting down, or the engine thread is dead.")}}},
            "/stats": {"get": {
                "summary": "Engine counters (docs/design.md §7); a non-admin key sees its tenant only",
                "responses": {"200": _json({"anyOf": [_ref("Stats"), _ref("TenantStats")]}),
                              **_error_responses("401")}}},
            "/metrics": {"get": {
                "summary": "Prometheus text format (admin key when --api-keys is set)",
                "responses": {"200": {"description": "Prometheus exposition format 0.0.4",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **_error_responses("401"),
                              "403": _json(_ref("Error"), "A non-admin key.")}}},
            "/openapi.json": {"get": {"summary": "This document", "security": [],
                                      "responses": {"200": _json({"type": "object"})}}},
            "/version": {"get": {
                "summary": "The radixkv package version (vLLM's /version)",
                "responses": {"200": _json(_obj({"version": {"type": "string"}}, ["version"])),
                              **_error_responses("401")}}},
            # What KV-aware routers ask of a replica (radixkv.server.fleet).
            "/get_server_info": {"get": {
                "summary": "Model id, per-process instance id and KV block size (router "
                           "discovery; public)", "security": [],
                "responses": {"200": _json(_obj({
                    "model_id": {"type": "string"}, "instance_id": {"type": "string"},
                    "kv_block_size": _int(1), "max_model_len": _int(1),
                    "enable_kv_cache_events": {"type": "boolean"}},
                    ["model_id", "instance_id", "kv_block_size"]))}}},
            "/kv_event_sources": {"get": {
                "summary": "Where KV events are published, keyed by DP rank; {} when off "
                           "(router discovery; public)", "security": [],
                "responses": {"200": _json({"type": "object", "additionalProperties": _obj({
                    "endpoint": {"type": "string"}, "replay_endpoint": {"type": ["string", "null"]},
                    "topic": {"type": "string"}, "hwm": _int(1), "buffer_steps": _int(1),
                    "publisher": {"const": "zmq"}, "encoding": {"const": "msgpack"},
                    "schema_version": {"const": 1}, "enable_kv_cache_events": {"const": True}})})}}},
            **{path: {"post": {
                "summary": f"{name}: evict every cached block no running request holds "
                           "(admin key when --api-keys is set)",
                "responses": {"200": _json(_obj({"success": {"const": True},
                                                 "num_evicted_blocks": _int(0)})),
                              **_error_responses("401", "503"),
                              "403": _json(_ref("Error"), "A non-admin key.")}}}
               for path, name in (("/reset_prefix_cache", "vLLM's name"),
                                  ("/flush_cache", "SGLang's alias of /reset_prefix_cache"))},
            **dashboard_paths(),  # /dashboard and its data routes
        },
    }

"""The parameter-policy table: every request field of chat completions, completions,
tokenize and Anthropic's messages / count_tokens, as supported, ignored, or neutral-only
(``radixkv.server.param_policy``).

Covers OpenAI's request fields, every extra of vLLM 0.33's ChatCompletionRequest /
CompletionRequest / Tokenize*Request (sampling parameters included), the fields vllm-router
and sglang-router inject into forwarded requests (docs/routers-and-kv-events.md §1),
and a few of SGLang's own constrained-decoding fields. docs/api.md "Parameter policy" states it;
docs/reference/parameters.md is generated from it.
"""

from __future__ import annotations

from typing import Any

from radixkv.server.param_policy import Param, ignored, only, supported

MAX_PROMPTS = 64   # prompts in one /v1/completions request
MAX_CHOICES = 64   # n, and n x prompts


def int_schema(minimum: int | None = None, maximum: int | None = None, **extra: Any) -> dict:
    out: dict[str, Any] = {"type": "integer", **extra}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def obj_schema(props: dict, required: list[str] | None = None, *, extra: bool = False,
               description: str | None = None) -> dict:
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": extra}
    if required:
        out["required"] = required
    if description:
        out["description"] = description
    return out


# Names the chat-template machinery binds itself (HF apply_chat_template's own arguments and
# the variables it hands the template): chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = (
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "pad_token")

_TEXT_PART = obj_schema({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
_TOOL_CALL = obj_schema({
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": obj_schema({"name": {"type": "string"}, "arguments": {"type": "string"}},
                           ["name"])}, ["id", "function"])
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null", "description": "Empty text."},
                     {"type": "array", "maxItems": 1024, "items": _TEXT_PART}]}
_IGNORED_ID = {"type": "string", "description": "Ignored."}
_REASONING = {"type": ["string", "null"], "description": "Ignored."}
MESSAGE_SCHEMA = {"anyOf": [
    obj_schema({"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT,
                "name": {"type": "string"}, "id": _IGNORED_ID}, ["role", "content"]),
    obj_schema({"role": {"const": "assistant"},
                "content": _CONTENT,
                "name": {"type": "string"}, "tool_calls": {"type": "array", "items": _TOOL_CALL},
                "refusal": {}, "annotations": {}, "audio": {"type": "null"},
                "function_call": {"type": "null"}, "id": _IGNORED_ID,
                "reasoning_content": _REASONING, "reasoning": _REASONING}, ["role"]),
    obj_schema({"role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": {"type": "string"},
                "name": {"type": "string"}, "id": _IGNORED_ID},
               ["role", "content", "tool_call_id"]),
], "description": "Text only; developer is treated as system. NUL characters are refused."}

# Ignored keys inside messages[i]: (entry, roles allowed to carry it).
MESSAGE_IGNORED = {
    "id": (ignored("messages[].id", "string", "message ids are the client's bookkeeping"),
           frozenset({"system", "developer", "user", "assistant", "tool"})),
    "reasoning_content": (ignored("messages[].reasoning_content", "string",
                                  "earlier reasoning is not sent back to the template"),
                          frozenset({"assistant"})),
    "reasoning": (ignored("messages[].reasoning", "string",
                          "earlier reasoning is not sent back to the template"),
                  frozenset({"assistant"})),
}

STREAM_OPTIONS = {
    "include_usage": supported("stream_options.include_usage", {"type": "boolean"}),
    "include_obfuscation": ignored("stream_options.include_obfuscation", "boolean",
                                   "no obfuscation padding is added to stream chunks"),
    "continuous_usage_stats": only("stream_options.continuous_usage_stats", False,
                                   why="usage in every chunk is not implemented"),
}
_TOOLS = {"type": "array", "maxItems": 128, "items": obj_schema({
    "type": {"const": "function"},
    "function": obj_schema({"name": {"type": "string", "minLength": 1},
                            "description": {"type": "string"},
                            "parameters": {"type": "object",
                                           "description": "At most 32 levels deep."}},
                           ["name"], extra=True)}, ["type", "function"])}
_TEMPLATE_KWARGS = {"type": "object",
                    "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}},
                    "description": "Extra chat-template variables (e.g. enable_thinking); names "
                                   "the templating itself binds are refused (400)."}
_LOGPROBS = "radixkv does not compute log probabilities"
_GUIDED = "constrained decoding is not implemented"

_COMMON = [
    supported("model", {"type": "string", "description": "The served model id or a loaded LoRA "
                                                         "adapter's name; may be omitted."}),
    supported("max_tokens", int_schema(1, description="Output cap in tokens.")),
    supported("temperature", {"type": "number", "minimum": 0, "maximum": 2,
                              "description": "0 = greedy."}),
    supported("top_p", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    supported("top_k", int_schema(-1, description="0 or -1 disables.")),
    supported("seed", int_schema(-(1 << 63), (1 << 64) - 1,
                                 description="Choice i of an n > 1 request uses (seed + i) mod 2^64.")),
    supported("n", int_schema(1, MAX_CHOICES)),
    supported("stop", {"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "maxItems": 64, "items": {
                                     "type": "string", "minLength": 1, "maxLength": 1024}}]}),
    supported("stream", {"type": "boolean"}),
    supported("stream_options", obj_schema({k: p.schema for k, p in STREAM_OPTIONS.items()},
                                           description="Only with stream: true.")),
    supported("cache_salt", {"type": "string", "minLength": 1, "maxLength": 1024,
                             "description": "Narrows the prefix-cache namespace; with API keys "
                                            "it is combined with the tenant's server-side salt."}),
    supported("ignore_eos", {"type": "boolean"}),
    supported("user", {"type": "string", "description": "Session hint for prefix-cache eviction "
                                                        "when prompt_cache_key is absent."}),
    ignored("safety_identifier", "string", "end-user ids are not used"),
    ignored("store", "boolean", "completions are not stored"),
    ignored("metadata", "object", "completions are not stored"),
    ignored("service_tier", "string", "there is one tier"),
    supported("prompt_cache_retention", {
        "enum": ["in_memory", "24h", None],
        "description": "in_memory (or null): what the cache holds is up to its eviction policy; "
                       "24h: the prompt and the reply are retained for 24 hours (within the "
                       "server's and the tenant's retention budgets)."}),
    supported("prompt_cache_key", {"type": "string",
                                   "description": "Session hint: requests of one conversation or "
                                                  "agent run share it; the eviction policy "
                                                  "(predicted-reuse) learns from it. No isolation "
                                                  "(that is cache_salt)."}),
    only("logit_bias", {}, why="logit biasing is not implemented"),
    only("presence_penalty", 0, why="penalties are not implemented"),
    only("frequency_penalty", 0, why="penalties are not implemented"),
    only("response_format", {"type": "text"}, why="JSON modes are not implemented"),
    # vLLM 0.33 sampling parameters and extras
    only("use_beam_search", False, why="beam search is not implemented"),
    only("min_p", 0, why="min-p sampling is not implemented"),
    only("repetition_penalty", 1, why="penalties are not implemented"),
    only("watermarking", False, why="watermarking is not implemented"),
    ignored("length_penalty", "number", "it only weighs beam search, which is off"),
    only("stop_token_ids", [], why="stop token ids are not implemented; use 'stop'"),
    only("include_stop_str_in_output", False, why="stop strings are always trimmed"),
    only("min_tokens", 0, why="a minimum output length is not implemented"),
    only("skip_special_tokens", True, why="special tokens are always skipped in the text"),
    ignored("spaces_between_special_tokens", "boolean", "special tokens are skipped"),
    only("truncate_prompt_tokens", why="prompt truncation is not implemented"),
    ignored("truncation_side", "string", "it only applies with truncate_prompt_tokens"),
    only("allowed_token_ids", why="token allow-lists are not implemented"),
    only("prompt_logprobs", why=_LOGPROBS),
    only("logprob_token_ids", why=_LOGPROBS),
    only("bad_words", [], why="bad-word lists are not implemented"),
    ignored("priority", "integer", "it orders scheduling only, never the result"),
    ignored("request_id", "string", "responses carry radixkv's own id"),
    ignored("session_id", "string", "sessions are not tracked"),
    ignored("return_tokens_as_token_ids", "boolean", "it only shapes logprobs, which are off"),
    ignored("routed_experts_prompt_start", "integer", "no expert routing data is returned"),
    ignored("return_token_offsets", "boolean", "it applies to the render endpoints only"),
    ignored("return_mm_kwargs", "boolean", "it applies to the render endpoints only"),
    only("kv_transfer_params", why="disaggregated prefill is not implemented"),
    only("ec_transfer_params", why="encoder-cache transfer is not implemented"),
    only("vllm_xargs", {}, why="custom extension arguments are not implemented"),
    only("repetition_detection", why="repetition detection is not implemented"),
    ignored("stream_interval", "integer", "it groups stream chunks only"),
    only("thinking_token_budget", -1, why="thinking budgets are not implemented"),
    only("structured_outputs", why=_GUIDED),
    only("guided_json", why=_GUIDED), only("guided_regex", why=_GUIDED),
    only("guided_choice", why=_GUIDED), only("guided_grammar", why=_GUIDED),
    only("structural_tag", why=_GUIDED),
    ignored("guided_decoding_backend", "string", "it only applies with guided decoding"),
    ignored("guided_whitespace_pattern", "string", "it only applies with guided decoding"),
    only("logits_processors", why="logits processors are not implemented"),
    only("add_special_tokens", False, why="special tokens come from the chat template only"),
    # SGLang's constrained decoding, and what the routers inject (routers ref §1)
    only("regex", why=_GUIDED), only("ebnf", why=_GUIDED), only("json_schema", why=_GUIDED),
    only("no_stop_trim", False, why="stop strings are always trimmed"),
    only("return_hidden_states", False, why="hidden states are not returned"),
    ignored("separate_reasoning", "boolean", "no reasoning parser runs"),
    ignored("stream_reasoning", "boolean", "no reasoning parser runs"),
]

_CHAT = [
    supported("messages", {"type": "array", "minItems": 1, "maxItems": 8192,
                           "items": MESSAGE_SCHEMA}),
    supported("max_completion_tokens", int_schema(1)),
    supported("tools", _TOOLS),
    supported("tool_choice", {"anyOf": [
        {"enum": ["auto", "none", "required"]},
        obj_schema({"type": {"const": "function"},
                    "function": obj_schema({"name": {"type": "string"}}, ["name"])},
                   ["type", "function"])],
        "description": "'required' / a named function need tools; the name must be one of "
                       "them."}),
    supported("parallel_tool_calls", {"type": "boolean",
                                      "description": "false: at most the first call returned."}),
    supported("chat_template_kwargs", _TEMPLATE_KWARGS),
    only("logprobs", False, why=_LOGPROBS),
    only("top_logprobs", 0, why=_LOGPROBS),
    only("echo", False, why="echoing the last message is not implemented"),
    only("add_generation_prompt", True, why="the generation prompt is always added"),
    only("continue_final_message", False, why="continuing the final message is not implemented"),
    only("documents", [], why="RAG documents are not passed to the template"),
    only("chat_template", why="per-request chat templates are not accepted"),
    ignored("media_io_kwargs", "object", "content is text only"),
    ignored("mm_processor_kwargs", "object", "content is text only"),
    ignored("reasoning_effort", "string", "no reasoning effort control"),
    ignored("include_reasoning", "boolean", "no reasoning parser runs"),
    only("return_token_ids", False, why="token ids are returned by /v1/completions only"),
    only("return_prompt_text", False, why="the rendered prompt is not returned"),
    ignored("prompt_cache_options", "object", "the prefix cache needs no breakpoints"),
    only("moderation", why="moderation is not implemented"),
    only("modalities", ["text"], why="output is text only"),
    only("verbosity", why="verbosity control is not implemented"),
    only("audio", why="audio output is not implemented"),
    ignored("prediction", "object", "predicted outputs only speed up, never change, the result"),
    only("web_search_options", why="web search is not implemented"),
    only("functions", why="legacy functions are not implemented; use 'tools'"),
    only("function_call", "none", "auto", why="legacy function calls are not implemented"),
    only("best_of", 1, why="best_of is a /v1/completions parameter"),
]

_PROMPT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": int_schema(0)},
    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": int_schema(0)}]}}],
    "description": f"Text or token ids, or a list of up to {MAX_PROMPTS} of those (one choice "
                   f"set per prompt; n x prompts <= {MAX_CHOICES})."}
_COMPLETIONS = [
    supported("prompt", _PROMPT),
    supported("echo", {"type": "boolean", "description": "Prefix each choice with the prompt."}),
    supported("best_of", int_schema(1, MAX_CHOICES, description="Only equal to n.")),
    supported("return_token_ids", {"type": "boolean", "description": "Add prompt_token_ids "
                                   "and each choice's token_ids (vLLM's field)."}),
    only("logprobs", why=_LOGPROBS),
    only("suffix", why="insertion (suffix) is not implemented"),
    only("prompt_embeds", why="prompt embeddings are not accepted"),
    only("max_completion_tokens", why="/v1/completions caps output with 'max_tokens'"),
    supported("add_special_tokens", {"type": "boolean", "description": "Put the tokenizer's BOS "
                                     "in front of each text prompt (default true, as vLLM; "
                                     "token-id prompts are sent as they are)."}),
]

_TOKENIZE = [
    supported("model", {"type": "string"}),
    supported("messages", {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}),
    supported("prompt", {"type": "string"}),
    supported("tools", _TOOLS),
    supported("cache_salt", {"type": "string", "minLength": 1, "maxLength": 1024}),
    supported("chat_template_kwargs", _TEMPLATE_KWARGS),
    only("add_generation_prompt", True, why="chat requests always add the generation prompt"),
    supported("add_special_tokens", {"type": "boolean", "description": "With 'prompt': put the "
                                     "tokenizer's BOS in front (default true, as "
                                     "/v1/completions); with 'messages' only false (the chat "
                                     "template places them)."}),
    only("continue_final_message", False, why="continuing the final message is not implemented"),
    only("chat_template", why="per-request chat templates are not accepted"),
    only("documents", [], why="RAG documents are not passed to the template"),
    only("return_token_strs", False, why="token strings are not returned"),
    ignored("mm_processor_kwargs", "object", "content is text only"),
    ignored("media_io_kwargs", "object", "content is text only"),
]


def _table(*groups: list[Param]) -> dict[str, Param]:
    out: dict[str, Param] = {}
    for group in groups:
        for param in group:
            out[param.name] = param  # a later group overrides (logprobs, best_of per operation)
    return out


CHAT_PARAMS = _table(_COMMON, _CHAT)
COMPLETION_PARAMS = _table(_COMMON, _COMPLETIONS)
TOKENIZE_PARAMS = _table(_TOKENIZE)


# ---------------------------------------------------------------- Anthropic Messages API
# POST /v1/messages and /v1/messages/count_tokens (radixkv.server.anthropic_protocol). The same
# three policies: an Anthropic field radixkv cannot honour is refused with a 400 naming it
# unless it cannot change the result.

TTL_VALUES = ("5m", "1h")
CACHE_CONTROL_SCHEMA = obj_schema(
    {"type": {"const": "ephemeral"}, "ttl": {"enum": list(TTL_VALUES)}}, ["type"],
    description="A retention breakpoint: the rendered prompt up to the end of this block is "
                "retained for ttl (default 5m); at most 4 per request.")
_A_TEXT_BLOCK = obj_schema({"type": {"const": "text"}, "text": {"type": "string"},
                            "cache_control": CACHE_CONTROL_SCHEMA,
                            "citations": {"enum": [None, []]}}, ["type", "text"])
_A_TOOL_USE = obj_schema({"type": {"const": "tool_use"}, "id": {"type": "string"},
                          "name": {"type": "string", "minLength": 1},
                          "input": {"type": "object"}, "cache_control": CACHE_CONTROL_SCHEMA,
                          "caller": {"enum": [None, {"type": "direct"}]}},
                         ["type", "id", "name", "input"])
_A_TOOL_RESULT = obj_schema({
    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT_BLOCK}]},
    "is_error": {"type": "boolean", "description": "Ignored: the chat template has no error "
                                                   "flag; the result's text is rendered as is."},
    "cache_control": CACHE_CONTROL_SCHEMA}, ["type", "tool_use_id"])
_A_IGNORED_BLOCK = {"type": "object", "properties": {"type": {"enum": ["thinking",
                                                                    "redacted_thinking"]}},
                    "required": ["type"],
                    "description": "Assistant messages only; dropped: earlier reasoning is not "
                                   "sent back to the template."}
_A_MESSAGE = obj_schema({
    "role": {"enum": ["user", "assistant"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [
        _A_TEXT_BLOCK, _A_TOOL_USE, _A_TOOL_RESULT, _A_IGNORED_BLOCK]}}]}},
    ["role", "content"],
    description="tool_use blocks in assistant messages, tool_result blocks in user messages.")
_A_TOOL = obj_schema({
    "type": {"enum": ["custom", None]}, "name": {"type": "string", "minLength": 1},
    "description": {"type": "string"},
    "input_schema": {"type": "object", "description": "At most 32 levels deep."},
    "cache_control": CACHE_CONTROL_SCHEMA}, ["name", "input_schema"], extra=True,
    description="Client tools only (server tools are refused).")
_A_TOOL_CHOICE = {"anyOf": [
    obj_schema({"type": {"enum": ["auto", "any"]},
                "disable_parallel_tool_use": {"type": "boolean"}}, ["type"]),
    obj_schema({"type": {"const": "tool"}, "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"}}, ["type", "name"]),
    obj_schema({"type": {"const": "none"}}, ["type"])],
    "description": "any / tool need tools (tool: one of them by name); the call's start is "
                   "put at the end of the prompt."}

# Content block types radixkv does not implement, refused with a 400 naming the block's type.
MESSAGES_REFUSED_BLOCKS = {
    "image": "images are not supported (text only)",
    "document": "documents are not supported (text only)",
    "search_result": "search results are not supported",
    "server_tool_use": "server tools are not implemented",
    "web_search_tool_result": "server tools are not implemented",
    "web_fetch_tool_result": "server tools are not implemented",
    "code_execution_tool_result": "server tools are not implemented",
    "container_upload": "containers are not implemented",
    "mcp_tool_use": "MCP connectors are not implemented",
    "mcp_tool_result": "MCP connectors are not implemented",
}
# Content block types accepted and dropped (assistant messages only) and why.
MESSAGES_IGNORED_BLOCKS = {
    "thinking": "earlier reasoning is not sent back to the template",
    "redacted_thinking": "earlier reasoning is not sent back to the template",
}
# Non-supported keys inside blocks: block type -> {key: entry}.
MESSAGES_BLOCK_FIELDS = {
    "text": {"citations": only("messages[].content[].citations", [],
                               why="citations are not implemented")},
    "tool_use": {"caller": only("messages[].content[].caller", {"type": "direct"},
                                why="server-side tool callers are not implemented")},
    "tool_result": {"is_error": ignored("messages[].content[].is_error", "boolean",
                                        "the chat template has no error flag; the result's "
                                        "text is rendered as is")},
}

_MESSAGES_COMMON = [
    supported("model", {"type": "string", "description": "The served model id or a loaded LoRA "
                                                         "adapter's name; may be omitted."}),
    supported("messages", {"type": "array", "minItems": 1, "maxItems": 8192, "items": _A_MESSAGE}),
    supported("system", {"anyOf": [{"type": "string"},
                                   {"type": "array", "items": _A_TEXT_BLOCK}],
                         "description": "Rendered as the chat's system message (text blocks "
                                        "joined by newlines)."}),
    supported("tools", {"type": "array", "maxItems": 128, "items": _A_TOOL}),
    supported("tool_choice", _A_TOOL_CHOICE),
    supported("cache_control", {**CACHE_CONTROL_SCHEMA,
                                "description": "A breakpoint on the last block of the last "
                                               "message (counts toward the 4)."}),
    supported("cache_salt", {"type": "string", "minLength": 1, "maxLength": 1024,
                             "description": "radixkv extension: narrows the prefix-cache "
                                            "namespace, as on the OpenAI routes."}),
    only("thinking", {"type": "disabled"}, why="extended thinking is not implemented"),
    only("mcp_servers", [], why="MCP connectors are not implemented"),
    only("output_config", {}, why="output formats and effort control are not implemented"),
    only("output_format", why="structured outputs are not implemented"),
    only("context_management", why="context editing is not implemented"),
    ignored("container", ["string", "object"], "containers only serve server tools, which "
                                               "are refused"),
]
_MESSAGES = [
    supported("max_tokens", int_schema(1, description="Output cap in tokens (required).")),
    supported("stop_sequences", {"type": "array", "maxItems": 64, "items": {
        "type": "string", "minLength": 1, "maxLength": 1024}}),
    supported("temperature", {"type": "number", "minimum": 0, "maximum": 1,
                              "description": "0 = greedy."}),
    supported("top_p", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    supported("top_k", int_schema(0, description="0 disables.")),
    supported("stream", {"type": "boolean"}),
    supported("metadata", obj_schema({"user_id": {"type": ["string", "null"], "maxLength": 256}},
                                     description="user_id is the session hint for "
                                                 "prefix-cache eviction (as prompt_cache_key)."
                                     )),
    ignored("service_tier", "string", "there is one tier"),
    ignored("inference_geo", "string", "there is one place"),
    ignored("speed", "string", "there is one speed"),
    ignored("diagnostics", "object", "cache-miss diagnostics are not returned"),
    ignored("user_profile_id", "string", "requests are not attributed"),
    ignored("workspace_id", "string", "there are no workspaces"),
]

MESSAGES_PARAMS = _table(_MESSAGES_COMMON, _MESSAGES)
COUNT_TOKENS_PARAMS = _table(_MESSAGES_COMMON)

"""The parameter-policy table enforced by the parsers (pure, no server): every NEUTRAL field is
accepted at its neutral values and refused (400 naming it) at any other; every IGNORED field is
accepted at its type and refused at another; unknown names are accepted; the new chat and
completion fields parse to the documented values."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from radixkv.server.completions import PromptInput, parse_completion_request
from radixkv.server.errors import APIError
from radixkv.server.param_policy import (
    IGNORED,
    IGNORED_COUNTS,
    NEUTRAL,
    SUPPORTED,
    UNKNOWN_LABEL,
    IgnoredCounts,
    same_json,
)
from radixkv.server.param_table import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    RESERVED_TEMPLATE_KWARGS,
    TOKENIZE_PARAMS,
)
from radixkv.server.protocol import parse_chat_request, parse_tokenize_request

MODEL = "tiny"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OPS = {
    "chat": (CHAT_PARAMS, lambda b: parse_chat_request(b, MODEL), {"messages": MSG}),
    "completions": (COMPLETION_PARAMS, lambda b: parse_completion_request(b, MODEL),
                    {"prompt": "hi"}),
    "tokenize": (TOKENIZE_PARAMS, lambda b: parse_tokenize_request(b, MODEL), {"messages": MSG}),
}
# Values tried against every field: each one a NEUTRAL field does not list must be refused.
CANDIDATES: list[Any] = [True, False, 0, 1, -1, 0.5, 7, "x", "text", [], ["x"], ["text"], [1],
                         {}, {"x": 1}, {"type": "text"}, {"type": "json_object"}]
EXAMPLES = {"string": "x", "boolean": True, "integer": 3, "number": 0.5, "object": {"k": "v"}}
WRONG = {"string": 5, "boolean": "yes", "integer": "3", "number": "0.5", "object": [1]}


def refused(parse, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


def entries(policy: str) -> list[tuple[str, str]]:
    return [(op, name) for op, (table, _, _) in OPS.items() for name, p in table.items()
            if p.policy == policy]


def test_every_table_entry_is_well_formed():
    for table, _, _ in OPS.values():
        for name, p in table.items():
            assert p.name == name and p.policy in (SUPPORTED, IGNORED, NEUTRAL)
            if p.policy == NEUTRAL:
                assert p.neutral[0] is None and p.schema["enum"] == list(p.neutral) and p.why
            if p.policy == IGNORED:
                assert p.why and "null" in p.schema.get("type", ["null"])
    # The fields clients and routers send are classified, with these policies.
    chat = {n: p.policy for n, p in CHAT_PARAMS.items()}
    for name in ("no_stop_trim", "logprobs", "top_logprobs", "modalities", "verbosity", "audio",
                 "continue_final_message", "return_hidden_states", "skip_special_tokens",
                 "min_p", "repetition_penalty", "stop_token_ids", "min_tokens",
                 "include_stop_str_in_output", "structured_outputs", "guided_json",
                 "response_format", "prompt_logprobs", "truncate_prompt_tokens",
                 "add_special_tokens", "bad_words", "allowed_token_ids", "kv_transfer_params",
                 "vllm_xargs", "documents", "echo", "add_generation_prompt"):
        assert chat[name] == NEUTRAL, name
    for name in ("store", "metadata", "service_tier", "safety_identifier",
                 "reasoning_effort", "separate_reasoning", "stream_reasoning",
                 "include_reasoning", "mm_processor_kwargs", "return_tokens_as_token_ids",
                 "spaces_between_special_tokens", "priority", "request_id"):
        assert chat[name] == IGNORED, name
    for name in ("ignore_eos", "cache_salt", "prompt_cache_key", "user", "tool_choice",
                 "parallel_tool_calls",
                 "chat_template_kwargs", "top_k", "seed", "n", "max_completion_tokens"):
        assert chat[name] == SUPPORTED, name
    assert COMPLETION_PARAMS["return_token_ids"].policy == SUPPORTED
    assert CHAT_PARAMS["return_token_ids"].policy == NEUTRAL
    assert TOKENIZE_PARAMS["continue_final_message"].neutral == (None, False)


@pytest.mark.parametrize("op,name", entries(NEUTRAL))
def test_neutral_fields_accept_neutral_values_and_refuse_every_other(op, name):
    table, parse, base = OPS[op]
    param = table[name]
    for value in param.neutral:
        parse({**base, name: value})  # accepted: changes nothing
    others = [v for v in CANDIDATES if not any(same_json(v, n) for n in param.neutral)]
    assert len(others) >= len(CANDIDATES) - 3
    for value in others:
        err = refused(parse, {**base, name: value})
        assert err.param == name and name in err.message
        assert "not supported" in err.message or "must be" in err.message  # a bad type


@pytest.mark.parametrize("op,name", entries(IGNORED))
def test_ignored_fields_accept_their_type_and_refuse_another(op, name):
    table, parse, base = OPS[op]
    (json_type,) = [t for t in table[name].schema["type"] if t != "null"]
    parse({**base, name: None})
    parse({**base, name: EXAMPLES[json_type]})
    err = refused(parse, {**base, name: WRONG[json_type]})
    assert err.param == name


def test_ignored_and_unknown_fields_are_counted_once_the_request_is_valid():
    before = IGNORED_COUNTS.snapshot()
    parse_chat_request({"messages": [{"role": "user", "content": "a", "id": "m1"},
                                     {"role": "assistant", "content": "b", "id": "m2",
                                      "reasoning_content": "thought"}],
                        "store": True, "no_stop_trim": False, "frobnicate": 1, "zorp": 2,
                        "stream": True, "stream_options": {"include_obfuscation": True}}, MODEL)
    refused(lambda b: parse_chat_request(b, MODEL), {"messages": MSG, "store": True, "n": 0})
    after = IGNORED_COUNTS.snapshot()
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert delta == {"store": 1, "no_stop_trim": 1, "messages[].id": 2,
                     "messages[].reasoning_content": 1, "stream_options.include_obfuscation": 1,
                     UNKNOWN_LABEL: 2}


def test_each_ignored_name_is_logged_once():
    counts = IgnoredCounts()
    with capture_logs() as logs:
        counts.record(["store", "store"], ["frob"])
        counts.record(["store", "metadata"], ["frob", "zap"])
    assert [(e["event"], e["param"]) for e in logs] == [
        ("parameter_ignored", "store"), ("parameter_unknown_ignored", "frob"),
        ("parameter_ignored", "metadata"), ("parameter_unknown_ignored", "zap")]
    assert counts.snapshot() == {"store": 3, "metadata": 1, UNKNOWN_LABEL: 3}


@pytest.mark.parametrize("op", ["chat", "completions", "tokenize"])
def test_unknown_names_are_accepted(op):
    _, parse, base = OPS[op]
    before = IGNORED_COUNTS.snapshot().get(UNKNOWN_LABEL, 0)
    plain = parse(base)
    assert parse({**base, "frobnicate": {"anything": [1, 2]}, "x-custom": None}) == plain
    assert IGNORED_COUNTS.snapshot()[UNKNOWN_LABEL] - before == 2


def test_message_level_ignored_keys():
    chat = lambda messages: parse_chat_request({"messages": messages}, MODEL)  # noqa: E731
    req = chat([{"role": "system", "content": "s", "id": "a"},
                {"role": "user", "content": "u", "id": "b"},
                {"role": "assistant", "content": "c", "id": "c", "reasoning_content": "r",
                 "reasoning": None}])
    assert req.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                            {"role": "assistant", "content": "c"}]
    parse = lambda b: parse_chat_request(b, MODEL)  # noqa: E731
    assert refused(parse, {"messages": [{"role": "user", "content": "u",
                                         "reasoning_content": "r"}]}).param == \
        "messages[0].reasoning_content"
    assert refused(parse, {"messages": [{"role": "user", "content": "u", "id": 3}]}).param == \
        "messages[0].id"


def test_stream_options_policy():
    parse = lambda b: parse_chat_request(b, MODEL)  # noqa: E731
    req = parse({"messages": MSG, "stream": True,
                 "stream_options": {"include_usage": True, "include_obfuscation": False,
                                    "continuous_usage_stats": False}})
    assert req.include_usage is True
    err = refused(parse, {"messages": MSG, "stream": True,
                          "stream_options": {"continuous_usage_stats": True}})
    assert err.param == "stream_options.continuous_usage_stats"
    assert refused(parse, {"messages": MSG, "stream": True,
                           "stream_options": {"x": 1}}).param == "stream_options.x"


def test_tool_choice_and_parallel_tool_calls():
    parse = lambda b: parse_chat_request(b, MODEL)  # noqa: E731
    req = parse({"messages": MSG})
    assert (req.tool_choice, req.tool_choice_function, req.parallel_tool_calls) == ("auto", None,
                                                                                   True)
    req = parse({"messages": MSG, "tools": [TOOL], "tool_choice": "required",
                 "parallel_tool_calls": False})
    assert (req.tool_choice, req.tool_choice_function, req.parallel_tool_calls) == (
        "required", None, False)
    req = parse({"messages": MSG, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert (req.tool_choice, req.tool_choice_function) == ("function", "get_weather")
    assert parse({"messages": MSG, "tool_choice": "none"}).tool_choice == "none"
    for body, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ]:
        assert refused(parse, {"messages": MSG, **body}).param == param


def test_chat_template_kwargs():
    parse = lambda b: parse_chat_request(b, MODEL)  # noqa: E731
    assert parse({"messages": MSG}).chat_template_kwargs is None
    assert parse({"messages": MSG, "chat_template_kwargs": {}}).chat_template_kwargs is None
    kwargs = {"enable_thinking": False, "custom": {"a": [1, "b", None]}}
    assert parse({"messages": MSG, "chat_template_kwargs": kwargs}).chat_template_kwargs == kwargs
    assert refused(parse, {"messages": MSG, "chat_template_kwargs": [1]}).param == \
        "chat_template_kwargs"
    for name in ("messages", "tools", "add_generation_prompt", "tokenize", "documents",
                 "chat_template"):
        assert name in RESERVED_TEMPLATE_KWARGS
        err = refused(parse, {"messages": MSG, "chat_template_kwargs": {name: 1}})
        assert err.param == f"chat_template_kwargs.{name}"
    deep: dict = {}
    for _ in range(40):
        deep = {"x": deep}
    assert refused(parse, {"messages": MSG, "chat_template_kwargs": deep}).param == \
        "chat_template_kwargs"
    tok = parse_tokenize_request({"messages": MSG, "chat_template_kwargs": kwargs}, MODEL)
    assert tok.chat_template_kwargs == kwargs


def test_completion_prompts():
    parse = lambda b: parse_completion_request(b, MODEL)  # noqa: E731
    req = parse({"prompt": "abc"})
    assert req.prompts == (PromptInput("abc", None, "prompt"),)
    assert (req.prompt_text, req.prompt_ids, req.prompt_param, req.return_token_ids) == (
        "abc", None, "prompt", False)
    req = parse({"prompt": [5, 6]})
    assert req.prompts == (PromptInput(None, [5, 6], "prompt"),)
    req = parse({"prompt": ["a", [7, 8], "b"], "n": 2, "return_token_ids": True})
    assert req.prompts == (PromptInput("a", None, "prompt[0]"), PromptInput(None, [7, 8], "prompt[1]"),
                           PromptInput("b", None, "prompt[2]"))
    assert (req.prompt_text, req.prompt_ids, req.prompt_param) == ("a", None, "prompt[0]")
    assert (req.n, req.return_token_ids) == (2, True)
    assert len(parse({"prompt": ["a"] * 64}).prompts) == 64
    assert parse({"prompt": ["a"] * 32, "n": 2}).n == 2
    assert refused(parse, {"prompt": ["a"] * 65}).param == "prompt"
    assert refused(parse, {"prompt": ["a"] * 33, "n": 2}).param == "n"
    assert refused(parse, {"prompt": ["a", [1, "x"]]}).param == "prompt[1][1]"
    assert refused(parse, {"prompt": "a", "return_token_ids": 1}).param == "return_token_ids"


def test_integers_take_exact_integer_valued_floats_only():
    """2.0 is the integer 2 (JSON Schema); a float past 2^53 is not the number the client sent
    (orjson reads an integer beyond 64 bits as a float), so it is refused, never rounded."""

    def seed(raw: bytes):
        return parse_chat_request({"messages": MSG, **orjson.loads(raw)}, "m").seed

    assert seed(b'{"seed": 2.0}') == 2
    assert seed(b'{"seed": 18446744073709551615}') == (1 << 64) - 1
    assert seed(b'{"seed": -9223372036854775808}') == -(1 << 63)
    for raw in (b'{"seed": -9223372036854775809}', b'{"seed": 18446744073709551616}',
                b'{"seed": 1e30}', b'{"seed": 9007199254740994.0}'):
        with pytest.raises(APIError) as err:
            seed(raw)
        assert (err.value.status, err.value.param) == (400, "seed"), raw

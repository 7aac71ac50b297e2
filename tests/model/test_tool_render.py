"""Tools and tool calls reach the prompt even when the chat template ignores them."""

from __future__ import annotations

from radixkv.model.tool_render import render_tools_fallback, template_handles_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}]


def test_fallback_rendering_is_exact_and_leaves_input_alone():
    messages = [{"role": "system", "content": "Be brief."}, {**HISTORY[0]},
                {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    out = render_tools_fallback(messages, TOOLS)
    assert out[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert ('{"function":{"name":"get_weather","parameters":{"properties":{"city":{"type":"string"}},'
            '"type":"object"}},"type":"function"}') in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>{"arguments":{"city":"Paris"},"name":"get_weather"}</tool_call>'}
    assert "tool_calls" in messages[2] and messages[0]["content"] == "Be brief."
    assert render_tools_fallback([{"role": "user", "content": "x"}], TOOLS)[0]["role"] == "system"


def test_chatml_template_gets_tools_as_text_and_turns_extend(tiny_model):
    tok = tiny_model.tokenizer
    assert not template_handles_tools(tok.chat_template)
    with_tools = tok.apply_chat_template(HISTORY[:1], tools=TOOLS)
    without = tok.apply_chat_template(HISTORY[:1])
    assert with_tools != without
    text = tok.decode(tok.apply_chat_template(HISTORY, tools=TOOLS), skip_special_tokens=False)
    assert '<tool_call>{"arguments":{"city":"Paris"},"name":"get_weather"}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    # Every turn's rendering extends the previous one (up to the generation prompt), so an
    # agent's next request hits the cache on all of the previous one.
    turn1 = tok.apply_chat_template(HISTORY[:1], tools=TOOLS, add_generation_prompt=False)
    turn2 = tok.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=False)
    assert turn2[:len(turn1)] == turn1

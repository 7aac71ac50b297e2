"""``/v1/completions``: text and token-id prompts, echo, streaming, the official client, prompt
logprobs refused."""

from __future__ import annotations

import re
import uuid

import openai
import orjson
import pytest

from tests.server.helpers import cached_tokens, complete, post, post_json, sse_events


async def test_token_id_prompt_shape_and_cache(server):
    prompt = [5000 + i for i in range(40)]
    status, body = await complete(server.url, prompt, max_tokens=4, temperature=0,
                                  ignore_eos=True)
    assert status == 200, body
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion" and body["model"] == server.engine.model_name
    (choice,) = body["choices"]
    assert (choice["index"], choice["logprobs"], choice["finish_reason"]) == (0, None, "length")
    assert isinstance(choice["text"], str)
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    status, again = await complete(server.url, prompt, max_tokens=4, temperature=0,
                                   ignore_eos=True)
    assert cached_tokens(again) == 32 and again["choices"][0]["text"] == choice["text"]
    # A list holding one token-id list is the same prompt.
    status, nested = await complete(server.url, [prompt], max_tokens=4, temperature=0,
                                    ignore_eos=True)
    assert status == 200 and nested["choices"][0]["text"] == choice["text"]


async def test_text_prompt_matches_its_token_ids(server):
    text = f"{uuid.uuid4().hex} The quick brown fox jumps over the lazy dog."
    ids = server.engine.tokenizer.encode(text)
    status, by_text = await complete(server.url, text, max_tokens=5, temperature=0)
    status2, by_ids = await complete(server.url, ids, max_tokens=5, temperature=0)
    assert status == status2 == 200
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    status, listed = await complete(server.url, [text], max_tokens=5, temperature=0)
    assert listed["choices"][0]["text"] == by_text["choices"][0]["text"]


async def test_default_max_tokens_is_16(server):
    status, body = await complete(server.url, [7, 8, 9], max_tokens=None, ignore_eos=True)
    assert status == 200 and body["usage"]["completion_tokens"] == 16


async def test_echo_prefixes_the_prompt(server):
    text = "Once upon a time"
    status, plain = await complete(server.url, text, max_tokens=3, temperature=0)
    status, echoed = await complete(server.url, text, max_tokens=3, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == text + plain["choices"][0]["text"]
    ids = server.engine.tokenizer.encode(text)
    status, by_ids = await complete(server.url, ids, max_tokens=3, temperature=0, echo=True)
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]


async def test_stream_matches_non_stream(server):
    prompt = [6000 + i for i in range(20)]
    req = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, raw, headers = await post(server.url, "/v1/completions",
                                      {**req, "stream": True, "echo": True,
                                       "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    chunks = [orjson.loads(e) for e in sse_events(raw)]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    status, body = await post_json(server.url, "/v1/completions", {**req, "echo": True})
    assert streamed == body["choices"][0]["text"]


@pytest.mark.parametrize("body,param,fragment", [
    # Prompt logprobs (echo + logprobs) are not computed: a 400 that says so.
    ({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "echo": True, "logprobs": 1}, "logprobs",
     "prompt logprobs"),
    ({"prompt": [1, 2, 3], "logprobs": 0}, "logprobs", "not supported"),
    ({"prompt": "a", "logprobs": 99}, "logprobs", "[0, 20]"),
    ({"prompt": ["a"] * 65}, "prompt", "at most 64"),
    ({"prompt": ["a", "b"], "n": 33}, "n", "33 x 2"),
    ({"prompt": ["a", 3]}, "prompt[1]", None),
    ({"prompt": ["a", []]}, "prompt[1]", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [1, -2]}, "prompt[1]", "prompt[1]: must be an int in [0, 49151], got -2"),
    ({"prompt": [1, 2.5]}, "prompt[1]", "token id"),
    ({"prompt": [1, True]}, "prompt[1]", "token id"),
    ({"prompt": 5}, "prompt", None),
    ({"prompt": [[]]}, "prompt[0]", None),
    ({"prompt": [10 ** 9]}, "prompt[0]", "prompt[0]: must be an int in [0, 49151], got 1000000000"),
    ({"prompt": [[1, 10 ** 8]]}, "prompt[0][1]",
     "prompt[0][1]: must be an int in [0, 49151], got 100000000"),
    ({"prompt": [""]}, "prompt[0]", "at least one token"),
    ({"prompt": ""}, "prompt", "at least one token"),
    ({}, "prompt", "required"),
    ({"prompt": "a", "suffix": "b"}, "suffix", None),
    ({"prompt": "a", "best_of": 3}, "best_of", None),
    ({"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens", None),
    ({"prompt": "a", "min_tokens": 3}, "min_tokens", "only 0 or null"),
    ({"prompt": list(range(2049))}, "prompt", "maximum context length"),
    ({"prompt": [1, 2], "max_tokens": 2047}, "max_tokens", "maximum context length"),
])
async def test_refusals_name_the_parameter(server, body, param, fragment):
    status, err = await post_json(server.url, "/v1/completions", body)
    assert status == 400, err
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    if fragment:
        assert fragment in err["error"]["message"]


async def test_c14_in_either_order_no_crash(server):
    prompt = [7000 + i for i in range(8)]
    for _ in range(2):  # cold then warm: the same refusal, and the server keeps serving
        status, err = await post_json(server.url, "/v1/completions",
                                      {"prompt": prompt, "echo": True, "logprobs": 1,
                                       "max_tokens": 1})
        assert status == 400 and err["error"]["param"] == "logprobs"
        status, body = await complete(server.url, prompt)
        assert status == 200


def test_official_client_completions(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = server.engine.model_name
    prompt = [8000 + i for i in range(24)]
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 5
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == resp.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16
    many = client.completions.create(model=model, prompt="Hello", n=2, max_tokens=3, seed=3,
                                     temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hello", logprobs=2, echo=True)
    assert info.value.body["param"] == "logprobs"
    assert "not supported" in info.value.body["message"]

"""Schemathesis fuzzing driven by the server's own ``/openapi.json``.

Chat completions, completions, /tokenize and /detokenize, against a tiny-model server with a
256-token context and ``max_num_seqs`` 8: seed 0, 100 examples per operation, every response
is checked — no 5xx (nor a server error inside a 200
stream), every 4xx in OpenAI's error shape — and ``/health`` is 200 after each operation.

The document's request schemas are used as served, narrowed only so each request is cheap on
two CPU cores (``max_tokens`` always sent and at most 4, ``n`` at most 2, lists at most 3
long, ``model`` the served one, no undocumented keys). Each example comes from one of three
shapes of that schema, so that a run stays realistic, reaches every field and tries the
integer edges where overflows live: (a) as documented, optional fields optional; (b) every
field required (mostly refused for conflicts such as max_tokens vs max_completion_tokens, but
each field is sent); (c) the sampling fields required and every integer drawn from its edges
(``_edges_only``; with seed 0 this shape sends n = 2, seed 2^64 - 1, sampled — which fails
the run if the per-choice seed overflows again). No shrinking: a
failing input is reported as generated (its body in the assertion), and the run stays bounded.
"""

from __future__ import annotations

import copy
import urllib.request
from collections.abc import Iterator
from typing import Any

import hypothesis
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from radixkv.model.loader import load_model
from tests.conftest import make_tiny_model_dir
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread

CONTEXT = 256
EXAMPLES = 100
OPERATIONS = [("/v1/chat/completions", "ChatCompletionRequest"),
              ("/v1/completions", "CompletionRequest"), ("/tokenize", "TokenizeRequest"),
              ("/detokenize", "DetokenizeRequest")]
# Required in the edges shape; temperature stays optional (absent = 1.0, i.e. sampled).
SAMPLING = ("top_p", "top_k", "seed", "n", "stop", "ignore_eos", "stream")
# Narrower bounds for the fuzzer only, so that each request is cheap on 2 CPU cores.
CAPS = {"max_tokens": {"maximum": 4}, "max_completion_tokens": {"maximum": 4},
        "n": {"maximum": 2}, "best_of": {"maximum": 2}}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = load_model(str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-256"),
                                               max_position_embeddings=CONTEXT)))
    engine = make_async_engine(model, block_size=16, num_blocks=8 * CONTEXT // 16 + 16,
                               max_num_seqs=8)
    assert engine.max_model_len == CONTEXT
    yield from run_server_in_thread(engine)


def _get(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - 127.0.0.1 only
        return resp.status, orjson.loads(resp.read())


def _narrowed(doc: dict, model: str) -> dict:
    doc = copy.deepcopy(doc)
    for _, name in OPERATIONS:
        schema = doc["components"]["schemas"][name]
        schema["properties"]["model"] = {"enum": [model]}  # another name is a plain 404
        schema["additionalProperties"] = False  # spend the examples on the documented fields
        for field, bound in CAPS.items():
            if field in schema["properties"]:
                schema["properties"][field].update(bound)
        if "max_tokens" in schema["properties"]:  # else a chat runs to the end of the context
            schema["required"] = [*schema.get("required", []), "max_tokens"]
        # (short token lists: each id past the vocabulary is a 400, and a long random list
        # nearly always holds one, which left /detokenize's share of 200s near the bound)
        for field in ("messages", "prompt", "stop", "tools", "tokens"):
            _cap_arrays(schema["properties"].get(field), 3)
    return doc


def _cap_arrays(schema: Any, n: int) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "array":
            schema["maxItems"] = min(schema.get("maxItems", n), n)
        for value in schema.values():
            _cap_arrays(value, n)
    elif isinstance(schema, list):
        for value in schema:
            _cap_arrays(value, n)


# Integer edges (signed/unsigned 32- and 64-bit limits) where overflows live: random integers
# over a 2^64-wide range almost never land on them.
EDGES = (-(1 << 63), -1, 0, 1, 2, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, (1 << 63) - 1, 1 << 63,
         (1 << 64) - 1)


def _edges_only(schema: Any) -> Any:
    """Every integer schema becomes the enum of its edge values (bounds, bounds +- 1, EDGES)."""
    if isinstance(schema, list):
        return [_edges_only(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _edges_only(v) for k, v in schema.items()}
    if out.get("type") == "integer":
        lo, hi = out.get("minimum", -(1 << 64)), out.get("maximum", 1 << 64)
        return {"enum": sorted({v for v in (*EDGES, lo, hi, lo + 1, hi - 1) if lo <= v <= hi})}
    return out


def check_response(status: int, content_type: str, raw: bytes) -> None:
    """No 5xx; a 4xx carries exactly OpenAI's error shape; a 200 stream has no server error."""
    assert status < 500, (status, raw[:2000])
    if status >= 400:
        err = orjson.loads(raw)
        assert set(err) == {"error"}, err
        body = err["error"]
        assert set(body) == {"message", "type", "param", "code"}, err
        assert isinstance(body["message"], str) and body["message"], err
        assert body["type"] == "invalid_request_error", err
        assert body["param"] is None or isinstance(body["param"], str), err
        assert body["code"] is None or isinstance(body["code"], str), err
    elif content_type.startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-500:]
        for event in raw.split(b"\n\n"):
            if event.startswith(b"data: {"):
                assert b'"error"' not in event[:20], event


def _requiring(doc: dict, name: str, fields: list[str], *, edges: bool = False) -> dict:
    doc = copy.deepcopy(doc)
    schema = doc["components"]["schemas"][name]
    schema["required"] = sorted({*schema.get("required", []), *fields})
    if edges:
        schema["properties"] = _edges_only(schema["properties"])
    return doc


def _content_type(response: Any) -> str:
    value = response.headers.get("Content-Type") or response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value


@pytest.mark.parametrize("path,schema_name", OPERATIONS, ids=[p for p, _ in OPERATIONS])
def test_fuzz_operation(fuzz_server: RunningServer, path: str, schema_name: str):
    status, doc = _get(fuzz_server.url + "/openapi.json")
    assert status == 200
    assert doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"] \
        == {"$ref": f"#/components/schemas/{schema_name}"}
    documented = _narrowed(doc, fuzz_server.engine.model_name)
    fields = set(documented["components"]["schemas"][schema_name]["properties"])
    shapes = [documented, _requiring(documented, schema_name, sorted(fields))]
    if "seed" in fields:
        shapes.append(_requiring(documented, schema_name, list(SAMPLING), edges=True))
    strategies = []
    for shape in shapes:
        api = schemathesis.openapi.from_dict(shape)
        api.config.generation.update(allow_x00=False)
        strategies.append(api[path]["POST"].as_strategy())
    statuses: list[int] = []
    sent: set[str] = set()

    @hypothesis.seed(0)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(base_url=fuzz_server.url, timeout=60)
        statuses.append(response.status_code)
        sent.update(case.body if isinstance(case.body, dict) else ())
        try:
            check_response(response.status_code, _content_type(response), response.content)
        except AssertionError as exc:  # name the input: hypothesis prints Case bodies poorly
            body = orjson.dumps(case.body, option=orjson.OPT_NON_STR_KEYS).decode()
            raise AssertionError(f"POST {path} {body[:4000]}\n{exc}") from None

    fuzz()
    assert len(statuses) == EXAMPLES
    assert statuses.count(200) >= EXAMPLES // 4, sorted(set(statuses))  # reached the engine
    assert fields - sent == set()  # every documented field was sent at least once
    assert _get(fuzz_server.url + "/health") == (200, {"status": "ok"})
    assert fuzz_server.engine.error is None

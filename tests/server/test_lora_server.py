"""LoRA adapters over HTTP: --lora at start, model selection, /v1/models, run-time load and
unload (vLLM's endpoints), admin-only with keys, bad adapters as 400s, and no KV shared across adapters or
adapter versions.

One server per module: tiny model, B = 4, adapter "A" loaded at start.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest
import torch

from radixkv.cli import build_parser, main
from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.auth import load_api_keys
from tests.factories import make_async_engine
from tests.lora_files import ATTN, peft_key, write_adapter
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import HI, cached_tokens, complete, get, post_json

B = 4
ADMIN_KEY, USER_KEY = "key-lora-admin", "key-lora-user"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


def _engine(model, lora_adapters=()) -> AsyncEngine:
    return make_async_engine(model, block_size=B, num_blocks=1024, max_num_seqs=8,
                             lora_adapters=lora_adapters)


@pytest.fixture(scope="module")
def server(tiny_model, lora_dir) -> Iterator[RunningServer]:
    path = write_adapter(lora_dir / "A", tiny_model.shape, seed=1)
    yield from run_server_in_thread(_engine(tiny_model, (("A", str(path)),)))


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({ADMIN_KEY: {"tenant": "ops", "admin": True},
                                USER_KEY: {"tenant": "u", "admin": False}}))
    yield from run_server_in_thread(_engine(tiny_model), api_keys=load_api_keys(keys))


async def _load(url, name, path, key=None, **extra):
    return await post_json(url, "/v1/load_lora_adapter",
                           {"lora_name": name, "lora_path": str(path), **extra}, key)


async def _unload(url, name, key=None):
    return await post_json(url, "/v1/unload_lora_adapter", {"lora_name": name}, key)


async def test_c03_adapter_identity_over_http(server, tiny_model, lora_dir):
    url, shape = server.url, tiny_model.shape
    assert (await _load(url, "c03-A", write_adapter(lora_dir / "c03-A1", shape, seed=11)))[0] == 200
    assert (await _load(url, "c03-B", write_adapter(lora_dir / "c03-B", shape, seed=12)))[0] == 200
    prompt = [3000 + i for i in range(12)]
    cached = []
    for model in ("c03-A", "c03-B", None, "c03-A"):                 # R1 .. R4
        status, body = await complete(url, prompt, **({"model": model} if model else {}))
        assert status == 200, body
        assert body["model"] == (model or server.engine.model_name)
        cached.append(cached_tokens(body))
    status, body = await _unload(url, "c03-A")
    assert status == 200 and "removed" in body["message"]
    status, body = await _load(url, "c03-A", write_adapter(lora_dir / "c03-A2", shape, seed=13))
    assert status == 200, body
    for _ in range(2):                                              # R5, then R5 again
        status, body = await complete(url, prompt, model="c03-A")
        cached.append(cached_tokens(body))
    assert cached == [0, 0, 0, 8, 0, 8]


async def test_models_lists_adapters_and_model_selects_them(server, tiny_model, lora_dir):
    url, base = server.url, server.engine.model_name
    status, models = await get(url, "/v1/models")
    assert status == 200
    ids = [m["id"] for m in models["data"]]
    assert ids[0] == base and "A" in ids and "parent" not in models["data"][0]
    entry = models["data"][ids.index("A")]
    assert entry["parent"] == base and entry["object"] == "model"
    status, body = await post_json(url, "/v1/chat/completions",
                                   {"model": "A", "messages": HI, "max_tokens": 2})
    assert status == 200 and body["model"] == "A", body
    status, body = await post_json(url, "/tokenize", {"model": "A", "prompt": "hello"})
    assert status == 200 and body["count"] >= 1
    status, body = await complete(url, [1, 2, 3], model="nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'A'" in body["error"]["message"]
    # The adapter really changes what is generated: 8 greedy tokens differ from the base's.
    prompt = [4000 + 3 * i for i in range(10)]
    outs = {}
    for model in (base, "A"):
        status, body = await complete(url, prompt, model=model, max_tokens=8, temperature=0,
                                      ignore_eos=True)
        outs[model] = body["choices"][0]["text"]
    assert outs[base] != outs["A"]


async def test_load_unload_errors(server, tiny_model, lora_dir):
    url, shape = server.url, tiny_model.shape
    good = write_adapter(lora_dir / "dup", shape, seed=5)
    status, body = await _load(url, "A", good)
    assert status == 400 and "already loaded" in body["error"]["message"]
    assert body["error"]["param"] == "lora_name"
    status, body = await _load(url, server.engine.model_name, good)
    assert status == 400 and "base model" in body["error"]["message"]
    status, body = await post_json(url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "lora_path"
    status, body = await post_json(url, "/v1/load_lora_adapter",
                                   {"lora_name": "x", "lora_path": str(good), "extra": 1})
    assert status == 400 and body["error"]["param"] == "extra"
    status, body = await _unload(url, "never-loaded")
    assert status == 404 and body["error"]["code"] == "lora_not_found"
    # load_inplace swaps the weights under the name (a new digest).
    status, first = await _load(url, "swap", good)
    assert status == 200 and len(first["digest"]) == 64
    status, second = await _load(url, "swap", write_adapter(lora_dir / "swap2", shape, seed=6),
                                 load_inplace=True)
    assert status == 200 and second["digest"] != first["digest"]
    assert (await _unload(url, "swap"))[0] == 200
    # vLLM clients may send lora_int_id: accepted (and ignored) when it is an integer.
    status, body = await _load(url, "int-id", good, lora_int_id=7)
    assert status == 200, body
    status, body = await post_json(url, "/v1/unload_lora_adapter",
                                   {"lora_name": "int-id", "lora_int_id": "7"})
    assert status == 400 and body["error"]["param"] == "lora_int_id"
    status, body = await post_json(url, "/v1/unload_lora_adapter",
                                   {"lora_name": "int-id", "lora_int_id": 7})
    assert status == 200, body


def _bad_adapters(shape, root):
    """(name, adapter dir, fragment of the expected message)."""
    missing = root / "missing"
    missing.mkdir(parents=True)
    no_weights = write_adapter(root / "no-weights", shape)
    (no_weights / "adapter_model.safetensors").unlink()
    return [
        ("missing-files", missing, "adapter_config.json: missing"),
        ("no-weights", no_weights, "adapter_model.safetensors: missing"),
        ("not-a-dir", root / "nowhere", "not a directory"),
        ("rank", write_adapter(root / "rank", shape, config={"r": 8}), "rank mismatch"),
        ("targets", write_adapter(root / "targets", shape, config={"target_modules": ["lm_head"]}),
         "lm_head"),
        ("shape", write_adapter(root / "shape", shape, targets=ATTN,
                                tensors={peft_key(1, "v_proj", "B"): torch.zeros(7, 4)}),
         "has shape (7, 4), expected (32, 4)"),
    ]


async def test_bad_adapters_are_400_and_the_server_keeps_serving(server, tiny_model, lora_dir):
    url = server.url
    for name, path, fragment in _bad_adapters(tiny_model.shape, lora_dir / "bad"):
        status, body = await _load(url, name, path)
        assert status == 400, (name, body)
        assert body["error"]["code"] == "invalid_lora_adapter" and fragment in body["error"]["message"], name
        assert body["error"]["param"] == "lora_path"
        assert (await complete(url, [1, 2, 3], model=name))[0] == 404
    status, models = await get(url, "/v1/models")
    assert not {m["id"] for m in models["data"]} & {"missing-files", "rank", "shape"}
    status, body = await complete(url, [5, 6, 7, 8, 9], model="A")
    assert status == 200 and body["model"] == "A"
    assert (await get(url, "/health"))[0] == 200


async def test_unload_in_use_is_refused(server, tiny_model, lora_dir):
    url = server.url
    assert (await _load(url, "busy", write_adapter(lora_dir / "busy", tiny_model.shape)))[0] == 200
    body = {"model": "busy", "prompt": [7, 8, 9], "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")  # it is decoding
            status, err = await _unload(url, "busy")
            assert status == 409 and err["error"]["code"] == "lora_in_use", err
            assert "busy" in {m["id"] for m in (await get(url, "/v1/models"))[1]["data"]}
    # The client went away: the request is aborted and the adapter is free to go.
    for _ in range(200):
        status, _ = await _unload(url, "busy")
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200
    assert "busy" not in {m["id"] for m in (await get(url, "/v1/models"))[1]["data"]}


async def test_adapter_endpoints_are_admin_only_with_keys(keyed, tiny_model, lora_dir):
    url = keyed.url
    path = write_adapter(lora_dir / "keyed", tiny_model.shape, seed=9)
    for key, expected in ((None, 401), (USER_KEY, 403)):
        assert (await _load(url, "k", path, key))[0] == expected
        assert (await _unload(url, "k", key))[0] == expected
    assert (await _load(url, "k", path, ADMIN_KEY))[0] == 200
    # Any tenant may use a loaded adapter; only an admin may unload it.
    status, body = await complete(url, [1, 2, 3, 4, 5], USER_KEY, model="k")
    assert status == 200 and body["model"] == "k"
    status, models = await get(url, "/v1/models", USER_KEY)
    assert [m["id"] for m in models["data"]][1:] == ["k"]
    assert (await _unload(url, "k", USER_KEY))[0] == 403
    assert (await _unload(url, "k", ADMIN_KEY))[0] == 200


def test_cli_lora_flag(tiny_model_dir, tiny_model, tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--lora", "a=/x/a", "--lora", "b=/y=z"])
    assert args.lora == [("a", "/x/a"), ("b", "/y=z")]
    assert build_parser().parse_args(["serve"]).lora == []
    for bad in ("noequals", "=path", "name="):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--lora", bad])
    assert "expected NAME=PATH" in capsys.readouterr().err
    bad = write_adapter(tmp_path / "bad", tiny_model.shape, config={"r": 3})
    assert main(["serve", "--model", str(tiny_model_dir), "--num-blocks", "8", "--device", "cpu",
                 "--port", "0", "--lora", f"x={bad}"]) == 2
    err = capsys.readouterr().err
    assert "radixkv serve:" in err and "rank mismatch" in err and "Traceback" not in err


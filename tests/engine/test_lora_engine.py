"""LoRA adapters in the forward and the cache identity (engine level).

Outputs with an adapter must equal the base model run on merged weights ``W + scale·B·A``
(logits within 1e-5 on the tiny fp32 model, 1e-3 on SmolLM2), alone and in a mixed batch with
other adapters and the base model; and the adapter identity (name + weights digest) keys the
cache, so no KV is shared across adapters or adapter versions.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.config import EngineConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import LoRAError, LoRAInUseError, LoRANotFoundError
from radixkv.model.lora import read_adapter
from radixkv.model.runner import ModelRunner
from tests.factories import make_engine
from tests.lora_files import ATTN, merged_model, write_adapter

TINY_ATOL = 1e-5
SMOLLM2_ATOL = 1e-3
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Two adapters on the tiny model: A on every projection, B on attention only with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    shape = tiny_model.shape
    return {"A": write_adapter(root / "A", shape, r=4, alpha=8, seed=1),
            "B": write_adapter(root / "B", shape, r=2, alpha=3, targets=ATTN, seed=2,
                               use_rslora=True)}


def _run_alone(model, ids: list[int], prefix_len: int, adapter=None) -> torch.Tensor:
    """Logits of ``ids[prefix_len:]`` after a separate prefill of the prefix (all rows)."""
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    table = list(range(8, 16))
    if prefix_len:
        runner.forward(runner.build_batch([(ids[:prefix_len], 0, table)], [adapter]))
    return runner.forward(runner.build_batch([(ids[prefix_len:], prefix_len, table)], [adapter]),
                          all_logits=True)


def test_adapter_alone_equals_merged_weights(tiny_model, adapters):
    ids = _ids(20, seed=1)
    for name, path in adapters.items():
        adapter = read_adapter(name, str(path), tiny_model.shape)
        merged = merged_model(tiny_model, path)
        for prefix_len in (0, 12):  # cold prefill, then a cached-prefix suffix prefill
            got = _run_alone(tiny_model, ids, prefix_len, adapter)
            want = _run_alone(merged, ids, prefix_len)
            assert _diff(got, want) <= TINY_ATOL, (name, prefix_len)
        base = _run_alone(tiny_model, ids, 0)
        assert _diff(_run_alone(tiny_model, ids, 0, adapter), base) > 1e-2  # a real delta


def test_mixed_batch_equals_merged_weights(tiny_model, adapters):
    a = read_adapter("A", str(adapters["A"]), tiny_model.shape)
    b = read_adapter("B", str(adapters["B"]), tiny_model.shape)
    merged = {"A": merged_model(tiny_model, adapters["A"]), "B": merged_model(tiny_model, adapters["B"]),
              None: tiny_model}
    # (adapter, ids, cached prefix): prefills, a cached-suffix prefill and decode-like rows, with
    # A's sequences apart in the packed batch (not contiguous).
    seqs = [("A", _ids(9, 2), 0), (None, _ids(13, 3), 8), ("B", _ids(5, 4), 4), ("A", _ids(7, 5), 6),
            (None, _ids(3, 6), 0)]
    objects = {"A": a, "B": b, None: None}
    runner = ModelRunner(tiny_model, num_blocks=64, block_size=4)
    tables = [list(range(10 * i, 10 * i + 4)) for i in range(len(seqs))]
    for (name, ids, p), table in zip(seqs, tables):
        if p:
            runner.forward(runner.build_batch([(ids[:p], 0, table)], [objects[name]]))
    batch = runner.build_batch([(ids[p:], p, t) for (_, ids, p), t in zip(seqs, tables)],
                               [objects[name] for name, _, _ in seqs])
    assert batch.lora is not None and len(batch.lora.groups) == 2
    packed = runner.forward(batch, all_logits=True)
    indptr = batch.qo_indptr.tolist()
    for i, (name, ids, p) in enumerate(seqs):
        want = _run_alone(merged[name], ids, p)
        assert _diff(packed[indptr[i]:indptr[i + 1]], want) <= TINY_ATOL, (i, name)


def test_no_adapter_batch_has_no_lora_work(tiny_model):
    runner = ModelRunner(tiny_model, num_blocks=4, block_size=4)
    assert runner.build_batch([([1, 2], 0, [0])]).lora is None
    assert runner.build_batch([([1, 2], 0, [0])], [None]).lora is None
    with pytest.raises(ValueError, match="adapters"):
        runner.build_batch([([1, 2], 0, [0])], [None, None])


def _engine(model, adapters=()) -> LLMEngine:
    return make_engine(model, num_blocks=128, max_num_seqs=8,
                       lora_adapters=tuple((k, str(v)) for k, v in adapters))


def test_c03_adapter_identity_in_cache_key(tiny_model, adapters, tmp_path):
    engine = _engine(tiny_model, adapters.items())
    prompt = [100 + 3 * i for i in range(12)]

    def cached(lora_name):
        (req,) = engine.generate([prompt], GREEDY, lora_name=lora_name)
        engine.cache.check_integrity()
        return req.num_cached_tokens

    assert cached("A") == 0                                   # R1 warms adapter A
    assert cached("B") == 0                                   # R2: another adapter
    assert cached(None) == 0                                  # R3: the base model
    assert cached("A") == 8                                   # R4: same adapter, same weights
    old = engine.unload_lora("A")
    new = engine.load_lora("A", str(write_adapter(tmp_path / "A2", tiny_model.shape, seed=7)))
    assert new.name == old.name and new.digest != old.digest
    assert cached("A") == 0                                   # R5: reloaded A, new weights
    assert cached("A") == 8
    # The same weights reloaded from another directory are the same identity: KV is shared.
    engine.unload_lora("A")
    engine.load_lora("A", str(write_adapter(tmp_path / "A3", tiny_model.shape, seed=7)))
    assert cached("A") == 8


def test_engine_outputs_equal_merged_model(tiny_model, adapters):
    prompts = [_ids(11, 7), _ids(6, 8)]
    engine = _engine(tiny_model, adapters.items())
    for name in ("A", "B"):
        merged = _engine(merged_model(tiny_model, adapters[name]))
        want = [r.output_token_ids for r in merged.generate(prompts, GREEDY)]
        # Mixed in one engine with the base model and the other adapter, added together.
        other = "B" if name == "A" else "A"
        reqs = [engine.make_request(p, GREEDY, lora_name=n)
                for p in prompts for n in (name, other, None)]
        for req in reqs:
            engine.add_request(req)
        while engine.has_work:
            engine.step()
        assert [r.output_token_ids for r in reqs[0::3]] == want


def test_forked_choices_keep_the_adapter(tiny_model, adapters):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    prompt = _ids(7, 9)
    (want,) = _engine(merged_model(tiny_model, adapters["A"])).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    choices = _engine(tiny_model, adapters.items()).generate([prompt], params, lora_name="A")
    assert [c.output_token_ids for c in choices] == [want.output_token_ids] * 2


def test_unload_refused_while_in_use_and_unknown_names(tiny_model, adapters):
    engine = _engine(tiny_model, adapters.items())
    req = engine.make_request([1, 2, 3, 4, 5], GREEDY, lora_name="B")
    engine.add_request(req)
    with pytest.raises(LoRAInUseError, match="in use"):
        engine.unload_lora("B")
    engine.step()  # running now
    with pytest.raises(LoRAInUseError):
        engine.unload_lora("B")
    while engine.has_work:
        engine.step()
    engine.unload_lora("B")
    with pytest.raises(LoRANotFoundError):
        engine.unload_lora("B")
    with pytest.raises(LoRANotFoundError, match="model: no LoRA adapter named 'B'"):
        engine.make_request([1, 2], GREEDY, lora_name="B")
    with pytest.raises(LoRAError, match="already loaded"):
        engine.load_lora("A", str(adapters["A"]))
    with pytest.raises(LoRAError, match="base model"):
        engine.load_lora(engine.model_name, str(adapters["A"]))
    with pytest.raises(ValueError, match="lora_adapters"):
        EngineConfig(lora_adapters=(("x", "p"), ("x", "q")))


def test_a_failed_generate_gives_back_every_adapter_hold(tiny_model, adapters):
    """The first prompt's request was made (holding A) when the second one failed validation:
    it never runs, so A must not stay in use."""
    engine = _engine(tiny_model, adapters.items())
    vocab = tiny_model.shape.vocab_size
    with pytest.raises(ValueError, match=rf"prompt\[0\]: must be an int in \[0, {vocab - 1}\]"):
        engine.generate([[1, 2, 3], [vocab]], GREEDY, lora_name="A")
    assert engine.adapters.num_holders("A") == 0
    assert engine.unload_lora("A").name == "A"


@pytest.mark.smollm2
def test_smollm2_adapter_alone_and_mixed_equal_merged(smollm2, tmp_path):
    shape = smollm2.shape
    paths = {"A": write_adapter(tmp_path / "A", shape, r=8, alpha=16, seed=3, std=0.02),
             "B": write_adapter(tmp_path / "B", shape, r=4, alpha=4, targets=("q_proj", "k_proj",
                                "down_proj"), seed=4, std=0.02)}
    objects = {n: read_adapter(n, str(p), shape) for n, p in paths.items()}
    prompts = {"A": _ids(10, 11), "B": _ids(7, 12), None: _ids(8, 13)}
    want = {}
    for name in ("A", "B"):
        merged = ModelRunner(merged_model(smollm2, paths[name]), num_blocks=1, block_size=16)
        want[name] = merged.forward(merged.build_batch([(prompts[name], 0, [0])]), all_logits=True)
    runner = ModelRunner(smollm2, num_blocks=5, block_size=16)
    want[None] = runner.forward(runner.build_batch([(prompts[None], 0, [4])]), all_logits=True)
    alone = runner.forward(runner.build_batch([(prompts["A"], 0, [0])], [objects["A"]]),
                           all_logits=True)
    assert _diff(alone, want["A"]) <= SMOLLM2_ATOL
    base = runner.forward(runner.build_batch([(prompts["A"], 0, [1])]), all_logits=True)
    assert _diff(alone, base) > 1e-2  # the adapter really changes the logits
    order = ["A", None, "B"]
    batch = runner.build_batch([(prompts[n], 0, [i + 1]) for i, n in enumerate(order)],
                               [objects.get(n) if n else None for n in order])
    packed = runner.forward(batch, all_logits=True)
    indptr = batch.qo_indptr.tolist()
    for i, name in enumerate(order):
        assert _diff(packed[indptr[i]:indptr[i + 1]], want[name]) <= SMOLLM2_ATOL, name

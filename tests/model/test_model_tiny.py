"""Our forward + paged runner vs transformers on a tiny random-init model (fp32, CPU).

Every comparison is against transformers' logits of the *full* sequence, so a cached-suffix
prefill, a decode step or a packed batch must reproduce exactly what a from-scratch run gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner
from tests.conftest import make_tiny_model_dir

ATOL = 1e-5
BLOCK_SIZE = 4
NUM_BLOCKS = 96


def _ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _runner(model: LoadedModel, block_size: int = BLOCK_SIZE) -> ModelRunner:
    return ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=block_size)


def _table(first_block: int, num_tokens: int, block_size: int = BLOCK_SIZE) -> list[int]:
    # Descending ids: a table that is not the identity catches slot arithmetic mistakes.
    count = -(-num_tokens // block_size)
    return list(range(first_block + count - 1, first_block - 1, -1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def test_hf_dir_loader_facts(tiny_model: LoadedModel, tiny_model_dir: Path) -> None:
    shape = tiny_model.shape
    assert (shape.vocab_size, shape.hidden_size, shape.intermediate_size, shape.num_layers) == (49152, 64, 128, 2)
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, 16)
    assert (shape.rope_theta, shape.rope_scaling, shape.max_position_embeddings) == (10000.0, None, 2048)
    assert shape.tie_word_embeddings is False and shape.sliding_window is None
    assert tiny_model.name == tiny_model_dir.name
    assert tiny_model.dtype == torch.float32
    assert len(tiny_model.revision) == 64 and int(tiny_model.revision, 16) >= 0
    assert load_model(str(tiny_model_dir)).revision == tiny_model.revision
    assert tiny_model.tokenizer.eos_token_ids == frozenset({2})
    assert tiny_model.tokenizer.max_model_len == 2048
    assert "lm_head.weight" in tiny_model.state_dict


def test_revision_changes_with_weights(tmp_path: Path, tiny_model: LoadedModel) -> None:
    other = load_model(str(make_tiny_model_dir(tmp_path / "other", seed=99)))
    assert other.revision != tiny_model.revision


def test_build_batch_metadata(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=4)
    batch = runner.build_batch([([11, 12, 13], 0, [5]), ([21, 22], 6, [2, 7])])
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22]
    assert batch.positions.tolist() == [0, 1, 2, 6, 7]
    assert batch.qo_indptr.tolist() == [0, 3, 5]
    assert batch.prefix_lens.tolist() == [0, 6]
    assert batch.block_tables.tolist() == [[5, -1], [2, 7]]
    assert batch.slot_mapping.tolist() == [20, 21, 22, 30, 31]
    assert batch.qo_indptr.dtype == torch.int32 and batch.block_tables.dtype == torch.int32
    assert batch.slot_mapping.dtype == torch.int64 and batch.positions.dtype == torch.int64
    with pytest.raises(ValueError, match="block_table"):
        runner.build_batch([([1, 2], 3, [0])])
    with pytest.raises(ValueError, match="block_table"):
        runner.build_batch([([1], 0, [8])])
    with pytest.raises(ValueError, match="new_token_ids"):
        runner.build_batch([([], 0, [0])])
    assert runner.bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4
    assert ModelRunner.bytes_per_block_for(tiny_model.shape, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2


def test_full_prefill_matches_transformers(tiny_model: LoadedModel, hf_tiny: torch.nn.Module) -> None:
    ids = _ids(40, seed=1)
    runner = _runner(tiny_model)
    logits = runner.forward(runner.build_batch([(ids, 0, _table(0, 40))]), all_logits=True)
    expected = _hf_logits(hf_tiny, ids)
    assert logits.dtype == torch.float32
    assert _max_diff(logits, expected) <= ATOL
    last = runner.forward(runner.build_batch([(ids, 0, _table(0, 40))]))
    assert _max_diff(last, expected[-1:]) <= ATOL


@pytest.mark.parametrize("prefix_len", [16, 13])
def test_cached_suffix_prefill_matches_full(tiny_model: LoadedModel, hf_tiny: torch.nn.Module, prefix_len: int) -> None:
    ids = _ids(40, seed=2)
    expected = _hf_logits(hf_tiny, ids)
    runner = _runner(tiny_model)
    table = _table(10, 40)
    prefix_logits = runner.forward(runner.build_batch([(ids[:prefix_len], 0, table)]), all_logits=True)
    assert _max_diff(prefix_logits, expected[:prefix_len]) <= ATOL
    suffix = runner.build_batch([(ids[prefix_len:], prefix_len, table)])
    assert suffix.positions.tolist() == list(range(prefix_len, 40))
    suffix_logits = runner.forward(suffix, all_logits=True)
    assert _max_diff(suffix_logits, expected[prefix_len:]) <= ATOL


def test_decode_one_token_at_a_time(tiny_model: LoadedModel, hf_tiny: torch.nn.Module) -> None:
    ids = _ids(30, seed=3)
    expected = _hf_logits(hf_tiny, ids)
    runner = _runner(tiny_model)
    table = _table(3, 30)
    runner.forward(runner.build_batch([(ids[:9], 0, table)]))
    for pos in range(9, 30):
        logits = runner.forward(runner.build_batch([([ids[pos]], pos, table)]))
        assert _max_diff(logits, expected[pos:pos + 1]) <= ATOL, pos


def test_packed_batch_equals_running_alone(tiny_model: LoadedModel, hf_tiny: torch.nn.Module) -> None:
    # (token ids, cached prefix length): a cold prompt, a cached-suffix prefill, a decode step.
    seqs = [(_ids(12, seed=4), 0), (_ids(13, seed=5), 8), (_ids(21, seed=6), 20)]
    tables = [_table(0, 12), _table(10, 13), _table(20, 21)]
    expected = [_hf_logits(hf_tiny, ids) for ids, _ in seqs]

    def prefill_prefixes(runner: ModelRunner) -> None:
        for (ids, p), table in zip(seqs, tables):
            if p:
                runner.forward(runner.build_batch([(ids[:p], 0, table)]))

    alone = []
    for (ids, p), table in zip(seqs, tables):
        runner = _runner(tiny_model)
        prefill_prefixes(runner)
        alone.append(runner.forward(runner.build_batch([(ids[p:], p, table)]), all_logits=True))
    runner = _runner(tiny_model)
    prefill_prefixes(runner)
    batch = runner.build_batch([(ids[p:], p, table) for (ids, p), table in zip(seqs, tables)])
    packed = runner.forward(batch, all_logits=True)
    indptr = batch.qo_indptr.tolist()
    for i, ((ids, p), exp) in enumerate(zip(seqs, expected)):
        rows = packed[indptr[i]:indptr[i + 1]]
        assert _max_diff(rows, alone[i]) <= ATOL
        assert _max_diff(rows, exp[p:]) <= ATOL
    last = runner.forward(runner.build_batch([(ids[p:], p, table) for (ids, p), table in zip(seqs, tables)]))
    assert last.shape == (3, 49152)
    for i, (ids, p) in enumerate(seqs):
        assert _max_diff(last[i], expected[i][-1]) <= ATOL


VARIANTS = {
    "llama-tied": dict(tie_word_embeddings=True),
    "mistral-sliding-window": dict(sliding_window=8),
    "qwen2-bias": dict(architecture="qwen2"),
    "llama3-rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_transformers(tmp_path: Path, variant: str) -> None:
    directory = make_tiny_model_dir(tmp_path / variant, **VARIANTS[variant])
    model = load_model(str(directory))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = _ids(33, seed=7)
    expected = _hf_logits(hf_model, ids)
    runner = _runner(model)
    table = _table(0, 33)
    full = runner.forward(runner.build_batch([(ids, 0, table)]), all_logits=True)
    assert _max_diff(full, expected) <= ATOL
    runner = _runner(model)
    runner.forward(runner.build_batch([(ids[:20], 0, table)]))
    suffix = runner.forward(runner.build_batch([(ids[20:], 20, table)]), all_logits=True)
    assert _max_diff(suffix, expected[20:]) <= ATOL

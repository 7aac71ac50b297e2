"""Model runner attention-backend selection, and the Triton backend inside a real forward."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner

BLOCK_SIZE = 4


def _table(first_block: int, num_tokens: int) -> list[int]:
    count = -(-num_tokens // BLOCK_SIZE)
    return list(range(first_block + count - 1, first_block - 1, -1))  # descending ids


def test_auto_is_torch_on_cpu(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK_SIZE, attention_backend="auto")
    assert runner.attention_backend == "torch"
    assert runner._attn_ops is reference


def test_triton_on_cpu_without_interpreter_names_the_field(tiny_model: LoadedModel,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend"):
        ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK_SIZE, attention_backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; CUDA machines use the gpu test")
def test_triton_backend_matches_torch_backend(tiny_model: LoadedModel) -> None:
    # Prefill 13 tokens, extend with a 6-token suffix over the 13 cached ones (P not block
    # aligned), then two decode steps (the split-KV decode kernel): logits of both backends agree.
    ids = torch.randint(0, 49152, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    table = _table(3, 21)
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tiny_model, num_blocks=12, block_size=BLOCK_SIZE, attention_backend=backend)
        assert runner.attention_backend == backend
        steps = [runner.forward(runner.build_batch([(ids[:13], 0, table)]), all_logits=True),
                 runner.forward(runner.build_batch([(ids[13:19], 13, table)]), all_logits=True)]
        for pos in (19, 20):
            steps.append(runner.forward(runner.build_batch([([ids[pos]], pos, table)])))
        logits[backend] = steps
    for want, got in zip(logits["torch"], logits["triton"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_reference_backend_is_selectable(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK_SIZE, attention_backend="reference")
    assert runner.attention_backend == "reference"


def test_torch_plan_backend_matches_reference_backend_on_a_mixed_step(tiny_model: LoadedModel) -> None:
    # One step holding a prefill (no prefix), an extend over an unaligned prefix and two
    # decodes of different lengths, after the prefixes were written by per-sequence steps:
    # the batched plan path gives the per-sequence reference's logits.
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (9, 19, 14, 7)]
    tables = [_table(0, 9), _table(10, 19), _table(20, 14), _table(30, 7)]
    prefix = [0, 13, 13, 6]  # sequence 0 prefills; 1 extends by 6; 2 and 3 decode one token
    logits = {}
    for backend in ("reference", "torch"):
        runner = ModelRunner(tiny_model, num_blocks=40, block_size=BLOCK_SIZE, attention_backend=backend)
        for i in (1, 2, 3):
            runner.forward(runner.build_batch([(ids[i][:prefix[i]], 0, tables[i])]))
        step = [(ids[0], 0, tables[0]), (ids[1][13:19], 13, tables[1]),
                ([ids[2][13]], 13, tables[2]), ([ids[3][6]], 6, tables[3])]
        logits[backend] = runner.forward(runner.build_batch(step), all_logits=True)
    assert logits["torch"].shape == (9 + 6 + 1 + 1, 49152)
    torch.testing.assert_close(logits["torch"], logits["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.compile
def test_compiled_layers_match_eager(tiny_model: LoadedModel) -> None:
    # --compile: torch.compile of the layers' dense math gives the eager logits for a prefill
    # and for decodes of two batch sizes (dynamic shapes: no recompile per packed length).
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 49152, (11,), generator=gen).tolist()
    tables = [_table(0, 12), _table(4, 12)]
    logits = {}
    for compile in (False, True):
        runner = ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK_SIZE, compile=compile)
        assert runner.forward_model.compiled is compile
        out = [runner.forward(runner.build_batch([(ids[:10], 0, tables[0])]), all_logits=True),
               runner.forward(runner.build_batch([(ids[:10], 0, tables[1])]))]
        out.append(runner.forward(runner.build_batch([([ids[10]], 10, tables[0])])))
        out.append(runner.forward(runner.build_batch([([ids[10]], 10, t) for t in tables])))
        logits[compile] = out
    for want, got in zip(logits[False], logits[True]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

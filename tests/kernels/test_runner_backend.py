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

"""The CPU prefill/extend path (oneDNN projections, C elementwise kernels) against the torch
path of the same forward on the tiny model, fp32 and bf16, and the bf16 start-up rules."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from radixkv.kernels import gemm, host_memory, native
from radixkv.model import llama
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 64
# 40 prompt tokens then a 37-token suffix: both above native.MAX_LINEAR_ROWS, so both take the
# prefill path; the suffix reads a cached prefix (an extend step).
PROMPT, SUFFIX = 40, 37
assert min(PROMPT, SUFFIX) > native.MAX_LINEAR_ROWS


def _as(model: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    state = {name: t.to(dtype) for name, t in model.state_dict.items()}
    return LoadedModel(**{**model.__dict__, "state_dict": state, "dtype": dtype})


def _decode(runner: ModelRunner, steps: int = 3) -> torch.Tensor:
    # Few-row steps after _logits' prompt and suffix: each feeds token 5 at the next position.
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - (PROMPT + SUFFIX + steps + BLOCK_SIZE - 1) // BLOCK_SIZE, -1))
    out = [runner.forward(runner.build_batch([([5], PROMPT + SUFFIX + i, table)])) for i in range(steps)]
    return torch.cat(out)


def _logits(model: LoadedModel) -> tuple[ModelRunner, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, model.shape.vocab_size, (PROMPT + SUFFIX,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - (PROMPT + SUFFIX + BLOCK_SIZE - 1) // BLOCK_SIZE, -1))
    first = runner.forward(runner.build_batch([(ids[:PROMPT], 0, table)]), all_logits=True)
    second = runner.forward(runner.build_batch([(ids[PROMPT:], PROMPT, table)]), all_logits=True)
    return runner, first, second


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a torch build without oneDNN gets: every projection on F.linear, elementwise in torch.
    monkeypatch.setenv(gemm.DISABLE_ENV, "0")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a.float() - b.float()).abs().max())


def _require_prefill_path(runner: ModelRunner) -> None:
    if not gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    # Without the native library (RADIXKV_NATIVE_KERNELS=0, no compiler) the projections are
    # still oneDNN and the elementwise work stays on torch.
    assert runner.forward_model.prefill_gemm == gemm.gemm_backend()
    assert (runner.forward_model._prefill is not None) == (native.load() is not None)


def test_c_gemm_follows_the_runners_native_kernels(tiny_model: LoadedModel) -> None:
    # The C GEMM is one of the C kernels: a runner with them off keeps fp32 prefill on oneDNN.
    if not gemm.onednn_available() or gemm.native_gemm(torch.float32) is None:
        pytest.skip("no C GEMM here (an AVX-512 CPU, oneDNN or the native kernels unavailable)")
    on = ModelRunner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    off = ModelRunner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, native_kernels=False)
    assert on.forward_model.prefill_gemm == "native avx2 (packed weights)"
    assert {layer.qkv_lin.backend for layer in on.forward_model.layers} == {"native"}
    assert off.forward_model.prefill_gemm == "onednn (packed weights)"
    assert {layer.down_lin.backend for layer in off.forward_model.layers} == {"onednn"}


def test_fp32_prefill_path_matches_torch_path(tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, first, second = _logits(tiny_model)
    _require_prefill_path(runner)
    # fp32 packs the four projections of each layer and keeps the plain weights (the C decode
    # kernels read them); the lm_head stays plain (few-row logits take the C kernel).
    shape = tiny_model.shape
    q_kv = (shape.num_q_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_layer = (q_kv * shape.hidden_size + shape.hidden_size * shape.num_q_heads * shape.head_dim
                 + 3 * shape.intermediate_size * shape.hidden_size)
    assert runner.forward_model.packed_weight_bytes == 4 * per_layer * shape.num_layers
    with monkeypatch.context() as patch:
        _torch_path(patch)
        ref_runner, ref_first, ref_second = _logits(tiny_model)
        assert ref_runner.forward_model._prefill is None and ref_runner.forward_model.prefill_gemm == "torch F.linear"
    # The tolerance test_model_tiny holds the torch path to against transformers.
    assert _max_diff(first, ref_first) <= 1e-5
    assert _max_diff(second, ref_second) <= 1e-5


def test_bf16_prefill_path(tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    if not gemm.cpu_bf16_native():
        pytest.skip("this CPU has no native bf16 dot products")
    bf16 = _as(tiny_model, torch.bfloat16)
    with capture_logs() as logs:
        runner, first, second = _logits(bf16)
    _require_prefill_path(runner)
    assert runner.forward_model.bf16_native
    assert not [e for e in logs if e["event"] == "bf16_emulated"]
    ready = [e for e in logs if e["event"] == "model_runner_ready"]
    assert len(ready) == 1 and ready[0]["bf16_native"] is True
    # Packed bf16 copies of the four projections of each layer; they replace the plain layer
    # weights unless the C kernels (which read those and take the few-row logits) are on,
    # and then lm_head packs too.
    shape = tiny_model.shape
    q_kv = (shape.num_q_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_layer = (q_kv * shape.hidden_size + shape.hidden_size * shape.num_q_heads * shape.head_dim
                 + 3 * shape.intermediate_size * shape.hidden_size)
    head = shape.vocab_size * shape.hidden_size
    dropped = runner.forward_model.native is None
    assert runner.forward_model.packed_weight_bytes == 2 * (per_layer * shape.num_layers + head * dropped)
    assert all(layer.qkv_weight.is_mkldnn == dropped for layer in runner.forward_model.layers)
    decode = _decode(runner)  # few rows: also the packed weights, no plain copy left
    fp32_runner, fp32_first, fp32_second = _logits(tiny_model)
    fp32_decode = _decode(fp32_runner)
    with monkeypatch.context() as patch:
        _torch_path(patch)
        ref_runner, ref_first, ref_second = _logits(bf16)
        ref_decode = _decode(ref_runner)
    # bf16 keeps 8 bits of mantissa, and two bf16 paths that round at different points differ
    # by a few bf16 ulps of the hidden states. Measured on this model (largest |logit| ~4.3):
    # this path vs the torch bf16 path 0.047-0.055, vs fp32 0.056-0.082, while today's torch
    # bf16 path is 0.043-0.080 from fp32, i.e. 1-2 % of the largest logit; bound at 6 %.
    scale = float(fp32_first.abs().max())
    assert _max_diff(first, ref_first) <= 0.06 * scale
    assert _max_diff(second, ref_second) <= 0.06 * scale
    assert _max_diff(first, fp32_first) <= 0.06 * scale
    assert _max_diff(second, fp32_second) <= 0.06 * scale
    assert _max_diff(decode, ref_decode) <= 0.06 * scale
    assert _max_diff(decode, fp32_decode) <= 0.06 * scale


def test_bf16_without_native_dot_products_keeps_prefill_gemms_on_torch(
        tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # The prefill GEMMs (F.linear, nothing packed) and elementwise ops stay on torch, the
    # warning says so, and the C kernels (decode projections, extend attention) stay loaded.
    monkeypatch.setattr(gemm, "cpu_bf16_native", lambda: False)
    bf16 = _as(tiny_model, torch.bfloat16)
    with capture_logs() as logs:
        runner, first, _ = _logits(bf16)
    emulated = [e for e in logs if e["event"] == "bf16_emulated"]
    assert len(emulated) == 1 and emulated[0]["missing_cpu_flags"] == ["avx512_bf16", "amx_bf16"]
    assert "prefill GEMMs and elementwise ops stay on torch" in emulated[0]["detail"]
    assert runner.native is native.load() and runner.forward_model.native is runner.native
    ready = [e for e in logs if e["event"] == "model_runner_ready"]
    assert len(ready) == 1 and ready[0]["bf16_native"] is False
    model = runner.forward_model
    assert not model.bf16_native and model._prefill is None and not model._packed
    assert model.prefill_gemm == "torch F.linear" and model.packed_weight_bytes == 0
    assert first.dtype == torch.float32 and bool(torch.isfinite(first).all())


def test_mlp_in_row_chunks_matches_one_pass(tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Long steps run the MLP in row chunks (kernels.host_memory); force 16-row chunks on the
    # tiny model: the 40-token prompt takes chunks of 16, 16 and 8 rows, the suffix 16, 16, 5.
    runner, first, second = _logits(tiny_model)
    _require_prefill_path(runner)
    if runner.forward_model._prefill is None:
        pytest.skip("no native prefill kernels here")
    width = 2 * tiny_model.shape.intermediate_size
    with monkeypatch.context() as patch:
        patch.setattr(llama, "_MLP_ROW_QUANTUM", 8)
        patch.setattr(host_memory, "MAX_STEP_BUFFER_BYTES", 16 * width * 4 + 7)
        assert host_memory.max_rows_per_buffer(width, 4) == 16
        calls: list[int] = []
        real = gemm.silu_mul
        patch.setattr(gemm, "silu_mul", lambda k, gu, **kw: calls.append(gu.shape[0]) or real(k, gu, **kw))
        _, chunked_first, chunked_second = _logits(tiny_model)
    num_layers = tiny_model.shape.num_layers
    assert calls == [16, 16, 8] * num_layers + [16, 16, 5] * num_layers
    assert _max_diff(chunked_first, first) <= 1e-5
    assert _max_diff(chunked_second, second) <= 1e-5

"""``radixkv plan``: exact bytes per token for the worked example and public configs, the same
bytes radixkv allocates, the memory budget, and exit 2 naming the field or flag.

Public configs are trimmed to the fields the plan reads; each names its source. Expected values
are computed by hand from those fields (the formulas of ``radixkv.tools.plan.capacity``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv.tools.plan import (
    FULL,
    GIB,
    MLA,
    SLIDING,
    KVLayout,
    LayerGroup,
    MemoryBudget,
    dense_num_params,
    layout_from_hf_config,
    plan_capacity,
)
from radixkv.tools.plan.command import add_arguments, main

KIB = 1 << 10

# huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "vocab_size": 128256, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
# huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
LLAMA3_70B: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "vocab_size": 128256, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
# huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 40960, "max_window_layers": 36, "sliding_window": None,
    "use_sliding_window": False, "vocab_size": 151936, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
# huggingface.co/google/gemma-3-1b-it/blob/main/config.json
GEMMA3_1B: dict[str, Any] = {
    "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
    "head_dim": 256, "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "sliding_window": 512, "sliding_window_pattern": 6,
    "max_position_embeddings": 32768, "vocab_size": 262144, "torch_dtype": "bfloat16"}
# huggingface.co/google/gemma-3-4b-it/blob/main/config.json: the decoder's text_config leaves
# the heads to Gemma3TextConfig's defaults (8 query, 4 KV heads, head_dim 256, pattern 6).
GEMMA3_4B: dict[str, Any] = {
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    "vision_config": {"model_type": "siglip_vision_model"}}
# huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "moe_intermediate_size": 1408, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16"}
# huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "moe_intermediate_size": 2048, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16"}


def _layout(num_kv_heads: int) -> KVLayout:
    """The issue's worked example: 32 layers, ``num_kv_heads`` KV heads of 128 dims, bf16."""
    return KVLayout("example", "test", (LayerGroup(FULL, 32, num_kv_heads, 128),), "bfloat16",
                    8192, None, 2)


def test_worked_example_128_kib_per_token_1_gib_per_8k_32_gib_for_32() -> None:
    plan = plan_capacity(_layout(8), max_model_len=8192, budget=MemoryBudget(32 * GIB))
    assert plan.bytes_per_token == 128 * KIB
    assert plan.bytes_per_seq == GIB
    assert plan.concurrent_seqs_at_max_model_len == 32
    assert plan.num_blocks == 32 * GIB // (16 * 128 * KIB) == 16384
    assert plan.num_tokens == 262144
    assert plan_capacity(_layout(32)).bytes_per_token == 512 * KIB  # MHA: 32 KV heads


@pytest.mark.parametrize("config,kv_dtype,bytes_per_token", [
    (LLAMA3_8B, "auto", 131_072),         # 32 layers × 2 × 8 × 128 × 2 B
    (LLAMA3_70B, "auto", 327_680),        # 80 × 2 × 8 × 128 × 2
    (QWEN3_8B, "auto", 147_456),          # 36 × 2 × 8 × 128 × 2
    (GEMMA3_1B, "auto", 26_624),          # 26 × 2 × 1 × 256 × 2
    (GEMMA3_4B, "auto", 139_264),         # 34 × 2 × 4 × 256 × 2
    (DEEPSEEK_V2_LITE, "auto", 31_104),   # 27 × (512 + 64) × 2: one latent, not K and V
    (DEEPSEEK_V3, "auto", 70_272),        # 61 × (512 + 64) × 2
    (LLAMA3_8B, "int8", 67_584),          # 32 × (2 × 8 × 128 × 1 + 2 × 8 × 4 B of scales)
    (LLAMA3_8B, "fp8_e4m3", 67_584),
    (LLAMA3_8B, "float32", 262_144),
    (DEEPSEEK_V3, "fp8_e4m3", 35_380),    # 61 × (576 × 1 + 4)
], ids=["llama3-8b", "llama3-70b", "qwen3-8b", "gemma3-1b", "gemma3-4b", "deepseek-v2-lite",
        "deepseek-v3", "llama3-8b-int8", "llama3-8b-fp8", "llama3-8b-fp32", "deepseek-v3-fp8"])
def test_public_configs_bytes_per_token(config: dict[str, Any], kv_dtype: str,
                                        bytes_per_token: int) -> None:
    plan = plan_capacity(layout_from_hf_config(config), kv_cache_dtype=kv_dtype)
    assert plan.bytes_per_token == bytes_per_token


def test_gemma3_groups_and_window_bounded_sequence() -> None:
    plan = plan_capacity(layout_from_hf_config(GEMMA3_1B), block_size=16)
    full, sliding = plan.groups
    assert (full.group.kind, full.group.num_layers, full.bytes_per_token_per_layer) == (FULL, 4, 1024)
    assert (sliding.group.kind, sliding.group.num_layers, sliding.group.window_tokens) == (SLIDING, 22, 512)
    assert sliding.group.name == "sliding window 512"
    # 32,768 tokens: 2,048 blocks in a full layer; the last 512 tokens span at most
    # ceil(511 / 16) + 1 = 33 blocks in a sliding one.
    assert (full.blocks_per_seq, sliding.blocks_per_seq) == (2048, 33)
    assert plan.bytes_per_seq == 2048 * 16 * 4 * 1024 + 33 * 16 * 22 * 1024 == 146_112_512
    assert plan.bytes_per_seq_all_tokens_kept == 2048 * 16 * 26_624
    gemma4b = layout_from_hf_config(GEMMA3_4B)
    assert [(g.kind, g.num_layers, g.window_tokens) for g in gemma4b.groups] == [
        (FULL, 5, None), (SLIDING, 29, 1024)]


def test_explicit_layer_types_and_qwen_max_window_layers() -> None:
    mixed = {**LLAMA3_8B, "model_type": "mistral", "sliding_window": 4096,
             "layer_types": ["sliding_attention", "full_attention"] * 16}
    assert [(g.kind, g.num_layers) for g in layout_from_hf_config(mixed).groups] == [
        (FULL, 16), (SLIDING, 16)]
    qwen = {**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}
    assert [(g.kind, g.num_layers) for g in layout_from_hf_config(qwen).groups] == [
        (FULL, 28), (SLIDING, 8)]
    # No max_window_layers: transformers' default 28, as radixkv serve (hf_loader) reads it.
    no_first = {k: v for k, v in qwen.items() if k != "max_window_layers"}
    assert [(g.kind, g.num_layers) for g in layout_from_hf_config(no_first).groups] == [
        (FULL, 28), (SLIDING, 8)]
    assert [g.kind for g in layout_from_hf_config({**LLAMA3_8B, "sliding_window": 4096}).groups] == [FULL]


@pytest.mark.parametrize("tp,heads,bytes_per_token", [
    (1, 8, 327_680), (8, 1, 40_960), (16, 1, 40_960),  # 16 ranks: each keeps a replica of one head
])
def test_tensor_parallel_splits_then_replicates_kv_heads(tp: int, heads: int, bytes_per_token: int) -> None:
    plan = plan_capacity(layout_from_hf_config(LLAMA3_70B), tp=tp)
    assert (plan.groups[0].kv_heads_per_rank, plan.bytes_per_token) == (heads, bytes_per_token)
    # MLA: every rank keeps the whole latent.
    assert plan_capacity(layout_from_hf_config(DEEPSEEK_V3), tp=tp).bytes_per_token == 70_272


def test_dense_parameter_count_of_public_configs() -> None:
    assert dense_num_params(LLAMA3_8B) == 8_030_261_248
    assert dense_num_params(LLAMA3_70B) == 70_553_706_496
    assert dense_num_params(DEEPSEEK_V3) is None  # MoE / MLA: --weights-gib


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv plan")
    add_arguments(parser)
    return parser.parse_args(argv)


def _write_config(tmp_path: Path, config: dict[str, Any], name: str = "model") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_cli_budget_from_device_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _write_config(tmp_path, LLAMA3_8B, "Meta-Llama-3-8B")
    code = main(_parse(["--config", str(directory), "--device-memory-gib", "80", "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    # int(80 GiB × 0.9) − 8,030,261,248 parameters × 2 B = 61,248,888,832 B of KV.
    assert out["weights_bytes"] == 16_060_522_496
    assert out["kv_memory_bytes"] == 61_248_888_832
    assert out["num_blocks"] == 61_248_888_832 // (16 * 131_072) == 29_205
    assert out["num_tokens"] == 467_280
    assert out["concurrent_seqs_at_max_model_len"] == 57  # 8,192-token sequences of 1 GiB
    assert out["model"] == "Meta-Llama-3-8B"
    assert out["layer_groups"][0]["formula_bytes_per_token_per_layer"] == "2 × 8 × 128 × 2"


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _write_config(tmp_path, GEMMA3_1B)
    assert main(_parse(["--config", str(directory / "config.json"), "--kv-memory-gib", "8"])) == 0
    text = capsys.readouterr().out
    assert "sliding window 512      22              1  1,024 = 2 × 1 × 256 × 2   22,528" in text
    assert "per token (one rank): 26,624 B (26 KiB)" in text
    assert "blocks: 20,164  tokens: 322,624" in text  # 8 GiB // (16 × 26,624 B)
    assert "worst-case concurrent sequences at 32,768 tokens: 58" in text  # 8 GiB // 146,112,512 B
    assert "every layer keeping every token (radixkv's pool): 9" in text    # 20,164 // 2,048


def _smollm2_layout_bytes(kv_dtype: str) -> int:
    args = _parse(["--model", "SmolLM2-135M-Instruct", "--kv-cache-dtype", kv_dtype])
    from radixkv.tools.plan.command import load_layout

    return plan_capacity(load_layout(args), kv_cache_dtype=kv_dtype).bytes_per_token


@pytest.mark.parametrize("kv_dtype,model_dtype,bytes_per_token", [
    ("float32", torch.float32, 46_080), ("bfloat16", torch.bfloat16, 23_040),
    ("int8", torch.float32, 12_240), ("fp8_e4m3", torch.float32, 12_240),
])
def test_smollm2_matches_the_pool_radixkv_sizes(smollm2, kv_dtype: str, model_dtype: torch.dtype,
                                                bytes_per_token: int) -> None:
    from radixkv.model.runner import ModelRunner

    assert _smollm2_layout_bytes(kv_dtype) == bytes_per_token
    # What the engine divides its KV memory by (llm_engine._num_blocks_for).
    assert ModelRunner.bytes_per_block_for(smollm2.shape, 16, model_dtype, kv_dtype) == 16 * bytes_per_token


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "int8", "fp8_e4m3"])
def test_tiny_model_matches_the_bytes_radixkv_allocates(tiny_model_dir: Path, kv_dtype: str) -> None:
    from radixkv.model.loader import load_model
    from radixkv.model.runner import ModelRunner

    model_dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    runner = ModelRunner(load_model(str(tiny_model_dir), dtype=model_dtype), num_blocks=3,
                         block_size=16, kv_cache_dtype=kv_dtype)
    plan = plan_capacity(layout_from_hf_config(json.loads((tiny_model_dir / "config.json").read_text())),
                         kv_cache_dtype=kv_dtype, block_size=16)
    allocated = sum(t.numel() * t.element_size() for t in runner._pool_tensors())
    assert plan.bytes_per_token == runner.kv_bytes_per_token
    assert plan.bytes_per_block == runner.bytes_per_block == allocated // 3


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(_parse(argv))
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("config,field", [
    ({**LLAMA3_8B, "num_key_value_heads": 3}, "num_key_value_heads: must be a positive int dividing"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}, "num_hidden_layers: the config lacks it"),
    ({**LLAMA3_8B, "layer_types": ["chunked_attention"] * 32}, "layer_types: unsupported layer type"),
    ({**LLAMA3_8B, "torch_dtype": "int4"}, "torch_dtype: 'int4' is not one of"),
    ({**LLAMA3_8B, "torch_dtype": ["bfloat16"]}, "torch_dtype: ['bfloat16'] is not one of"),
    ({**LLAMA3_8B, "torch_dtype": {"text": "bfloat16"}}, "torch_dtype: {'text': 'bfloat16'} is not one of"),
    ({**GEMMA3_1B, "sliding_window": None}, "sliding_window: the config lacks it"),
    ({**LLAMA3_8B, "attention_chunk_size": 8192}, "attention_chunk_size: chunked attention"),
])
def test_unsupported_config_exits_2_naming_the_field(tmp_path: Path, capsys, config, field) -> None:
    code, err = _exit(["--config", str(_write_config(tmp_path, config))], capsys)
    assert code == 2 and field in err, err


def test_unreadable_config_and_unknown_model_exit_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    code, err = _exit(["--config", str(tmp_path / "bad")], capsys)
    assert code == 2 and "config: cannot read" in err
    code, err = _exit(["--model", "Llama-9", "--json"], capsys)
    assert code == 2 and err.startswith("radixkv plan: --model Llama-9: not a shipped model")


@pytest.mark.parametrize("flags,message", [
    (["--tp", "0"], "--tp: expected an int >= 1"),
    (["--tp", "3"], "--tp: 3 does not divide the 8 KV heads"),
    (["--block-size", "2048"], "--block-size: expected an int in [1, 1024]"),
    (["--memory-utilization", "1.5", "--device-memory-gib", "80"], "--memory-utilization: expected a number in (0, 1]"),
    (["--weights-gib", "4"], "--weights-gib: needs --device-memory-gib"),
    (["--device-memory-gib", "16"], "--device-memory-gib: 16.0 GiB × 0.9 leaves nothing"),
    (["--kv-memory-gib", "8", "--device-memory-gib", "80"], "not allowed with argument"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: invalid choice"),
    # 1e300 GiB is inf bytes: int() of it raised OverflowError (a traceback) before the bound.
    (["--kv-memory-gib", "1e300"], "--kv-memory-gib: expected a number in (0, 1.67423e+299]"),
    (["--device-memory-gib", "1e300"], "--device-memory-gib: expected a number in (0, 1.67423e+299]"),
    (["--device-memory-gib", "80", "--weights-gib", "1e300"],
     "--weights-gib: expected a number in [0, 1.67423e+299]"),
    (["--max-tokens", "-1"], "--max-tokens: expected an int >= 0, got '-1'"),
    # 1 GiB − int(0.999 GiB) = 1,073,742 B, under one 2 MiB block: the flag that set it is named.
    (["--device-memory-gib", "1", "--memory-utilization", "1", "--weights-gib", "0.999",
      "--trace", "tau-bench"], "--device-memory-gib: the budget (1,073,742 B) holds no block of 2,097,152 B"),
    (["--device-memory-gib", "1", "--memory-utilization", "1", "--weights-gib", "0.999"],
     "--device-memory-gib: the budget (1,073,742 B) holds no block of 2,097,152 B"),
    # 1e-9 GiB = 1 B: a plan of 0 blocks was printed with exit 0.
    (["--kv-memory-gib", "1e-9"], "--kv-memory-gib: the budget (1 B) holds no block of 2,097,152 B"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path: Path, capsys, flags, message) -> None:
    directory = _write_config(tmp_path, LLAMA3_8B)
    code, err = _exit(["--config", str(directory), *flags], capsys)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("fields,flags,message", [
    # "false" as a JSON string read as true: the lm_head left out of the weights estimate, or
    # Qwen2's top layers planned as sliding.
    ({"tie_word_embeddings": "false"}, [], "tie_word_embeddings: must be true or false, got 'false'"),
    ({"model_type": "qwen2", "use_sliding_window": "false", "sliding_window": 4096}, [],
     "use_sliding_window: must be true or false, got 'false'"),
    # A list of 1e30 layer kinds: OverflowError (a traceback, exit 1) before the bound.
    ({"num_hidden_layers": 10**30}, [], "num_hidden_layers: must be at most 10,000, got 1,"),
    ({"text_config": "x"}, [], "text_config: must be an object, got 'x'"),
    # A wrong-typed size named as such, not as "--weights-gib: parameters cannot be counted".
    ({"intermediate_size": "14336"}, ["--device-memory-gib", "80"],
     "intermediate_size: must be a positive int, got '14336'"),
])
def test_wrong_typed_config_fields_exit_2_naming_the_field(tmp_path: Path, capsys, fields, flags,
                                                          message) -> None:
    directory = _write_config(tmp_path, {**LLAMA3_8B, **fields})
    code, err = _exit(["--config", str(directory), *flags], capsys)
    assert code == 2 and message in err, err


def test_max_tokens_zero_is_accepted() -> None:
    assert _parse(["--config", "x", "--max-tokens", "0"]).max_tokens == 0


def test_moe_budget_needs_weights_gib(tmp_path: Path, capsys) -> None:
    directory = _write_config(tmp_path, DEEPSEEK_V3)
    code, err = _exit(["--config", str(directory), "--device-memory-gib", "141"], capsys)
    assert code == 2 and "--weights-gib: the config's parameters cannot be counted" in err
    code = main(_parse(["--config", str(directory), "--device-memory-gib", "141", "--tp", "8",
                        "--weights-gib", "640", "--max-model-len", "32768", "--json"]))
    out = json.loads(capsys.readouterr().out)
    # int(141 GiB × 0.9) − 640 GiB / 8 = 46.9 GiB per rank; 32,768 × 70,272 B per sequence.
    assert code == 0
    assert out["kv_memory_bytes"] == int(int(141 * GIB) * 0.9) - 80 * GIB == 50_358_491_545
    assert out["concurrent_seqs_at_max_model_len"] == 50_358_491_545 // (32768 * 70_272) == 21


def test_config_input_imports_no_torch(tmp_path: Path) -> None:
    directory = _write_config(tmp_path, LLAMA3_8B)
    probe = ("import argparse, sys\n"
             "from radixkv.tools.plan.command import add_arguments, main\n"
             "p = argparse.ArgumentParser(); add_arguments(p)\n"
             f"code = main(p.parse_args(['--config', {str(directory)!r}]))\n"
             "print('EXIT', code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.stdout.splitlines()[-1] == "EXIT 0 False", proc.stderr[-2000:]


def test_gguf_metadata_layouts() -> None:
    from radixkv.tools.plan.gguf_meta import layout_from_gguf_metadata

    # Keys as llama.cpp's converter writes them (gguf-py constants); values: DeepSeek-V2-Lite
    # and gemma-3-1b as above.
    deepseek = layout_from_gguf_metadata({
        "general.architecture": "deepseek2", "deepseek2.block_count": 27,
        "deepseek2.attention.kv_lora_rank": 512, "deepseek2.rope.dimension_count": 64},
        num_params=None)
    assert plan_capacity(deepseek, kv_cache_dtype="bfloat16").bytes_per_token == 31_104
    gemma = layout_from_gguf_metadata({
        "general.architecture": "gemma3", "gemma3.block_count": 26,
        "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
        "gemma3.attention.sliding_window": 512, "gemma3.context_length": 32768},
        num_params=999_885_952)
    assert [(g.kind, g.num_layers, g.window_tokens) for g in gemma.groups] == [
        (FULL, 4, None), (SLIDING, 22, 512)]
    assert plan_capacity(gemma, kv_cache_dtype="bfloat16").bytes_per_token == 26_624
    assert gemma.num_params == 999_885_952 and gemma.weight_dtype_bytes == 4
    with pytest.raises(ValueError, match="^general.architecture: 'mamba' is not supported"):
        layout_from_gguf_metadata({"general.architecture": "mamba"}, num_params=None)
    with pytest.raises(ValueError, match="^llama.attention.head_count: the GGUF metadata lacks it"):
        layout_from_gguf_metadata({"general.architecture": "llama", "llama.block_count": 2},
                                  num_params=None)


def test_gguf_file_with_an_unsupported_architecture_exits_2(tmp_path: Path, capsys) -> None:
    import gguf

    path = tmp_path / "tiny-mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, err = _exit(["--gguf", str(path)], capsys)
    assert code == 2 and "general.architecture: 'mamba' is not supported" in err, err
    code, err = _exit(["--gguf", str(tmp_path / "missing.gguf")], capsys)
    assert code == 2 and f"--gguf {tmp_path / 'missing.gguf'}: gguf: cannot read" in err, err


def test_layer_group_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="^sliding_window: must be a positive int"):
        LayerGroup(SLIDING, 4, 2, 64, None)
    with pytest.raises(ValueError, match="^kv_lora_rank: must be a positive int"):
        LayerGroup(MLA, 4, 1, 0, kv_lora_rank=0)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "gemma3"])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_served_families_match_the_pool_radixkv_sizes(family: str, kv_dtype: str) -> None:
    """The families radixkv serves beside Llama (sliding and hybrid layouts included): its pool
    keeps every layer of every token, which is the plan's ``bytes_per_token``."""
    import transformers

    from radixkv.model.hf_loader import shape_from_hf_config
    from radixkv.model.runner import ModelRunner

    classes = {"mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
               "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}
    config = json.loads(classes[family](
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        sliding_window=8).to_json_string())
    plan = plan_capacity(layout_from_hf_config(config), kv_cache_dtype=kv_dtype, block_size=16)
    per_layer = 2 * 2 * 32 * 4 if kv_dtype == "float32" else 2 * 2 * 32 + 2 * 2 * 4
    assert plan.bytes_per_token == 6 * per_layer
    assert plan.bytes_per_block == ModelRunner.bytes_per_block_for(
        shape_from_hf_config(config), 16, torch.float32, kv_dtype)

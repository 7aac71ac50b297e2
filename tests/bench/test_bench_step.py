"""``radixkv bench step`` on the tiny random Llama: result keys, finite ratios, the exact bytes a
decode step reads, skipped / cut points, and the decode logits against a reference forward and
against Hugging Face's own forward over the same synthetic K/V."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from radixkv.cli import BENCHES, load_bench
from tests.conftest import TINY_CONFIG

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _step_measure as m  # noqa: E402

step = load_bench("step")

# Tiny model bytes by hand (TINY_CONFIG, fp32, untied LM head): per layer q 64·64, k 64·32,
# v 64·32, o 64·64, gate/up/down 3·64·128, 2 norms · 64 = 36,992 params; 2 layers + final norm
# 64 = 74,048; LM head 49,152·64 = 3,145,728 -> 3,219,776 params · 4 B.
TINY_WEIGHT_BYTES = 12_879_104
# K + V of one cached token: 2 · 2 layers · 2 KV heads · 16 dims · 4 B.
TINY_KV_BYTES_PER_TOKEN = 512
TINY_BLOCK_BYTES = 16 * TINY_KV_BYTES_PER_TOKEN  # block size 16
LOGIT_TOL = 1e-4  # fp32, logits O(1) (initializer_range 0.1)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv bench step")
    step.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tiny_config_matches_the_tests_tiny_model() -> None:
    assert m.TINY_CONFIG == TINY_CONFIG
    assert "step" in BENCHES


def test_tiny_run_keys_ratios_bytes_and_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "step.json"
    # 53,687 B pool limit: 6 blocks of 8,192 B fit, b=3 x ctx=40 (9 blocks) and 2,048 tokens do not.
    args = parse("--tiny", "--prefill-tokens", "8,40,3000", "--decode-batch", "1,3",
                 "--decode-context", "5,40", "--repeats", "1", "--copy-mib", "8", "--gemm-n", "64",
                 "--max-pool-gib", "0.00005", "--json", str(out))
    result = step.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    table = capsys.readouterr().out
    assert "skipped: pool" in table and "prefill 2048 tok (asked 3000)" in table
    assert {"model", "dtype", "block_size", "num_threads", "torch", "weight_bytes", "roofs",
            "points"} <= set(result)
    assert result["weight_bytes"] == TINY_WEIGHT_BYTES
    assert result["roofs"]["copy"]["bytes"] == 8 << 20 and result["roofs"]["gemm"]["n"] == 64
    for roof, key in (("copy", "gbps"), ("gemm", "gflops")):
        assert m.finite_positive(result["roofs"][roof][key])
    names = [(p["kind"], p.get("tokens"), p.get("batch"), p.get("context")) for p in result["points"]]
    assert names == [("prefill", 8, None, None), ("prefill", 40, None, None),
                     ("prefill", 2048, None, None), ("decode", None, 1, 5), ("decode", None, 1, 40),
                     ("decode", None, 3, 5), ("decode", None, 3, 40)]
    skipped = [p for p in result["points"] if "skipped" in p]
    assert [(p["kind"], p["num_blocks"]) for p in skipped] == [("prefill", 128), ("decode", 9)]
    for p in result["points"]:
        assert p["pool_bytes"] == p["num_blocks"] * TINY_BLOCK_BYTES
        if "skipped" in p:
            assert "ratio" not in p
            continue
        assert math.isfinite(p["ratio"]) and p["ratio"] > 0
        assert p["ratio"] == pytest.approx(p["ms"] / p["floor_ms"])
        if p["kind"] == "prefill":
            # cost model: 2·P per token + 4·L·Hq·D per causal pair, P = 74,048.
            t = p["tokens"]
            assert p["flops"] == 2 * 74_048 * t + 4 * 2 * 4 * 16 * t * (t + 1) // 2
            continue
        want_bytes = TINY_WEIGHT_BYTES + p["batch"] * p["context"] * TINY_KV_BYTES_PER_TOKEN
        assert p["bytes_per_step"] == want_bytes
        assert p["floor_ms"] == pytest.approx(want_bytes / result["roofs"]["copy"]["gbps"] / 1e6)
        assert p["num_blocks"] == p["batch"] * -(-(p["context"] + 1) // 16)
        assert p["logits_shape"] == [p["batch"], 49152] and p["logits_finite"]
        assert p["check_max_abs_diff"] <= LOGIT_TOL


def test_decode_logits_match_hf_over_the_same_cache(tiny_model, tiny_model_dir: Path) -> None:
    """Runner logits (and the bench's reference forward) equal HF LlamaForCausalLM fed the pool's
    K/V as its cache, within 1e-4 (fp32)."""
    import transformers

    batch_size, context, block_size = 2, 37, 16
    runner, batch = m.decode_inputs(tiny_model, batch_size, context, block_size, seed=3)
    got = runner.forward(batch)
    want_ref = m.reference_logits(tiny_model, m.reference_forward(tiny_model), runner, batch)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    hkv, d = TINY_CONFIG["num_key_value_heads"], TINY_CONFIG["head_dim"]
    for i in range(batch_size):
        table = batch.block_tables[i].long()
        pos = torch.arange(context)
        slots = table[pos // block_size] * block_size + pos % block_size
        cache = transformers.DynamicCache()
        for layer in range(TINY_CONFIG["num_hidden_layers"]):
            k = runner.k_pools[layer].view(-1, hkv, d)[slots].permute(1, 0, 2)[None]
            v = runner.v_pools[layer].view(-1, hkv, d)[slots].permute(1, 0, 2)[None]
            cache.update(k.clone(), v.clone(), layer)
        with torch.no_grad():
            out = hf(input_ids=batch.input_ids[i:i + 1][None], position_ids=torch.tensor([[context]]),
                     cache=cache, use_cache=True)
        want = out.logits[0, -1]
        assert float((got[i] - want).abs().max()) <= LOGIT_TOL
        assert float((want_ref[i] - want).abs().max()) <= LOGIT_TOL


def test_dtype_accuracy_of_a_model_against_itself_is_exact(tiny_model) -> None:
    # The comparison itself adds nothing: fp32 against fp32 agrees everywhere, and bf16 on the
    # same prompt is reported with the prompt's real length (the shipped tau-bench sample).
    import _step_accuracy

    same = _step_accuracy.dtype_accuracy(tiny_model, tiny_model, max_prompt_tokens=96, greedy_tokens=8)
    assert same["prompt_tokens"] == 96
    assert (same["top1_agreement"], same["max_abs_logit_diff"], same["mean_kl"]) == (1.0, 0.0, 0.0)
    assert same["greedy_same_tokens"] == 8
    bf16 = m.load_tiny_model(torch.bfloat16)
    other = _step_accuracy.dtype_accuracy(tiny_model, bf16, max_prompt_tokens=96, greedy_tokens=8)
    assert other["dtype"] == "bfloat16" and other["prompt_tokens"] == 96
    assert 0.0 < other["max_abs_logit_diff"] < 1.0

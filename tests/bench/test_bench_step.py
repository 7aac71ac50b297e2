"""``radixkv bench step`` on the tiny random Llama: result keys, finite ratios, the exact bytes a
decode step reads, the peak / engine-GEMM / torch-GEMM prefill floors recomputed from the
JSON, skipped / cut points, and the decode logits against a reference forward and against
Hugging Face's own forward over the same synthetic K/V."""

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
                 "--gemm-tokens", "32", "--peak-seconds", "0.05", "--max-pool-gib", "0.00005",
                 "--json", str(out))
    result = step.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    table = capsys.readouterr().out
    assert "skipped: pool" in table and "prefill 2048 tok (asked 3000)" in table
    assert {"model", "dtype", "block_size", "num_threads", "torch", "weight_bytes", "roofs",
            "points", "cpu", "native_isa", "gemm_backend", "provenance"} <= set(result)
    check_roofs(result)
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
            # the fastest forward is at most the median one, and has its own ratio
            assert 0 < p["best_ms"] <= p["ms"]
            assert p["best_ratio"] == pytest.approx(p["best_ms"] / p["floor_ms"])
            # cost model: 2·P per token + 4·L·Hq·D per causal pair, P = 74,048.
            t = p["tokens"]
            assert p["flops"] == 2 * 74_048 * t + 4 * 2 * 4 * 16 * t * (t + 1) // 2
            # the split: attention's FLOPs, its time and the rest's (one repeat: they add up)
            assert p["attention_flops"] == 4 * 2 * 4 * 16 * t * (t + 1) // 2
            assert p["attention_ms"] > 0 and p["linear_ms"] > 0
            assert p["attention_ms"] + p["linear_ms"] == pytest.approx(p["ms"])
            assert p["attention_gflops"] == pytest.approx(p["attention_flops"] / p["attention_ms"] / 1e6)
            assert p["linear_gflops"] == pytest.approx(2 * 74_048 * t / p["linear_ms"] / 1e6)
            assert p["attention_pct_of_peak"] == pytest.approx(100 * p["attention_gflops"] / p["floor_gflops"])
            assert p["linear_pct_of_peak"] == pytest.approx(100 * p["linear_gflops"] / p["floor_gflops"])
            check_prefill_floors(p, result)
            continue
        want_bytes = TINY_WEIGHT_BYTES + p["batch"] * p["context"] * TINY_KV_BYTES_PER_TOKEN
        assert p["bytes_per_step"] == want_bytes
        assert p["floor_ms"] == pytest.approx(want_bytes / result["roofs"]["copy"]["gbps"] / 1e6)
        assert p["num_blocks"] == p["batch"] * -(-(p["context"] + 1) // 16)
        assert p["logits_shape"] == [p["batch"], 49152] and p["logits_finite"]
        assert p["check_max_abs_diff"] <= LOGIT_TOL


def check_roofs(result: dict) -> None:
    """The peak and GEMM roofs exist, are positive, and their derived numbers are what the
    docstrings say (recomputed from the JSON's own numbers)."""
    from radixkv.kernels import native

    roofs, cpu = result["roofs"], result["cpu"]
    assert cpu["cpu"] and cpu["cores"] >= 1 and cpu == result["provenance"]["machine"]
    peak = roofs["fma_peak"]
    assert peak["threads"] == result["num_threads"] and peak["seconds"] == 0.05
    usable = native.cpu_isas()
    loaded = native.load()
    assert result["native_isa"] == peak["isa"] == (loaded.isa if loaded is not None else None)
    assert sorted(peak["by_isa"]) == sorted(usable)  # every build this CPU runs, measured
    assert all(m.finite_positive(v) for v in peak["by_isa"].values())
    if peak["isa"] is not None:
        assert peak["gflops"] == peak["by_isa"][peak["isa"]]
        assert peak["chains"] == {"avx512": 24, "avx2": 12}[peak["isa"]]
    # Two passes (before and after the points); each rate is the higher of the two.
    assert len(peak["passes"]) == 2
    for isa, value in peak["by_isa"].items():
        assert value == max(p["by_isa"][isa] for p in peak["passes"])
    has_bf16 = "avx512_bf16" in cpu["flags"]
    assert (peak["bf16_dot_gflops"] is not None) == (has_bf16 and peak["isa"] is not None)
    assert peak["amx_bf16"] == ("amx_bf16" in cpu["flags"])
    gemms = roofs["gemms"]
    assert gemms["tokens"] == 32 and gemms["square"]["n"] == 64 and gemms["dtype"] == "float32"
    # TINY_CONFIG: hidden 64, 4 q heads + 2 KV heads of 16, intermediate 128.
    assert [(g["name"], g["m"], g["k"], g["n"]) for g in gemms["shapes"]] == [
        ("qkv", 32, 64, 128), ("o", 32, 64, 64), ("gate_up", 32, 64, 256), ("down", 32, 128, 64)]
    engine_present = m._engine_gemm() is not None
    assert len(gemms["passes"]) == 2
    for key in ("engine_gflops", "torch_gflops") if engine_present else ("torch_gflops",):
        for i, shape in enumerate(gemms["shapes"]):
            assert shape[key] == max(p["shapes"][i][key] for p in gemms["passes"])
        assert gemms["square"][key] == max(p["square"][key] for p in gemms["passes"])
    assert (gemms["backend"] is not None) == engine_present
    assert result["gemm_backend"] == gemms["backend"]
    for key in ("engine_gflops", "torch_gflops"):
        if key == "engine_gflops" and not engine_present:
            assert gemms["model"][key] is None
            continue
        assert all(m.finite_positive(g[key]) for g in gemms["shapes"] + [gemms["square"]])
        flops = [2 * g["m"] * g["k"] * g["n"] for g in gemms["shapes"]]
        want = sum(flops) / sum(f / g[key] for f, g in zip(flops, gemms["shapes"]))
        assert gemms["model"][key] == pytest.approx(want)
        pct_key = key.replace("gflops", "pct_of_peak")
        if peak["gflops"]:
            assert gemms["model"][pct_key] == pytest.approx(100 * want / peak["gflops"])
            assert gemms["square"][pct_key] == pytest.approx(100 * gemms["square"][key] / peak["gflops"])


def check_prefill_floors(p: dict, result: dict) -> None:
    """A prefill row's three floors: FLOPs over the FMA peak (fp32), the engine GEMM's
    model-shape rate and torch's square GEMM, each recomputed from the JSON."""
    roofs = result["roofs"]
    peak = max(roofs["fma_peak"]["by_isa"].values(), default=None)  # the best build, not the one in use
    assert p["floor_is_bound"] is True and "floor_note" not in p  # fp32: the FMA peak bounds it
    if peak:
        assert p["floor_basis"] == "fma_peak" and p["floor_gflops"] == peak
    else:
        assert p["floor_basis"] == "torch_gemm" and p["floor_gflops"] == roofs["gemm"]["gflops"]
    assert p["floor_ms"] == pytest.approx(p["flops"] / p["floor_gflops"] / 1e6)
    assert p["floor_tokens_per_s"] == pytest.approx(p["tokens"] / p["floor_ms"] * 1e3)
    assert p["torch_gemm_floor_ms"] == pytest.approx(p["flops"] / roofs["gemm"]["gflops"] / 1e6)
    assert p["torch_gemm_ratio"] == pytest.approx(p["ms"] / p["torch_gemm_floor_ms"])
    engine = roofs["gemms"]["model"]["engine_gflops"]
    if engine:
        assert p["engine_gemm_floor_ms"] == pytest.approx(p["flops"] / engine / 1e6)
        assert p["engine_gemm_ratio"] == pytest.approx(p["ms"] / p["engine_gemm_floor_ms"])
    else:
        assert "engine_gemm_ratio" not in p


def test_no_native_measures_the_gemm_its_runner_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --no-native keeps the runner's fp32 projections off the C GEMM (one of the C kernels): the
    # engine-GEMM roof and the backend it names must then be oneDNN's (or F.linear's), not the C GEMM.
    from radixkv.kernels import gemm

    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "auto")  # restored after the test, as step sets it
    args = parse("--tiny", "--no-native", "--prefill-tokens", "40", "--decode-batch", "1",
                 "--decode-context", "5", "--repeats", "1", "--copy-mib", "8", "--gemm-n", "64",
                 "--gemm-tokens", "32", "--peak-seconds", "0.05", "--json", str(tmp_path / "s.json"))
    result = step.run(args)
    assert result["gemm_backend"] in ("onednn (packed weights)", "torch F.linear")
    assert not result["native_kernels"]


def test_report_headline_names_the_peak_floor_and_the_gemm_share() -> None:
    # Recomputed by hand: 2,048 tokens in 4,000 ms = 512 tok/s; floor 1,000 ms -> 4.00x;
    # engine floor 2,000 ms -> 2.00x; engine 150 of a 200 GFLOP/s peak = 75 %.
    row = {"kind": "prefill", "tokens": 2048, "requested_tokens": 2048, "ms": 4000.0,
           "tokens_per_s": 512.0, "floor_basis": "fma_peak", "ratio": 4.0, "engine_gemm_ratio": 2.0}
    other = {**row, "tokens": 512, "requested_tokens": 512, "tokens_per_s": 900.0, "ratio": 9.0}
    gemms = {"backend": "onednn", "model": {"engine_gflops": 150.0, "engine_pct_of_peak": 75.0,
                                            "torch_pct_of_peak": 60.0}}
    lines = step.headline({"points": [other, row], "roofs": {"gemms": gemms}})
    assert lines == ["prefill 2,048 tokens: 512 tok/s, 4.00× the FMA-peak floor, 2.00× the "
                     "engine-GEMM floor",
                     "engine GEMM (onednn): 75 % of FMA peak at the model's prefill shapes "
                     "(150.0 GFLOP/s; torch F.linear 60 %)"]
    # With the fastest forward's ratio (a best-of run, as the roofs are) beside the median's.
    best = {**row, "best_ms": 3300.0, "best_ratio": 3.3}
    assert step.headline({"points": [best], "roofs": {"gemms": gemms}, "repeats": 5})[0] == (
        "prefill 2,048 tokens: 512 tok/s, 4.00× the FMA-peak floor (fastest of 5: 3.30×), 2.00× "
        "the engine-GEMM floor")
    # With the forward split into attention and the rest (each part's FLOPs over its time).
    split = {**row, "attention_ms": 1234.4, "attention_gflops": 120.0, "attention_pct_of_peak": 60.0,
             "linear_ms": 2765.6, "linear_gflops": 170.0, "linear_pct_of_peak": 85.0}
    assert step.headline({"points": [split], "roofs": {"gemms": gemms}})[1] == (
        "  of which attention 1,234 ms (120.0 GFLOP/s, 60 % of the peak; K/V writes included), "
        "the rest 2,766 ms (linear FLOPs at 170.0 GFLOP/s, 85 %)")
    # Without a 2,048-token point the largest measured one is named.
    lines = step.headline({"points": [other], "roofs": {"gemms": gemms}})
    assert lines[0].startswith("prefill 512 tokens: 900 tok/s, 9.00× the FMA-peak floor")


def test_fp32_floor_takes_the_best_build_and_amx_marks_the_bf16_floor_no_bound() -> None:
    # Forced onto the AVX2 build (RADIXKV_NATIVE_ISA=avx2): its 110 GFLOP/s must not lower the
    # floor below the 220 the AVX-512 build reaches on the same CPU.
    peak = {"isa": "avx2", "gflops": 110.0, "by_isa": {"avx512": 220.0, "avx2": 110.0},
            "bf16_dot_gflops": 400.0, "amx_bf16": False}
    roofs = {"fma_peak": peak, "gemm": {"gflops": 100.0}, "gemms": {"model": {"engine_gflops": None}}}
    assert m.peak_floor_gflops(roofs, torch.float32) == (220.0, "fma_peak")
    assert m.peak_floor_gflops(roofs, torch.bfloat16) == (400.0, "bf16_dot_peak")
    row = {"kind": "prefill", "tokens": 2048, "ms": 4000.0, "tokens_per_s": 512.0, "flops": 4.4e11}
    fp32 = m.apply_prefill_floors(dict(row), roofs, torch.float32)
    assert fp32["floor_gflops"] == 220.0 and fp32["floor_ms"] == pytest.approx(2000.0)
    assert fp32["ratio"] == pytest.approx(2.0) and fp32["floor_is_bound"] is True
    assert "best_ratio" not in fp32  # a row without best_ms (older results) gets none
    assert m.apply_prefill_floors({**row, "best_ms": 3000.0}, roofs, torch.float32)["best_ratio"] == \
        pytest.approx(1.5)
    bf16 = m.apply_prefill_floors(dict(row), roofs, torch.bfloat16)
    assert bf16["floor_basis"] == "bf16_dot_peak" and bf16["floor_is_bound"] is True
    # With AMX-BF16 the tiles outrun VDPBF16PS: the bf16 floor is then no bound, and says so.
    amx = {**roofs, "fma_peak": {**peak, "amx_bf16": True}}
    bf16 = m.apply_prefill_floors(dict(row), amx, torch.bfloat16)
    assert bf16["floor_is_bound"] is False and bf16["floor_note"] == m.AMX_NOT_A_BOUND
    assert m.apply_prefill_floors(dict(row), amx, torch.float32)["floor_is_bound"] is True
    bf16.update(ratio=4.0, floor_basis="bf16_dot_peak")
    gemms = {"backend": "onednn", "model": {"engine_gflops": None, "torch_pct_of_peak": 50.0}}
    line = step.headline({"points": [bf16], "roofs": {"gemms": gemms}})[0]
    assert line == ("prefill 2,048 tokens: 512 tok/s, 4.00× the bf16-dot-peak floor "
                    f"({m.AMX_NOT_A_BOUND})")


def test_engine_gemm_backend_names_the_bf16_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.kernels import gemm

    monkeypatch.setattr(gemm, "onednn_bf16_supported", lambda: False)
    monkeypatch.setenv(gemm.NATIVE_GEMM_ENV, "0")  # fp32 on oneDNN, not the C GEMM
    name = m.gemm_backend_name(gemm, torch.bfloat16)
    if gemm.onednn_available():
        assert name == f"torch F.linear ({gemm.BF16_UNSUPPORTED})"
        assert m.gemm_backend_name(gemm, torch.float32) == "onednn (packed weights)"
    else:
        assert name == "torch F.linear"
    assert gemm.gflops(8, 16, 24, torch.bfloat16, repeats=1) > 0  # measured on F.linear, no crash


@pytest.mark.parametrize("flag, value", [("--peak-seconds", "0"), ("--peak-seconds", "nan"),
                                         ("--gemm-tokens", "0"), ("--gemm-n", "-3")])
def test_bad_roof_flags_exit_2_naming_the_flag(flag: str, value: str,
                                               capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(flag, value)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


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


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_decode_check_on_window_and_hybrid_families(family: str) -> None:
    """The bench's reference forward is the model's own class with each layer's window, scale
    and soft cap: on tiny Gemma 2 / Gemma 3 (window 8) the runner's decode logits over 5 and 40
    tokens of synthetic K/V (inside and far past the window) agree with it within 1e-4."""
    from tests.engine.test_engine_window import small_tokenizer, window_model

    model = window_model(family, small_tokenizer())
    # The floor counts the K/V each layer reads: 40 cached tokens on a full layer, the 7 keys
    # left of the query on a window-8 layer; 2 KV heads x 32 dims x 4 B x K and V = 512 B.
    windows = {"gemma2": (2, 2), "gemma3": (5, 1)}[family]  # (window layers, full layers)
    assert m.kv_bytes(model, 40) == (windows[0] * 7 + windows[1] * 40) * 512
    assert m.kv_bytes(model, 5) == sum(windows) * 5 * 512  # inside the window: every layer reads all 5
    forward = m.reference_forward(model)
    assert type(forward).__name__ == "FamilyForward"
    for context in (5, 40):
        runner, batch = m.decode_inputs(model, 2, context, 4, seed=5)
        got = runner.forward(batch)
        want = m.reference_logits(model, forward, runner, batch)
        assert got.shape == want.shape == (2, 300)
        assert float((got - want).abs().max()) <= LOGIT_TOL

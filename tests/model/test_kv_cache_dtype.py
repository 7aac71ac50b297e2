"""``--kv-cache-dtype``: exact KV bytes per token and blocks per GiB (SmolLM2's shape and the tiny
model's), the runner's pools and scale pools and their segments, copy-on-write of scales, an
int8 engine whose prefix hits (at block boundaries and one token past) return the cold run's
greedy tokens and logits, int8 / fp8 logits against fp32-KV logits, the format in the cache
identity, ``/stats`` and ``/v1/models``, and bad values refused by name (config, runner, CLI
exit 2 before the model loads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from radixkv import cli
from radixkv.config import GIB, KV_CACHE_DTYPES, CacheConfig, EngineConfig
from radixkv.engine.llm_engine import LLMEngine, _num_blocks_for
from radixkv.engine.sampling import SamplingParams
from radixkv.kernels import kv_quant
from radixkv.model.config import ModelShape
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner
from tests.factories import engine_config
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import get

SMOLLM2 = ModelShape(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_q_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)
# Tiny model (tests/conftest.py): 2 layers, 2 KV heads, D = 16.
TINY_FP32_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4       # 512
TINY_INT8_BYTES_PER_TOKEN = 2 * 2 * 2 * (16 + 4)     # 160: values + one fp32 scale per head
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(97 * i) % 7000 + 11 for i in range(24)]
# int8 / fp8 K/V against fp32 K/V on the tiny model (random weights, logits std 0.8, |max|
# 3.9), teacher-forced over the greedy tokens both agree on, measured on the three prompts
# below: max |Δlogit| 0.023-0.041 (int8) and 0.085-0.21 (fp8_e4m3), mean |Δlogit| 0.0038-0.0053
# and 0.014-0.030, KL(fp32 || quantized) per position at most 4.4e-5 and 1.1e-3 nats. The
# bounds are about twice the worst measured value.
LOGIT_TOLS = {"int8": (0.08, 0.01, 1e-4), "fp8_e4m3": (0.4, 0.06, 2.5e-3)}  # max, mean, KL
# A prefix hit against a cold run, same int8 settings. With the C extend kernel (it reads every
# key from the pool in place, cold or warm) a suffix of >= 2 tokens gives torch.equal logits.
# A one-token suffix is computed by the one-row (decode) step where the cold run's last prompt
# token was a row of its prefill: its fp32 K/V, and so its per-token scale, differ by ulps,
# and every logits row differs by fp32 rounding (measured <= 1.5e-6, as with fp32 K/V). Without
# the C kernels the torch path attends a cold prefill with SDPA's causal kernel and a hit with
# a masked one: the same tolerance.
HIT_LOGIT_TOL = 1e-5


def test_kv_cache_dtypes_agree_with_kv_quant() -> None:
    assert KV_CACHE_DTYPES == kv_quant.KV_CACHE_DTYPES


@pytest.mark.parametrize("kv, per_token, per_block", [("auto", 46_080, 737_280),
                                                      ("float32", 46_080, 737_280),
                                                      ("int8", 12_240, 195_840),
                                                      ("fp8_e4m3", 12_240, 195_840)])
def test_smollm2_bytes_per_token_and_block(kv: str, per_token: int, per_block: int) -> None:
    fmt = kv_quant.resolve_kv_format(kv, torch.float32)
    assert fmt.bytes_per_token(SMOLLM2.num_layers, SMOLLM2.num_kv_heads, SMOLLM2.head_dim) == per_token
    assert ModelRunner.bytes_per_block_for(SMOLLM2, 16, torch.float32, kv) == per_block


def test_smollm2_blocks_per_gib() -> None:
    """The pool size from --kv-cache-memory 1 GiB: int8 gets 3.76x fp32's blocks."""
    blocks = {}
    for kv in ("float32", "int8", "fp8_e4m3"):
        config = EngineConfig(cache=CacheConfig(block_size=16, kv_cache_memory_bytes=GIB), kv_cache_dtype=kv)
        blocks[kv] = _num_blocks_for(config, ModelRunner.bytes_per_block_for(SMOLLM2, 16, torch.float32, kv))
    assert blocks == {"float32": GIB // 737_280, "int8": GIB // 195_840, "fp8_e4m3": GIB // 195_840}
    assert (blocks["float32"], blocks["int8"]) == (1456, 5482)
    assert blocks["int8"] / blocks["float32"] >= 3.5
    assert 12_240 / 46_080 <= 0.27


def test_bf16_model_int8_bytes() -> None:
    assert ModelRunner.bytes_per_block_for(SMOLLM2, 16, torch.bfloat16) == 16 * 23_040
    assert ModelRunner.bytes_per_block_for(SMOLLM2, 16, torch.bfloat16, "int8") == 195_840


@pytest.mark.parametrize("kv, pool_dtype", [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)])
def test_runner_pools_scales_and_segments(tiny_model: LoadedModel, kv: str, pool_dtype: torch.dtype) -> None:
    runner = ModelRunner(tiny_model, num_blocks=5, block_size=4, kv_cache_dtype=kv)
    assert runner.kv_format.name == kv and runner.kv_cache_dtype == kv
    assert runner.kv_format.tag == f"{kv}-tokhead-f32-v1"
    assert runner.kv_bytes_per_token == TINY_INT8_BYTES_PER_TOKEN
    assert runner.bytes_per_block == 4 * TINY_INT8_BYTES_PER_TOKEN == 640
    assert runner.k_scales is not None and runner.v_scales is not None
    for pool in (*runner.k_pools, *runner.v_pools):
        assert pool.dtype == pool_dtype and pool.shape == (5, 4, 2, 16) and pool.is_contiguous()
    for scales in (*runner.k_scales, *runner.v_scales):
        assert scales.dtype == torch.float32 and scales.shape == (5, 4, 2) and scales.is_contiguous()
    segments = runner.kv_segments()
    order = [runner.k_pools[0], runner.v_pools[0], runner.k_pools[1], runner.v_pools[1],
             runner.k_scales[0], runner.v_scales[0], runner.k_scales[1], runner.v_scales[1]]
    assert segments == [(t.data_ptr(), size) for t, size in zip(order, [128] * 4 + [32] * 4)]
    assert sum(size for _, size in segments) == runner.bytes_per_block
    with pytest.raises(ValueError, match="^kv_store: the .* KV pool keeps scale pools"):
        runner.kv_segment_bases()


def test_runner_unquantized_is_unchanged(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, num_blocks=3, block_size=4)
    assert (runner.kv_cache_dtype, runner.kv_format.tag, runner.k_scales, runner.v_scales) == (
        "float32", "float32", None, None)
    assert runner.bytes_per_block == 4 * TINY_FP32_BYTES_PER_TOKEN
    assert runner.kv_segments() == [(p.data_ptr(), 512) for pair in zip(runner.k_pools, runner.v_pools)
                                    for p in pair]
    assert runner.kv_segment_bases() == [base for base, _ in runner.kv_segments()]


def test_runner_refuses_bad_kv_cache_dtype(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of auto, float32, bfloat16, int8, "
                                         "fp8_e4m3, got 'int4'"):
        ModelRunner(tiny_model, num_blocks=2, block_size=4, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="^kv_cache_dtype: bfloat16 with a float32 model"):
        ModelRunner(tiny_model, num_blocks=2, block_size=4, kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="^kv_cache_dtype: bfloat16 with a float32 model"):
        EngineConfig(kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_copy_blocks_copies_values_and_scales(tiny_model: LoadedModel, kv: str) -> None:
    runner = ModelRunner(tiny_model, num_blocks=4, block_size=4, kv_cache_dtype=kv)
    batch = runner.build_batch([(list(range(30, 36)), 0, [1, 2])])
    runner.forward(batch)
    runner.copy_blocks([(2, 3)])
    assert runner.k_scales is not None and runner.v_scales is not None
    for pools in (runner.k_pools, runner.v_pools, runner.k_scales, runner.v_scales):
        for pool in pools:
            data = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
            assert torch.equal(data[3], data[2]) and bool(data[2].count_nonzero())
            assert not bool(data[0].count_nonzero())


# ----------------------------------------------------------------------------- engines


def make(tiny_model: LoadedModel, kv: str = "int8", **config: object) -> LLMEngine:
    cfg = dataclasses.replace(engine_config(**config), kv_cache_dtype=kv)  # type: ignore[arg-type]
    return LLMEngine(cfg, tiny_model)


def run_recording(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], torch.Tensor, int]:
    """Greedy tokens, the logits row each token was sampled from (``[steps, vocab]``), and the
    cached prompt tokens, of one request run alone."""
    rows: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording(batch, **kwargs):
        logits = forward(batch, **kwargs)
        rows.append(logits[-1].clone())
        return logits

    engine.runner.forward = recording  # type: ignore[method-assign]
    try:
        (req,) = engine.generate([prompt], GREEDY)
    finally:
        del engine.runner.forward
    engine.cache.check_integrity()
    return list(req.output_token_ids), torch.stack(rows), req.num_cached_tokens


@pytest.mark.parametrize("length, cached", [(8, 4), (9, 8), (12, 8), (13, 12), (17, 16), (24, 20)])
def test_int8_prefix_hit_returns_the_cold_run(tiny_model: LoadedModel, length: int, cached: int) -> None:
    """Prompts ending at and one token past block boundaries (B = 4), after the whole 24-token
    prompt was cached: the hit run's greedy tokens equal the cold run's, logits equal (but a
    one-token suffix's first row, within HIT_LOGIT_TOL), and the hit really read ``cached``
    tokens of int8 K/V."""
    prompt = PROMPT[:length]
    cold_tokens, cold_logits, cold_cached = run_recording(make(tiny_model, prefix_cache=False), prompt)
    engine = make(tiny_model)
    run_recording(engine, PROMPT)
    tokens, logits, num_cached = run_recording(engine, prompt)
    assert (cold_cached, num_cached) == (0, cached)
    assert tokens == cold_tokens and len(tokens) == GREEDY.max_tokens
    assert logits.shape == cold_logits.shape == (GREEDY.max_tokens, 49152)
    assert (logits - cold_logits).abs().max().item() <= HIT_LOGIT_TOL
    if engine.runner._native_extend is not None and length - cached >= 2:
        assert torch.equal(logits, cold_logits)  # deterministic: the pool read in place


def test_int8_one_token_suffix_after_a_hit_is_bit_exact(tiny_model: LoadedModel) -> None:
    """The deterministic case: request 2's prompt is request 1's 8-token prompt plus request 1's
    first generated token, so its one-token suffix after the 8-token int8 hit is computed by the
    same one-row step over the same cached blocks as request 1's first decode step: every
    logits row of request 2 equals request 1's next one exactly (torch.equal)."""
    prompt = PROMPT[:8]
    engine = make(tiny_model)
    first_tokens, first_logits, _ = run_recording(engine, prompt)
    again_tokens, again_logits, cached = run_recording(engine, prompt + [first_tokens[0]])
    assert cached == 8
    steps = GREEDY.max_tokens - 1
    assert again_tokens[:steps] == first_tokens[1:]
    assert torch.equal(again_logits[:steps], first_logits[1:])


def test_quantized_logits_close_to_fp32_kv(tiny_model: LoadedModel) -> None:
    mean_diffs: dict[str, list[float]] = {"int8": [], "fp8_e4m3": []}
    for prompt in (PROMPT, PROMPT[5:18], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]):
        want_tokens, want, _ = run_recording(make(tiny_model, "auto"), prompt)
        for kv, (max_tol, mean_tol, kl_tol) in LOGIT_TOLS.items():
            tokens, got, _ = run_recording(make(tiny_model, kv), prompt)
            # Teacher-forced only while the greedy tokens agree (a differing token changes the input).
            same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
            assert same >= 1, kv
            diff = (got[:same + 1] - want[:same + 1]).abs()
            log_p = torch.log_softmax(want[:same + 1], -1)
            kl = (log_p.exp() * (log_p - torch.log_softmax(got[:same + 1], -1))).sum(-1)
            assert 0 < diff.max().item() <= max_tol, (kv, diff.max().item())  # > 0: really quantized
            assert diff.mean().item() <= mean_tol, (kv, diff.mean().item())
            assert kl.max().item() <= kl_tol, (kv, kl.max().item())
            mean_diffs[kv].append(diff.mean().item())
    assert all(a < b for a, b in zip(mean_diffs["int8"], mean_diffs["fp8_e4m3"]))


def test_bf16_model_int8_kv(tiny_model_dir) -> None:
    """A bf16 model over int8 K/V (dequantized to bf16): the pool is int8, a prefix hit one
    token past a block boundary gives the cold run's tokens with logits within bf16 rounding
    of a 1-row vs a 13-row step (measured max |Δlogit| 0.031-0.044 at 9, 13 and 17 tokens),
    and int8 K/V stays within 0.047-0.070 of bf16 K/V (bounds: about twice that)."""
    from radixkv.model.loader import load_model

    model = load_model(str(tiny_model_dir), dtype=torch.bfloat16)

    def bf16(kv: str, **config: object) -> LLMEngine:
        cfg = dataclasses.replace(engine_config(**config), dtype="bfloat16",  # type: ignore[arg-type]
                                  kv_cache_dtype=kv)
        return LLMEngine(cfg, model)

    cold_tokens, cold, _ = run_recording(bf16("int8", prefix_cache=False), PROMPT[:13])
    engine = bf16("int8")
    assert engine.runner.k_pools[0].dtype == torch.int8 and engine.stats_snapshot()["kv_cache_dtype"] == "int8"
    run_recording(engine, PROMPT)
    tokens, hit, cached = run_recording(engine, PROMPT[:13])
    assert cached == 12 and tokens == cold_tokens
    assert (hit - cold).abs().max().item() <= 0.09
    want_tokens, want, _ = run_recording(bf16("auto"), PROMPT[:13])
    same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
    assert same >= 1
    assert 0 < (cold[:same + 1] - want[:same + 1]).abs().max().item() <= 0.15


def test_format_in_identity_stats_and_pool_size(tiny_model: LoadedModel) -> None:
    fp32, int8 = make(tiny_model, "auto"), make(tiny_model, "int8")
    assert (fp32._kv_dtype, int8._kv_dtype) == ("float32", "int8-tokhead-f32-v1")
    assert fp32.cache_root(None) != int8.cache_root(None)
    stats = int8.stats_snapshot()
    assert (stats["kv_cache_dtype"], stats["kv_bytes_per_token"]) == ("int8", TINY_INT8_BYTES_PER_TOKEN)
    assert stats["pool"]["bytes_per_block"] == 4 * TINY_INT8_BYTES_PER_TOKEN
    stats = fp32.stats_snapshot()
    assert (stats["kv_cache_dtype"], stats["kv_bytes_per_token"]) == ("float32", TINY_FP32_BYTES_PER_TOKEN)
    sized = {}
    for kv in ("auto", "int8"):
        cfg = dataclasses.replace(engine_config(), kv_cache_dtype=kv,
                                  cache=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20))
        sized[kv] = LLMEngine(cfg, tiny_model).num_blocks
    assert sized == {"auto": (1 << 20) // 2048, "int8": (1 << 20) // 640} == {"auto": 512, "int8": 1638}


# ----------------------------------------------------------------------------- server and CLI


@pytest.fixture(scope="module")
def int8_server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    from radixkv.engine.async_engine import AsyncEngine

    cfg = dataclasses.replace(engine_config(block_size=4, num_blocks=64), kv_cache_dtype="int8")
    yield from run_server_in_thread(AsyncEngine(cfg, tiny_model, check_integrity_when_idle=True))


async def test_stats_and_models_report_the_allocated_kv_dtype(int8_server: RunningServer) -> None:
    status, models = await get(int8_server.url, "/v1/models")
    assert status == 200
    assert [(m["kv_cache_dtype"], m["kv_bytes_per_token"]) for m in models["data"]] == [
        ("int8", TINY_INT8_BYTES_PER_TOKEN)]
    status, stats = await get(int8_server.url, "/stats")
    assert status == 200
    assert (stats["kv_cache_dtype"], stats["kv_bytes_per_token"]) == ("int8", TINY_INT8_BYTES_PER_TOKEN)
    assert stats["pool"]["bytes_per_block"] == 640


@pytest.mark.parametrize("argv, fragment", [
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4' (choose from "
                                   "'auto', 'float32', 'bfloat16', 'int8', 'fp8_e4m3')"),
    (["--kv-cache-dtype", "bfloat16"], "radixkv serve: --kv-cache-dtype bfloat16: bfloat16 with a float32 "
                                       "model is not supported"),
    (["--dtype", "bfloat16", "--kv-cache-dtype", "float32"],
     "radixkv serve: --kv-cache-dtype float32: float32 with a bfloat16 model is not supported"),
])
def test_cli_bad_kv_cache_dtype_exits_2_before_the_model_loads(
        argv: list[str], fragment: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_load(*args, **kwargs):  # the model must not be loaded for a bad flag
        raise AssertionError("model loaded")

    monkeypatch.setattr("radixkv.engine.llm_engine.load_model", no_load)
    code: object
    try:
        code = cli.main(["serve", "--port", "0", "--device", "cpu", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err
    if "choose from" not in fragment:
        assert "(choices: auto, float32, bfloat16, int8, fp8_e4m3)" in err


def test_cli_kv_cache_dtype_reaches_the_engine_config() -> None:
    args = cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"])
    assert cli.kv_cache_dtype_flag_problem(args) is None
    assert cli.engine_config_from_args(args).kv_cache_dtype == "fp8_e4m3"
    args = cli.build_parser().parse_args(["serve", "--device", "cpu"])
    assert cli.engine_config_from_args(args).kv_cache_dtype == "auto"


def test_bench_step_bad_kv_cache_dtype_exits_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "step", "--tiny", "--kv-cache-dtype", "float32,int4"])
    assert exc.value.code == 2
    assert "--kv-cache-dtype: expected a comma list of auto, float32" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "step", "--tiny", "--dtype", "float32", "--kv-cache-dtype", "bfloat16"])
    assert exc.value.code == 2
    assert "--kv-cache-dtype: bfloat16 with a float32 model" in capsys.readouterr().err


def test_bench_step_measures_each_kv_dtype_side_by_side(capsys: pytest.CaptureFixture) -> None:
    """``bench step --kv-cache-dtype float32,int8`` on the tiny model: every point twice, the
    int8 rows' pools and bytes per step in int8's size, their logits checked against the
    reference over the same int8 pools, and one ratio per point."""
    import argparse

    step = cli.load_bench("step")
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    args = parser.parse_args(["--tiny", "--prefill-tokens", "8", "--decode-batch", "2", "--decode-context",
                              "5", "--repeats", "1", "--copy-mib", "8", "--gemm-n", "64", "--gemm-tokens",
                              "32", "--peak-seconds", "0.05", "--kv-cache-dtype", "float32",
                              "--kv-cache-dtype", "int8,auto"])
    result = step.run(args)
    assert result["kv_cache_dtypes"] == ["float32", "int8"]
    points = [(p["kind"], p["kv_cache_dtype"], p["pool_bytes"]) for p in result["points"]]
    # prefill 8 tokens: 1 block of 16; decode b=2 ctx=5: 2 blocks.
    assert points == [("prefill", "float32", 16 * TINY_FP32_BYTES_PER_TOKEN),
                      ("prefill", "int8", 16 * TINY_INT8_BYTES_PER_TOKEN),
                      ("decode", "float32", 32 * TINY_FP32_BYTES_PER_TOKEN),
                      ("decode", "int8", 32 * TINY_INT8_BYTES_PER_TOKEN)]
    fp32_decode, int8_decode = result["points"][2:]
    assert int8_decode["bytes_per_step"] - int8_decode["weight_bytes"] == 2 * 5 * TINY_INT8_BYTES_PER_TOKEN
    assert fp32_decode["bytes_per_step"] - fp32_decode["weight_bytes"] == 2 * 5 * TINY_FP32_BYTES_PER_TOKEN
    assert int8_decode["check_max_abs_diff"] <= 1e-4 and int8_decode["logits_finite"]
    ratios = [(r["kind"], r["kv_cache_dtype"], r["base_kv_cache_dtype"]) for r in result["kv_ratios"]]
    assert ratios == [("prefill", "int8", "float32"), ("decode", "int8", "float32")]
    for r, p in zip(result["kv_ratios"], (result["points"][1], int8_decode)):
        assert r["ratio"] == pytest.approx(p["ms"] / r["base_ms"]) and r["ratio"] > 0
    out = capsys.readouterr().out
    assert "KV dtype ratios (time ÷ float32 KV time" in out and "decode b=2 ctx=5 kv=int8" in out

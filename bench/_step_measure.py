"""Roofs, byte / FLOP models and timed points of ``bench/step.py`` (see its docstring).

Loaded by path like its caller (``bench/`` is on ``sys.path``); imports torch and radixkv.
"""

# No ``from __future__ import annotations``: the CLI loads bench/step.py (and so this) by path.
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from radixkv.eviction.cost_model import cost_shape_from_model_shape, prefill_flops
from radixkv.kernels import reference
from radixkv.model.llama import LlamaForward
from radixkv.model.loader import LoadedModel, embedded_tokenizer_dir, load_model
from radixkv.model.runner import ModelRunner

GIB = 1 << 30

#: The tiny random Llama of ``--tiny``: tests/conftest.py's ``TINY_CONFIG`` (kept equal there
#: by tests/bench/test_bench_step.py), SmolLM2's vocabulary so the tokenizer loads.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "initializer_range": 0.1, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2,
}
TINY_SEED = 1234


# Extra ModelRunner arguments of every point (``--compile``: {"compile": True}).
RUNNER_OPTIONS: dict = {}


def load_tiny_model(dtype: torch.dtype) -> LoadedModel:
    """Random-init :data:`TINY_CONFIG` Llama (seed :data:`TINY_SEED`), loaded through the HF loader."""
    import transformers  # deferred: heavy import, only for --tiny

    tmp = Path(tempfile.mkdtemp(prefix="radixkv-bench-step-tiny-"))
    try:
        torch.manual_seed(TINY_SEED)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIG))
        model.to(torch.float32).eval().save_pretrained(str(tmp))
        shutil.copytree(embedded_tokenizer_dir(), tmp, dirs_exist_ok=True)
        return load_model(str(tmp), dtype=dtype)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- models of work


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(model: LoadedModel) -> int:
    """Weight bytes one forward step reads: ``(P + vocab · hidden) · itemsize``.

    ``P`` is ``ModelShape.num_non_embedding_params()`` (every projection, norm and bias, once);
    ``vocab · hidden`` is the LM head, read whole for the logits (it is the embedding matrix
    when tied). The embedding lookup (N rows) and the RoPE tables are not counted.
    """
    shape = model.shape
    return (shape.num_non_embedding_params() + shape.vocab_size * shape.hidden_size) * itemsize(model.dtype)


def kv_bytes(model: LoadedModel, context: int) -> int:
    """K + V bytes of one sequence's ``context`` cached tokens: ``2 · L · ctx · Hkv · D · itemsize``."""
    s = model.shape
    return 2 * s.num_layers * context * s.num_kv_heads * s.head_dim * itemsize(model.dtype)


def median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _copy_ms(numel: int, repeats: int) -> float:
    src = torch.rand(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), 1, repeats)  # buffers freed on return


def measure_roofs(dtype: torch.dtype, copy_bytes: int, gemm_n: int, repeats: int) -> dict:
    """Copy bandwidth and GEMM throughput of this machine, now.

    Copy: ``dst.copy_(src)`` of two contiguous ``copy_bytes`` buffers; ``gbps`` counts bytes
    read + bytes written (``2 · copy_bytes / t``), as ``bench kernels`` does. GEMM:
    ``torch.matmul`` of two ``gemm_n``² matrices of ``dtype``, ``2 · n³ / t`` FLOP/s.
    """
    numel = copy_bytes // 4
    copy_ms = _copy_ms(numel, max(repeats, 3))
    a = torch.rand(gemm_n, gemm_n, dtype=dtype)
    b = torch.rand(gemm_n, gemm_n, dtype=dtype)
    gemm_ms = median_ms(lambda: torch.matmul(a, b), 1, max(repeats, 3))
    return {
        "copy": {"bytes": numel * 4, "ms": copy_ms, "gbps": 2 * numel * 4 / copy_ms / 1e6,
                 "counts": "read + write"},
        "gemm": {"n": gemm_n, "dtype": str(dtype)[6:], "ms": gemm_ms,
                 "gflops": 2 * gemm_n ** 3 / gemm_ms / 1e6},
    }


# ----------------------------------------------------------------------------- points


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _skip(row: dict, pool_bytes: int, max_pool_bytes: int) -> bool:
    if pool_bytes > max_pool_bytes:
        row["skipped"] = (f"pool {pool_bytes / GIB:.2f} GiB > --max-pool-gib "
                          f"{max_pool_bytes / GIB:g}")
        return True
    return False


def prefill_point(model: LoadedModel, tokens: int, block_size: int, roofs: dict, repeats: int,
                  max_pool_bytes: int, seed: int) -> dict:
    """One sequence of ``tokens`` new tokens, no prefix: tokens/s against the GEMM floor.

    Floor: ``radixkv.eviction.cost_model.prefill_flops(shape, 0, tokens)`` (linear ``2 · P`` per
    token + attention ``4 · L · Hq · D`` per causal pair; no LM head) over the GEMM FLOP/s.
    """
    shape = model.shape
    requested = tokens
    tokens = min(tokens, shape.max_position_embeddings)
    num_blocks = _blocks(tokens, block_size)
    pool_bytes = num_blocks * ModelRunner.bytes_per_block_for(shape, block_size, model.dtype)
    row: dict = {"kind": "prefill", "tokens": tokens, "requested_tokens": requested,
                 "num_blocks": num_blocks, "pool_bytes": pool_bytes}
    if _skip(row, pool_bytes, max_pool_bytes):
        return row
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device="cpu", **RUNNER_OPTIONS)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (tokens,), generator=gen).tolist()
    batch = runner.build_batch([(ids, 0, list(range(num_blocks)))])
    ms = median_ms(lambda: runner.forward(batch), 1, repeats)
    flops = prefill_flops(cost_shape_from_model_shape(shape), 0, tokens)
    floor_ms = flops / roofs["gemm"]["gflops"] / 1e6
    row.update(ms=ms, tokens_per_s=tokens / ms * 1e3, flops=flops, floor_ms=floor_ms,
               floor_tokens_per_s=tokens / floor_ms * 1e3, ratio=ms / floor_ms)
    return row


def reference_forward(model: LoadedModel) -> LlamaForward:
    """A separate ``LlamaForward`` of ``model`` on the CPU, for :func:`reference_logits`."""
    return LlamaForward(model.shape, model.state_dict, device="cpu", dtype=model.dtype)


def reference_logits(model: LoadedModel, forward: LlamaForward, runner: ModelRunner,
                     batch) -> torch.Tensor:
    """Last-row logits of ``batch`` from ``forward`` with ``radixkv.kernels.reference``
    attention over ``runner``'s pools (it rewrites the batch's own slots, nothing else)."""
    max_q_len = int((batch.qo_indptr[1:] - batch.qo_indptr[:-1]).max())

    def attention(layer, q, k, v):
        k_pool, v_pool = runner.k_pools[layer], runner.v_pools[layer]
        reference.paged_kv_write(k, v, k_pool, v_pool, batch.slot_mapping)
        return reference.extend_attention(q, k, v, k_pool, v_pool, batch.block_tables, batch.prefix_lens,
                                          batch.qo_indptr, max_q_len=max_q_len,
                                          window_left=model.shape.window_left)

    with torch.inference_mode():
        return forward.forward(batch.input_ids, batch.positions, attention,
                               batch.qo_indptr[1:].to(torch.int64) - 1)


def decode_inputs(model: LoadedModel, batch_size: int, context: int, block_size: int,
                  seed: int) -> tuple[ModelRunner, Any]:
    """A runner of ``batch · ceil((ctx + 1) / B)`` blocks whose pools hold ``randn`` K/V, and the
    decode batch: sequence i owns blocks ``[i · n, (i + 1) · n)`` and takes one random token at
    position ``context`` (which must be below the model's context length)."""
    per_seq = _blocks(context + 1, block_size)
    runner = ModelRunner(model, num_blocks=batch_size * per_seq, block_size=block_size, device="cpu",
                         **RUNNER_OPTIONS)
    gen = torch.Generator().manual_seed(seed)
    for pool in (*runner.k_pools, *runner.v_pools):
        pool.normal_(generator=gen)  # synthetic cached K/V; the unused tail slots too
    ids = torch.randint(0, model.shape.vocab_size, (batch_size,), generator=gen).tolist()
    batch = runner.build_batch([([ids[i]], context, list(range(i * per_seq, (i + 1) * per_seq)))
                                for i in range(batch_size)])
    return runner, batch


def decode_point(model: LoadedModel, batch_size: int, context: int, block_size: int, roofs: dict,
                 repeats: int, max_pool_bytes: int, seed: int,
                 check: LlamaForward | None) -> dict:
    """``batch_size`` sequences with ``context`` cached tokens each take one token at position
    ``context``: step ms (= ms per token of each sequence) against the copy floor.

    The pool is ``batch · ceil((ctx + 1) / B)`` blocks, each sequence its own; the cached K/V
    is synthetic (``randn``, no prefill). Floor: ``weight_bytes + batch · kv_bytes(ctx)`` over
    the copy bandwidth (read + write). ``check`` (a :func:`reference_forward`, or None to
    skip): the last timed step's logits against :func:`reference_logits`
    (``check_max_abs_diff``).
    """
    shape = model.shape
    requested = context
    context = min(context, shape.max_position_embeddings - 1)  # the new token needs a position
    per_seq = _blocks(context + 1, block_size)
    num_blocks = batch_size * per_seq
    pool_bytes = num_blocks * ModelRunner.bytes_per_block_for(shape, block_size, model.dtype)
    weights, kv = weight_bytes(model), kv_bytes(model, context)
    row: dict = {"kind": "decode", "batch": batch_size, "context": context,
                 "requested_context": requested, "num_blocks": num_blocks, "pool_bytes": pool_bytes,
                 "weight_bytes": weights, "kv_bytes_per_seq": kv,
                 "bytes_per_step": weights + batch_size * kv}
    if _skip(row, pool_bytes, max_pool_bytes):
        return row
    runner, batch = decode_inputs(model, batch_size, context, block_size, seed)
    last: dict = {}

    def step() -> None:
        last["logits"] = runner.forward(batch)

    ms = median_ms(step, 2, repeats)
    floor_ms = row["bytes_per_step"] / roofs["copy"]["gbps"] / 1e6
    row.update(ms=ms, tokens_per_s=batch_size / ms * 1e3, floor_ms=floor_ms, ratio=ms / floor_ms)
    if check is not None:
        want = reference_logits(model, check, runner, batch)
        got = last["logits"].float()
        row["check_max_abs_diff"] = float((got - want.float()).abs().max())
        row["logits_shape"] = list(got.shape)
        row["logits_finite"] = bool(torch.isfinite(got).all())
    return row


def finite_positive(value: Any) -> bool:
    """True for a finite float > 0 (a ratio the report may print)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0

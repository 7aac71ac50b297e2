"""``radixkv verify``'s cache paths (a)-(e): each runs one prompt teacher-forced on the same
tokens and returns its logits and the K/V its cache holds (:class:`Trace`).

(a) ``recompute``: no cache, a full forward per step; (b) ``contiguous``: one ``[S, Hkv, D]``
tensor per layer; (c) ``paged``: a ``ModelRunner``'s pool; (d) ``prefix-hit`` /
``prefix-hit+1``: that pool entered through a prefix hit; (e) the pool of a quantized runner.
Torch is imported when a variant runs, not with this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixkv.model.llama import LlamaForward
    from radixkv.model.runner import ModelRunner

RECOMPUTE, CONTIGUOUS, PAGED = "recompute", "contiguous", "paged"
HIT, HIT_PAST = "prefix-hit", "prefix-hit+1"

StepHook = Callable[[str, int, "Sequence[torch.Tensor]", "Sequence[torch.Tensor]"], None]
"""``hook(variant, step, k_caches, v_caches)``: called after each step of every cached variant
(step 0 = the prompt's prefill, step t = the decode that fed generated token t - 1) with the
per-layer K and V storage it just wrote (pools ``[M, B, Hkv, D]`` or contiguous ``[S, Hkv, D]``),
before the next step reads them. A test seam: perturbing a layer there must be reported."""


@dataclass
class Trace:
    """What one variant computed for one prompt, teacher-forced on ``S = prompt + continuation``.

    Attributes:
        logits: ``[N - 1, V]`` fp32; row ``i`` predicts token ``i + 1`` of S (N = len(S)).
        keys / values: per layer ``[N - 1, Hkv, D]`` fp32, the K/V of S's first N - 1 tokens
            as the variant's cache holds them (dequantized).
        detail: facts of the run (e.g. ``prefix_hit_tokens``).
    """

    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    detail: dict[str, Any] = field(default_factory=dict)


def _single_seq_meta(prefix_len: int, num_new: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_tables ``[[0]]``, prefix_lens ``[P]``, qo_indptr ``[0, L]``) of one sequence whose
    cache is one block holding it all."""
    import torch

    return (torch.zeros((1, 1), dtype=torch.int32, device=device),
            torch.tensor([prefix_len], dtype=torch.int32, device=device),
            torch.tensor([0, num_new], dtype=torch.int32, device=device))


@dataclass(frozen=True)
class AttentionSettings:
    """What the reference attention of variants (a) and (b) needs per layer, as the runner
    passes it to its kernels (``ModelRunner._family_attention``).

    Attributes:
        window_lefts: per layer, keys visible left of a query (-1 = unlimited;
            ``ModelShape.layer_window_lefts``).
        sm_scale: softmax scale, or None for ``head_dim ** -0.5`` (the kernels' default).
        logits_soft_cap: ``cap * tanh(s / cap)`` on scaled scores (Gemma 2); 0 = none.
    """

    window_lefts: tuple[int, ...]
    sm_scale: float | None
    logits_soft_cap: float

    @classmethod
    def of(cls, shape: Any) -> AttentionSettings:
        """The settings of a ``ModelShape`` (any family: hybrid window layers, Gemma's scale
        and soft cap)."""
        return cls(tuple(shape.layer_window_lefts),
                   None if shape.query_pre_attn_scalar is None else shape.attention_scale,
                   0.0 if shape.attn_logit_softcap is None else float(shape.attn_logit_softcap))

    def kwargs(self, layer: int) -> dict[str, Any]:
        return {"window_left": self.window_lefts[layer], "sm_scale": self.sm_scale,
                "logits_soft_cap": self.logits_soft_cap}


def run_recompute(fwd: LlamaForward, prompt: Sequence[int], max_new_tokens: int,
                  attn: AttentionSettings) -> tuple[Trace, list[int]]:
    """Variant (a): greedy generation with no cache, a full forward of the sequence per step.

    Returns:
        ``(trace, continuation)``: the continuation is the greedy tokens (``max_new_tokens``).
    """
    import torch

    from radixkv.kernels import reference

    device = fwd.device
    num_layers = fwd.shape.num_layers
    keys: list[torch.Tensor] = [torch.empty(0)] * num_layers
    values: list[torch.Tensor] = [torch.empty(0)] * num_layers
    capture = [False]

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num = q.shape[0]
        empty = k.new_zeros((1, 1, *k.shape[1:]))
        tables, prefix_lens, indptr = _single_seq_meta(0, num, device)
        if capture[0]:  # copies: k and v may be views of a buffer the next layer reuses
            keys[layer] = k.to(torch.float32, copy=True).cpu()
            values[layer] = v.to(torch.float32, copy=True).cpu()
        out = reference.extend_attention(q, k, v, empty, empty, tables, prefix_lens, indptr,
                                         max_q_len=num, **attn.kwargs(layer))
        assert isinstance(out, torch.Tensor)
        return out

    sequence = list(prompt)
    rows: list[torch.Tensor] = []
    generated: list[int] = []
    with torch.inference_mode():
        for step in range(max_new_tokens):
            capture[0] = step == max_new_tokens - 1  # the last step's forward covers N - 1 tokens
            ids = torch.tensor(sequence, dtype=torch.int64, device=device)
            positions = torch.arange(len(sequence), dtype=torch.int64, device=device)
            last = None if step == 0 else torch.tensor([len(sequence) - 1], device=device)
            logits = fwd.forward(ids, positions, attention, last).float().cpu()
            rows.append(logits)
            token = int(logits[-1].argmax())
            generated.append(token)
            sequence.append(token)
    return Trace(torch.cat(rows), keys, values), generated


def run_contiguous(fwd: LlamaForward, sequence: Sequence[int], prompt_len: int, attn: AttentionSettings,
                   hook: StepHook | None) -> Trace:
    """Variant (b): prefill into a contiguous per-sequence cache, then one token per step."""
    import torch

    from radixkv.kernels import reference

    device, shape = fwd.device, fwd.shape
    total = len(sequence) - 1
    cache_shape = (total, shape.num_kv_heads, shape.head_dim)
    caches_k = [torch.zeros(cache_shape, dtype=fwd.dtype, device=device) for _ in range(shape.num_layers)]
    caches_v = [torch.zeros(cache_shape, dtype=fwd.dtype, device=device) for _ in range(shape.num_layers)]
    cursor = [0]

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, num = cursor[0], q.shape[0]
        cache_k, cache_v = caches_k[layer], caches_v[layer]
        cache_k[start:start + num] = k
        cache_v[start:start + num] = v
        tables, prefix_lens, indptr = _single_seq_meta(start, num, device)
        out = reference.extend_attention(q, k, v, cache_k[None], cache_v[None], tables, prefix_lens,
                                         indptr, max_q_len=num, **attn.kwargs(layer))
        assert isinstance(out, torch.Tensor)
        return out

    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        chunks = [(0, prompt_len)] + [(pos, pos + 1) for pos in range(prompt_len, total)]
        for step, (start, end) in enumerate(chunks):
            cursor[0] = start
            ids = torch.tensor(sequence[start:end], dtype=torch.int64, device=device)
            positions = torch.arange(start, end, dtype=torch.int64, device=device)
            rows.append(fwd.forward(ids, positions, attention, None).float().cpu())
            if hook is not None:
                hook(CONTIGUOUS, step, caches_k, caches_v)
    return Trace(torch.cat(rows), [c.float().cpu() for c in caches_k], [c.float().cpu() for c in caches_v])


def runner_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks a runner needs for the paged variants of an ``num_tokens``-token sequence: a
    cold table and a prefix-hit request's own blocks beside the earlier request's, plus block
    0 that no table uses (a write through a wrong table lands where no read looks)."""
    return 2 * -(-num_tokens // block_size) + 2


def _read_pool(runner: ModelRunner, table: Sequence[int], num_tokens: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the first ``num_tokens`` K and V of ``table`` as fp32 ``[num_tokens, Hkv, D]``,
    dequantized with the block's scale rows when the pools are quantized."""
    import torch

    from radixkv.kernels.kv_quant import dequantize_kv

    blocks = torch.tensor(list(table), dtype=torch.int64, device=runner.k_pools[0].device)
    k_scales = getattr(runner, "k_scales", None)
    v_scales = getattr(runner, "v_scales", None)

    def gather(pool: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        rows = pool.index_select(0, blocks).reshape(-1, *pool.shape[2:])[:num_tokens]
        if scales is None:
            return rows.float().cpu()
        scale_rows = scales.index_select(0, blocks).reshape(-1, scales.shape[2])[:num_tokens]
        return dequantize_kv(rows, scale_rows).cpu()

    keys = [gather(pool, None if k_scales is None else k_scales[i])
            for i, pool in enumerate(runner.k_pools)]
    values = [gather(pool, None if v_scales is None else v_scales[i])
              for i, pool in enumerate(runner.v_pools)]
    return keys, values


def run_paged(runner: ModelRunner, name: str, sequence: Sequence[int], prompt_len: int,
              hook: StepHook | None, *, hit_tokens: int | None = None) -> Trace:
    """Variants (c), (d), (e): the prompt through ``runner``'s paged pool, then one token per
    step.

    Without ``hit_tokens`` the prompt is one cold prefill over the table ``[M-1, M-2, …]``.
    With ``hit_tokens = h`` an earlier request prefills ``S[:h]`` over that table; the
    prompt's request shares its full blocks, copies its partial block (``copy_blocks``, as
    copy-on-write does) when ``h`` is not a block boundary, takes fresh blocks ``[1, 2, …]``
    for the rest and computes ``S[h:prompt_len]`` as a suffix.
    """
    import torch

    block_size, num_blocks = runner.block_size, runner.num_blocks
    total = len(sequence) - 1
    needed = -(-total // block_size)
    if runner_blocks_needed(total, block_size) > num_blocks:
        raise ValueError(f"num_blocks: the runner has {num_blocks} blocks, the sequence needs "
                         f"{runner_blocks_needed(total, block_size)}")
    top = [num_blocks - 1 - i for i in range(needed)]
    rows: list[torch.Tensor] = []
    detail: dict[str, Any] = {}
    if hit_tokens is None:
        table = top
        first = [(list(sequence[:prompt_len]), 0)]
    else:
        if not 0 < hit_tokens < prompt_len:
            raise ValueError(f"hit_tokens: must be in [1, {prompt_len - 1}], got {hit_tokens}")
        rows.append(runner.forward(runner.build_batch([(list(sequence[:hit_tokens]), 0, top)]),
                                   all_logits=True).float().cpu())
        shared = hit_tokens // block_size
        fresh = list(range(1, 1 + needed - shared))
        table = top[:shared] + fresh
        if hit_tokens % block_size:
            runner.copy_blocks([(top[shared], fresh[0])])
        first = [(list(sequence[hit_tokens:prompt_len]), hit_tokens)]
        detail = {"prefix_hit_tokens": hit_tokens, "shared_blocks": shared,
                  "copied_blocks": int(hit_tokens % block_size > 0)}
    steps = first + [([sequence[pos]], pos) for pos in range(prompt_len, total)]
    for step, (ids, prefix_len) in enumerate(steps):
        batch = runner.build_batch([(ids, prefix_len, table)])
        rows.append(runner.forward(batch, all_logits=True).float().cpu())
        if hook is not None:
            hook(name, step, runner.k_pools, runner.v_pools)
    keys, values = _read_pool(runner, table, total)
    return Trace(torch.cat(rows), keys, values, detail)


def hit_points(prompt_len: int, block_size: int) -> dict[str, int]:
    """The prefix-hit lengths of a prompt: the block boundary nearest its middle (at least one
    block) and one token past it, each kept only where a suffix token is left to compute."""
    boundary = max(block_size, round(prompt_len / 2 / block_size) * block_size)
    return {name: h for name, h in ((HIT, boundary), (HIT_PAST, boundary + 1)) if h < prompt_len}

"""``radixkv verify``'s metrics of a variant against its baseline: top-1 agreement, max |Δlogit|,
mean KL, the first differing step, position and K/V layer, per prompt (:func:`compare`) and
pooled over prompts (:class:`Pair`), within the stated tolerances."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixkv.kernels.kv_quant import KVFormat
    from radixkv.tools.verify.variants import Trace

LOGIT_ATOL = {"float32": 1e-3, "bfloat16": 2.0}
"""Stated tolerance of the exact pairs, max |Δlogit| per model dtype. fp32: SmolLM2's logits
are O(30) and transformers' own attention backends differ by ~5e-5 (the SmolLM2 model test
holds radixkv to 1e-3; measured on a 1,373-token tau-bench turn: paged vs recompute 9.3e-5).
bf16 is no exactness check: the C kernels compute in fp32 on bf16 data while the torch
reference rounds after every op, so the two differ by bf16 noise (same turn: max |Δlogit|
1.19, top-1 0.975 with every differing choice a tie, about as far as bf16 is from fp32); 2.0
still catches a wrong block or position. Verify cache paths at float32."""

KV_ATOL = {"float32": 1e-4, "bfloat16": 0.05}
KV_RTOL = {"float32": 1e-3, "bfloat16": 0.02}
"""K/V tolerance per model dtype: element ``|Δ| <= KV_ATOL + KV_RTOL * amax`` with ``amax`` the
baseline's max |x| over that (token, KV head) row; a quantized variant adds its format's
rounding (int8: half a step, ``amax / 254``; fp8_e4m3: ``|x| / 16 + amax / 458752``)."""


@dataclass
class Tolerances:
    """What the comparisons allow (see :data:`LOGIT_ATOL`, :data:`KV_ATOL`, :data:`KV_RTOL`)."""

    logit_atol: float
    kv_atol: float
    kv_rtol: float


def _kv_rounding(base: torch.Tensor, amax: torch.Tensor, fmt: KVFormat | None) -> torch.Tensor | float:
    """The extra K/V error a quantized format's own rounding allows per element."""
    if fmt is None or not fmt.quantized:
        return 0.0
    scale = (amax / fmt.qmax).unsqueeze(-1)
    if fmt.name == "int8":
        return scale * 0.5
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal spacing 2^-9 of the scale.
    return base.abs() * 2.0 ** -4 + scale * 2.0 ** -10


def compare_kv(variant: Trace, base: Trace, tol: Tolerances, fmt: KVFormat | None) -> dict[str, Any]:
    """Per layer max |ΔK|, |ΔV| and the first layer (K before V) with an element beyond
    tolerance: ``{"kv_max_abs_diff": [[k, v], ...], "first_kv_mismatch": None | {...}}``."""
    per_layer: list[list[float]] = []
    first: dict[str, Any] | None = None
    for layer in range(len(base.keys)):
        maxes = []
        for tensor, ours, theirs in (("k", variant.keys[layer], base.keys[layer]),
                                     ("v", variant.values[layer], base.values[layer])):
            diff = (ours - theirs).abs()
            amax = theirs.abs().amax(dim=-1)
            allowed = tol.kv_atol + tol.kv_rtol * amax.unsqueeze(-1) + _kv_rounding(theirs, amax, fmt)
            maxes.append(float(diff.max()) if diff.numel() else 0.0)
            beyond = (diff > allowed).flatten(1).any(dim=1).nonzero()
            if first is None and beyond.numel():
                first = {"layer": layer, "tensor": tensor, "position": int(beyond[0, 0]),
                         "max_abs_diff": maxes[-1]}
        per_layer.append(maxes)
    return {"kv_max_abs_diff": per_layer, "first_kv_mismatch": first}


def compare(variant: Trace, base: Trace, prompt_len: int, tol: Tolerances,
            fmt: KVFormat | None = None, chunk_rows: int = 256) -> dict[str, Any]:
    """One prompt's metrics of ``variant`` against ``base`` (see :mod:`radixkv.tools.verify`).

    Returns:
        ``positions``, ``agreeing_positions``, ``tie_positions`` (differing choices the
        baseline scores within ``logit_atol``), ``top1_agreement``, ``max_abs_logit_diff``,
        ``mean_kl_nats``, ``first_token_mismatch_step`` (generation step, or None),
        ``first_argmax_mismatch_position`` (first token position, prompt or generated, whose
        chosen token differs, or None), ``first_logit_mismatch_position`` (first token position
        whose logits differ by more
        than logit_atol, or None; generation step t is position ``prompt_len - 1 + t``),
        ``greedy_agreement`` (leading steps agreeing / steps), ``greedy_steps``, plus
        :func:`compare_kv`'s fields.
    """
    import torch

    if variant.logits.shape != base.logits.shape:
        raise ValueError(f"logits: variant {tuple(variant.logits.shape)} vs baseline "
                         f"{tuple(base.logits.shape)}")
    num_rows = base.logits.shape[0]
    steps = num_rows - prompt_len + 1
    agree = torch.empty(num_rows, dtype=torch.bool)
    ties = 0
    max_diff = 0.0
    row_max = torch.empty(num_rows, dtype=torch.float64)
    kl_sum = 0.0
    for start in range(0, num_rows, chunk_rows):
        ours = variant.logits[start:start + chunk_rows]
        theirs = base.logits[start:start + chunk_rows]
        diff = (ours - theirs).abs().amax(dim=-1)
        row_max[start:start + ours.shape[0]] = diff.double()
        max_diff = max(max_diff, float(diff.max()))
        choice_ours, choice_theirs = ours.argmax(dim=-1), theirs.argmax(dim=-1)
        same = choice_ours == choice_theirs
        agree[start:start + ours.shape[0]] = same
        if not bool(same.all()):
            gap = theirs.gather(1, choice_theirs[:, None]) - theirs.gather(1, choice_ours[:, None])
            ties += int(((gap[:, 0] <= tol.logit_atol) & ~same).sum())
        logp = torch.log_softmax(theirs.double(), dim=-1)
        logq = torch.log_softmax(ours.double(), dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(dim=-1).clamp_(min=0.0)
        kl_sum += float(kl.sum())
    step_agree = agree[prompt_len - 1:]
    mismatched_steps = (~step_agree).nonzero()
    first_step = int(mismatched_steps[0, 0]) if mismatched_steps.numel() else None
    mismatched = (~agree).nonzero()
    first_argmax = int(mismatched[0, 0]) if mismatched.numel() else None
    beyond = (row_max > tol.logit_atol).nonzero()
    first_logit = int(beyond[0, 0]) if beyond.numel() else None
    agreeing = int(agree.sum())
    out = {
        "positions": num_rows,
        "agreeing_positions": agreeing,
        "tie_positions": ties,
        "top1_agreement": agreeing / num_rows,
        "max_abs_logit_diff": max_diff,
        "mean_kl_nats": kl_sum / num_rows,
        "first_token_mismatch_step": first_step,
        "first_argmax_mismatch_position": first_argmax,
        "first_logit_mismatch_position": first_logit,
        "greedy_agreement": (steps if first_step is None else first_step) / steps,
        "greedy_steps": steps,
    }
    out.update(compare_kv(variant, base, tol, fmt))
    return out


@dataclass
class Pair:
    """A variant against its baseline, over every prompt."""

    variant: str
    baseline: str
    must_match: bool
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, tol: Tolerances) -> dict[str, Any]:
        """Pooled metrics (positions pooled over prompts; the earliest mismatch over prompts)
        and ``ok``: for an exact pair, no differing choice beyond a tie and max |Δlogit| within
        ``logit_atol``; None for a reported-only pair."""
        runs = self.per_prompt
        out: dict[str, Any] = {"variant": self.variant, "baseline": self.baseline,
                               "must_match": self.must_match, "prompts": len(runs)}
        if not runs:
            out.update(ok=None, skipped=self.skipped, per_prompt=[])
            return out
        positions = sum(r["positions"] for r in runs)
        steps = sum(r["greedy_steps"] for r in runs)

        def earliest(key: str, unit: str) -> dict[str, Any] | None:
            found = [dict(r[key], prompt=r["prompt"]) if isinstance(r[key], dict)
                     else {"prompt": r["prompt"], unit: r[key]} for r in runs if r[key] is not None]
            return min(found, key=lambda m: (m[unit], m["prompt"])) if found else None

        out.update({
            "positions": positions,
            "top1_agreement": sum(r["agreeing_positions"] for r in runs) / positions,
            "tie_positions": sum(r["tie_positions"] for r in runs),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in runs),
            "mean_kl_nats": sum(r["mean_kl_nats"] * r["positions"] for r in runs) / positions,
            "greedy_agreement": sum(r["greedy_agreement"] * r["greedy_steps"] for r in runs) / steps,
            "first_token_mismatch": earliest("first_token_mismatch_step", "step"),
            "first_argmax_mismatch": earliest("first_argmax_mismatch_position", "position"),
            "first_logit_mismatch": earliest("first_logit_mismatch_position", "position"),
            "first_kv_mismatch": earliest("first_kv_mismatch", "layer"),
        })
        beyond_ties = positions - out["tie_positions"] - sum(r["agreeing_positions"] for r in runs)
        out["ok"] = (beyond_ties == 0 and out["max_abs_logit_diff"] <= tol.logit_atol
                     if self.must_match else None)
        out["skipped"] = self.skipped
        out["per_prompt"] = runs
        return out

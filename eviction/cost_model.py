"""Prefill cost model: FLOPs to recompute tokens ``[s, s+n)`` of a sequence (docs/design.md §4).

For a decoder of ``L`` layers with ``Hq`` query heads of width ``D`` and ``P`` non-embedding
parameters, prefilling token position ``p`` (0-based) costs

* linear layers (QKV/O projections, MLP, norms): ``2 · P`` FLOPs (one multiply-add per weight),
* attention: ``4 · L · Hq · D · (p + 1)`` FLOPs (``Q·Kᵀ`` and ``softmax·V`` over the ``p + 1``
  keys it sees, two FLOPs per multiply-add each; with a sliding window of ``W`` tokens a query
  sees ``min(p + 1, W)`` keys),

so ``flops(s, n) = 2·P·n + 4·L·Hq·D·Σ_{p=s}^{s+n-1} (p + 1)``, evaluated in closed form. Deeper
blocks cost more to recompute: at depth 12K tokens a Llama-3-8B block costs ~1.4× a block at the
start of the sequence, at 100K ~4.6×. The embedding lookup and the LM head are left out (a
prefill computes logits only for its last token).

Presets (``PRESETS``) come from the models' published ``config.json``:

==============  ======  ======  =====  ===  ====  ===  ======  =====
name            layers  hidden  MLP    Hq   Hkv   D    vocab   bias
==============  ======  ======  =====  ===  ====  ===  ======  =====
smollm2-135m    30      576     1536   9    3     64   49152   no
llama3-8b       32      4096    14336  32   8     128  128256  no
qwen2.5-7b      28      3584    18944  28   4     128  152064  yes
llama3-70b      80      8192    28672  64   8     128  128256  no
==============  ======  ======  =====  ===  ====  ===  ======  =====

(HuggingFaceTB/SmolLM2-135M-Instruct, meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-7B-Instruct,
meta-llama/Meta-Llama-3-70B.) Pure Python: no torch, no radixkv imports; a served model's
``radixkv.model.ModelShape`` converts with :func:`cost_shape_from_model_shape` (duck-typed).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostShape", "PRESETS", "get_shape", "cost_shape_from_model_shape", "prefill_flops",
           "saved_prefill_flops"]


@dataclass(frozen=True)
class CostShape:
    """The model facts the cost model needs.

    Attributes:
        name: Label (preset name or the served model's name).
        num_layers: Decoder layers (L).
        hidden_size: Model width.
        intermediate_size: SwiGLU MLP width.
        num_q_heads: Query heads (Hq).
        num_kv_heads: Key/value heads (Hkv).
        head_dim: Per-head width (D).
        vocab_size: Vocabulary rows (not counted in the FLOPs; kept for reference).
        attention_bias: q/k/v projections carry a bias (Qwen2).
        sliding_window: Attention window in tokens, None for full attention.
        non_embedding_params: Overrides the parameter count derived from the shape (P).
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 0
    attention_bias: bool = False
    sliding_window: int | None = None
    non_embedding_params: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "intermediate_size", "num_q_heads",
                      "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field}: must be a positive int, got {value!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window: must be positive or None, got {self.sliding_window!r}")

    @property
    def params(self) -> int:
        """Non-embedding parameters P (attention + MLP + norms of every layer + final norm)."""
        if self.non_embedding_params is not None:
            return self.non_embedding_params
        q_dim = self.num_q_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        if self.attention_bias:
            attn += q_dim + 2 * kv_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + self.hidden_size

    @property
    def linear_flops_per_token(self) -> float:
        """``2 · P``: FLOPs of the linear layers for one token."""
        return 2.0 * self.params

    @property
    def attention_flops_per_key(self) -> float:
        """``4 · L · Hq · D``: attention FLOPs per (query, visible key) pair."""
        return 4.0 * self.num_layers * self.num_q_heads * self.head_dim

    def flops(self, start: int, num_tokens: int) -> float:
        """Prefill FLOPs to recompute positions ``[start, start + num_tokens)``."""
        return prefill_flops(self, start, num_tokens)


PRESETS: dict[str, CostShape] = {
    "smollm2-135m": CostShape("smollm2-135m", num_layers=30, hidden_size=576,
                              intermediate_size=1536, num_q_heads=9, num_kv_heads=3, head_dim=64,
                              vocab_size=49152),
    "llama3-8b": CostShape("llama3-8b", num_layers=32, hidden_size=4096, intermediate_size=14336,
                           num_q_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256),
    "qwen2.5-7b": CostShape("qwen2.5-7b", num_layers=28, hidden_size=3584,
                            intermediate_size=18944, num_q_heads=28, num_kv_heads=4,
                            head_dim=128, vocab_size=152064, attention_bias=True),
    "llama3-70b": CostShape("llama3-70b", num_layers=80, hidden_size=8192,
                            intermediate_size=28672, num_q_heads=64, num_kv_heads=8,
                            head_dim=128, vocab_size=128256),
}
"""Preset shapes by name (published configs, see the module docstring)."""


def get_shape(shape: str | CostShape | object | None) -> CostShape:
    """Resolve a preset name, a :class:`CostShape`, or a model-shape-like object.

    Args:
        shape: A name in :data:`PRESETS`, a ``CostShape`` (returned as is), an object with the
            attributes of ``radixkv.model.ModelShape``, or None (``llama3-8b``).

    Raises:
        ValueError: naming ``model_shape`` for an unknown preset name or an unusable object.
    """
    if shape is None:
        return PRESETS["llama3-8b"]
    if isinstance(shape, CostShape):
        return shape
    if isinstance(shape, str):
        try:
            return PRESETS[shape]
        except KeyError:
            raise ValueError(f"model_shape: unknown preset {shape!r} "
                             f"(known: {', '.join(sorted(PRESETS))})") from None
    return cost_shape_from_model_shape(shape)


def cost_shape_from_model_shape(shape: object, name: str = "served") -> CostShape:
    """Adapt a ``radixkv.model.ModelShape`` (or any object with its fields) to a CostShape.

    Reads ``num_layers``, ``hidden_size``, ``intermediate_size``, ``num_q_heads``,
    ``num_kv_heads``, ``head_dim`` and, when present, ``vocab_size``, ``attention_bias``,
    ``sliding_window`` and ``num_non_embedding_params()``.

    Raises:
        ValueError: naming ``model_shape`` if a required field is missing.
    """
    try:
        fields = {f: getattr(shape, f) for f in ("num_layers", "hidden_size", "intermediate_size",
                                                 "num_q_heads", "num_kv_heads", "head_dim")}
    except AttributeError as exc:
        raise ValueError(f"model_shape: {type(shape).__name__} lacks a field: {exc}") from None
    count = getattr(shape, "num_non_embedding_params", None)
    return CostShape(name, vocab_size=getattr(shape, "vocab_size", 0) or 0,
                     attention_bias=bool(getattr(shape, "attention_bias", False)),
                     sliding_window=getattr(shape, "sliding_window", None),
                     non_embedding_params=count() if callable(count) else None, **fields)


def _sum_positions(start: int, num_tokens: int) -> float:
    """``Σ_{p=start}^{start+num_tokens-1} (p + 1)``."""
    return num_tokens * start + num_tokens * (num_tokens + 1) / 2


def prefill_flops(shape: CostShape | str, start: int, num_tokens: int) -> float:
    """FLOPs to prefill positions ``[start, start + num_tokens)`` of one sequence.

    Args:
        shape: A :class:`CostShape` or a preset name.
        start: First position (tokens already before it), ≥ 0.
        num_tokens: Tokens to recompute, ≥ 0 (0 costs 0).

    Raises:
        ValueError: naming ``start`` / ``num_tokens`` when negative.
    """
    if start < 0:
        raise ValueError(f"start: must be >= 0, got {start}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
    s = shape if isinstance(shape, CostShape) else get_shape(shape)
    if num_tokens == 0:
        return 0.0
    w = s.sliding_window
    if w is None or start + num_tokens <= w:
        keys = _sum_positions(start, num_tokens)
    elif start >= w:
        keys = float(num_tokens) * w
    else:  # ramps up to the window, then flat
        ramp = w - start
        keys = _sum_positions(start, ramp) + float(num_tokens - ramp) * w
    return s.linear_flops_per_token * num_tokens + s.attention_flops_per_key * keys


def saved_prefill_flops(shape: CostShape | str, num_cached_tokens: int) -> float:
    """FLOPs a prefix-cache hit of ``num_cached_tokens`` saves: ``prefill_flops(shape, 0, m)``.

    The engine adds this at each request's admission (``saved_prefill_flops_total``).
    """
    return prefill_flops(shape, 0, num_cached_tokens)

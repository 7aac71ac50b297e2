"""Model shape: the architecture facts the forward, the KV pool and the cost model need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixkv.eviction.cost_model import CostShape

__all__ = ["ModelShape", "SUPPORTED_ROPE_TYPES", "LAYER_TYPES", "HIDDEN_ACTS", "FULL_ATTENTION",
           "SLIDING_ATTENTION"]

# RoPE variants the forward implements. "default" is plain RoPE (stored as rope_scaling=None).
SUPPORTED_ROPE_TYPES = ("llama3", "linear")
_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",)}
#: Per-layer attention kinds, in transformers' ``config.layer_types`` names.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: MLP activations: SwiGLU (``silu``, Llama / Qwen / Mistral) or GeGLU with the tanh GELU
#: (``gelu_pytorch_tanh``, Gemma 2 / 3).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder of the Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 families.

    The fields after ``attention_bias`` describe what the Qwen3 and Gemma families add to the
    Llama layer; their defaults are Llama's, and a shape with all of them at their defaults is
    :attr:`plain_llama` (the forward's fused fast paths take only those).

    Attributes:
        vocab_size: rows of the embedding / lm_head.
        hidden_size: model width.
        intermediate_size: SwiGLU MLP width.
        num_layers: decoder layers.
        num_q_heads: query heads (Hq).
        num_kv_heads: key/value heads (Hkv); Hq must be a multiple of it.
        head_dim: per-head width (D); may differ from hidden_size / Hq (Mistral-style configs).
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        max_position_embeddings: context length, tokens.
        tie_word_embeddings: lm_head shares the embedding matrix.
        rope_scaling: None for plain RoPE, or a llama3-style dict with ``rope_type="llama3"``,
            ``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``.
        sliding_window: attention window, tokens (a query sees itself and the previous
            ``sliding_window - 1`` tokens) of the layers it applies to (every layer when
            ``layer_types`` is None, else the ``sliding_attention`` ones); None = full attention.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (transformers'
            names), ``num_layers`` entries; None = every layer alike (windowed iff
            ``sliding_window`` is set: Mistral). Gemma 2 alternates, Gemma 3 has five
            sliding layers to one full.
        qk_norm: RMSNorm over each head's D values of q and k before RoPE (Qwen3, Gemma 3).
        rms_norm_weight_offset: every RMSNorm scales by ``offset + weight`` (Gemma: 1.0,
            computed in fp32 before the cast back, as Gemma's reference does); Llama: 0.0.
        sandwich_norms: each layer also norms the attention output and the MLP output before
            their residual adds, and norms the MLP input with its own weight (Gemma 2 / 3:
            ``post_attention_layernorm`` on the attention output, ``pre_feedforward_layernorm``,
            ``post_feedforward_layernorm``).
        hidden_act: MLP activation, one of :data:`HIDDEN_ACTS` (``silu``: SwiGLU;
            ``gelu_pytorch_tanh``: GeGLU, Gemma).
        embedding_multiplier: the token embeddings are multiplied by this (cast to the model
            dtype first, as Gemma's reference does); Gemma: ``sqrt(hidden_size)``; Llama 1.0.
        attn_logit_softcap: scaled attention logits become ``cap * tanh(s / cap)`` before the
            softmax (Gemma 2); None = off.
        final_logit_softcap: output logits become ``cap * tanh(z / cap)`` (Gemma 2); None = off.
        query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5``
            (Gemma); None = ``head_dim ** -0.5``.
        rope_local_theta: RoPE base of the ``sliding_attention`` layers, which also take no
            ``rope_scaling`` (Gemma 3's ``rope_local_base_freq``); None = those layers rotate
            as the full ones.

    Raises:
        ValueError: from ``__post_init__``, naming the bad field.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    sliding_window: int | None = None
    attention_bias: bool = False
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False
    rms_norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_multiplier: float = 1.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_q_heads {self.num_q_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps!r}")
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window: must be a positive int or None, got {self.sliding_window!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}; "
                                 f"supported: {SUPPORTED_ROPE_TYPES}")
            missing = [k for k in _ROPE_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling: {rope_type} scaling lacks {missing}")
            if not float(self.rope_scaling["factor"]) > 0:
                raise ValueError(f"rope_scaling: factor must be > 0, got {self.rope_scaling['factor']!r}")
        self._check_family_fields()

    def _check_family_fields(self) -> None:
        """Validate (and normalise: a JSON list of layer types becomes a tuple) the fields the
        Qwen3 / Gemma families add."""
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not isinstance(self.layer_types, (list, tuple)):
                raise ValueError(f"layer_types: must be a sequence of {LAYER_TYPES}, "
                                 f"got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types: {len(self.layer_types)} entries for "
                                 f"num_layers {self.num_layers}")
            unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
            if unknown:
                raise ValueError(f"layer_types: unsupported entries {unknown}; supported: {LAYER_TYPES}")
            has_sliding = SLIDING_ATTENTION in self.layer_types
            if has_sliding and self.sliding_window is None:
                raise ValueError("sliding_window: layer_types has sliding_attention layers but no window")
            if not has_sliding and self.sliding_window is not None:
                raise ValueError("sliding_window: set, but no layer_types entry is sliding_attention")
        for name in ("qk_norm", "sandwich_norms", "attention_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.rms_norm_weight_offset not in (0.0, 1.0):
            raise ValueError(f"rms_norm_weight_offset: must be 0.0 (Llama) or 1.0 (Gemma), "
                             f"got {self.rms_norm_weight_offset!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act: unsupported {self.hidden_act!r}; supported: {HIDDEN_ACTS}")
        for name in ("embedding_multiplier", "attn_logit_softcap", "final_logit_softcap",
                     "query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if name != "embedding_multiplier" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                optional = "" if name == "embedding_multiplier" else " or None"
                raise ValueError(f"{name}: must be a number > 0{optional}, got {value!r}")

    @property
    def layer_window_lefts(self) -> tuple[int, ...]:
        """Per layer, the keys visible left of a query in attention-kernel terms
        (``sliding_window - 1``), or -1 (unlimited) for a full-attention layer."""
        window = -1 if self.sliding_window is None else self.sliding_window - 1
        if self.layer_types is None:
            return (window,) * self.num_layers
        return tuple(window if t == SLIDING_ATTENTION else -1 for t in self.layer_types)

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with ``rope_local_theta`` (a sliding layer of a model that
        has a separate local base) instead of ``rope_theta`` + ``rope_scaling``."""
        return (self.rope_local_theta is not None and self.layer_types is not None
                and self.layer_types[layer] == SLIDING_ATTENTION)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of every layer: ``query_pre_attn_scalar ** -0.5`` or ``head_dim ** -0.5``."""
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    @property
    def plain_llama(self) -> bool:
        """Whether every layer is a Llama layer with one window for all layers (the fused C
        decode layer and the C prefill elementwise kernels take only these)."""
        return (self.layer_types is None and not self.qk_norm and self.rms_norm_weight_offset == 0.0
                and not self.sandwich_norms and self.hidden_act == "silu"
                and self.embedding_multiplier == 1.0 and self.attn_logit_softcap is None
                and self.final_logit_softcap is None and self.query_pre_attn_scalar is None
                and self.rope_local_theta is None)

    @property
    def window_left(self) -> int:
        """Keys visible to the left of a query in attention-kernel terms, one value for every
        layer; -1 = unlimited.

        Raises:
            ValueError: naming ``layer_types`` when layers differ (use :attr:`layer_window_lefts`).
        """
        windows = set(self.layer_window_lefts)
        if len(windows) != 1:
            raise ValueError("layer_types: layers differ in attention window; use layer_window_lefts")
        return windows.pop()

    def rope_description(self) -> str:
        """Canonical text of the RoPE config and of every other forward fact that
        ``config.json`` sets and the weights' digest does not cover, for the cache identity.

        E.g. ``theta=100000.0;scaling=None`` for a :attr:`plain_llama` shape without a window
        (the text these shapes always had, so their cache roots do not change); any family
        field off its default is appended as ``;name=value`` in field order, e.g. Gemma 3's
        ``…;sliding_window=512;layer_types=SSSSSF…;qk_norm=True;…``.
        """
        if self.rope_scaling is None:
            scaling = "None"
        else:
            scaling = ",".join(f"{k}={self.rope_scaling[k]!r}" for k in sorted(self.rope_scaling))
        text = f"theta={float(self.rope_theta)!r};scaling={scaling}"
        if self.sliding_window is not None:
            text += f";sliding_window={self.sliding_window}"
        if self.layer_types is not None:
            kinds = "".join("S" if t == SLIDING_ATTENTION else "F" for t in self.layer_types)
            text += f";layer_types={kinds}"
        defaults = {"qk_norm": False, "rms_norm_weight_offset": 0.0, "sandwich_norms": False,
                    "hidden_act": "silu", "embedding_multiplier": 1.0, "attn_logit_softcap": None,
                    "final_logit_softcap": None, "query_pre_attn_scalar": None, "rope_local_theta": None}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                text += f";{name}={float(value)!r}" if isinstance(value, (int, float)) and not isinstance(
                    value, bool) else f";{name}={value}"
        return text

    def num_non_embedding_params(self) -> int:
        """Parameters outside the embedding and lm_head matrices (norms included).

        The formula is the cost model's (``radixkv.eviction.cost_model.CostShape.params``): a
        linear layer costs ``2 * params`` FLOPs per token.
        """
        return CostShape(name="", num_layers=self.num_layers, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, num_q_heads=self.num_q_heads,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         attention_bias=self.attention_bias).params

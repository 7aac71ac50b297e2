"""Model shape: the architecture facts the forward, the KV pool and the cost model need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixkv.eviction.cost_model import CostShape

__all__ = ["ModelShape", "SUPPORTED_ROPE_TYPES"]

# RoPE variants the forward implements. "default" is plain RoPE (stored as rope_scaling=None).
SUPPORTED_ROPE_TYPES = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelShape:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2).

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
            ``sliding_window - 1`` tokens); None = full attention.
        attention_bias: q/k/v projections carry a bias (Qwen2).

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
            missing = [k for k in _LLAMA3_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling: llama3 scaling lacks {missing}")

    @property
    def window_left(self) -> int:
        """Keys visible to the left of a query in attention-kernel terms; -1 = unlimited."""
        return -1 if self.sliding_window is None else self.sliding_window - 1

    def rope_description(self) -> str:
        """Canonical text of the RoPE config, for the cache identity.

        E.g. ``theta=100000.0;scaling=None``.
        """
        if self.rope_scaling is None:
            scaling = "None"
        else:
            scaling = ",".join(f"{k}={self.rope_scaling[k]!r}" for k in sorted(self.rope_scaling))
        return f"theta={float(self.rope_theta)!r};scaling={scaling}"

    def num_non_embedding_params(self) -> int:
        """Parameters outside the embedding and lm_head matrices (norms included).

        The formula is the cost model's (``radixkv.eviction.cost_model.CostShape.params``): a
        linear layer costs ``2 * params`` FLOPs per token.
        """
        return CostShape(name="", num_layers=self.num_layers, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, num_q_heads=self.num_q_heads,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         attention_bias=self.attention_bias).params

"""A model's KV layout: its layers grouped by what one cached token costs in them.

Letters as in the rest of radixkv: Hkv KV heads, D head dim, W window tokens, B block tokens.
Nothing here imports torch; the readers (``hf_config``, ``gguf_meta``) build these from config
dicts and GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FULL", "SLIDING", "MLA", "FLOAT_DTYPE_BYTES", "LayerGroup", "KVLayout"]

FULL = "full"          # full attention: every token of the sequence is kept (K and V)
SLIDING = "sliding"    # sliding window W: a query sees itself and the previous W - 1 tokens
MLA = "mla"            # multi-head latent attention: one compressed latent + a RoPE key per token

#: Bytes per element of the unquantized dtypes a config's ``torch_dtype`` may name.
FLOAT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _positive(name: str, value: object) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")


@dataclass(frozen=True)
class LayerGroup:
    """Layers that store the same per-token K/V.

    Attributes:
        kind: :data:`FULL`, :data:`SLIDING` or :data:`MLA`.
        num_layers: layers in the group.
        num_kv_heads: Hkv of each layer before tensor parallelism (MLA: 1, the shared latent).
        head_dim: D of K and of V (MHA/GQA/MQA); 0 for MLA.
        window_tokens: W for :data:`SLIDING`, else None.
        kv_lora_rank: MLA latent width (``kv_lora_rank``), else 0.
        qk_rope_head_dim: MLA decoupled RoPE key width (``qk_rope_head_dim``), else 0.

    Raises:
        ValueError: from ``__post_init__``, naming the config field that is out of range.
    """

    kind: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    window_tokens: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (FULL, SLIDING, MLA):
            raise ValueError(f"kind: must be one of {FULL}, {SLIDING}, {MLA}, got {self.kind!r}")
        _positive("num_hidden_layers", self.num_layers)
        if self.kind == MLA:
            _positive("kv_lora_rank", self.kv_lora_rank)
            if type(self.qk_rope_head_dim) is not int or self.qk_rope_head_dim < 0:
                raise ValueError(f"qk_rope_head_dim: must be an int >= 0, got {self.qk_rope_head_dim!r}")
            return
        _positive("num_key_value_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        if self.kind == SLIDING:
            _positive("sliding_window", self.window_tokens)
        elif self.window_tokens is not None:
            raise ValueError(f"window_tokens: only a {SLIDING} group has one, got {self.window_tokens!r}")

    @property
    def name(self) -> str:
        """Row label: ``full attention``, ``sliding window 512``, ``MLA latent``."""
        if self.kind == FULL:
            return "full attention"
        if self.kind == SLIDING:
            return f"sliding window {self.window_tokens}"
        return "MLA latent"


@dataclass(frozen=True)
class KVLayout:
    """What ``radixkv plan`` knows about a model without its weights.

    Attributes:
        model: a display name (the config's directory or file name, or the shipped name).
        source: where it was read (path, ``gguf:PATH``).
        groups: the layer groups, at least one; their ``num_layers`` sum to the model's layers.
        torch_dtype: the dtype ``--kv-cache-dtype auto`` resolves to: the config's
            ``torch_dtype``, or ``float32`` where the config names none (a GGUF: radixkv
            serve's default ``--dtype``).
        max_position_embeddings: the context length the config states, tokens; None if absent.
        num_params: parameters of the weights radixkv would hold (the GGUF's tensor elements,
            or the dense-decoder count of an HF config); None where not countable (MoE, MLA).
        weight_dtype_bytes: bytes per weight at which the weights are held (2 for a bf16 HF
            config, 4 for a GGUF that radixkv dequantizes to fp32).
        notes: facts the reader assumed (defaults used), printed under the table.
    """

    model: str
    source: str
    groups: tuple[LayerGroup, ...]
    torch_dtype: str
    max_position_embeddings: int | None
    num_params: int | None
    weight_dtype_bytes: int
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("groups: a layout needs at least one layer group")

    @property
    def num_layers(self) -> int:
        """Decoder layers over all groups."""
        return sum(g.num_layers for g in self.groups)

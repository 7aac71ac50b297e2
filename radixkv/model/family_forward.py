"""Decoder forward of the families beyond the Llama layer: Qwen3, Gemma 2, Gemma 3.

:class:`FamilyForward` extends :class:`radixkv.model.llama.LlamaForward` (same packed-token
interface, same fused q/k/v and gate/up weights, same projections through ``_linear``: the C
kernel for few rows, oneDNN for many) with what :class:`ModelShape` describes beyond Llama:

- q/k RMSNorm over each head's D values, before RoPE (``qk_norm``: Qwen3, Gemma 3);
- Gemma's RMSNorm, ``(1 + w) * x_normed`` with the product taken in fp32 and cast after
  (``rms_norm_weight_offset`` 1.0), for every norm of the model;
- sandwich norms (``sandwich_norms``): the attention output and the MLP output are normed
  before their residual adds, the MLP input by ``pre_feedforward_layernorm``;
- GeGLU with the tanh GELU (``hidden_act`` ``gelu_pytorch_tanh``);
- embeddings times ``embedding_multiplier`` (Gemma: sqrt(hidden), cast to the model dtype);
- final logit soft-capping ``cap * tanh(z / cap)`` (Gemma 2);
- per-layer RoPE tables: sliding layers of a model with ``rope_local_theta`` rotate with that
  base and no scaling (Gemma 3), the others with ``rope_theta`` and ``rope_scaling``.

Attention itself (window, scale, logit soft-capping per layer) stays the caller's callback:
:class:`radixkv.model.runner.ModelRunner` routes each layer to a path that implements its kind.
Every step runs the layers in eager torch: the fused C decoder layer
(:meth:`LlamaForward.decode_native`) and the C prefill elementwise kernels compute only the
Llama layer, so they are never used here (:meth:`FamilyForward.decode_native` refuses).

Sources: transformers' ``modeling_qwen3.py``, ``modeling_gemma2.py``, ``modeling_gemma3.py``
(the tests compare logits with them, ``tests/model/test_families.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.kernels import native

from .config import ModelShape
from .llama import AttentionFn, LlamaForward, rope_inv_freq
from .lora import LoRABatch

__all__ = ["FamilyForward", "make_forward"]


@dataclass
class _FamilyLayer:
    """Per-layer tensors the Llama layer lacks (None where the family has none).

    Norm weights are stored as the norm multiplies: for Gemma ``1 + w`` in fp32, else ``w`` in
    the model dtype.
    """

    q_norm: torch.Tensor | None          # [D]
    k_norm: torch.Tensor | None          # [D]
    pre_mlp_norm: torch.Tensor | None    # [hidden] (sandwich: pre_feedforward_layernorm)
    post_mlp_norm: torch.Tensor | None   # [hidden] (sandwich: post_feedforward_layernorm)
    local_rope: bool                     # rotates with the local base (Gemma 3 sliding layer)


class FamilyForward(LlamaForward):
    """Weights and forward of a Qwen3 / Gemma 2 / Gemma 3 (or any non-``plain_llama``) shape.

    Args: as :class:`LlamaForward`; ``compile`` must be False.

    Raises:
        ValueError: if a tensor is missing or has the wrong shape (names the tensor); naming
            ``compile`` when it is asked for (these layers run eager).
    """

    def __init__(self, shape: ModelShape, state_dict: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compile: bool = False, native_kernels: native.NativeKernels | None = None) -> None:
        if compile:
            raise ValueError("compile: torch.compile is not supported for this model family "
                             "(its layers run eager)")
        super().__init__(shape, state_dict, device=device, dtype=dtype, compile=False,
                         native_kernels=native_kernels)
        # The C prefill elementwise kernels compute Llama's norms and SwiGLU only.
        self._prefill = None
        hidden, head_dim = shape.hidden_size, shape.head_dim
        self._gemma_norm = shape.rms_norm_weight_offset != 0.0

        def get(name: str, expected: tuple[int, ...]) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"state_dict: missing tensor {name!r}")
            tensor = state_dict[name]
            if tuple(tensor.shape) != expected:
                raise ValueError(f"state_dict: {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            return tensor.to(device=self.device)

        self.family_layers: list[_FamilyLayer] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qk = shape.qk_norm
            self.family_layers.append(_FamilyLayer(
                q_norm=self._norm_weight(get(p + "self_attn.q_norm.weight", (head_dim,))) if qk else None,
                k_norm=self._norm_weight(get(p + "self_attn.k_norm.weight", (head_dim,))) if qk else None,
                pre_mlp_norm=(self._norm_weight(get(p + "pre_feedforward_layernorm.weight", (hidden,)))
                              if shape.sandwich_norms else None),
                post_mlp_norm=(self._norm_weight(get(p + "post_feedforward_layernorm.weight", (hidden,)))
                               if shape.sandwich_norms else None),
                local_rope=shape.layer_uses_local_rope(i)))
            layer.input_norm = self._norm_weight(layer.input_norm)
            layer.post_norm = self._norm_weight(layer.post_norm)
        self.final_norm = self._norm_weight(self.final_norm)
        # Gemma multiplies by sqrt(hidden) cast to the weights' dtype (bf16: 55.4256 -> 55.5).
        self._embed_scale = (None if shape.embedding_multiplier == 1.0 else
                             torch.tensor(shape.embedding_multiplier, dtype=torch.float32)
                             .to(device=self.device, dtype=dtype))
        self._local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        if any(f.local_rope for f in self.family_layers):
            positions = torch.arange(shape.max_position_embeddings, dtype=torch.int64).float()
            freqs = positions[:, None] * rope_inv_freq(shape, local=True)[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            self._local_rope = (emb.cos().to(device=self.device, dtype=dtype),
                                emb.sin().to(device=self.device, dtype=dtype))
        self._gelu = shape.hidden_act == "gelu_pytorch_tanh"

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The multiplier a norm applies: ``1 + w`` in fp32 (Gemma), else ``w`` as loaded."""
        if self._gemma_norm:
            return (1.0 + weight.float()).contiguous()
        return weight.to(dtype=self.dtype).contiguous()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim. Gemma: ``(x_normed_fp32 * (1 + w)).to(dtype)``; else
        Llama's ``w * x_normed.to(dtype)``."""
        if not self._gemma_norm:
            return self._rms_norm(x, weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return (xf * weight).to(x.dtype)

    def decode_native(self, *args: object, **kwargs: object) -> torch.Tensor:
        """Not available: the fused C decoder layer computes the Llama layer only.

        Raises:
            ValueError: naming ``native_kernels`` always.
        """
        raise ValueError("native_kernels: the fused C decode layer does not compute this model "
                         "family's layers; run forward() with an attention callback")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                logit_rows: torch.Tensor | None = None,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """Run the decoder on packed tokens (arguments, returns and errors as
        :meth:`LlamaForward.forward`; the logits soft-capped when ``final_logit_softcap``)."""
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions: shape {tuple(positions.shape)} != input_ids "
                             f"{tuple(input_ids.shape)}")
        shape = self.shape
        num_tokens, head_dim = input_ids.shape[0], shape.head_dim
        q_dim, kv_dim = shape.num_q_heads * head_dim, shape.num_kv_heads * head_dim
        rope = [(self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :])]
        if self._local_rope is not None:
            local_cos, local_sin = self._local_rope
            rope.append((local_cos[positions][:, None, :], local_sin[positions][:, None, :]))
        hidden = self.embed[input_ids]
        if self._embed_scale is not None:
            hidden = hidden * self._embed_scale
        for i, (layer, extra) in enumerate(zip(self.layers, self.family_layers)):
            x = self._norm(hidden, layer.input_norm)
            qkv = self._linear(x, layer.qkv_weight, layer.qkv_bias)
            if lora is not None:
                lora.add(qkv, x, i, "qkv")
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q.reshape(num_tokens, shape.num_q_heads, head_dim)
            k = k.reshape(num_tokens, shape.num_kv_heads, head_dim)
            if extra.q_norm is not None and extra.k_norm is not None:
                q, k = self._norm(q, extra.q_norm), self._norm(k, extra.k_norm)
            cos, sin = rope[1] if extra.local_rope else rope[0]
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            attn = attention(i, q, k, v.reshape(num_tokens, shape.num_kv_heads, head_dim))
            attn = attn.reshape(num_tokens, q_dim)
            out = self._linear(attn, layer.o_weight)
            if lora is not None:
                lora.add(out, attn, i, "o")
            if extra.pre_mlp_norm is not None:
                # Sandwich: post_norm is Gemma's post_attention_layernorm (on the attention
                # output); the MLP input has its own pre_feedforward_layernorm.
                hidden = hidden + self._norm(out, layer.post_norm)
                x = self._norm(hidden, extra.pre_mlp_norm)
            else:
                hidden = hidden + out
                x = self._norm(hidden, layer.post_norm)
            gate_up = self._linear(x, layer.gate_up_weight)
            if lora is not None:
                lora.add(gate_up, x, i, "gate_up")
            gate, up = gate_up.chunk(2, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self._gelu else F.silu(gate)) * up
            down = self._linear(act, layer.down_weight)
            if lora is not None:
                lora.add(down, act, i, "down")
            if extra.post_mlp_norm is not None:
                down = self._norm(down, extra.post_mlp_norm)
            hidden = hidden + down
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        logits = self._linear(self._norm(hidden, self.final_norm), self.lm_head).float()
        cap = shape.final_logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits


def make_forward(shape: ModelShape, state_dict: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compile: bool = False,
                 native_kernels: native.NativeKernels | None = None) -> LlamaForward:
    """The forward for ``shape``: :class:`LlamaForward` for a ``plain_llama`` shape (its fused
    C decode and prefill paths), else :class:`FamilyForward`. Arguments and errors as theirs."""
    cls = LlamaForward if shape.plain_llama else FamilyForward
    return cls(shape, state_dict, device=device, dtype=dtype, compile=compile, native_kernels=native_kernels)


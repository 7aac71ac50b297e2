"""Llama-family decoder forward in plain torch, over packed tokens.

The forward sees a flat batch of T tokens ``[T, hidden]`` (the suffix tokens of every sequence
of a step, packed) and delegates attention to a callback, so the paged-KV bookkeeping lives in
the runner and this module stays a pure function of weights, token ids and positions.

Weights use Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight`` …). q/k/v and
gate/up projections are concatenated once at load time: one GEMM instead of three (or two) per
layer is noticeably faster on CPU for the short decode batches. LoRA adapters add their delta
to these fused projections per packed row (``radixkv.model.lora.LoRABatch``), never merged.

Prefill and extend steps (more than ``native.MAX_LINEAR_ROWS`` rows) on a CPU run their
projections through oneDNN (``radixkv.kernels.gemm.PackedLinear``, weights prepared once at
load) and, with the native library loaded, the elementwise work through one-pass C kernels
(fused residual add + RMSNorm, RoPE in place on the fused q/k/v output, SwiGLU): see
:meth:`LlamaForward._layers_prefill`. bf16 takes that path only on CPUs with native bf16 dot
products (``gemm.cpu_bf16_native``); elsewhere bf16 prefill GEMMs stay on ``F.linear`` and its
elementwise work on torch, while the few-row projections of decode steps still take the C
kernels (fp32 arithmetic on the bf16 weights). The torch code stays the fallback and the
reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.kernels import gemm, host_memory, native

from .config import ModelShape
from .lora import LoRABatch

#: MLP row chunks of a prefill step are multiples of this (whole GEMM row blocks).
_MLP_ROW_QUANTUM = 256

__all__ = ["LlamaForward", "AttentionFn", "rope_inv_freq"]

# attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope_inv_freq(shape: ModelShape, *, local: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies ``[D/2]`` fp32, with llama3 or linear scaling when
    configured.

    llama3 scaling leaves high-frequency pairs alone, divides low-frequency pairs by
    ``factor`` and blends linearly in between (by wavelength relative to the original context);
    linear scaling divides every frequency by ``factor`` (positions interpolated). ``local``:
    the frequencies of the sliding layers of a model with ``rope_local_theta`` (Gemma 3), plain
    RoPE on that base.
    """
    dim = shape.head_dim
    theta = shape.rope_local_theta if local and shape.rope_local_theta is not None else shape.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = shape.rope_scaling
    if scaling is None or (local and shape.rope_local_theta is not None):
        return inv_freq
    factor = float(scaling["factor"])
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv_freq / factor
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = inv_freq / factor
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, scaled, inv_freq)
    middle = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(middle, blended, out)


@dataclass
class _Layer:
    input_norm: torch.Tensor      # [hidden]
    qkv_weight: torch.Tensor      # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D] (Qwen2) or None
    o_weight: torch.Tensor        # [hidden, Hq D]
    post_norm: torch.Tensor       # [hidden]
    gate_up_weight: torch.Tensor  # [2 I, hidden]
    down_weight: torch.Tensor     # [hidden, I]
    # oneDNN projections for prefill/extend rows (None where oneDNN or the dtype rules it out)
    qkv_lin: gemm.PackedLinear | None = None
    o_lin: gemm.PackedLinear | None = None
    gate_up_lin: gemm.PackedLinear | None = None
    down_lin: gemm.PackedLinear | None = None


class LlamaForward:
    """Weights of a Llama-family model plus its forward over packed tokens.

    Args:
        shape: model shape.
        state_dict: HF Llama-named tensors; ``lm_head.weight`` may be absent when tied.
        device: torch device for the weights.
        dtype: weight / activation dtype (fp32 by default; bf16 halves the bytes read).
        compile: ``torch.compile`` the per-layer dense math (norms, projections, RoPE, MLP)
            with dynamic shapes; attention and LoRA batches stay eager. The first steps of
            each new shape class compile (tens of seconds on a CPU).
        native_kernels: the C kernels (``radixkv.kernels.native.load()``) for projections of
            at most ``MAX_LINEAR_ROWS`` rows (decode steps, the logits rows) on fp32 or bf16
            CPU weights (bf16 widened to fp32 in registers, with or without native bf16 dot
            products), and for the prefill elementwise kernels (fp32, or bf16 where the CPU
            has native bf16 dot products); None, or with ``compile``, keeps every projection
            of at most ``MAX_LINEAR_ROWS`` rows on ``F.linear`` and the elementwise work on
            torch.

    Raises:
        ValueError: if a tensor is missing or has the wrong shape (names the tensor); naming
            ``shape`` for a shape that is not :attr:`ModelShape.plain_llama` (its layers need
            :class:`radixkv.model.family_forward.FamilyForward`: :func:`make_forward` picks).
    """

    def __init__(self, shape: ModelShape, state_dict: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compile: bool = False, native_kernels: native.NativeKernels | None = None) -> None:
        if type(self) is LlamaForward and not shape.plain_llama:
            raise ValueError("shape: q/k norms, Gemma norms, GeGLU, soft-capping, an attention "
                             "scalar or per-layer attention kinds need FamilyForward (make_forward)")
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = dtype
        hidden, head_dim = shape.hidden_size, shape.head_dim
        q_dim, kv_dim = shape.num_q_heads * head_dim, shape.num_kv_heads * head_dim

        def get(name: str, expected: tuple[int, ...]) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"state_dict: missing tensor {name!r}")
            tensor = state_dict[name]
            if tuple(tensor.shape) != expected:
                raise ValueError(f"state_dict: {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            # Contiguous: the C kernels take raw row-major pointers (a loader may hand views).
            return tensor.to(device=self.device, dtype=dtype).contiguous()

        self.embed = get("model.embed_tokens.weight", (shape.vocab_size, hidden))
        if shape.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = get("lm_head.weight", (shape.vocab_size, hidden))
        self.final_norm = get("model.norm.weight", (hidden,))
        self.layers: list[_Layer] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([get(p + "self_attn.q_proj.weight", (q_dim, hidden)),
                             get(p + "self_attn.k_proj.weight", (kv_dim, hidden)),
                             get(p + "self_attn.v_proj.weight", (kv_dim, hidden))])
            bias = None
            if shape.attention_bias:
                bias = torch.cat([get(p + "self_attn.q_proj.bias", (q_dim,)),
                                  get(p + "self_attn.k_proj.bias", (kv_dim,)),
                                  get(p + "self_attn.v_proj.bias", (kv_dim,))])
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight", (shape.intermediate_size, hidden)),
                                 get(p + "mlp.up_proj.weight", (shape.intermediate_size, hidden))])
            self.layers.append(_Layer(
                input_norm=get(p + "input_layernorm.weight", (hidden,)),
                qkv_weight=qkv,
                qkv_bias=bias,
                o_weight=get(p + "self_attn.o_proj.weight", (hidden, q_dim)),
                post_norm=get(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up_weight=gate_up,
                down_weight=get(p + "mlp.down_proj.weight", (hidden, shape.intermediate_size)),
            ))
        # cos/sin for every position of the context, fp32, [max_pos, D] each; indexed per token.
        inv_freq = rope_inv_freq(shape)
        positions = torch.arange(shape.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos = emb.cos().to(device=self.device, dtype=dtype)
        self.rope_sin = emb.sin().to(device=self.device, dtype=dtype)
        self.compiled = compile
        # fp32 or bf16 weights (bf16 widened to fp32 in the kernels' registers)
        usable = dtype in native.DTYPES and self.device.type == "cpu" and not compile
        self.native = native_kernels if usable and hidden % 8 == 0 and q_dim % 8 == 0 else None
        # decode_native's fp32 copies of the small per-layer vectors (norm weights, q/k/v bias),
        # made at its first call: the C layer reads them as fp32 whatever the weights' dtype
        self._native_vectors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
        self._native_rope: tuple[torch.Tensor, torch.Tensor] = (self.rope_cos, self.rope_sin)
        # Prefill/extend: oneDNN GEMMs for fp32, and for bf16 where the CPU has bf16 dot
        # products (emulated bf16 would be slower than today's path); eager CPU only.
        self.bf16_native = dtype == torch.bfloat16 and gemm.cpu_bf16_native()
        fast = (self.device.type == "cpu" and not compile and gemm.onednn_available(self.device)
                and (dtype == torch.float32 or self.bf16_native))
        # _linear finds a projection's oneDNN form by the id of the weight it is handed.
        self._packed: dict[int, gemm.PackedLinear] = {}
        self._prefill: gemm.PrefillKernels | None = None
        # Packed oneDNN beats F.linear at every bf16 row count (see radixkv.kernels.gemm): bf16
        # projections of any size go through the packed copy, except few rows where the C
        # kernels run (they read the plain weights). Without those, nothing reads the plain
        # layer weights, and the packed copies replace them (no second copy).
        self._packed_all_rows = fast and dtype == torch.bfloat16
        drop_plain = self._packed_all_rows and self.native is None
        if fast:
            for layer in self.layers:
                for name, bias in (("qkv", layer.qkv_bias), ("o", None), ("gate_up", None), ("down", None)):
                    lin = gemm.PackedLinear(getattr(layer, name + "_weight"), bias, keep_plain=not drop_plain,
                                            c_gemm_allowed=native_kernels is not None)
                    if drop_plain and lin.packed is not None:
                        setattr(layer, name + "_weight", lin.packed)
                    setattr(layer, name + "_lin", lin)
                    self._packed[id(getattr(layer, name + "_weight"))] = lin
            # Logits: where few-row logits go through oneDNN (bf16 without the C kernels), a
            # packed copy (the embedding lookup of a tied head needs the plain table); else
            # oneDNN on the plain weight for many rows.
            self._packed[id(self.lm_head)] = gemm.PackedLinear(self.lm_head, pack=drop_plain)
            self._prefill = gemm.prefill_kernels(native_kernels)
            if self._prefill is not None:
                host_memory.keep_step_buffers_mapped()
        self.prefill_gemm = (gemm.gemm_backend(dtype, c_gemm_allowed=native_kernels is not None) if fast
                             else "torch F.linear")
        self.packed_weight_bytes = sum(lin.packed_bytes for lin in self._packed.values())
        # The C RoPE reads fp32 tables whatever the model dtype.
        self._rope_cos32 = emb.cos().contiguous() if self._prefill is not None else None
        self._rope_sin32 = emb.sin().contiguous() if self._prefill is not None else None
        self._attn_in_fn, self._attn_out_fn = self._attn_in, self._attn_out
        if compile:
            # dynamic=True: one graph for every packed length T (no recompile per batch shape).
            self._attn_in_fn = torch.compile(self._attn_in, dynamic=True)
            self._attn_out_fn = torch.compile(self._attn_out, dynamic=True)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``, the C kernel for a few fp32 rows (memory-bound decode GEMMs), or
        oneDNN (:class:`radixkv.kernels.gemm.PackedLinear`) for more rows, and for every bf16
        row count (``weight`` is then the packed tensor, which only oneDNN reads)."""
        few = x.shape[0] <= native.MAX_LINEAR_ROWS
        if few and self.native is not None:
            return native.linear(self.native, x, weight, bias)
        lin = self._packed.get(id(weight))
        if lin is not None and (not few or self._packed_all_rows):
            return lin(x)
        return F.linear(x, weight, bias)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Half-split RoPE (HF layout): pair i is (x[i], x[i + D/2]).
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _split_rope(self, qkv: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused ``[T, (Hq + 2 Hkv) D]`` projections -> rotated q ``[T, Hq, D]``, rotated k and
        v ``[T, Hkv, D]``."""
        shape = self.shape
        head_dim, num_tokens = shape.head_dim, qkv.shape[0]
        q_dim, kv_dim = shape.num_q_heads * head_dim, shape.num_kv_heads * head_dim
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = self._rotate(q.view(num_tokens, shape.num_q_heads, head_dim), cos, sin)
        k = self._rotate(k.view(num_tokens, shape.num_kv_heads, head_dim), cos, sin)
        return q, k, v.reshape(num_tokens, shape.num_kv_heads, head_dim)

    def _attn_in(self, hidden: torch.Tensor, input_norm: torch.Tensor, qkv_weight: torch.Tensor,
                 qkv_bias: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, fused q/k/v projection and RoPE of ``[T, hidden]`` (see :meth:`_split_rope`).
        Weights come in as arguments, so one compiled graph serves every layer."""
        return self._split_rope(self._linear(self._rms_norm(hidden, input_norm), qkv_weight, qkv_bias),
                                cos, sin)

    def _attn_out(self, hidden: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor,
                  post_norm: torch.Tensor, gate_up_weight: torch.Tensor,
                  down_weight: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and the SwiGLU MLP: the next ``[T, hidden]``."""
        hidden = hidden + self._linear(attn.reshape(hidden.shape[0], -1), o_weight)
        gate, up = self._linear(self._rms_norm(hidden, post_norm), gate_up_weight).chunk(2, dim=-1)
        return hidden + self._linear(F.silu(gate) * up, down_weight)

    def _layers_with_lora(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          attention: AttentionFn, lora: LoRABatch) -> torch.Tensor:
        """The decoder layers with each adapter's delta added to the fused projections (eager:
        the deltas need the projections' inputs); the base projections as :meth:`_linear`."""
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = self._linear(x, layer.qkv_weight, layer.qkv_bias)
            lora.add(qkv, x, i, "qkv")
            q, k, v = self._split_rope(qkv, cos, sin)
            attn = attention(i, q, k, v).reshape(hidden.shape[0], -1)
            o = self._linear(attn, layer.o_weight)
            lora.add(o, attn, i, "o")
            hidden = hidden + o
            x = self._rms_norm(hidden, layer.post_norm)
            gate_up = self._linear(x, layer.gate_up_weight)
            lora.add(gate_up, x, i, "gate_up")
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            down = self._linear(act, layer.down_weight)
            lora.add(down, act, i, "down")
            hidden = hidden + down
        return hidden

    def _layers_prefill(self, hidden: torch.Tensor, positions: torch.Tensor,
                        attention: AttentionFn, kernels: gemm.PrefillKernels) -> torch.Tensor:
        """The decoder layers of a prefill/extend step: oneDNN projections and one-pass C
        kernels for the elementwise work, the same maths as :meth:`_attn_in` /
        :meth:`_attn_out` (residual adds fused into the next RMSNorm; RoPE in place on the
        fused q/k/v output, so q/k/v reach ``attention`` as views of it).

        Args:
            hidden: ``[T, hidden]`` contiguous, a fresh tensor (updated in place).
            positions: ``[T]`` int64.

        Returns:
            ``[T, hidden]`` (``hidden`` itself).
        """
        shape = self.shape
        eps, head_dim, num_tokens = shape.rms_norm_eps, shape.head_dim, hidden.shape[0]
        num_q, num_kv = shape.num_q_heads, shape.num_kv_heads
        q_dim, kv_dim = num_q * head_dim, num_kv * head_dim
        assert self._rope_cos32 is not None and self._rope_sin32 is not None
        positions = positions.to(torch.int64).contiguous()
        layers = self.layers
        gate_up_width = 2 * shape.intermediate_size
        mlp_rows = max(_MLP_ROW_QUANTUM, host_memory.max_rows_per_buffer(gate_up_width, hidden.element_size())
                       // _MLP_ROW_QUANTUM * _MLP_ROW_QUANTUM)
        down_buf: torch.Tensor | None = None
        x = gemm.add_rms_norm(kernels, hidden, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            assert (layer.qkv_lin is not None and layer.o_lin is not None
                    and layer.gate_up_lin is not None and layer.down_lin is not None)
            qkv = layer.qkv_lin(x).contiguous()
            gemm.rope_inplace(kernels, qkv, num_q + num_kv, head_dim, positions,
                              self._rope_cos32, self._rope_sin32)
            q = qkv[:, :q_dim].view(num_tokens, num_q, head_dim)
            k = qkv[:, q_dim:q_dim + kv_dim].view(num_tokens, num_kv, head_dim)
            v = qkv[:, q_dim + kv_dim:].view(num_tokens, num_kv, head_dim)
            attn = attention(i, q, k, v).reshape(num_tokens, q_dim)
            x = gemm.add_rms_norm(kernels, hidden, layer.post_norm, eps, layer.o_lin(attn).contiguous())
            if num_tokens <= mlp_rows:
                down = layer.down_lin(gemm.silu_mul(kernels, layer.gate_up_lin(x).contiguous()))
            else:
                # Row chunks keep the gate/up output under the allocator's mmap threshold, so
                # it is reused from the heap instead of faulted in anew (kernels.host_memory).
                if down_buf is None:
                    down_buf = torch.empty_like(hidden)
                down = down_buf
                for start in range(0, num_tokens, mlp_rows):
                    rows = slice(start, start + mlp_rows)
                    down[rows].copy_(layer.down_lin(
                        gemm.silu_mul(kernels, layer.gate_up_lin(x[rows]).contiguous())))
            if i + 1 < len(layers):
                x = gemm.add_rms_norm(kernels, hidden, layers[i + 1].input_norm, eps, down.contiguous())
            else:
                hidden.add_(down)
        return hidden

    def decode_native(self, input_ids: torch.Tensor, positions: torch.Tensor, k_pools: list[torch.Tensor],
                      v_pools: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      kv_lens: torch.Tensor, *, window_left: int = -1,
                      k_scales: list[torch.Tensor] | None = None,
                      v_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        """A decode step (one new token per sequence, row i = sequence i, no LoRA) through the
        C kernels, one call per layer (:func:`radixkv.kernels.native.decode_layer`).

        Args:
            input_ids / positions: ``[N]`` int64.
            k_pools / v_pools: per layer ``[M, B, Hkv, D]`` of the model dtype, fp32 or bf16, or
                a quantized KV format's int8 / float8_e4m3fn (written at ``slot_mapping``: the
                new K/V quantized per (token, KV head) as ``kernels.kv_quant.quantize_kv``).
            slot_mapping: ``[N]`` int64; block_tables ``[N, max_blocks]`` int32 (checked by the
                caller); kv_lens ``[N]`` int32 (P + 1).
            window_left: sliding window (-1: none).
            k_scales / v_scales: per layer ``[M, B, Hkv]`` fp32 scale pools of quantized pools
                (written at ``slot_mapping``); None for unquantized pools.

        Returns:
            ``[N, vocab]`` fp32 logits. With bf16 weights the residual stream between layers
            and all arithmetic are fp32 (the torch bf16 path rounds after every op), so the
            logits differ from that path's by bf16 rounding noise.

        Raises:
            ValueError: when the native kernels are off for this model (``self.native`` None);
                naming ``k_scales`` / ``v_scales`` when given for some layers and not others,
                or for one list and not the other (each layer's pools and scales are checked
                by :func:`radixkv.kernels.native.decode_layer`).
        """
        kernels = self.native
        if kernels is None:
            raise ValueError("native_kernels: decode_native needs the native kernels "
                             "(fp32 or bf16 CPU weights, no compile)")
        shape = self.shape
        num_layers = len(self.layers)
        if (k_scales is None) != (v_scales is None):
            raise ValueError("k_scales, v_scales: give both scale pool lists or neither")
        for name, pools in (("k_scales", k_scales), ("v_scales", v_scales)):
            if pools is not None and len(pools) != num_layers:
                raise ValueError(f"{name}: need one scale pool per layer ({num_layers}), got {len(pools)}")
        layer_scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = (
            list(zip(k_scales, v_scales)) if k_scales is not None and v_scales is not None
            else [(None, None)] * num_layers)
        if self._native_vectors is None:
            self._native_vectors = [
                (layer.input_norm.float(), layer.post_norm.float(),
                 None if layer.qkv_bias is None else layer.qkv_bias.float()) for layer in self.layers]
            # RoPE rows exact in fp32 whatever the model dtype: bf16-rounded tables (relative
            # error 2^-9) moved SmolLM2's bf16 decode logits 10x further from the fp32 model's
            # on the same weights than the bf16 K/V rounding did
            if self.rope_cos.dtype == torch.float32:
                self._native_rope = (self.rope_cos, self.rope_sin)
            else:
                positions_all = torch.arange(shape.max_position_embeddings, dtype=torch.int64).float()
                freqs = positions_all[:, None] * rope_inv_freq(shape)[None, :]
                emb = torch.cat([freqs, freqs], dim=-1)
                self._native_rope = (emb.cos().contiguous(), emb.sin().contiguous())
        rope_cos, rope_sin = self._native_rope
        step = native.DecodeStep(
            slots=slot_mapping.to(torch.int64).contiguous(), block_tables=block_tables, kv_lens=kv_lens,
            q_rows=torch.arange(input_ids.shape[0], dtype=torch.int64),
            cos=rope_cos[positions].contiguous(), sin=rope_sin[positions].contiguous(),
            sm_scale=shape.head_dim ** -0.5, window_left=window_left, chunk_tokens=256)
        hidden = self.embed[input_ids].float().contiguous()
        for layer, (input_norm, post_norm, qkv_bias), k_pool, v_pool, (k_scale, v_scale) in zip(
                self.layers, self._native_vectors, k_pools, v_pools, layer_scales):
            native.decode_layer(kernels, hidden, step, input_norm=input_norm,
                                qkv_weight=layer.qkv_weight, qkv_bias=qkv_bias,
                                o_weight=layer.o_weight, post_norm=post_norm,
                                gate_up_weight=layer.gate_up_weight, down_weight=layer.down_weight,
                                rms_norm_eps=shape.rms_norm_eps, k_pool=k_pool, v_pool=v_pool,
                                num_q_heads=shape.num_q_heads, k_scales=k_scale, v_scales=v_scale)
        # fp32 hidden against the model-dtype norm weight and LM head: fp32 logits (the C
        # linear reads a bf16 LM head as bf16)
        return self._linear(self._rms_norm(hidden, self.final_norm), self.lm_head).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                logit_rows: torch.Tensor | None = None,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """Run the decoder on packed tokens.

        Token ids and positions are trusted, not checked: they are validated where they enter
        (``LLMEngine.prepare_request`` checks ids against the vocabulary and prompt + max_tokens
        against the context), and a check here would sync the device every step.

        Args:
            input_ids: ``[T]`` int64 token ids, each in ``[0, vocab_size)``.
            positions: ``[T]`` int64 absolute positions, each in ``[0, max_position_embeddings)``.
            attention: callback computing attention of layer ``i`` (it also stores K/V).
            logit_rows: ``[R]`` int64 rows whose logits to return; None = all T rows.
            lora: which rows add which LoRA adapter's delta to the projections; None (no
                adapter in the batch) adds no work.

        Returns:
            ``[R, vocab]`` (or ``[T, vocab]``) fp32 logits.

        Raises:
            ValueError: if ``positions`` and ``input_ids`` differ in shape (host metadata: no sync).
        """
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions: shape {tuple(positions.shape)} != input_ids "
                             f"{tuple(input_ids.shape)}")
        cos = self.rope_cos[positions][:, None, :]  # [T, 1, D], broadcast over heads
        sin = self.rope_sin[positions][:, None, :]
        hidden = self.embed[input_ids]
        prefill = self._prefill
        if lora is None and prefill is not None and input_ids.shape[0] > native.MAX_LINEAR_ROWS:
            hidden = self._layers_prefill(hidden.contiguous(), positions, attention, prefill)
        elif lora is None:
            attn_in, attn_out = self._attn_in_fn, self._attn_out_fn
            for i, layer in enumerate(self.layers):
                q, k, v = attn_in(hidden, layer.input_norm, layer.qkv_weight, layer.qkv_bias, cos, sin)
                attn = attention(i, q, k, v)
                hidden = attn_out(hidden, attn, layer.o_weight, layer.post_norm,
                                  layer.gate_up_weight, layer.down_weight)
        else:
            hidden = self._layers_with_lora(hidden, cos, sin, attention, lora)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        hidden = self._rms_norm(hidden, self.final_norm)
        return self._linear(hidden, self.lm_head).float()

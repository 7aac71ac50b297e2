"""Model runner: owns the paged KV pools and runs packed suffix prefills / decodes.

A step hands the runner one ``(new_token_ids, prefix_len, block_table)`` tuple per sequence.
The runner packs the new tokens ``[T]``, gives token j of sequence i the absolute position
``prefix_len + j`` and the pool slot ``block_table[pos // B] * B + pos % B``, runs the forward,
writes every new token's K/V into its slot and attends over (cached prefix from the pool +
causal suffix). Only full blocks before ``prefix_len`` are ever read from other requests, and
the runner never writes a slot outside the new tokens' own positions.

Models beyond the Llama layer (Qwen3, Gemma 2 / 3: ``ModelShape.plain_llama`` False) run
:class:`radixkv.model.family_forward.FamilyForward`, and each layer's attention goes to a path
that implements its window, scale and logit soft-cap (:meth:`ModelRunner._family_attention`;
``docs/model-families.md``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import time
from collections.abc import Mapping, Sequence
from types import ModuleType

import numpy
import structlog
import torch

from radixkv.config import check_block_size, check_int
from radixkv.kernels import gemm, host_memory, native, native_attention, reference
from radixkv.kernels.kv_quant import KVFormat, resolve_kv_format
from radixkv.kernels.paged_sdpa import native_quant_formats, plan_attention

from .config import ModelShape
from .family_forward import make_forward
from .forward_batch import ForwardBatch, padded_tables, window_group_tables
from .llama import AttentionFn
from .loader import LoadedModel
from .lora import LoRAAdapter, LoRABatch

__all__ = ["ForwardBatch", "ModelRunner", "kv_format_problem"]

log = structlog.get_logger(__name__)

_BACKENDS = ("auto", "torch", "reference", "triton")


class ModelRunner:
    """Weights + per-layer KV pools + the step forward.

    Args:
        model: loaded model (shape, HF-named state dict, dtype).
        num_blocks: M, blocks per pool.
        block_size: B, token slots per block.
        device: torch device for weights and pools.
        attention_backend: ``"torch"`` (``radixkv.kernels.paged_sdpa``: one plan per step,
            one batched SDPA per layer; any device), ``"reference"`` (the per-sequence torch
            oracle, ``radixkv.kernels.reference``), ``"triton"`` (the ``radixkv.kernels``
            Triton kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"`` (triton
            on CUDA, torch elsewhere).
        compile: ``torch.compile`` the decoder layers' dense math (see ``LlamaForward``;
            refused, naming ``compile``, for a model that is not ``plain_llama``).
        native_kernels: use the C decode kernels (``radixkv.kernels.native``: few-row
            projections and decode attention over the pool) on the ``torch`` backend with fp32
            CPU weights and no ``compile``; None = wherever they build and run
            (``RADIXKV_NATIVE_KERNELS=0`` turns them off), False = never.
        kv_cache_dtype: KV pool format (``radixkv.kernels.kv_quant``): ``auto`` (the model
            dtype), ``float32`` / ``bfloat16`` (the model dtype only), ``int8`` or
            ``fp8_e4m3`` (quantized with one fp32 scale per token and KV head, stored in
            scale pools beside the values).
        window_num_blocks: None (default): every layer's pools have ``num_blocks`` blocks and
            one block table serves every layer. Given: KV groups, the layout of
            docs/sliding-window.md: the full-attention layers keep ``num_blocks``-block pools
            and the full block table; each window group (the layers of one window size) gets
            pools of ``window_num_blocks`` blocks and a block table of its own per sequence
            (``build_batch(window_tables=...)``), whose block 0 is the null block (zeros,
            never written) standing in for blocks wholly left of the window. Needs a model with
            window layers; ``>= 2``.

    Attributes:
        kv_format: the resolved ``KVFormat``.
        k_pools / v_pools: per layer ``[M, B, Hkv, D]`` contiguous tensors of
            ``kv_format.storage_dtype`` (the model dtype, int8 or float8_e4m3fn).
        k_scales / v_scales: per layer ``[M, B, Hkv]`` contiguous fp32 scale pools (block
            ``b``'s scales are row ``b``) for a quantized format; None otherwise.
        bytes_per_block: K+V bytes of one block over all layers, scales included (the
            keep-all layout; with window KV groups see :attr:`group_bytes_per_block`).
        kv_group_of_layer: per layer, its KV group: the layer's ``window_left`` for a window
            layer of a runner with window KV groups, -1 (the full group, whose pools and block
            table are the batch's own) otherwise.
        kv_groups: KV group -> blocks in each of its layers' pools.

    Raises:
        ValueError: on a ``num_blocks`` < 1, naming ``window_num_blocks`` when < 2 or given
            for a model without window layers, a ``block_size`` outside ``[1, MAX_BLOCK_SIZE]``
            (``radixkv.config``), an unknown backend, ``"triton"`` where it cannot run
            (triton missing, or CPU without TRITON_INTERPRET=1), or a ``kv_cache_dtype`` this
            model, backend or device cannot run (:func:`kv_format_problem`; naming
            ``kv_cache_dtype``).
    """

    def __init__(self, model: LoadedModel, *, num_blocks: int, block_size: int,
                 device: str = "cpu", attention_backend: str = "torch", compile: bool = False,
                 native_kernels: bool | None = None, kv_cache_dtype: str = "auto",
                 window_num_blocks: int | None = None) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        if window_num_blocks is not None:
            check_int("window_num_blocks", window_num_blocks, minimum=2)
            if all(w < 0 for w in model.shape.layer_window_lefts):
                raise ValueError("window_num_blocks: the model has no sliding-window layers")
        check_block_size(block_size)
        if attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend: must be one of {_BACKENDS}, got {attention_backend!r}")
        self.device = torch.device(device)
        self.attention_backend, self._attn_ops = _select_attention_backend(attention_backend, self.device)
        self.kv_format: KVFormat = resolve_kv_format(kv_cache_dtype, model.dtype)
        problem = _backend_kv_problem(self.kv_format, self.attention_backend, self._attn_ops, self.device)
        if problem is not None:
            raise ValueError(f"kv_cache_dtype: {problem}")
        self.model = model
        self.shape: ModelShape = model.shape
        # Layers beyond Llama's: FamilyForward, attention routed per layer (checked once here,
        # not per step).
        self._family_layers = not self.shape.plain_llama
        self.dtype = model.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        kernels = None
        if (native_kernels is not False and self.attention_backend == "torch" and not compile
                and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)):
            kernels = native.load()
        self.native = kernels
        shape = self.shape
        # The C decode kernels take fp32 and bf16 weights / pools (bf16 widened in registers).
        decode_ok = self.dtype in native.DTYPES and native.decode_supported(
            shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
        # Extend rows (prefills, prefix-hit suffixes) on the C extend kernel, fp32 or bf16 pools.
        extend_ok = native_attention.extend_supported(shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
        if self.kv_format.quantized:
            # Quantized pools go to a C kernel only where it says it reads them; else the torch
            # gather path dequantizes them (kernels.paged_sdpa).
            decode_formats, extend_formats = native_quant_formats()
            decode_ok = decode_ok and self.kv_format.name in decode_formats
            extend_ok = extend_ok and self.kv_format.name in extend_formats
        self._native_decode = kernels if kernels is not None and decode_ok else None
        self._native_extend = kernels if kernels is not None and extend_ok else None
        # A quantized pool's extend-step K/V write in C where the C kernels take the format.
        self._native_write = (kernels if kernels is not None and self.kv_format.quantized
                              and self.kv_format.name in native_quant_formats()[0] else None)
        self.forward_model = make_forward(self.shape, model.state_dict, device=self.device, dtype=self.dtype,
                                          compile=compile, native_kernels=kernels)
        #: Wall seconds the latest :meth:`forward` spent in attention over all layers (K/V
        #: pool writes included, except in the fused C decode layer), measured on the CPU;
        #: None on an accelerator (not timed).
        self.last_attention_seconds: float | None = None
        if self.dtype == torch.bfloat16 and self.device.type == "cpu" and not self.forward_model.bf16_native:
            log.warning("bf16_emulated", missing_cpu_flags=list(gemm.BF16_DOT_FLAGS),
                        detail="no native bf16 dot products: bf16 prefill GEMMs and elementwise ops "
                               "stay on torch (F.linear); decode steps and extend attention still "
                               "take the C kernels where they loaded (fp32 arithmetic on bf16 data)")
        self.kv_group_of_layer: tuple[int, ...] = tuple(
            w if window_num_blocks is not None and w >= 0 else -1 for w in shape.layer_window_lefts)
        self.kv_groups: dict[int, int] = {
            group: num_blocks if group < 0 else int(window_num_blocks or 0)
            for group in sorted(set(self.kv_group_of_layer))}
        storage = self.kv_format.storage_dtype
        pool_shapes = [(self.kv_groups[group], block_size, shape.num_kv_heads, shape.head_dim)
                       for group in self.kv_group_of_layer]
        self.k_pools = [_zeroed(ps, storage, self.device) for ps in pool_shapes]
        self.v_pools = [_zeroed(ps, storage, self.device) for ps in pool_shapes]
        self.k_scales: list[torch.Tensor] | None = None
        self.v_scales: list[torch.Tensor] | None = None
        if self.kv_format.quantized:
            self.k_scales = [_zeroed(ps[:3], torch.float32, self.device) for ps in pool_shapes]
            self.v_scales = [_zeroed(ps[:3], torch.float32, self.device) for ps in pool_shapes]
        self.bytes_per_block = self.bytes_per_block_for(self.shape, block_size, self.dtype,
                                                        self.kv_format.name)
        # K+V of one token in one layer as attention gathers it (dequantized: the model dtype),
        # the paged_sdpa plan's group budget.
        self._kv_bytes_per_token = 2 * self.shape.num_kv_heads * self.shape.head_dim * _itemsize(self.dtype)
        log.info("model_runner_ready", model=model.name, num_blocks=num_blocks, block_size=block_size,
                 kv_cache_dtype=self.kv_cache_dtype, kv_bytes_per_token=self.kv_bytes_per_token,
                 kv_pool_bytes=sum(t.numel() * t.element_size() for t in self._pool_tensors()),
                 kv_groups={str(g): n for g, n in self.kv_groups.items()}, device=str(self.device),
                 attention_backend=self.attention_backend, native_kernels=kernels is not None,
                 prefill_gemm=self.forward_model.prefill_gemm,
                 packed_weight_bytes=self.forward_model.packed_weight_bytes,
                 bf16_native=self.device.type == "cpu" and gemm.cpu_bf16_native())
        # The pool's pages mapped on a background thread, not by the first requests that write
        # them (radixkv.kernels.host_memory); off unless the CLI enabled it for this process.
        self.pool_populate: host_memory.PoolPopulator | None = None
        if self.device.type == "cpu" and host_memory.pool_populate_enabled():
            # The full group's pools (a window group's are small and touched at once).
            regions = [(int(t.data_ptr()), t[0].numel() * t.element_size()) for t in self._pool_tensors()
                       if t.shape[0] == num_blocks]
            self.pool_populate = host_memory.PoolPopulator(regions, num_blocks).start()

    @staticmethod
    def bytes_per_block_for(shape: ModelShape, block_size: int, dtype: torch.dtype,
                            kv_cache_dtype: str = "auto") -> int:
        """K+V bytes of one block over all layers, scales included:
        ``B * KVFormat.bytes_per_token(layers, Hkv, D)`` (unquantized:
        ``2 * layers * B * Hkv * D * itemsize``; int8: ``2 * layers * B * Hkv * (D + 4)``).

        Raises:
            ValueError: naming ``kv_cache_dtype`` (``kv_quant.resolve_kv_format``).
        """
        fmt = resolve_kv_format(kv_cache_dtype, dtype)
        return block_size * fmt.bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim)

    @property
    def group_bytes_per_block(self) -> dict[int, int]:
        """KV group -> K+V bytes of one of its blocks over its layers, scales included
        (``B * KVFormat.bytes_per_token(layers in the group, Hkv, D)``)."""
        return {group: self.block_size * self.kv_format.bytes_per_token(
                    self.kv_group_of_layer.count(group), self.shape.num_kv_heads, self.shape.head_dim)
                for group in self.kv_groups}

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one cached token over all layers, scales included (SmolLM2: 46,080
        fp32, 12,240 int8)."""
        return self.kv_format.bytes_per_token(self.shape.num_layers, self.shape.num_kv_heads,
                                              self.shape.head_dim)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV dtype actually allocated, read from the pool tensors: ``float32``,
        ``bfloat16``, ``int8`` or ``fp8_e4m3`` (what ``/stats`` and ``/v1/models`` report)."""
        return _POOL_DTYPE_NAMES.get(self.k_pools[0].dtype, str(self.k_pools[0].dtype))

    def build_batch(self, seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
                    adapters: Sequence[LoRAAdapter | None] | None = None, *,
                    window_tables: Sequence[Mapping[int, Sequence[int]]] | None = None) -> ForwardBatch:
        """Pack sequences into one ForwardBatch (CPU tensors).

        Args:
            seqs: per sequence ``(new_token_ids, prefix_len, block_table)``: the L tokens to
                compute, the P tokens already in the pool, and block ids covering at least
                ``P + L`` token slots (the full group's, with window KV groups).
            adapters: per sequence, its LoRA adapter or None (base model); None: no adapters.
            window_tables: with window KV groups (``window_num_blocks``), required: per
                sequence, per window group (its ``window_left`` w, a key of :attr:`kv_groups`)
                the block table into that group's pools, position p in entry ``p // B``. The
                blocks overlapping ``[max(0, P - w), P + L)`` (what the new rows attend to and
                write) must be ids in ``[1, window_num_blocks)``; earlier entries may be 0, the
                null block. Without window groups it must be None.

        Raises:
            ValueError: naming the field, for an empty batch, an empty ``new_token_ids``, a
                negative ``prefix_len``, a context overflow, a ``block_table`` too short or
                holding a block id outside ``[0, num_blocks)``, or ``window_tables`` missing,
                given without window groups, or short of a group, a needed block or a valid id.
        """
        if not seqs:
            raise ValueError("seqs: empty batch")
        if adapters is not None and len(adapters) != len(seqs):
            raise ValueError(f"adapters: {len(adapters)} entries for {len(seqs)} sequences")
        window_groups = [g for g in self.kv_groups if g >= 0]
        if window_groups and window_tables is None:
            raise ValueError("window_tables: required with window KV groups (window_num_blocks)")
        if not window_groups and window_tables is not None:
            raise ValueError("window_tables: this runner has no window KV groups")
        if window_tables is not None and len(window_tables) != len(seqs):
            raise ValueError(f"window_tables: {len(window_tables)} entries for {len(seqs)} sequences")
        block_size = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        indptr = [0]
        prefix_lens: list[int] = []
        tables: list[list[int]] = []
        for i, (new_ids, prefix_len, table) in enumerate(seqs):
            num_new = len(new_ids)
            if num_new == 0:
                raise ValueError(f"new_token_ids: sequence {i} has no new tokens")
            if prefix_len < 0:
                raise ValueError(f"prefix_len: sequence {i} has negative prefix_len {prefix_len}")
            end = prefix_len + num_new
            if end > self.shape.max_position_embeddings:
                raise ValueError(f"new_token_ids: sequence {i} reaches {end} tokens > context "
                                 f"{self.shape.max_position_embeddings}")
            needed = -(-end // block_size)
            if len(table) < needed:
                raise ValueError(f"block_table: sequence {i} has {len(table)} blocks, needs {needed} "
                                 f"for {end} tokens")
            used = table[:needed]
            if min(used) < 0 or max(used) >= self.num_blocks:
                raise ValueError(f"block_table: sequence {i} holds a block id outside [0, {self.num_blocks})")
            ids.extend(new_ids)
            for pos in range(prefix_len, end):
                positions.append(pos)
                slots.append(used[pos // block_size] * block_size + pos % block_size)
            indptr.append(indptr[-1] + num_new)
            prefix_lens.append(prefix_len)
            tables.append(list(table))
        window_block_tables = window_slots = None
        if window_tables is not None:
            window_block_tables, window_slots = {}, {}
            for group in window_groups:
                group_tables, group_slots = window_group_tables(
                    seqs, window_tables, group, self.block_size, self.kv_groups[group])
                window_block_tables[group] = padded_tables(group_tables)
                window_slots[group] = torch.tensor(group_slots, dtype=torch.int64)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            qo_indptr=torch.tensor(indptr, dtype=torch.int32),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
            block_tables=padded_tables(tables),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            lora=LoRABatch.build(adapters, indptr, self.device),
            window_block_tables=window_block_tables,
            window_slot_mapping=window_slots,
        )

    def _group_meta(self, batch: ForwardBatch, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(block_tables, slot_mapping, pool blocks)`` the layers of KV group ``group`` read
        and write through (the batch's own for the full group)."""
        if group < 0 or batch.window_block_tables is None or batch.window_slot_mapping is None:
            return batch.block_tables, batch.slot_mapping, self.num_blocks
        return batch.window_block_tables[group], batch.window_slot_mapping[group], self.kv_groups[group]

    def warm_up(self) -> float:
        """Run a 2-token prefill and a 1-token decode in block 0, so a compiled model builds
        its graphs (T = 1 is specialised apart from T >= 2) before a request waits on them.

        Only call while block 0 holds nothing cached (at start): its slots are overwritten.

        Returns:
            Seconds spent (the compile time when ``compile`` is on).
        """
        started = time.perf_counter()
        self.forward(self.build_batch([([0, 0], 0, [0])]))
        self.forward(self.build_batch([([0], 0, [0])]))
        return time.perf_counter() - started

    def _pool_tensors(self) -> list[torch.Tensor]:
        """Every pool tensor in :meth:`kv_segments` order: K0, V0, …, then Ks0, Vs0, …"""
        tensors = [pool for pair in zip(self.k_pools, self.v_pools) for pool in pair]
        if self.k_scales is not None and self.v_scales is not None:
            tensors += [s for pair in zip(self.k_scales, self.v_scales) for s in pair]
        return tensors

    @torch.inference_mode()
    def kv_segments(self) -> list[tuple[int, int]]:
        """``(host base address, bytes per block)`` of every pool tensor, in the fixed order
        K0, V0, K1, V1, …, K_{L-1}, V_{L-1}, then for a quantized format the scale pools
        Ks0, Vs0, Ks1, Vs1, … (``B * Hkv * 4`` bytes per block). Block ``b`` of segment ``i``
        is the ``bytes`` at ``base + b * bytes`` (every pool is contiguous, block-major); the
        sizes sum to :attr:`bytes_per_block`. The store tier moves block bytes through them.

        Raises:
            ValueError: naming ``kv_store`` when the pools are not in host memory (a device
                pool needs device copies, which the store tier does not do yet).
        """
        if self.device.type != "cpu":
            raise ValueError(f"kv_store: the store tier needs the KV pool in host memory; this "
                             f"runner's pool is on {self.device}")
        if len(self.kv_groups) > 1:
            raise ValueError("kv_store: the store tier moves whole blocks of every layer; window "
                             "KV groups (window_num_blocks) have per-group block ids")
        return [(int(t.data_ptr()), t[0].numel() * t.element_size()) for t in self._pool_tensors()]

    @torch.inference_mode()
    def kv_segment_bases(self) -> list[int]:
        """Host addresses of every layer's K and V pool (K0, V0, K1, V1, …) of an unquantized
        format: block ``b``'s K/V in pool ``i`` is the ``segment_bytes = B * Hkv * D *
        itemsize`` bytes at ``bases[i] + b * segment_bytes`` (the pools are contiguous
        ``[M, B, Hkv, D]``). Quantized formats: :meth:`kv_segments` (it has the scales).

        Raises:
            ValueError: naming ``kv_store`` when the pools are not in host memory (a device
                pool needs device copies, which the store tier does not do yet), or the format
                is quantized (these bases leave out the scale pools, so a block stored through
                them would lose its scales).
        """
        if self.kv_format.quantized:
            raise ValueError(f"kv_store: the {self.kv_format.name} KV pool keeps scale pools "
                             f"beside its values; the store tier must move kv_segments()")
        return [base for base, _ in self.kv_segments()]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy the K/V of whole blocks ``src -> dst`` in every layer's pools, and their scale
        rows for a quantized format.

        Used for copy-on-write of a partial tail block when a sequence forks (``n > 1``).

        Args:
            copies: ``(src_block, dst_block)`` pairs; dst blocks must be distinct from srcs.

        Raises:
            ValueError: naming ``copies`` with window KV groups (ids are per group there).
        """
        if not copies:
            return
        if len(self.kv_groups) > 1:
            raise ValueError("copies: block ids are per KV group with window_num_blocks; "
                             "copy-on-write of grouped blocks is not supported")
        device = self.k_pools[0].device
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
        for pool in self._pool_tensors():
            if pool.dtype == torch.float8_e4m3fn:  # no float8 index_copy_: copy the bytes
                pool = pool.view(torch.uint8)
            pool.index_copy_(0, dst, pool.index_select(0, src))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> torch.Tensor:
        """Run one step: write K/V of every row into the pools and return logits.

        Args:
            batch: from :meth:`build_batch`.
            all_logits: return every row's logits instead of each sequence's last row.

        Returns:
            fp32 logits on the runner device: ``[N, vocab]`` (last row of each sequence) or
            ``[T, vocab]`` when ``all_logits``.
        """
        batch = batch.to(self.device)
        rows = None if all_logits else batch.qo_indptr[1:].to(torch.int64) - 1
        self.last_attention_seconds = None
        if self._family_layers:
            return self.forward_model.forward(batch.input_ids, batch.positions,
                                              self._timed(self._family_attention(batch)), rows,
                                              lora=batch.lora)
        window_left = self.shape.window_left
        if self.attention_backend == "torch":
            # Metadata-only work (slots, masks, padding) once per step, not once per layer. One
            # window for every layer here, so one KV group.
            tables, slots, pool_blocks = self._group_meta(batch, self.kv_group_of_layer[0])
            plan = plan_attention(tables, batch.prefix_lens, batch.qo_indptr,
                                  slots, block_size=self.block_size,
                                  num_pool_blocks=pool_blocks, head_dim=self.shape.head_dim,
                                  window_left=window_left,
                                  kv_bytes_per_token=self._kv_bytes_per_token,
                                  native_kernels=self._native_decode,
                                  native_extend=self._native_extend,
                                  native_write=self._native_write)

            nd = plan.native
            if (nd is not None and not plan.groups and plan.native_extend is None and batch.lora is None
                    and self.forward_model.native is not None
                    and batch.num_tokens <= native.MAX_LINEAR_ROWS):
                # A pure decode step: every layer is one C call (rows = sequences, in order).
                # (_native_decode is set for a quantized format only where the C kernels read it.)
                scales = ({} if self.k_scales is None
                          else {"k_scales": self.k_scales, "v_scales": self.v_scales})
                kernels = self.forward_model.native
                kernels.take_attention_seconds()  # drop what other callers left
                logits = self.forward_model.decode_native(
                    batch.input_ids, batch.positions, self.k_pools, self.v_pools, plan.slot_mapping,
                    nd.block_tables, nd.kv_lens, window_left=window_left, **scales)
                self.last_attention_seconds = kernels.take_attention_seconds()
                return logits
            k_scales, v_scales = self.k_scales, self.v_scales

            def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                if k_scales is None or v_scales is None:
                    return plan.attend(q, k, v, self.k_pools[layer], self.v_pools[layer])
                return plan.attend(q, k, v, self.k_pools[layer], self.v_pools[layer],
                                   k_scales[layer], v_scales[layer])
        else:
            attention = self._kernel_attention(batch, [window_left] * self.shape.num_layers)
        return self.forward_model.forward(batch.input_ids, batch.positions, self._timed(attention),
                                          rows, lora=batch.lora)

    def _timed(self, attention: AttentionFn) -> AttentionFn:
        """``attention`` adding each call's wall time to :attr:`last_attention_seconds` (which
        starts the step at 0). On the CPU the call is synchronous, so its wall time is the
        attention's (the K/V write into the pool included); on an accelerator the kernels run
        asynchronously and only events could time them, so nothing is measured (stays None)."""
        if self.device.type != "cpu":
            return attention
        self.last_attention_seconds = 0.0
        clock = time.perf_counter
        total_s = [0.0]

        def timed(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t0 = clock()
            out = attention(layer, q, k, v)
            total_s[0] += clock() - t0
            self.last_attention_seconds = total_s[0]
            return out

        return timed

    def _family_attention(self, batch: ForwardBatch):
        """The attention callback of a model that is not ``plain_llama``: each layer with its
        own window (``ModelShape.layer_window_lefts``), the model's attention scale and logit
        soft cap, on a path that implements all three.

        - triton / reference backends: their kernels take all three per call;
        - torch backend with ``attn_logit_softcap`` (Gemma 2): neither SDPA nor the C kernels
          cap logits, so every layer runs the reference kernels (explicit fp32 scores);
        - torch backend otherwise: one ``paged_sdpa`` plan per distinct window (the C decode /
          extend kernels inside it where they loaded: they take the scale and window), each
          layer attending through its window's plan.
        """
        shape = self.shape
        windows = shape.layer_window_lefts
        scale = shape.attention_scale
        cap = shape.attn_logit_softcap
        if self.attention_backend != "torch" or cap is not None:
            ops = self._attn_ops if self.attention_backend != "torch" else reference
            return self._kernel_attention(batch, windows, ops=ops, sm_scale=scale,
                                          logits_soft_cap=0.0 if cap is None else cap)
        plans = {}
        for window, group in sorted(set(zip(windows, self.kv_group_of_layer))):
            tables, slots, pool_blocks = self._group_meta(batch, group)
            plans[window] = plan_attention(tables, batch.prefix_lens, batch.qo_indptr, slots,
                                           block_size=self.block_size, num_pool_blocks=pool_blocks,
                                           head_dim=shape.head_dim, window_left=window,
                                           sm_scale=scale, kv_bytes_per_token=self._kv_bytes_per_token,
                                           native_kernels=self._native_decode,
                                           native_extend=self._native_extend,
                                           native_write=self._native_write)
        layer_plans = [plans[window] for window in windows]
        k_scales, v_scales = self.k_scales, self.v_scales

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if k_scales is None or v_scales is None:
                return layer_plans[layer].attend(q, k, v, self.k_pools[layer], self.v_pools[layer])
            return layer_plans[layer].attend(q, k, v, self.k_pools[layer], self.v_pools[layer],
                                             k_scales[layer], v_scales[layer])

        return attention

    def _kernel_attention(self, batch: ForwardBatch, window_lefts: Sequence[int],
                          ops: ModuleType | None = None, **options: float):
        """The attention callback over the three-function backends (reference, triton):
        layer i with ``window_lefts[i]``; ``ops`` (default: the runner's backend module) and
        ``options`` (``sm_scale``, ``logits_soft_cap``) passed to every attention call."""
        max_q_len = int((batch.qo_indptr[1:] - batch.qo_indptr[:-1]).max())
        ops = self._attn_ops if ops is None else ops
        # A pure decode step on the Triton backend takes the split-KV decode kernel: the extend
        # kernel would spend a whole BLOCK_M row tile on each single query. The new token's K/V
        # is written first, so the sequence's keys are exactly its first P + 1 pool slots.
        kv_lens = batch.prefix_lens + 1 if max_q_len == 1 and self.attention_backend == "triton" else None

        k_scales, v_scales = self.k_scales, self.v_scales

        metas = {group: self._group_meta(batch, group) for group in self.kv_groups}

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
            tables, slots, _ = metas[self.kv_group_of_layer[layer]]
            # Quantized pools: the layer's scale pools (kv_quant); unquantized calls unchanged.
            scales = ({} if k_scales is None or v_scales is None
                      else {"k_scale_pool": k_scales[layer], "v_scale_pool": v_scales[layer]})
            ops.paged_kv_write(k, v, k_pool, v_pool, slots, **scales)
            window_left = window_lefts[layer]
            if kv_lens is not None:
                return ops.decode_attention(q, k_pool, v_pool, tables, kv_lens,
                                            window_left=window_left, **options, **scales)
            return ops.extend_attention(
                q, k, v, k_pool, v_pool, tables, batch.prefix_lens, batch.qo_indptr,
                max_q_len=max_q_len, window_left=window_left, **options, **scales)

        return attention


#: Pool storage dtype -> ``--kv-cache-dtype`` name (``ModelRunner.kv_cache_dtype``).
_POOL_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8",
                     torch.float8_e4m3fn: "fp8_e4m3"}
#: The attention ops a backend module must take ``k_scale_pool`` / ``v_scale_pool`` in to run
#: a quantized pool.
_SCALED_OPS = ("paged_kv_write", "extend_attention", "decode_attention")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _backend_kv_problem(fmt: KVFormat, backend: str, ops: ModuleType, device: torch.device) -> str | None:
    """Why a pool of ``fmt`` cannot run on this resolved backend and device, or None.

    The torch and reference backends take every format (torch dequantizes per gathered block;
    the C kernels only take what they list). Triton needs kernels that accept scale pools
    (``k_scale_pool`` in the signatures of its three ops) and, for fp8_e4m3, a CUDA device
    with e4m3 conversions (compute capability 8.9+; the CPU interpreter emulates them).
    """
    if not fmt.quantized or backend != "triton":
        return None
    lacking = [name for name in _SCALED_OPS
               if "k_scale_pool" not in inspect.signature(getattr(ops, name)).parameters]
    if lacking:
        return (f"{fmt.name} is not supported by the triton attention backend here (its "
                f"{', '.join(lacking)} take no scale pools); use --attention-backend torch, or "
                f"--kv-cache-dtype auto")
    if fmt.name == "fp8_e4m3" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"fp8_e4m3 needs a GPU of compute capability 8.9 or newer for the triton "
                    f"kernels, this one is {major}.{minor}; use --kv-cache-dtype int8")
    return None


def kv_format_problem(kv_cache_dtype: str, dtype: torch.dtype, attention_backend: str,
                      device: str) -> str | None:
    """Why ``--kv-cache-dtype`` cannot run for a ``dtype`` model on this backend and device
    (no field prefix), or None: what :class:`ModelRunner` would refuse, checked before a
    model is loaded (``radixkv serve``). Imports the Triton kernels for ``triton``."""
    try:
        fmt = resolve_kv_format(kv_cache_dtype, dtype)
    except ValueError as exc:
        return str(exc).removeprefix("kv_cache_dtype: ")
    torch_device = torch.device(device)
    try:
        backend, ops = _select_attention_backend(attention_backend, torch_device)
    except ValueError:  # the backend's own problem: the runner names attention_backend
        return None
    return _backend_kv_problem(fmt, backend, ops, torch_device)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on the CPU, from pages the kernel zeroes on first touch.

    Zeroed, not empty: stale memory could hold NaN, and a bug reading an unwritten slot should
    show up as a wrong logit rather than poison a whole batch. ``torch.zeros`` writes every
    byte up front (8-10 s for the default 4 GiB pool on 2 cores, at every start); numpy's
    ``zeros`` takes large buffers from ``calloc``, i.e. fresh anonymous pages that cost
    nothing until a block is first written.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = numpy.zeros(math.prod(shape) * itemsize, dtype=numpy.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _select_attention_backend(name: str, device: torch.device) -> tuple[str, ModuleType]:
    """Resolve ``auto`` and return ``(backend name, module with the three attention ops)``.

    ``auto`` is triton on CUDA and torch elsewhere (``torch`` builds ``paged_sdpa`` plans in
    :meth:`ModelRunner.forward`; its module entry is the reference, unused). ``triton`` on a
    CPU needs the Triton interpreter (``TRITON_INTERPRET=1`` set before the kernels are
    imported): tests use it, serving should not.

    Raises:
        ValueError: naming ``attention_backend`` when triton cannot run here.
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name in ("torch", "reference"):
        return name, reference
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
    if device.type == "cpu" and not interpret:
        raise ValueError("attention_backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for "
                         "the slow CPU interpreter); use 'torch' or 'auto' on the CPU")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"attention_backend: 'triton' does not run on device {device.type!r}; use 'torch'")
    try:
        ops = importlib.import_module("radixkv.kernels.triton_backend")
    except ImportError as exc:
        raise ValueError(f"attention_backend: 'triton' unavailable ({exc}); use 'torch'") from exc
    if device.type == "cpu" and not ops.interpreting():
        raise ValueError("attention_backend: the Triton kernels were imported before TRITON_INTERPRET=1 "
                         "was set, so they cannot run on the CPU; use 'torch'")
    return name, ops

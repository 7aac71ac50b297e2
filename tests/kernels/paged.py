"""Factories for kernel tests: paged batches with NaN-poisoned pools, tolerances, the device.

Dimension letters as in ``radixkv/kernels/reference.py``: N sequences, T packed suffix
tokens, Hq / Hkv heads, D head dim, B block size, M pool blocks, P prefix, L suffix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixkv.kernels import reference
from radixkv.kernels import triton_backend as triton_ops

INTERPRETER = triton_ops.interpreting()
DEVICE = torch.device("cpu" if INTERPRETER or not torch.cuda.is_available() else "cuda")

# (atol, rtol) of a kernel output against the fp32 reference on the same (rounded) inputs.
# The kernels' GPU branch rounds p to the storage dtype for the PV product; the interpreter
# runs that branch for fp16 but upcasts bf16 tiles to fp32, so its bf16 error is the final
# rounding only.
_TOL_INTERPRETER = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (8e-3, 8e-3)}
_TOL_GPU = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
LSE_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for outputs of ``dtype`` on the current kernel device."""
    return (_TOL_INTERPRETER if DEVICE.type == "cpu" else _TOL_GPU)[dtype]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class PagedBatch:
    """Inputs of one ``extend_attention`` call plus what the reference needs.

    The pools hold each sequence's prefix K/V at the slots named by its block table and NaN in
    every other slot (including the suffix positions, which the kernel must read from k/v).
    Block ids are a random permutation of the pool: non-monotonic, never the identity.
    """

    seqs: list[tuple[int, int]]       # (P, L) per sequence
    block_size: int
    q: torch.Tensor                   # [T, Hq, D]
    k: torch.Tensor                   # [T, Hkv, D]
    v: torch.Tensor                   # [T, Hkv, D]
    k_pool: torch.Tensor              # [M, B, Hkv, D]
    v_pool: torch.Tensor              # [M, B, Hkv, D]
    block_tables: torch.Tensor        # [N, max_blocks] int32, -1 padded
    prefix_lens: torch.Tensor         # [N] int32
    qo_indptr: torch.Tensor           # [N+1] int32
    prefix_k: list[torch.Tensor] = field(default_factory=list)  # per sequence [P, Hkv, D]
    prefix_v: list[torch.Tensor] = field(default_factory=list)

    @property
    def max_q_len(self) -> int:
        return max((l for _, l in self.seqs), default=0)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.k_pool, self.v_pool, self.block_tables,
                self.prefix_lens, self.qo_indptr)

    def slots(self, seq: int, positions: range) -> torch.Tensor:
        """``[len(positions)]`` int64 pool slots of sequence ``seq`` at these positions."""
        table = self.block_tables[seq].tolist()
        b = self.block_size
        return torch.tensor([table[p // b] * b + p % b for p in positions], dtype=torch.int64, device=self.q.device)


def make_paged_batch(seqs: list[tuple[int, int]], *, block_size: int, heads: tuple[int, int] = (2, 1),
                     head_dim: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0,
                     spare_blocks: int = 3, device: torch.device = DEVICE) -> PagedBatch:
    """A random paged batch; see :class:`PagedBatch`. ``spare_blocks`` unused blocks stay NaN."""
    num_q_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks_per_seq = [-(-(p + l) // block_size) for p, l in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq, default=0) + 1  # one -1 column past every table
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(perm[start:start + count] + [-1] * (width - count))
        start += count
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.full(pool_shape, float("nan"), dtype=dtype)
    v_pool = torch.full(pool_shape, float("nan"), dtype=dtype)
    batch = PagedBatch(
        seqs=list(seqs), block_size=block_size,
        q=randn(sum(l for _, l in seqs), num_q_heads, head_dim),
        k=randn(sum(l for _, l in seqs), num_kv_heads, head_dim),
        v=randn(sum(l for _, l in seqs), num_kv_heads, head_dim),
        k_pool=k_pool, v_pool=v_pool,
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(len(seqs), width),
        prefix_lens=torch.tensor([p for p, _ in seqs], dtype=torch.int32),
        qo_indptr=torch.tensor([0] + torch.tensor([l for _, l in seqs]).cumsum(0).tolist(), dtype=torch.int32),
    )
    for i, (p, _) in enumerate(seqs):
        pk, pv = randn(p, num_kv_heads, head_dim), randn(p, num_kv_heads, head_dim)
        batch.prefix_k.append(pk)
        batch.prefix_v.append(pv)
        reference.paged_kv_write(pk, pv, k_pool, v_pool, batch.slots(i, range(p)))
    for name in ("q", "k", "v", "k_pool", "v_pool", "block_tables", "prefix_lens", "qo_indptr"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def decode_pools(kv_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, *, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_pool, v_pool, block_tables)`` on the CPU for a decode over ``kv_lens`` cached tokens
    per sequence: :func:`make_paged_batch` with no suffix and two spare blocks, so every slot no
    sequence owns is NaN (a read past a sequence's keys or of a foreign block shows) and each
    table has a ``-1`` column past its blocks. Pools ``[M, B, Hkv, D]`` of ``dtype``, tables
    ``[N, max_blocks + 1]`` int32."""
    batch = make_paged_batch([(n, 0) for n in kv_lens], block_size=block_size,
                             heads=(num_kv_heads, num_kv_heads), head_dim=head_dim, dtype=dtype,
                             seed=seed, spare_blocks=2, device=torch.device("cpu"))
    return batch.k_pool, batch.v_pool, batch.block_tables


def reference_extend(batch: PagedBatch, **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference on fp32 copies of the batch (fp32 math on the same rounded inputs)."""
    f = [t.float() if t.is_floating_point() else t for t in batch.args()]
    return reference.extend_attention(*f, max_q_len=batch.max_q_len, **kwargs)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))

"""The packed metadata of one forward step (:class:`ForwardBatch`) and the block-table
helpers :meth:`radixkv.model.runner.ModelRunner.build_batch` fills it with, window KV groups'
tables included (docs/sliding-window.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .lora import LoRABatch

__all__ = ["ForwardBatch", "padded_tables", "window_group_tables"]


@dataclass
class ForwardBatch:
    """Packed metadata of one forward step (see ``radixkv.model.runner``'s module docstring).

    Attributes:
        input_ids: ``[T]`` int64, packed suffix tokens of N sequences.
        positions: ``[T]`` int64, absolute positions (seq i token j -> prefix_lens[i] + j).
        qo_indptr: ``[N+1]`` int32, seq i owns rows ``qo_indptr[i]:qo_indptr[i+1]``.
        prefix_lens: ``[N]`` int32, tokens of seq i whose K/V already sit in the pool.
        block_tables: ``[N, max_blocks]`` int32, padded with -1.
        slot_mapping: ``[T]`` int64, ``block_id * B + offset`` where row t's K/V go.
        lora: which rows use which LoRA adapter (indices already on the runner device), or
            None when no sequence uses one.
        window_block_tables / window_slot_mapping: for a runner with window KV groups
            (``ModelRunner.kv_groups``), per window group (keyed by its ``window_left``) the
            ``[N, max_blocks]`` int32 block tables into that group's pools (-1 padded; 0, the
            group's null block, where a block lies wholly left of the window) and the ``[T]``
            int64 slots where the group's layers write row t's K/V; None otherwise.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    lora: LoRABatch | None = None
    window_block_tables: dict[int, torch.Tensor] | None = None
    window_slot_mapping: dict[int, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        """N, sequences in the batch."""
        return int(self.prefix_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, packed new tokens."""
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        """Copy of the batch with every tensor on ``device``."""
        def moved(group: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor] | None:
            return None if group is None else {w: t.to(device) for w, t in group.items()}

        return ForwardBatch(self.input_ids.to(device), self.positions.to(device),
                            self.qo_indptr.to(device), self.prefix_lens.to(device),
                            self.block_tables.to(device), self.slot_mapping.to(device), lora=self.lora,
                            window_block_tables=moved(self.window_block_tables),
                            window_slot_mapping=moved(self.window_slot_mapping))



def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """``[N, max_blocks]`` int32 block tables, short ones padded with -1."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)


def window_group_tables(seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
                        window_tables: Sequence[Mapping[int, Sequence[int]]], group: int,
                        block_size: int, group_blocks: int) -> tuple[list[list[int]], list[int]]:
    """Window group ``group``'s block tables and slots of a batch.

    Args:
        seqs: per sequence ``(new_token_ids, prefix_len, full block_table)``.
        window_tables: per sequence, window group (``window_left``) -> block table.
        group: the group's ``window_left`` (w).
        block_size: B; group_blocks: blocks in each of the group's pools (id 0 = null block).

    Returns:
        ``(tables, slots)``: the group's table per sequence and ``[T]`` slots of the new rows.

    Raises:
        ValueError: naming ``window_tables`` when a sequence has no table for the group, or
            its blocks overlapping ``[max(0, P - w), P + L)`` are missing, null, or out of
            ``[1, group_blocks)`` (earlier entries: out of ``[0, group_blocks)``).
    """
    tables: list[list[int]] = []
    slots: list[int] = []
    for i, ((new_ids, prefix_len, _), per_group) in enumerate(zip(seqs, window_tables)):
        if group not in per_group:
            raise ValueError(f"window_tables: sequence {i} has no table for window group {group}")
        table = list(per_group[group])
        end = prefix_len + len(new_ids)
        first, last = max(0, prefix_len - group) // block_size, (end - 1) // block_size
        if len(table) <= last:
            raise ValueError(f"window_tables: sequence {i}, window group {group}: {len(table)} "
                             f"blocks, needs {last + 1} for {end} tokens")
        if any(b < 0 or b >= group_blocks for b in table[:last + 1]) or 0 in table[first:last + 1]:
            raise ValueError(f"window_tables: sequence {i}, window group {group}: blocks "
                             f"{first}..{last} must be ids in [1, {group_blocks}), earlier "
                             f"ones in [0, {group_blocks})")
        slots.extend(table[pos // block_size] * block_size + pos % block_size
                     for pos in range(prefix_len, end))
        tables.append(table)
    return tables, slots

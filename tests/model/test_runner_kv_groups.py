"""Window KV groups in the model runner (``ModelRunner(window_num_blocks=...)``): window layers
read and write pools of their own through block tables of their own, where every block wholly
left of the window is the null block 0 and released ids are reused at once. The logits must be
bit-identical (``torch.equal``) to the keep-all layout's, step by step: two sequences of a
ragged batch, chunked prefills crossing the window edge, then decode steps.

Tiny random-init Mistral (every layer windowed: the Llama path, fused C decode layer included),
Gemma 2 (alternating, soft caps: the reference kernels) and Gemma 3 (5:1) from transformers'
classes (``tests/engine/test_engine_window.py``), window W = 8 tokens, blocks of 4; the torch
and reference backends, and the Triton kernels (interpreted) on Mistral.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner
from tests.engine.test_engine_window import VOCAB, WINDOW, small_tokenizer, window_model

B = 4
# Per sequence: its prompt chunks (start, end), then DECODE_STEPS one-token steps.
CHUNKS = {"a": [(0, 13), (13, 29), (29, 41)], "b": [(0, 9), (9, 17), (17, 23)]}
DECODE_STEPS = 5
FULL_BLOCKS = 20
# Window 8 = window_left 7: a step's rows need the blocks overlapping [P - 7, P + L): at most
# 7 for "a"'s widest chunk, 6 for "b"'s, plus the null block.
WINDOW_BLOCKS = 1 + 7 + 6


@pytest.fixture(scope="module")
def tokenizer():
    return small_tokenizer()


class WindowTable:
    """One sequence's window-group block table: entries left of the window go back to a shared
    free list (FIFO, so a released id is soon reused by the other sequence) and become 0."""

    def __init__(self, free: list[int]) -> None:
        self.free = free
        self.table: list[int] = []

    def cover(self, prefix_len: int, end: int) -> list[int]:
        first = max(0, prefix_len - (WINDOW - 1)) // B
        for i in range(first):
            if i < len(self.table) and self.table[i]:
                self.free.append(self.table[i])
                self.table[i] = 0
        while len(self.table) <= (end - 1) // B:
            self.table.append(0)
        for i in range(first, (end - 1) // B + 1):
            if not self.table[i]:
                self.table[i] = self.free.pop(0)
        return list(self.table)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_steps(runner: ModelRunner, grouped: bool) -> list[torch.Tensor]:
    """Every step's logits (all rows) for the two sequences, chunk k of each in step k."""
    prompts = {"a": _tokens(41 + DECODE_STEPS, 1), "b": _tokens(23 + DECODE_STEPS, 2)}
    full = {"a": list(range(0, 12)), "b": list(range(12, 20))}
    free = list(range(1, WINDOW_BLOCKS))
    windows = {name: WindowTable(free) for name in prompts}
    steps = [list(zip(*(CHUNKS[name] for name in prompts)))]
    decode = [[(41 + i, 42 + i), (23 + i, 24 + i)] for i in range(DECODE_STEPS)]
    out = []
    for step in [*steps[0], *decode]:
        seqs, window_tables = [], []
        for name, (start, end) in zip(prompts, step):
            seqs.append((prompts[name][start:end], start, full[name]))
            group = next(g for g in runner.kv_groups if g >= 0) if grouped else None
            if group is not None:
                window_tables.append({group: windows[name].cover(start, end)})
        batch = runner.build_batch(seqs, window_tables=window_tables if grouped else None)
        out.append(runner.forward(batch, all_logits=True))
    return out


@pytest.mark.parametrize(("family", "backend"), [
    *((family, backend) for family in ("mistral", "gemma2", "gemma3")
      for backend in ("torch", "reference")),
    ("mistral", "triton"),  # the Triton kernels under TRITON_INTERPRET=1 (~5 s)
])
def test_grouped_layout_gives_the_keep_all_logits(tokenizer, family: str, backend: str) -> None:
    model: LoadedModel = window_model(family, tokenizer)
    keep_all = ModelRunner(model, num_blocks=FULL_BLOCKS, block_size=B, attention_backend=backend)
    grouped = ModelRunner(model, num_blocks=FULL_BLOCKS, block_size=B, attention_backend=backend,
                          window_num_blocks=WINDOW_BLOCKS)
    windows = model.shape.layer_window_lefts
    assert grouped.kv_group_of_layer == windows
    assert grouped.kv_groups == {**({-1: FULL_BLOCKS} if -1 in windows else {}),
                                 WINDOW - 1: WINDOW_BLOCKS}
    assert [p.shape[0] for p in grouped.k_pools] == [
        FULL_BLOCKS if w < 0 else WINDOW_BLOCKS for w in windows]
    # One block of a group: B × 2 (K, V) × Hkv 2 × D 32 × 4 bytes × its layers.
    assert grouped.group_bytes_per_block == {g: B * 2 * 2 * 32 * 4 * windows.count(g)
                                             for g in grouped.kv_groups}
    assert sum(grouped.group_bytes_per_block.values()) == keep_all.bytes_per_block
    assert sum(grouped.group_bytes_per_block[g] * n for g, n in grouped.kv_groups.items()) == sum(
        t.numel() * t.element_size() for t in grouped.k_pools + grouped.v_pools)
    want, got = run_steps(keep_all, grouped=False), run_steps(grouped, grouped=True)
    assert len(got) == 3 + DECODE_STEPS
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max():.3g}"
    # The null block is never written.
    for layer, w in enumerate(windows):
        if w >= 0:
            assert not grouped.k_pools[layer][0].any() and not grouped.v_pools[layer][0].any()


def test_window_tables_are_checked(tokenizer) -> None:
    model = window_model("gemma3", tokenizer)
    runner = ModelRunner(model, num_blocks=FULL_BLOCKS, block_size=B, window_num_blocks=6)
    seq = ([1, 2, 3, 4, 5], 8, [0, 1, 2, 3])  # rows 8..12 attend to [1, 12]: blocks 0..3
    with pytest.raises(ValueError, match="window_tables: required"):
        runner.build_batch([seq])
    with pytest.raises(ValueError, match="window_tables: sequence 0 has no table for window group 7"):
        runner.build_batch([seq], window_tables=[{3: [1, 2, 3, 4]}])
    with pytest.raises(ValueError, match=r"blocks 0\.\.3 must be ids in \[1, 6\)"):
        runner.build_batch([seq], window_tables=[{7: [0, 2, 3, 4]}])
    with pytest.raises(ValueError, match=r"blocks 0\.\.3 must be ids in \[1, 6\)"):
        runner.build_batch([seq], window_tables=[{7: [1, 2, 3, 6]}])
    with pytest.raises(ValueError, match="needs 4 for 13 tokens"):
        runner.build_batch([seq], window_tables=[{7: [1, 2, 3]}])
    # Past the window edge the earlier entries may be the null block: rows 20..22 need [13, 22].
    batch = runner.build_batch([([1, 2, 3], 20, list(range(6)))], window_tables=[{7: [0, 0, 0, 1, 2, 3]}])
    assert batch.window_slot_mapping is not None
    assert batch.window_slot_mapping[7].tolist() == [3 * B, 3 * B + 1, 3 * B + 2]  # block 5 -> id 3
    assert batch.slot_mapping.tolist() == [20, 21, 22]
    with pytest.raises(ValueError, match="copies: block ids are per KV group"):
        runner.copy_blocks([(1, 2)])
    with pytest.raises(ValueError, match="kv_store: the store tier moves whole blocks"):
        runner.kv_segments()
    keep_all = ModelRunner(model, num_blocks=FULL_BLOCKS, block_size=B)
    with pytest.raises(ValueError, match="window_tables: this runner has no window KV groups"):
        keep_all.build_batch([seq], window_tables=[{7: [1, 2, 3, 4]}])


def test_window_num_blocks_needs_window_layers(tokenizer, tiny_model) -> None:
    with pytest.raises(ValueError, match="window_num_blocks: the model has no sliding-window layers"):
        ModelRunner(tiny_model, num_blocks=8, block_size=B, window_num_blocks=4)
    with pytest.raises(ValueError, match="window_num_blocks"):
        ModelRunner(window_model("mistral", tokenizer), num_blocks=8, block_size=B, window_num_blocks=1)

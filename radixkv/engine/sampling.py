"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from radixkv.config import check_int

GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it before softmax.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 (or -1) disables.
        seed: seeds this request's own generator, so a seeded request samples the same tokens
            alone or inside any batch.
        stop: strings that end generation; the matched string is not returned.
        ignore_eos: keep generating past EOS (benchmarks).
        n: number of choices sampled from the prompt. The prompt is prefilled once and the
            sequence forked (shared prompt blocks, copy-on-write tail); choice i uses seed
            ``seed + i``, so it equals an ``n = 1`` request with that seed.

    Raises:
        ValueError: naming the field, for an out-of-range value.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        check_int("n", self.n, minimum=1, maximum=64)
        check_int("max_tokens", self.max_tokens, minimum=1)
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature: must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        check_int("top_k", self.top_k, minimum=-1)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an int, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop sequence must be a non-empty string")

    @property
    def greedy(self) -> bool:
        # Below this, softmax(logits / T) is one-hot in fp32 anyway, and dividing by T would
        # overflow to inf (NaN probabilities); vLLM uses the same epsilon.
        return self.temperature < GREEDY_TEMPERATURE_EPS


def make_generator(params: SamplingParams, device: str | torch.device = "cpu",
                   choice_index: int = 0) -> torch.Generator | None:
    """A per-choice generator: None for greedy requests (no randomness consumed).

    Choice i of a seeded request is seeded with ``seed + i``.
    """
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed + choice_index if params.seed is not None
                    else random.getrandbits(63))
    return gen


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [N, vocab] float32, one row per request.
        params: N sampling parameter sets.
        generators: N generators (None for greedy rows).

    Returns:
        N token ids.
    """
    out: list[int] = []
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy_ids[i])
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, sorted_idx = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (the token crossing it included).
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop = (cum - sorted_probs) >= p.top_p
            drop[0] = False  # the most likely token always stays (top_p may underflow in fp32)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, sorted_idx, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out

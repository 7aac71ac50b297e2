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
            ``(seed + i) mod 2**64``, so it equals an ``n = 1`` request with that seed. Any int
            is a valid seed: it is taken mod 2**64 (a negative one as its two's complement).

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
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature: must be a number in [0, 2], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be a number in (0, 1], got {self.top_p!r}")
        check_int("top_k", self.top_k, minimum=-1)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed: must be an int, got {self.seed!r}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)):
            raise ValueError(f"stop: must be a sequence of strings, got {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop sequence must be a non-empty string")
        object.__setattr__(self, "stop", tuple(self.stop))  # frozen: hashable, never aliased
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        # Below this, softmax(logits / T) is one-hot in fp32 anyway, and dividing by T would
        # overflow to inf (NaN probabilities); vLLM uses the same epsilon.
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


SEED_MODULUS = 1 << 64  # torch generators take a 64-bit seed


def choice_seed(seed: int, choice_index: int) -> int:
    """The seed of choice ``choice_index``: ``(seed + choice_index) mod 2**64``, in [0, 2**64)."""
    return (seed + choice_index) % SEED_MODULUS


def make_generator(params: SamplingParams, device: str | torch.device = "cpu",
                   choice_index: int = 0) -> torch.Generator | None:
    """A per-choice generator: None for greedy requests (no randomness consumed).

    Choice i of a seeded request is seeded with ``choice_seed(seed, i)``; an unseeded one
    draws a random 63-bit seed.
    """
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(choice_seed(params.seed, choice_index) if params.seed is not None
                    else random.getrandbits(63))
    return gen


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """Pick one token from one row of logits ([vocab] float) with ``params``.

    Greedy parameters take the argmax; otherwise temperature, top-k, then top-p, then a draw
    from ``generator``.
    """
    if params.greedy:
        return int(torch.argmax(logits).item())
    row = logits.float() / params.temperature
    if 0 < params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token crossing it included).
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= params.top_p
        drop[0] = False  # the most likely token always stays (top_p may underflow in fp32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, sorted_idx, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_each(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int | Exception]:
    """Pick one token per row, keeping a fault to its row.

    Args:
        logits: [N, vocab] float32, one row per request.
        params: N sampling parameter sets.
        generators: N generators (None for greedy rows).

    Returns:
        N entries: the token id, or the exception sampling that row raised (the other rows'
        generators advance exactly as if it had not happened).
    """
    out: list[int | Exception] = []
    greedy_ids: list[int] | Exception | None = None
    for i, p in enumerate(params):
        try:
            if p.greedy:
                if greedy_ids is None:  # one argmax over the batch, not one per row
                    try:
                        greedy_ids = torch.argmax(logits, dim=-1).tolist()
                    except Exception as exc:  # noqa: BLE001 - every greedy row reports it
                        greedy_ids = exc
                if isinstance(greedy_ids, Exception):
                    raise greedy_ids
                out.append(greedy_ids[i])
            else:
                out.append(sample_token(logits[i], p, generators[i]))
        except Exception as exc:  # noqa: BLE001 - the caller decides what a row fault means
            out.append(exc)
    return out


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row (``sample_each`` without per-row isolation).

    Returns:
        N token ids.

    Raises:
        Exception: the first row's fault, whatever sampling raised.
    """
    out = sample_each(logits, params, generators)
    for token in out:
        if isinstance(token, Exception):
            raise token
    return out  # type: ignore[return-value]  # no Exception left in it: raised above

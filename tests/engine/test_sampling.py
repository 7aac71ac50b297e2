"""Sampler and incremental detokenizer: exact behaviour on small hand-made inputs."""

from __future__ import annotations

import pytest
import torch

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.sampling import SamplingParams, make_generator, sample_tokens


def test_extreme_temperature_and_top_p_fall_back_to_the_top_token():
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9]])
    for kwargs in ({"temperature": 1e-300}, {"temperature": 1e-38}, {"top_p": 1e-300},
                   {"top_p": 1e-46}):
        params = SamplingParams(seed=3, **kwargs)
        assert sample_tokens(logits, [params], [make_generator(params)]) == [1]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=0)
    top_p = SamplingParams(temperature=1.0, top_p=0.7, seed=0)  # keeps 0.5 + 0.3
    for params in (top_k, top_p):
        gen = make_generator(params)
        seen = {sample_tokens(logits, [params], [gen])[0] for _ in range(200)}
        assert seen == {0, 1}


def test_seeded_choices_are_reproducible_and_derived():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(index):
        gen = make_generator(params, choice_index=index)
        return [sample_tokens(logits, [params], [gen])[0] for _ in range(10)]

    seed_43 = SamplingParams(temperature=1.0, seed=43)
    gen_43 = make_generator(seed_43)
    assert draw(0) == draw(0)
    assert draw(1) == [sample_tokens(logits, [seed_43], [gen_43])[0] for _ in range(10)]
    assert draw(0) != draw(1)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.1),
                                         ("top_p", 0.0), ("top_k", -2), ("n", 0), ("n", 65)])
def test_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


class _CharTokenizer:
    """Token i decodes to chr(i); token 0 is half of a two-token character (shown as U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for i, t in enumerate(ids):
            if t == 0:
                nxt = ids[i + 1] if i + 1 < len(ids) else None
                out.append("\ufffd" if nxt is None else "é")
            elif i > 0 and ids[i - 1] == 0:
                continue
            else:
                out.append(chr(t))
        return "".join(out)


def test_detokenizer_waits_for_incomplete_characters():
    detok = IncrementalDetokenizer(_CharTokenizer())
    ids = [ord("a")]
    assert detok.add(ids) == "a"
    ids.append(0)
    assert detok.add(ids) == ""  # half a character: held back
    ids.append(1)
    assert detok.add(ids) == "é"
    ids.append(ord("b"))
    assert detok.add(ids, final=True) == "b"
    assert detok.text == "aéb"


def test_detokenizer_holds_back_a_possible_stop_string_and_cuts_it():
    detok = IncrementalDetokenizer(_CharTokenizer(), stop=("XY",))
    ids, emitted = [], []
    for ch in "abXcXY":
        ids.append(ord(ch))
        emitted.append(detok.add(ids))
        if detok.stopped:
            break
    # One character (len("XY") - 1) is always held back, so the final "X" is never shown.
    assert emitted == ["", "a", "b", "X", "c", ""]
    assert detok.stopped and detok.text == "abXc"

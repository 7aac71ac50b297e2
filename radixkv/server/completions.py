"""Validation of ``/v1/completions`` (legacy text completions) requests.

The prompt is text or token ids, or a list of up to ``MAX_PROMPTS`` of those (one choice set
per prompt; ``n`` x prompts at most ``MAX_CHOICES``). ``echo: true`` puts the prompt text in
front of each choice; ``return_token_ids`` (vLLM's field) adds the ids. Log probabilities
(``logprobs``, including prompt logprobs via ``echo`` + ``logprobs``), ``suffix`` and
``best_of`` > ``n`` are not implemented and are refused with a 400 naming them, never ignored;
the rest of the policy is ``radixkv.server.param_table.COMPLETION_PARAMS``.
``prompt_cache_retention`` (``"in_memory"`` or ``"24h"``, as on chat) is parsed with the
sampling fields (``radixkv.server.params.parse_prompt_cache_retention``) into
``CompletionRequest.retention``; with several prompts each prompt's sequence is retained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.server import param_policy
from radixkv.server.errors import bad_request
from radixkv.server.param_table import COMPLETION_PARAMS, MAX_CHOICES, MAX_PROMPTS
from radixkv.server.params import (
    Sampling,
    as_int,
    check_model,
    opt_bool,
    opt_int,
    parse_sampling,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_PROMPTS", "CompletionRequest", "PromptInput",
           "parse_completion_request", "parse_prompts"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a ``/v1/completions`` request: text or token ids (exactly one is set).

    Attributes:
        param: Where it sits in the body, for errors: ``prompt``, ``prompt[0]``, ``prompt[1]``...
    """

    text: str | None
    ids: list[int] | None
    param: str


@dataclass(frozen=True)
class CompletionRequest(Sampling):
    """A validated text-completion request: exactly one of ``prompt_text`` / ``prompt_ids``.

    ``max_tokens`` None means ``DEFAULT_MAX_TOKENS`` (within the context).

    Attributes:
        echo: Return the prompt text in front of each choice.
        add_special_tokens: Put the tokenizer's BOS in front of each text prompt
            (``ChatTokenizer.encode_prompt``; vLLM's default, true); token-id prompts are sent
            as they are.
        prompt_param: Where the prompt sits in the body, for errors: ``prompt``, or
            ``prompt[0]`` for the one-prompt list form (``[[ids]]`` / ``["text"]``).
    """

    prompt_text: str | None
    prompt_ids: list[int] | None
    echo: bool
    prompt_param: str = "prompt"
    prompts: tuple[PromptInput, ...] = ()
    return_token_ids: bool = False
    add_special_tokens: bool = True


def _token_ids(ids: list, param: str) -> list[int]:
    """The JSON shape of a token-id prompt: a non-empty list of integers (``2.0`` counts as 2).
    Their range (the vocabulary) is checked once, by the engine
    (``radixkv.config.check_token_ids``)."""
    if not ids:
        raise bad_request(f"'{param}' must not be empty", param)
    out: list[int] = []
    for i, t in enumerate(ids):
        v = as_int(t)
        if v is None:
            raise bad_request(f"'{param}[{i}]' must be a token id (an integer), got {t!r}",
                              f"{param}[{i}]")
        out.append(v)
    return out


def parse_prompts(prompt: Any) -> tuple[PromptInput, ...]:
    """The prompts of the ``prompt`` field: a string, a list of token ids, or a list of up to
    ``MAX_PROMPTS`` of those (one choice set per prompt).

    Raises:
        APIError: 400 naming ``prompt`` (or ``prompt[i]`` / ``prompt[i][j]``) for another shape.
    """
    shape = ("'prompt' must be a string, a list of token ids, or a list of strings / token-id "
             "lists")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return (PromptInput(prompt, None, "prompt"),)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(shape, "prompt")
    if as_int(prompt[0]) is not None:  # a token-id list; _token_ids names a bad entry
        return (PromptInput(None, _token_ids(prompt, "prompt"), "prompt"),)
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS}", "prompt")
    out = []
    for i, item in enumerate(prompt):
        param = f"prompt[{i}]"
        if isinstance(item, str):
            out.append(PromptInput(item, None, param))
        elif isinstance(item, list):
            out.append(PromptInput(None, _token_ids(item, param), param))
        else:
            raise bad_request(f"{shape}; '{param}' is {type(item).__name__}", param)
    return tuple(out)


def parse_completion_request(body: dict[str, Any], served_model: str | tuple[str, ...]
                             ) -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        APIError: 400 naming the parameter for any invalid or unsupported field; 404 for an
            unknown model.
    """
    check_model(body, served_model)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if as_int(logprobs) is None or not 0 <= logprobs <= 20:
            raise bad_request(f"'logprobs' must be an integer in [0, 20], got {logprobs!r}",
                              "logprobs")
        what = "prompt logprobs ('echo' + 'logprobs')" if body.get("echo") else "'logprobs'"
        raise bad_request(f"{what} is not supported: radixkv does not compute log "
                          "probabilities", "logprobs")
    found = param_policy.check(body, COMPLETION_PARAMS)
    prompts = parse_prompts(body.get("prompt"))
    echo = bool(opt_bool(body, "echo"))
    sampling = parse_sampling(body, found)
    best_of = opt_int(body, "best_of", 1)
    if best_of is not None:
        if best_of != sampling.n:
            raise bad_request("'best_of' other than 'n' is not supported (no server-side "
                              "ranking of choices)", "best_of")
    if sampling.n * len(prompts) > MAX_CHOICES:
        raise bad_request(f"'n' x the number of prompts must be at most {MAX_CHOICES}, got "
                          f"{sampling.n} x {len(prompts)}", "n")
    first = prompts[0]
    req = CompletionRequest(prompt_text=first.text, prompt_ids=first.ids, echo=echo,
                            prompt_param=first.param, prompts=prompts,
                            return_token_ids=bool(opt_bool(body, "return_token_ids")),
                            add_special_tokens=opt_bool(body, "add_special_tokens") is not False,
                            **sampling.fields())
    found.record()
    return req

"""Validation of ``/v1/completions`` (legacy text completions) requests.

The prompt is text or token ids — one prompt per request (``"abc"``, ``[1, 2, 3]``, or a list
holding exactly one of those); a batch of several prompts is refused with a 400 that says so.
``echo: true`` puts the prompt text in front of each choice. Log probabilities (``logprobs``,
including prompt logprobs via ``echo`` + ``logprobs``), ``suffix`` and ``best_of`` > ``n`` are
not implemented and are refused with a 400 naming them, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.server.errors import bad_request
from radixkv.server.params import (
    Sampling,
    check_model,
    is_int,
    opt_bool,
    parse_sampling,
    refuse_unimplemented_sampling,
    refuse_unknown_keys,
)

COMPLETION_KEYS = frozenset({
    "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
    "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty",
    "best_of", "logit_bias", "user", "seed", "cache_salt", "ignore_eos",
})
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class CompletionRequest(Sampling):
    """A validated text-completion request: exactly one of ``prompt_text`` / ``prompt_ids``.

    ``max_tokens`` None means ``DEFAULT_MAX_TOKENS`` (within the context).

    Attributes:
        echo: Return the prompt text in front of each choice.
        prompt_param: Where the prompt sits in the body, for errors: ``prompt``, or
            ``prompt[0]`` for the one-prompt list form (``[[ids]]`` / ``["text"]``).
    """

    prompt_text: str | None
    prompt_ids: list[int] | None
    echo: bool
    prompt_param: str = "prompt"


def _token_ids(ids: list, param: str) -> list[int]:
    """The JSON shape of a token-id prompt: a non-empty list of integers. Their range (the
    vocabulary) is checked once, by the engine (``radixkv.config.check_token_ids``)."""
    if not ids:
        raise bad_request(f"'{param}' must not be empty", param)
    for i, t in enumerate(ids):
        if not is_int(t):
            raise bad_request(f"'{param}[{i}]' must be a token id (an integer), got {t!r}",
                              f"{param}[{i}]")
    return ids


def parse_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """``(text, None)`` or ``(None, token ids)`` of the ``prompt`` field."""
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("'prompt' must be a string, a list of token ids, or a list holding "
                          "one of those", "prompt")
    if all(is_int(t) for t in prompt):
        return None, _token_ids(prompt, "prompt")
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"'prompt' holds {len(prompt)} prompts; batched prompts are not "
                          "supported, send one request per prompt", "prompt")
    only = prompt[0] if len(prompt) == 1 else None
    if isinstance(only, str):
        return only, None
    if isinstance(only, list):
        return None, _token_ids(only, "prompt[0]")
    raise bad_request("'prompt' must be a string, a list of token ids, or a list holding one "
                      "of those", "prompt")


def parse_completion_request(body: dict[str, Any], served_model: str) -> CompletionRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        APIError: 400 naming the parameter for any invalid or unsupported field; 404 for an
            unknown model.
    """
    refuse_unknown_keys(body, COMPLETION_KEYS)
    check_model(body, served_model)
    text, ids = parse_prompt(body.get("prompt"))
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not is_int(logprobs) or not 0 <= logprobs <= 20:
            raise bad_request(f"'logprobs' must be an integer in [0, 20], got {logprobs!r}",
                              "logprobs")
        what = "prompt logprobs ('echo' + 'logprobs')" if body.get("echo") else "'logprobs'"
        raise bad_request(f"{what} is not supported: radixkv does not compute log "
                          "probabilities", "logprobs")
    if body.get("suffix") is not None:
        raise bad_request("'suffix' (insertion) is not supported", "suffix")
    refuse_unimplemented_sampling(body)
    echo = bool(opt_bool(body, "echo"))
    sampling = parse_sampling(body)
    best_of = body.get("best_of")
    if best_of is not None:
        if not is_int(best_of) or best_of < 1:
            raise bad_request(f"'best_of' must be an integer >= 1, got {best_of!r}", "best_of")
        if best_of != sampling.n:
            raise bad_request("'best_of' other than 'n' is not supported (no server-side "
                              "ranking of choices)", "best_of")
    nested = isinstance(body.get("prompt"), list) and len(body["prompt"]) == 1 \
        and isinstance(body["prompt"][0], (str, list))
    return CompletionRequest(prompt_text=text, prompt_ids=ids, echo=echo,
                             prompt_param="prompt[0]" if nested else "prompt", **sampling.fields())

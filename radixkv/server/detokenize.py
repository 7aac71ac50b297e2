"""``POST /detokenize`` (vLLM's shape): ``{"model"?, "tokens": [ids]}`` → ``{"prompt": text}``.

The text is the tokenizer's decoding with special tokens kept, as vLLM's ``/detokenize``
returns it, so ``/tokenize`` of that text gives the ids back for canonical tokenizations.
"""

from __future__ import annotations

from typing import Any

from radixkv.server.errors import bad_request
from radixkv.server.params import check_model, is_int, refuse_unknown_keys

DETOKENIZE_KEYS = frozenset({"model", "tokens"})


def parse_detokenize_request(body: dict[str, Any], served_model: str | tuple[str, ...],
                             vocab_size: int) -> list[int]:
    """The token ids of a ``/detokenize`` body (may be empty: its text is "").

    Args:
        body: the parsed JSON object.
        served_model: the served model name(s) ``model`` may name.
        vocab_size: ids the tokenizer can decode: each id must lie in ``[0, vocab_size)``.

    Raises:
        APIError: 400 naming ``tokens`` (missing, not a list) or ``tokens[i]`` (not an
            integer, or outside the vocabulary), or an unknown key; 404 for another model.
    """
    refuse_unknown_keys(body, DETOKENIZE_KEYS)
    check_model(body, served_model)
    tokens = body.get("tokens")
    if tokens is None:
        raise bad_request("'tokens' is required", "tokens")
    if not isinstance(tokens, list):
        raise bad_request(f"'tokens' must be a list of token ids, got {type(tokens).__name__}",
                          "tokens")
    for i, token in enumerate(tokens):
        if not is_int(token):
            raise bad_request(f"'tokens[{i}]' must be a token id (an integer), got {token!r}",
                              f"tokens[{i}]")
        if not 0 <= token < vocab_size:
            raise bad_request(f"'tokens[{i}]' = {token} is outside the vocabulary "
                              f"[0, {vocab_size - 1}]", f"tokens[{i}]")
    return tokens

"""Request decoding and the sampling parameters shared by chat and text completions.

No engine, no I/O. Every refusal is a 400 naming the parameter; which fields are honoured,
ignored or refused is the parameter policy (``radixkv.server.param_table``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from radixkv.cache.retention import RetentionBreakpoint
from radixkv.engine.sampling import SamplingParams
from radixkv.server.errors import APIError, bad_request
from radixkv.server.param_policy import SUPPORTED, PolicyCheck, check_field
from radixkv.server.param_table import MAX_CHOICES, STREAM_OPTIONS

JSON_CONTENT_TYPES = ("application/json",)
MAX_STOP_SEQUENCES = 64
MAX_STOP_CHARS = 1024
MAX_SALT_CHARS = 1024
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


def parse_json_object(raw: bytes, content_type: str) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Raises:
        APIError: 400 for a non-JSON content type, an empty body, invalid JSON (including
            invalid UTF-8, lone surrogates and nesting deeper than 1024), a non-object value, or
            a NUL character (U+0000) in any string (param: its path).
    """
    if content_type not in JSON_CONTENT_TYPES and not content_type.endswith("+json"):
        raise bad_request(f"Content-Type must be application/json, got {content_type!r}")
    if not raw.strip():
        raise bad_request("request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    if b"\\u0000" in raw:  # a NUL can only arrive escaped (raw NUL bytes are invalid JSON)
        path = _find_nul(body, "")
        if path is not None:
            raise bad_request(f"'{path or 'body'}' contains a NUL character (U+0000), which is "
                              "not allowed in text", path or None)
    return body


def _find_nul(value: Any, path: str) -> str | None:
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                if "\x00" in k:
                    return p
                stack.append((item, f"{p}.{k}" if p else k))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in enumerate(v))
    return None


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, counting stops past ``limit``."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_EXACT_FLOAT_INT = 1 << 53  # past this a float no longer holds every integer


def as_int(v: Any) -> int | None:
    """``v`` as an int if it is one or an integer-valued float (JSON Schema's integer and
    pydantic both take ``2.0`` as 2); None otherwise (booleans, fractions, NaN, infinities,
    and floats past 2^53: the JSON decoder reads an integer beyond 64 bits as a float, so such
    a value is not the number the client sent)."""
    if is_int(v):
        return v
    if isinstance(v, float) and v.is_integer() and abs(v) <= _EXACT_FLOAT_INT:
        return int(v)
    return None


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def opt_int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    raw = body.get(key)
    if raw is None:
        return None
    v = as_int(raw)
    bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    if v is None:
        if isinstance(raw, float) and raw.is_integer() and abs(raw) > _EXACT_FLOAT_INT:
            # The JSON decoder read an integer past 64 bits as this float: the client did send
            # an integer, only out of range.
            within = f"in {bound}" if hi is not None else bound
            raise bad_request(f"'{key}' must be an integer {within}, got one of about "
                              f"{raw:.3g}", key)
        raise bad_request(f"'{key}' must be an integer, got {raw!r}", key)
    if v < lo or (hi is not None and v > hi):
        raise bad_request(f"'{key}' must be {bound}, got {v}", key)
    return v


def opt_number(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_number(v):
        raise bad_request(f"'{key}' must be a number, got {v!r}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def opt_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {v!r}", key)
    return v


# What sglang-router forwards as ``model`` when the client sent none.
UNKNOWN_MODEL = "unknown"


def check_model(body: dict, served_model: str | tuple[str, ...]) -> None:
    """``model`` may be omitted; otherwise it must name the served model (or, given a tuple of
    names, one of them: the base model first, then its LoRA adapters). ``"unknown"`` (sent by
    sglang-router for a request without ``model``) means the base model while it is the only
    name served; with adapters loaded it is ambiguous, so it is refused like any other name.

    Raises:
        APIError: 400 if not a string, 404 ``model_not_found`` for another model.
    """
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    names = (served_model,) if isinstance(served_model, str) else served_model
    if model == UNKNOWN_MODEL and len(names) == 1:
        return
    if model not in names:
        served = ", ".join(f"'{n}'" for n in names)
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"{served}", param="model", code="model_not_found")


def refuse_unknown_keys(body: dict, allowed: frozenset[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad_request(f"unknown parameter '{key}'", key)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop_t: tuple[str, ...] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_t = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if any(not s for s in stop_t):
        raise bad_request("'stop' sequences must be non-empty", "stop")
    if len(stop_t) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stop_t):
        raise bad_request(f"'stop' allows at most {MAX_STOP_SEQUENCES} sequences of at most "
                          f"{MAX_STOP_CHARS} characters", "stop")
    return stop_t


@dataclass(frozen=True)
class Sampling:
    """The sampling and streaming fields common to chat and text completions.

    Attributes:
        max_tokens: Requested output cap in tokens; None = the endpoint's default.
        stream: Answer as server-sent events.
        include_usage: Streaming only: send a final chunk carrying ``usage``.
        cache_salt: The client's cache isolation salt, or None (the server may narrow it).
        session_key: Session hint for the eviction policy: ``prompt_cache_key``, else ``user``,
            else None (a hint only: it isolates nothing).
        retention: What the request retains in the cache (``prompt_cache_retention``): ``()``
            for ``"in_memory"`` or none (the cache's own eviction decides), else
            ``RETAIN_24H``, the whole sequence (prompt + reply) for 24 hours.
    """

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None
    n: int
    session_key: str | None
    retention: tuple[RetentionBreakpoint, ...] = field(default=(), kw_only=True)

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in Sampling.__dataclass_fields__}

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters with the resolved ``max_tokens``."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop,
                              ignore_eos=self.ignore_eos, n=self.n)


def parse_sampling(body: dict[str, Any], found: PolicyCheck | None = None) -> Sampling:
    """Validate the shared sampling / streaming fields (400 naming the parameter); ignored
    ``stream_options`` entries are noted in ``found``."""
    max_tokens = opt_int(body, "max_tokens", 1)
    max_completion = opt_int(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request("'max_tokens' and 'max_completion_tokens' disagree; send one",
                          "max_completion_tokens")
    stop = _stop(body)
    stream = bool(opt_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              "stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        for key, value in options.items():
            entry = STREAM_OPTIONS.get(key)
            if entry is None:
                raise bad_request(f"unknown parameter 'stream_options.{key}'",
                                  f"stream_options.{key}")
            if entry.policy != SUPPORTED:
                check_field(entry, value, entry.name, found or PolicyCheck())
        include_usage = bool(opt_bool(options, "include_usage"))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS):
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} "
                          "characters", "cache_salt")
    top_k = opt_int(body, "top_k", -1)
    n = opt_int(body, "n", 1)
    if n is not None and n > MAX_CHOICES:
        raise bad_request(f"'n' must be at most {MAX_CHOICES}, got {n}", "n")
    temperature = opt_number(body, "temperature", 0.0, 2.0)
    top_p = opt_number(body, "top_p", 0.0, 1.0, lo_open=True)
    return Sampling(
        max_tokens=max_completion if max_completion is not None else max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,
        seed=opt_int(body, "seed", _SEED_MIN, _SEED_MAX),
        stop=stop, ignore_eos=bool(opt_bool(body, "ignore_eos")),
        stream=stream, include_usage=include_usage, cache_salt=salt,
        n=1 if n is None else n, session_key=session_key_of(body),
        retention=parse_prompt_cache_retention(body))


#: OpenAI's ``prompt_cache_retention`` values and what each retains: ``"in_memory"`` is what
#: the prefix cache does anyway (nothing pinned); ``"24h"`` retains the prompt and the reply
#: (the whole sequence at finish) for 24 hours.
PROMPT_CACHE_RETENTION: dict[str, tuple[RetentionBreakpoint, ...]] = {
    "in_memory": (),
    "24h": (RetentionBreakpoint(-1, "24h"),),
}


def parse_prompt_cache_retention(body: dict[str, Any]) -> tuple[RetentionBreakpoint, ...]:
    """The retention breakpoints of ``prompt_cache_retention`` (absent or null: none).

    Raises:
        APIError: 400 naming ``prompt_cache_retention`` for any value but ``"in_memory"`` and
            ``"24h"``.
    """
    value = body.get("prompt_cache_retention")
    if value is None:
        return ()
    if not isinstance(value, str) or value not in PROMPT_CACHE_RETENTION:
        allowed = " or ".join(f"'{v}'" for v in PROMPT_CACHE_RETENTION)
        raise bad_request(f"'prompt_cache_retention' must be {allowed}, got {value!r}",
                          "prompt_cache_retention")
    return PROMPT_CACHE_RETENTION[value]


def session_key_of(body: dict[str, Any]) -> str | None:
    """The request's session hint: ``prompt_cache_key``, else ``user`` (non-empty strings; the
    parameter table already refused other types), else None."""
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    return None


"""The parameter policy: one table classifying every request field of each operation.

A field is (a) ``SUPPORTED`` — honoured, validated by the operation's parser; (b) ``IGNORED`` —
accepted with any value of its type because it cannot change the result; or ``NEUTRAL`` —
accepted and ignored at its neutral values (b), refused with a 400 naming it at any other value
(c), because it would change the result and radixkv does not implement it. A name in none of
the operation's entries is accepted with a warning (as vLLM does). Ignored fields that arrive
are logged once per name and counted (``radixkv_ignored_parameters_total``); the entries live
in ``radixkv.server.param_table`` and ``/openapi.json`` lists exactly them per operation.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from radixkv.server.errors import bad_request

log = structlog.get_logger(__name__)

SUPPORTED, IGNORED, NEUTRAL = "supported", "ignored", "neutral"
CHAT, COMPLETIONS, TOKENIZE = "chat.completions", "completions", "tokenize"
UNKNOWN_LABEL = "(unknown)"  # the metric label of names in no table (bounded cardinality)
MAX_UNKNOWN_LOGGED = 1024    # distinct unknown names remembered for log-once


@dataclass(frozen=True)
class Param:
    """One field of one operation.

    Attributes:
        name: The field (a top-level key; nested ones are written ``stream_options.x``).
        policy: ``SUPPORTED``, ``IGNORED`` or ``NEUTRAL``.
        schema: The OpenAPI schema of the accepted values (for NEUTRAL: their enum).
        neutral: NEUTRAL only: the values that change nothing (None always among them).
        why: What the field does that radixkv does not (IGNORED: why it cannot matter).
    """

    name: str
    policy: str
    schema: dict[str, Any]
    neutral: tuple[Any, ...] = ()
    why: str = ""


def supported(name: str, schema: dict[str, Any]) -> Param:
    return Param(name, SUPPORTED, schema)


def ignored(name: str, json_type: str | list[str] | None, why: str) -> Param:
    """Any value of ``json_type`` (or null) is accepted; None = any JSON value."""
    if json_type is None:
        return Param(name, IGNORED, {"description": f"Ignored: {why}."}, why=why)
    types = [json_type] if isinstance(json_type, str) else list(json_type)
    return Param(name, IGNORED, {"type": [*types, "null"], "description": f"Ignored: {why}."},
                 why=why)


def only(name: str, *values: Any, why: str) -> Param:
    """Accepted (and ignored) only at ``values`` or null; any other value is a 400."""
    neutral = (None, *values)
    return Param(name, NEUTRAL, {"enum": list(neutral),
                                 "description": f"Only {_show(values)}: {why}."},
                 neutral=neutral, why=why)


def _show(values: tuple[Any, ...]) -> str:
    shown = [orjson.dumps(v).decode() for v in values]
    return " or ".join([*shown, "null"])


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: booleans are not numbers, 0 equals 0.0, containers compare deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "object": (dict,), "array": (list,),
    "integer": (int,), "number": (int, float), "null": (type(None),)}


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    types = schema.get("type")
    if types is None:
        return True
    for t in [types] if isinstance(types, str) else types:
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, _JSON_TYPES[t]):
            return True
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True  # JSON Schema's integer: 2.0 is one
    return False


class IgnoredCounts:
    """Counts of ignored fields by name, process-wide (the server runs one app per process);
    the first sighting of each name is logged. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._logged: set[str] = set()

    def record(self, names: list[str], unknown: list[str]) -> None:
        with self._lock:
            for name in names:
                self.counts[name] += 1
                if name not in self._logged:
                    self._logged.add(name)
                    log.info("parameter_ignored", param=name)
            for name in unknown:
                self.counts[UNKNOWN_LABEL] += 1
                if name not in self._logged and len(self._logged) < MAX_UNKNOWN_LOGGED:
                    self._logged.add(name)
                    log.warning("parameter_unknown_ignored", param=name,
                                note="not a field radixkv knows; accepted and ignored")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


IGNORED_COUNTS = IgnoredCounts()


@dataclass
class PolicyCheck:
    """What ``check`` found in one body: ignored names to record once the request is valid."""

    ignored: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def record(self) -> None:
        if _RECORDING.get():
            IGNORED_COUNTS.record(self.ignored, self.unknown)


_RECORDING: contextvars.ContextVar[bool] = contextvars.ContextVar("radixkv_record_ignored",
                                                                   default=True)


@contextlib.contextmanager
def unrecorded():
    """Check bodies without counting their ignored or unknown parameters: a router asks every
    replica to render each request it forwards, and only the request itself should count."""
    token = _RECORDING.set(False)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def check_field(param: Param, value: Any, path: str, found: PolicyCheck) -> None:
    """Enforce one non-supported entry on ``value`` at ``path`` (400 naming ``path``); an
    ignored value is noted in ``found`` under ``param.name`` (``messages[].id``, not ``[3]``)."""
    if param.policy == IGNORED:
        if value is not None and not _type_ok(value, param.schema):
            wanted = " or ".join(t for t in param.schema["type"] if t != "null")
            raise bad_request(f"'{path}' must be {wanted}, got {value!r}", path)
        if value is not None:
            found.ignored.append(param.name)
    elif param.policy == NEUTRAL:
        if not any(same_json(value, n) for n in param.neutral):
            raise bad_request(f"'{path}' is not supported: {param.why} (only "
                              f"{_show(param.neutral[1:])} is accepted)", path)
        if value is not None:
            found.ignored.append(param.name)


def check(body: dict[str, Any], table: dict[str, Param]) -> PolicyCheck:
    """Refuse non-neutral values of NEUTRAL fields and mistyped IGNORED ones; note the rest.

    Supported fields are left to the operation's parser; names in no entry are noted as
    unknown. Call ``record()`` on the result once the whole request is valid.

    Raises:
        APIError: 400 naming the field.
    """
    found = PolicyCheck()
    for key, value in body.items():
        param = table.get(key)
        if param is None:
            found.unknown.append(key)
        elif param.policy != SUPPORTED:
            check_field(param, value, key, found)
    return found


def request_schema(table: dict[str, Param], required: list[str], description: str
                   ) -> dict[str, Any]:
    """The OpenAPI request-body schema of an operation: exactly the table's fields."""
    out: dict[str, Any] = {
        "type": "object", "properties": {name: p.schema for name, p in table.items()},
        "additionalProperties": True,
        "description": description + " Fields not listed here are accepted and ignored with a "
                                     "warning in the server log; see docs/api.md 'Parameter policy'."}
    if required:
        out["required"] = required
    return out

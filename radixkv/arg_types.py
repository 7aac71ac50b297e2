"""argparse value types shared by ``radixkv``'s commands and the ``bench/`` drivers.

Each type turns a flag's text into its value or raises ``argparse.ArgumentTypeError`` with a
one-line reason; argparse prefixes the flag's name (``argument --num-prompts: must be an int
>= 1, got 0``) and exits 2. Integers are checked by :func:`radixkv.config.int_problem`, the one
wording of every integer check (a config field's error says the same after its field name).

Imports no torch: the CLI builds its parsers before any subcommand loads what it runs.
``bench/`` may import this module; nothing here imports from ``bench/``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

from radixkv.config import int_problem

__all__ = ["bounded_int", "comma_choices", "fraction", "non_negative_int", "non_negative_seconds",
           "positive_float", "positive_int", "positive_int_list"]


def _int_in_range(text: str, minimum: int, maximum: int | None) -> int:
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int {bound}, got {text!r}") from None
    problem = int_problem(value, minimum=minimum, maximum=maximum)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def positive_int(text: str) -> int:
    """An int >= 1: ``"0"`` -> ``must be an int >= 1, got 0``; ``"x"`` -> ``expected an int
    >= 1, got 'x'``."""
    return _int_in_range(text, 1, None)


def non_negative_int(text: str) -> int:
    """An int >= 0 (errors as :func:`positive_int`'s)."""
    return _int_in_range(text, 0, None)


def bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    """The type of an int in ``[minimum, maximum]``: ``bounded_int(1, 1024)("2048")`` raises
    ``must be an int in [1, 1024], got 2048``.

    Raises:
        ValueError: naming ``maximum`` when it is below ``minimum``.
    """
    if maximum < minimum:
        raise ValueError(f"maximum: must be >= minimum {minimum}, got {maximum}")

    def int_in_range(text: str) -> int:
        return _int_in_range(text, minimum, maximum)

    int_in_range.__name__ = f"int_in_{minimum}_{maximum}"
    return int_in_range


def positive_int_list(text: str) -> list[int]:
    """``"2048,8191"`` -> ``[2048, 8191]`` (empty items skipped), every value an int >= 1, in the
    order given; ``expected comma-separated integers`` or ``expected integers >= 1`` otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def comma_choices(choices: Sequence[str], *, none_word: str | None = None
                  ) -> Callable[[str], tuple[str, ...]]:
    """The type of a comma list of ``choices``: ``"b,a,b"`` -> ``("b", "a")`` (in the order
    given, repeats dropped). With ``none_word`` (e.g. ``"none"``) that word alone, in any case,
    is the empty tuple. An empty list or an unknown name raises ``expected a comma list of a, b
    (or none), got 'x'``."""
    allowed = tuple(choices)
    listed = ", ".join(allowed) + ("" if none_word is None else f" (or {none_word})")

    def choice_list(text: str) -> tuple[str, ...]:
        if none_word is not None and text.strip().lower() == none_word:
            return ()
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        if not names or any(name not in allowed for name in names):
            raise argparse.ArgumentTypeError(f"expected a comma list of {listed}, got {text!r}")
        return tuple(dict.fromkeys(names))

    choice_list.__name__ = "comma_list"
    return choice_list


def _number(text: str) -> float:
    """``float(text)``, NaN for text that is no number (so every range check rejects it)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def fraction(text: str) -> float:
    """A number in ``[0, 1]``; ``expected a number in [0, 1], got 'x'`` otherwise (NaN too)."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def open_fraction(text: str) -> float:
    """A number in ``(0, 1)``; ``expected a number in (0, 1), got 'x'`` otherwise (NaN too)."""
    value = _number(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0; ``expected a finite number > 0, got 'x'`` otherwise."""
    value = _number(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds >= 0; ``expected a number of seconds >= 0, got 'x'``
    otherwise."""
    value = _number(text)
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value

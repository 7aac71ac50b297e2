"""argparse types shared by the bench drivers (loaded by path: ``bench/`` is on ``sys.path``)."""

import argparse


def sizes(text: str) -> list[int]:
    """``"2048,8191"`` -> ``[2048, 8191]``; raises ``argparse.ArgumentTypeError`` unless every
    value is an integer >= 1 (the flag's name is added by argparse, so the CLI exits 2 naming it)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values

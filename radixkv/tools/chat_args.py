"""``radixkv chat``'s flags, apart from the client (``radixkv.tools.chat``) so that building
the CLI's parser, ``--help`` included, imports no HTTP client."""

from __future__ import annotations

import argparse

DEFAULT_TEMPERATURE = 0.0
"""Greedy: the embedded SmolLM2-135M answers short questions at 0 and rambles at 0.7."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``radixkv chat``'s flags to ``p``; every help line states its default."""
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL; the scheme and a trailing /v1 may be given or not "
                        "(default: %(default)s)")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--system", default=None, help="system prompt (default: none)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="most output tokens per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help="sampling temperature; 0 is greedy, the same reply for the same history "
                        "(default: %(default)g)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for reproducible replies above temperature 0 "
                        "(default: none)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer <key>' (default: none)")
    p.add_argument("--cache-salt", default=None,
                   help="cache_salt sent with every request (default: none)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds without data before a request fails (default: %(default)g)")

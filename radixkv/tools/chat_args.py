"""``radixkv chat``'s flags, apart from the client (``radixkv.tools.chat``) so that building
the CLI's parser, ``--help`` included, imports no HTTP client."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="most output tokens per reply")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--cache-salt", default=None, help="cache_salt sent with every request")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds without data before a request fails")

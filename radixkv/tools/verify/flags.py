"""``radixkv verify``'s flags and usage error; importing this module imports no torch (``radixkv
verify --help`` and the commands reference build the parser from it)."""

from __future__ import annotations

import argparse

from radixkv.arg_types import bounded_int, comma_choices, non_negative_int, positive_float, positive_int
from radixkv.config import MAX_BLOCK_SIZE

QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
"""The quantized ``--kv-cache-dtype`` values (``radixkv.kernels.kv_quant``), spelled here so
that building the parser imports no torch (a test checks they agree)."""

SOURCES = ("tau-bench", "swe-agent", "mini-swe-agent", "crewai")
"""Transcript sources with a shipped sample (``radixkv.tools.transcripts``)."""


class VerifyError(ValueError):
    """A usage error (bad flag value, model path, prompt file): the message names the flag;
    ``main`` prints it and returns 2."""


kv_dtypes_arg = comma_choices(QUANTIZED_KV_DTYPES, none_word="none")
"""argparse type of ``--kv-cache-dtype``: a comma list of quantized KV dtypes, or ``none``."""

_block_size = bounded_int(1, MAX_BLOCK_SIZE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``radixkv verify``'s flags to ``p`` (imports no torch); every help line states its
    default."""
    p.add_argument("--model", default=None,
                   help="Hugging Face directory, .gguf file or shipped name (gemma3-270m; default: "
                        "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights, activations and the unquantized KV pools (default: %(default)s)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N; auto: cuda when available, else cpu (default: %(default)s)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "reference", "triton"],
                   help="backend of the paged variants (auto: triton on CUDA, torch elsewhere; "
                        "default: %(default)s)")
    p.add_argument("--kv-cache-dtype", type=kv_dtypes_arg, default=None, metavar="LIST",
                   help=f"quantized KV dtypes to compare against the unquantized paged cache, comma "
                        f"list of {', '.join(QUANTIZED_KV_DTYPES)}, or none (default: "
                        f"{','.join(QUANTIZED_KV_DTYPES)}, those the runner supports here)")
    p.add_argument("--compare-dtype", default=None, choices=["float32", "bfloat16"],
                   help="also run the model at this weight dtype (paged) and compare it with the "
                        "--dtype paged cache, beside the quantized KV (default: none)")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="prompts: a .jsonl file, one per line ({\"messages\": [...], \"tools\": [...]}, "
                        "{\"prompt\": \"text\"} or {\"prompt_token_ids\": [...]}), or any other file "
                        "read as one text prompt (default: shipped agent-transcript turns)")
    p.add_argument("--source", default="tau-bench", choices=SOURCES,
                   help="transcript source of the default prompts (default: %(default)s)")
    p.add_argument("--shared", action="store_true",
                   help="take the default prompts from the full transcripts in the shared data "
                        "folder ($RADIXKV_SHARED_DIR) instead of the shipped sample")
    p.add_argument("--num-prompts", type=positive_int, default=3,
                   help="prompts to run (default: %(default)s)")
    p.add_argument("--min-prompt-tokens", type=non_negative_int, default=0,
                   help="transcript turns shorter than this are skipped (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=4096,
                   help="transcript turns longer than this are skipped (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=8,
                   help="greedy steps after each prompt; the recompute variant runs a full forward "
                        "per step (default: %(default)s)")
    p.add_argument("--block-size", type=_block_size, default=16,
                   help="tokens per KV block of the paged variants (default: %(default)s)")
    p.add_argument("--logit-atol", type=positive_float, default=None,
                   help="max |Δlogit| the exact pairs may show (default: 1e-3 for float32, 2.0 for "
                        "bfloat16, whose paths differ by bf16 rounding)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH; without PATH print it instead of the table")
    p.add_argument("--log-level", default="warning",
                   help="structlog level of the engine's logs on stderr (default: %(default)s)")

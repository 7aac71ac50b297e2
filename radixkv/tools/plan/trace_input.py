"""Token ids of a shipped agent trace, tokenized exactly as ``radixkv bench serve`` sends it.

``bench serve`` flattens each transcript request to plain-text messages and renders them with
the served model's chat template (``bench/_serve_tokens.py``); this reuses that module, loaded
by path from the source checkout (``bench/`` is not an installed package), and the embedded
SmolLM2 tokenizer, the model ``radixkv serve`` runs by default.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["TRACES", "BENCH_DIR", "trace_prompts"]

#: ``--trace`` names: the transcript sources ``bench serve`` replays by default.
TRACES = ("tau-bench",)
BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def _serve_tokens() -> ModuleType:
    path = BENCH_DIR / "_serve_tokens.py"
    if not path.is_file():
        raise ValueError(f"trace: {path} not found (--trace needs a source checkout)")
    name = "radixkv_plan_serve_tokens"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def trace_prompts(trace: str, path: str | Path | None = None) -> list[list[list[int]]]:
    """Per session, per turn, the prompt token ids ``bench serve`` would send.

    Args:
        trace: one of :data:`TRACES`.
        path: the transcript file; None = the shipped sample (3 sessions, 31 requests).

    Raises:
        ValueError: naming ``trace`` for an unknown name, a missing file or no source checkout.
    """
    if trace not in TRACES:
        raise ValueError(f"trace: must be one of {', '.join(TRACES)}, got {trace!r}")
    from radixkv.tools.transcripts import load_tau_bench

    try:
        sessions = load_tau_bench(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"trace: {exc}") from exc
    tokens = _serve_tokens()
    tokenizer, _ = tokens.load_client_tokenizer(None)
    return [tokens.client_tokens(tokenizer, [tokens.flatten_request(r) for r in s]) for s in sessions]

"""Shared fixtures: a tiny random-init Llama in HF layout, and the embedded SmolLM2 (once per session)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Servers the tests start leave their KV pools lazily mapped: each would otherwise commit its
# whole pool (4 GiB by default) in the background. tests/kernels/test_host_memory.py turns it on.
os.environ.setdefault("RADIXKV_POPULATE_KV_POOL", "0")

import pytest  # noqa: E402
import structlog  # noqa: E402
import torch  # noqa: E402

# triton.jit reads TRITON_INTERPRET when a function is decorated, triton.language's own helpers
# (tl.cdiv, ...) included, and transformers' model classes import triton.language: set before
# any test module is collected, or a kernel run later under the interpreter calls compiled
# helpers. Servers and CLIs the tests start inherit it and stay on the torch backend ("auto").
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from radixkv.cache.pool import BlockPool  # noqa: E402
from radixkv.model.loader import LoadedModel, embedded_tokenizer_dir, load_model  # noqa: E402

# Tests check every block a publish hands to the tree (the hot path checks the run's ends).
BlockPool.check_every_block = True

# Tiny Llama: SmolLM2's vocab (so its tokenizer and chat template work), everything else small.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    # Wider than HF's default 0.02 so attention is sharp and logits are O(1): a mask or
    # position bug then moves logits far beyond the 1e-5 tolerance.
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TINY_SEED = 1234


def make_tiny_model_dir(path: str | os.PathLike, *, architecture: str | None = None,
                        seed: int = TINY_SEED, **overrides: Any) -> Path:
    """Save a random-init Llama-family model plus SmolLM2's tokenizer into ``path``.

    Args:
        path: directory to create / fill.
        architecture: ``"llama"`` (default), ``"mistral"`` (default when ``sliding_window`` is
            given) or ``"qwen2"``.
        seed: ``torch.manual_seed`` for the weights; same seed + overrides = same weights.
        **overrides: config fields replacing :data:`TINY_CONFIG` entries (e.g.
            ``sliding_window=8``, ``num_hidden_layers=3``, ``tie_word_embeddings=True``).

    Returns:
        The directory, loadable with ``radixkv.model.loader.load_model(path)``.
    """
    import transformers

    if architecture is None:
        architecture = "mistral" if overrides.get("sliding_window") is not None else "llama"
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    if architecture not in classes:
        raise ValueError(f"architecture: expected one of {sorted(classes)}, got {architecture!r}")
    config_cls, model_cls = classes[architecture]
    config = config_cls(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    shutil.copytree(embedded_tokenizer_dir(), out, dirs_exist_ok=True)
    return out


@pytest.fixture(autouse=True)
def _restore_structlog_config():
    """A CLI entry point called in-process (``main([...])``) configures structlog for the
    process, e.g. a ``warning`` filtering logger that drops the info events later tests
    capture with ``structlog.testing.capture_logs``: every test starts from the configuration
    the one before it started from."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF directory of the default tiny random-init Llama (session-wide, do not modify)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    """The default tiny model loaded through the HF directory loader (fp32)."""
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    """Gemma 3 270M from the optional ``gemma3`` extra, dequantized to fp32, loaded once per
    session (~6 s; modules using it skip when the extra is not installed)."""
    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct, loaded once per test session (fp32)."""
    return load_model(None)

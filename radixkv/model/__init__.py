"""Model side of radixkv: shapes, loaders (GGUF, HF directories), chat tokenizer, forward, runner."""

from .config import ModelShape
from .forward_batch import ForwardBatch
from .loader import LoadedModel, load_model
from .runner import ModelRunner
from .tokenizer import ChatTokenizer

__all__ = ["ModelShape", "LoadedModel", "load_model", "ChatTokenizer", "ForwardBatch", "ModelRunner"]

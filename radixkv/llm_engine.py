"""The synchronous engine: one ``step()`` = schedule → forward → sample → publish → finish.

``LLMEngine`` is single-threaded: the ``AsyncEngine`` in ``radixkv.engine`` runs it in its own
thread. Everything here (scheduler, cache manager, pools) is touched only by that thread.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import torch

from radixkv.cache_manager import CacheManager
from radixkv.config import GIB, EngineConfig
from radixkv.detokenizer import IncrementalDetokenizer
from radixkv.hashing import CacheIdentity
from radixkv.log import get_logger
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner
from radixkv.request import Request, RequestStatus
from radixkv.sampling import SamplingParams, make_generator, sample_tokens
from radixkv.scheduler import Scheduler
from radixkv.stats import EngineStats

log = get_logger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (see the server's use of each field)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int


def _num_blocks_for(config: EngineConfig, bytes_per_block: int) -> int:
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        if config.device.startswith("cuda"):
            free_bytes, _ = torch.cuda.mem_get_info(torch.device(config.device))
            budget = int(free_bytes * 0.9)
        else:
            budget = 4 * GIB
    return max(1, budget // bytes_per_block)


class LLMEngine:
    """Owns the model runner, cache manager, scheduler and stats.

    Args:
        config: engine configuration.
        model: an already loaded model (tests share one); None loads ``config.model``.
        tokenizer_decode: a decode function to use instead of the tokenizer's own (the async
            engine passes a lock-guarded one, since HF tokenizers are not re-entrant).
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None,
                 tokenizer_decode=None) -> None:
        self.config = config
        self.model = model if model is not None else load_model(config.model)
        self.tokenizer = self.model.tokenizer
        self._decoder = tokenizer_decode or self.tokenizer
        shape = self.model.shape
        block_size = config.cache.block_size
        bytes_per_block = ModelRunner.bytes_per_block_for(shape, block_size, self.model.dtype)
        num_blocks = _num_blocks_for(config, bytes_per_block)
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=block_size,
                                  device=config.device,
                                  attention_backend=config.resolved_attention_backend())
        self.cache = CacheManager(num_blocks, block_size,
                                  eviction_policy=config.cache.eviction_policy,
                                  enable_prefix_caching=config.cache.enable_prefix_caching,
                                  hash_algo=config.cache.hash_algo)
        self.stats = EngineStats()
        self.scheduler = Scheduler(config.scheduler, self.cache, self.stats)
        self.model_name = config.served_model_name or self.model.name
        self.max_model_len = shape.max_position_embeddings
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._rope = shape.rope_description()
        self._kv_dtype = str(self.model.dtype).removeprefix("torch.")
        self._roots: dict[str | None, bytes] = {}
        log.info("engine_ready", model=self.model_name, revision=self.model.revision[:16],
                 num_blocks=num_blocks, block_size=block_size, bytes_per_block=bytes_per_block,
                 prefix_caching=config.cache.enable_prefix_caching,
                 eviction_policy=config.cache.eviction_policy)

    # ------------------------------------------------------------------ requests
    def cache_root(self, cache_salt: str | None) -> bytes:
        """The identity root for this model, KV layout and salt (memoised)."""
        root = self._roots.get(cache_salt)
        if root is None:
            identity = CacheIdentity(model_revision=self.model.revision, block_size=self.block_size,
                                     kv_dtype=self._kv_dtype, rope=self._rope,
                                     cache_salt=cache_salt)
            root = self._roots[cache_salt] = self.cache.identity_root(identity)
        return root

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Room left for generation when a client gives no ``max_tokens`` (vLLM's default)."""
        return max(1, min(self.max_model_len, self.num_blocks * self.block_size) - num_prompt_tokens)

    def make_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     cache_salt: str | None = None, request_id: str | None = None) -> Request:
        """Validate a prompt and build its ``Request`` (not yet queued).

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, prompt + max_tokens
                beyond the model's context, or a request that could never fit the KV pool.
        """
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model.shape.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {len(prompt)} prompt tokens and max_tokens={params.max_tokens} "
                f"({total} in total).")
        num_blocks_needed = -(-total // self.block_size)
        if num_blocks_needed > self.num_blocks:
            raise ValueError(
                f"The request needs {num_blocks_needed} KV blocks ({total} tokens) but the pool "
                f"holds only {self.num_blocks} blocks of {self.block_size} tokens.")
        return Request(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=prompt,
                       params=params, cache_root=self.cache_root(cache_salt),
                       detokenizer=IncrementalDetokenizer(self._decoder, params.stop),
                       generator=make_generator(params, self.config.device))

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any phase; its blocks are released now (steps run in this same thread)."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        req.finish_reason = "abort"
        return self._output(req, [], "", finished=True)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one forward step over the scheduled requests and return their outputs."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        batch = self.runner.build_batch(
            [(r.new_token_ids(), r.num_computed_tokens, self.cache.block_table(r.request_id))
             for r in scheduled])
        logits = self.runner.forward(batch)
        tokens = sample_tokens(logits, [r.params for r in scheduled],
                               [r.generator for r in scheduled])
        now = time.monotonic()
        outputs = []
        for req, token in zip(scheduled, tokens):
            req.num_computed_tokens = len(req.token_ids)
            req.token_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            # Publish the blocks this step completed (prompt or generated tokens alike).
            self.cache.publish(req.request_id, req.token_ids, req.num_computed_tokens)
            outputs.append(self._postprocess(req, token))
        self.stats.record_generated(len(tokens))
        return outputs

    def _postprocess(self, req: Request, token: int) -> RequestOutput:
        params = req.params
        reason = None
        if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif req.num_output_tokens >= params.max_tokens or len(req.token_ids) >= self.max_model_len:
            reason = "length"
        text = req.detokenizer.add(req.output_token_ids, final=reason is not None)
        if req.detokenizer.stopped:
            reason = "stop"
        if reason is not None:
            req.finish_reason = reason
            self.scheduler.finish(req, RequestStatus.FINISHED)
        return self._output(req, [token], text, finished=reason is not None)

    def _output(self, req: Request, new_ids: list[int], text: str, *, finished: bool) -> RequestOutput:
        return RequestOutput(request_id=req.request_id, new_token_ids=new_ids, new_text=text,
                             finished=finished, finish_reason=req.finish_reason if finished else None,
                             num_prompt_tokens=req.num_prompt_tokens,
                             num_cached_tokens=req.num_cached_tokens,
                             num_generated_tokens=req.num_output_tokens)

    def stats_snapshot(self) -> dict:
        return self.stats.snapshot(self.cache, self.runner.bytes_per_block)

    # ------------------------------------------------------------------ offline helper
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 cache_salt: str | None = None, max_steps: int = 100_000) -> list[Request]:
        """Run prompts to completion in this thread (tests, offline use); returns the requests."""
        reqs = [self.make_request(p, params, cache_salt=cache_salt) for p in prompts]
        for req in reqs:
            self.add_request(req)
        for _ in range(max_steps):
            if all(r.status in (RequestStatus.FINISHED, RequestStatus.ABORTED) for r in reqs):
                return reqs
            self.step()
        raise RuntimeError(f"requests did not finish within {max_steps} steps")

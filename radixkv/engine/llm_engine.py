"""The synchronous engine: one ``step()`` = schedule → forward → sample → publish → finish.

``LLMEngine`` is single-threaded and has no event loop: offline use and tests step it directly;
the server uses the asynchronous engine, ``AsyncEngine`` in ``radixkv.engine.async_engine``,
which runs it in its own thread. Everything here (scheduler, cache manager, pools) is touched
only by that thread. Two exceptions: ``prepare_request`` (validation, no cache state: the
event loop calls it and hands the result to ``admit`` on the engine thread), and the LoRA
adapter registry (``radixkv.engine.adapters``), which documents its own lock.
"""

from __future__ import annotations

import time
import uuid
from typing import Sequence

import torch

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.cache.retention import (
    RetentionBreakpoint,
    RetentionInfo,
    check_breakpoints,
    clamp_created,
)
from radixkv.cache.store.backend import StoreBackend
from radixkv.config import GIB, EngineConfig, check_token_ids
from radixkv.engine.adapters import LoRAAdapters
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.faults import (
    FAILED,
    RequestOutput,
    fail_request,
    fail_step,
    make_output,
    num_unfinished,
)
from radixkv.engine.kv_activity import chunk_attention_context, chunk_kv_tokens
from radixkv.engine.request import Request, RequestSpec, RequestStatus
from radixkv.engine.sampling import SamplingParams, make_generator, sample_each
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.stats import EngineStats
from radixkv.engine.store_setup import attach_store
from radixkv.engine.window_kv import (
    WINDOW_KV_WINDOW,
    hit_granularity,
    plan_window_pools,
    window_kv_mode,
)
from radixkv.eviction.cost_model import cost_shape_from_model_shape
from radixkv.log import get_logger
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.lora import LoRAAdapter
from radixkv.model.runner import ModelRunner

log = get_logger(__name__)

__all__ = ["LLMEngine", "RequestOutput"]


def _kv_budget_bytes(config: EngineConfig) -> int:
    """Bytes for the KV pools: ``kv_cache_memory_bytes``, else 4 GiB on a CPU, ~90 % of the
    free device memory on CUDA."""
    budget = config.cache.kv_cache_memory_bytes
    if budget is None:
        if config.device.startswith("cuda"):
            free_bytes, _ = torch.cuda.mem_get_info(torch.device(config.device))
            budget = int(free_bytes * 0.9)
        else:
            budget = 4 * GIB
    return budget


def _num_blocks_for(config: EngineConfig, bytes_per_block: int) -> int:
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    return max(1, _kv_budget_bytes(config) // bytes_per_block)


class LLMEngine:
    """Owns the model runner, cache manager, scheduler and stats.

    A fault of one request's own ends that request only (``fail_request``, from
    ``radixkv.engine.faults``); ``step`` raises only what must stop the engine.

    Args:
        config: engine configuration.
        model: an already loaded model (tests share one); None loads ``config.model``.
        store_backend: the ``config.cache.kv_store`` backend, built already (``radixkv serve``
            connects to Mooncake before loading the model); None builds it here.
    """

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, *,
                 store_backend: StoreBackend | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = model if model is not None else load_model(
            config.model, dtype=getattr(torch, config.dtype))
        if str(self.model.dtype).removeprefix("torch.") != config.dtype:
            raise ValueError(f"dtype: the model given is {self.model.dtype}, the config asks for "
                             f"{config.dtype}")
        self.tokenizer = self.model.tokenizer
        shape = self.model.shape
        block_size = config.cache.block_size
        # Pool capacity from the bytes of a block in the KV format (scales included): int8 K/V
        # gets ~3.8x the blocks of fp32 in the same --kv-cache-memory.
        bytes_per_block = ModelRunner.bytes_per_block_for(shape, block_size, self.model.dtype,
                                                          config.kv_cache_dtype)
        # Window KV groups (docs/sliding-window.md): only for a model with window layers.
        self.window_kv = window_kv_mode(config.cache.sliding_window_kv, shape)
        if self.window_kv != config.cache.sliding_window_kv:
            log.warning("sliding_window_kv_ignored", requested=config.cache.sliding_window_kv,
                        reason="the model has no sliding-window layers: every block is kept")
        window_num_blocks: int | None = None
        if self.window_kv == WINDOW_KV_WINDOW:
            config, num_blocks, window_num_blocks = plan_window_pools(
                config, shape, bytes_per_block, _kv_budget_bytes(config))
            self.config = config
        else:
            num_blocks = _num_blocks_for(config, bytes_per_block)
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=block_size,
                                  device=config.device,
                                  attention_backend=config.resolved_attention_backend(),
                                  compile=config.compile, kv_cache_dtype=config.kv_cache_dtype,
                                  window_num_blocks=window_num_blocks)
        self._window_groups = sorted(g for g in self.runner.kv_groups if g >= 0) \
            if window_num_blocks is not None else []
        if config.compile:
            log.info("model_compiled", compile_s=round(self.runner.warm_up(), 2))
        # What a prefix hit can reuse, per layer group: a 0 % hit rate on a window model
        # explains itself from the log and /stats (docs/sliding-window.md).
        self.hit_granularity = hit_granularity(shape, block_size, self.window_kv)
        cost_shape = cost_shape_from_model_shape(shape, self.model.name)
        self.cache = CacheManager(num_blocks, block_size,
                                  eviction_policy=config.cache.eviction_policy,
                                  enable_prefix_caching=config.cache.enable_prefix_caching,
                                  hash_algo=config.cache.hash_algo,
                                  model_shape=cost_shape,
                                  max_retained_fraction=config.cache.max_retained_fraction,
                                  tenant_max_retained_tokens=dict(
                                      config.cache.tenant_max_retained_tokens),
                                  window_num_blocks=window_num_blocks,
                                  window_tokens=max(shape.layer_window_lefts) + 1
                                  if window_num_blocks is not None else None)
        self.stats = EngineStats(cost_shape)
        self.store = attach_store(config.cache, self.runner, self.cache, self.stats, cost_shape,
                                  backend=store_backend)
        self.scheduler = Scheduler(config.scheduler, self.cache, self.stats)
        self.model_name = config.served_model_name or self.model.name
        self.max_model_len = shape.max_position_embeddings
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._rope = shape.rope_description()
        # The KV format's tag in the cache identity: the dtype name for unquantized pools (as
        # before, so their roots are unchanged), e.g. ``int8-tokhead-f32-v1`` for quantized
        # ones, so blocks of different formats never match.
        self._kv_dtype = self.runner.kv_format.tag
        if self.window_kv == WINDOW_KV_WINDOW:  # a store value or KV event of one layout
            self._kv_dtype += ";window-kv=window"  # never matches the other's
        self.adapters = LoRAAdapters(shape, base_model_name=self.model_name,
                                     device=self.runner.device, dtype=self.model.dtype)
        for name, path in config.lora_adapters:
            self.adapters.load(name, path)
        self._groups: dict[str, list[Request]] = {}  # group id -> its choices, while live
        log.info("engine_ready", model=self.model_name, revision=self.model.revision[:16],
                 num_blocks=num_blocks, window_num_blocks=window_num_blocks,
                 prefill_chunk_tokens=config.scheduler.prefill_chunk_tokens,
                 block_size=block_size, bytes_per_block=bytes_per_block,
                 prefix_caching=config.cache.enable_prefix_caching,
                 eviction_policy=config.cache.eviction_policy, dtype=config.dtype,
                 kv_cache_dtype=self.runner.kv_cache_dtype,
                 kv_bytes_per_token=self.runner.kv_bytes_per_token,
                 num_threads=torch.get_num_threads(), compile=config.compile,
                 hit_granularity=self.hit_granularity)

    # ------------------------------------------------------------------ requests
    def cache_root(self, cache_salt: str | None, adapter: LoRAAdapter | None = None) -> bytes:
        """The identity root for this model, KV layout, salt and adapter (memoised by the cache;
        the thread that steps only: it writes the identity memo and the event log's allow-list).

        The adapter enters as ``(name, weights digest)``: new weights under an old name get a
        new root, so KV computed with the old weights is never matched.
        """
        identity = CacheIdentity(model_revision=self.model.revision, block_size=self.block_size,
                                 kv_dtype=self._kv_dtype, rope=self._rope, cache_salt=cache_salt,
                                 adapter=adapter.identity if adapter is not None else None)
        # The cache's identity memo (the only one) maps it to its root, LRU-bounded.
        return self.cache.identity_root(identity)

    # ------------------------------------------------------------------ LoRA adapters
    # The rules (names, replace, the in-use refusal) live in ``radixkv.engine.adapters``.
    def load_lora(self, name: str, path: str, *, replace: bool = False) -> LoRAAdapter:
        """Read a PEFT adapter from ``path`` and serve it as model ``name`` (blocking I/O).

        Raises:
            LoRAError: a bad name or adapter (see ``radixkv.model.lora.read_adapter``).
        """
        return self.adapters.load(name, path, replace=replace)

    def unload_lora(self, name: str) -> LoRAAdapter:
        """Stop serving adapter ``name`` (see ``LoRAAdapters.unload``).

        Raises:
            LoRANotFoundError: no such adapter.
            LoRAInUseError: a request made with it has not finished.
        """
        return self.adapters.unload(name)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Room left for generation when a client gives no ``max_tokens`` (vLLM's default)."""
        return max(1, min(self.max_model_len, self.num_blocks * self.block_size) - num_prompt_tokens)

    def prepare_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                        cache_salt: str | None = None, request_id: str | None = None,
                        tenant: str | None = None, lora_name: str | None = None,
                        session_key: str | None = None,
                        retention: Sequence[RetentionBreakpoint] = ()) -> RequestSpec:
        """Validate a prompt and describe its request (any thread: no cache state is touched).

        ``tenant`` only labels the request for per-tenant stats; isolation is ``cache_salt``;
        ``session_key`` (``prompt_cache_key`` / ``user``) is a hint for the eviction policy.
        ``retention``: breakpoints to retain (``radixkv.cache.retention``; at most 4 prompt
        breakpoints and one ``-1``, the whole sequence at finish).
        ``lora_name`` selects a loaded LoRA adapter (None: the base model); the request holds
        it from now until it finishes or is aborted, so pass the description on to ``admit``
        or ``build_request`` (or to ``discard_request`` if it will not run).

        Raises:
            LoRANotFoundError: no adapter named ``lora_name`` is loaded.
            ValueError: empty prompt, a token id outside the vocabulary (naming it,
                ``prompt[i]: ...``), a ``cache_salt`` that is not a string, prompt +
                max_tokens beyond the model's context, a request that could never fit the
                KV pool, or bad ``retention`` breakpoints (naming ``retention``).
        """
        prompt = check_token_ids("prompt", prompt_token_ids, self.model.shape.vocab_size)
        breakpoints = check_breakpoints(retention, len(prompt))
        adapter = self.adapters.resolve(lora_name) if lora_name is not None else None
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
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt: must be a string or None")  # as CacheIdentity says
        if adapter is not None:
            self.adapters.hold(adapter)  # now: an unload from here on sees it in use
        return RequestSpec(request_id=request_id or uuid.uuid4().hex,
                           prompt_token_ids=tuple(prompt), params=params,
                           arrival_s=time.monotonic(), cache_salt=cache_salt, tenant=tenant,
                           adapter=adapter, session_key=session_key, retention=breakpoints)

    def build_request(self, spec: RequestSpec) -> Request:
        """The ``Request`` of ``spec``, its cache identity root resolved (the cache's thread).

        The root goes through the cache's identity memo and, with KV events on, names the
        identity in the event log's allow-list: both belong to the thread that steps.
        """
        req = self._request_of(spec)
        self._bind(req, spec)
        return req

    def _request_of(self, spec: RequestSpec) -> Request:
        # Plain data from a validated spec: nothing here can fault, so a fault in _bind has a
        # request to end (fail_request). The root is filled in by _bind.
        return Request(request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
                       params=spec.params, cache_root=b"",
                       detokenizer=IncrementalDetokenizer(self.tokenizer, spec.params.stop),
                       arrival_s=spec.arrival_s, tenant=spec.tenant, adapter=spec.adapter,
                       session_key=spec.session_key, retention=spec.retention)

    def _bind(self, req: Request, spec: RequestSpec) -> None:
        req.cache_root = self.cache_root(spec.cache_salt, spec.adapter)
        req.generator = make_generator(spec.params, self.config.device)

    def make_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     cache_salt: str | None = None, request_id: str | None = None,
                     tenant: str | None = None, lora_name: str | None = None,
                     session_key: str | None = None,
                     retention: Sequence[RetentionBreakpoint] = ()) -> Request:
        """Validate a prompt and build its ``Request`` (not yet queued), in the calling thread:
        ``prepare_request`` then ``build_request``, for offline use and tests that step the
        engine themselves. Pass it to ``add_request`` (or ``discard_request``).

        Raises:
            As ``prepare_request``.
        """
        spec = self.prepare_request(prompt_token_ids, params, cache_salt=cache_salt,
                                    request_id=request_id, tenant=tenant, lora_name=lora_name,
                                    session_key=session_key, retention=retention)
        try:
            return self.build_request(spec)
        except BaseException:
            self.discard_request(spec)
            raise

    def admit(self, spec: RequestSpec) -> list[RequestOutput]:
        """Build ``spec``'s request and queue it (the engine thread's side of
        ``prepare_request``).

        Returns:
            [] once it is queued; when a fault of its own stops it (``fail_request``), its
            final ``"error"`` outputs.

        Raises:
            BaseException: a fatal fault (``faults.is_fatal``): the engine must stop.
        """
        req = self._request_of(spec)
        try:
            self._bind(req, spec)
            self.add_request(req)
        except Exception as exc:  # noqa: BLE001 - fail_request re-raises fatal faults
            return self.fail_request(req, exc)
        return []

    def add_request(self, req: Request) -> None:
        self._groups[req.group_id] = [req]
        self.scheduler.add(req)

    def discard_request(self, req: Request | RequestSpec) -> None:
        """Give back a request (or description) that will never be added: its adapter hold."""
        if req.adapter is not None:
            self.adapters.release(req.adapter)

    def fail_request(self, req: Request, exc: BaseException, *, check: bool = True
                     ) -> list[RequestOutput]:
        """End ``req`` on a fault of its own (``radixkv.engine.faults.fail_request``)."""
        return fail_request(self, req, exc, check=check)

    def pop_group(self, group_id: str) -> list[Request] | None:
        """Take a live request's choices out of the engine (None: ended, or never added)."""
        return self._groups.pop(group_id, None)

    def end_group(self, group: list[Request]) -> None:
        """The request (all its choices) is over: its adapter is no longer held."""
        adapter = group[0].adapter
        if adapter is not None:
            self.adapters.release(adapter)

    def abort_request(self, request_id: str, *, cancel_s: float | None = None
                      ) -> list[RequestOutput]:
        """Abort every unfinished choice of a request, in any phase.

        Blocks are released now: steps run in this same thread, so no step is in flight.
        ``cancel_s``: when the abort was asked (``time.perf_counter``; None: now), the start
        of the cancel → blocks released time recorded in ``stats.activity``.

        Returns:
            One final output (``finish_reason="abort"``) per choice that was still live;
            empty when the request is unknown or already finished.
        """
        if cancel_s is None:
            cancel_s = time.perf_counter()
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        outputs = []
        for req in group:
            if self.scheduler.abort(req.request_id) is not None:
                req.finish_reason = "abort"
                outputs.append(make_output(req, [], "", finished=True))
        if outputs:
            self.stats.activity.observe_cancel_release(time.perf_counter() - cancel_s)
            self.stats.record_abort(num_sequences=num_unfinished(group), tenant=group[0].tenant)
        self.end_group(group)
        return outputs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one forward step over the scheduled chunks and return the outputs it produced.

        A chunk that ends before the newest token (a partial suffix prefill) only advances
        ``num_computed_tokens`` and publishes the blocks it completed; a chunk that reaches the
        newest token samples the next one. A fault of one request's own ends that request
        (``fail_request``); a fault building or running the batched forward ends every request
        of the step the same way. The step's other requests go on; the cache's integrity is
        checked after any fault.

        Raises:
            BaseException: a fatal fault (``faults.is_fatal``) or a failed integrity check; the
                engine must stop.
        """
        t_schedule = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.loading and not self.scheduler.loaded:  # wait for a load, not spin
                self.cache.store_wait(0.005)
            return []
        try:
            t_batch = time.perf_counter()
            batch = self.runner.build_batch(
                [(c.request.token_ids[c.start:c.start + c.num_tokens], c.start,
                  self.cache.block_table(c.request.request_id)) for c in chunks],
                adapters=[c.request.adapter for c in chunks],
                window_tables=self._window_tables(chunks) if self._window_groups else None)
            self.stats.activity.observe_step(t_batch - t_schedule,
                                             time.perf_counter() - t_batch,
                                             *chunk_kv_tokens(chunks))
            # Blocks released while the forward may still write (none in this synchronous
            # loop, but the contract holds for an asynchronous device) are freed only at
            # end_step.
            self.cache.begin_step()
            try:
                logits = self.runner.forward(batch)
            finally:
                self.cache.end_step()
            if self.runner.last_attention_seconds is not None:
                self.stats.activity.observe_attention(*chunk_attention_context(chunks),
                                                      self.runner.last_attention_seconds)
        except Exception as exc:  # noqa: BLE001 - fail_request re-raises fatal faults
            return fail_step(self, chunks, exc)
        sampling_rows = [i for i, c in enumerate(chunks) if c.completes_prompt]
        tokens: dict[int, int | Exception] = {}
        if sampling_rows:
            sampled = sample_each(logits[sampling_rows],
                                  [chunks[i].request.params for i in sampling_rows],
                                  [chunks[i].request.generator for i in sampling_rows])
            tokens = dict(zip(sampling_rows, sampled))
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        faulted = False
        for i, chunk in enumerate(chunks):
            req = chunk.request
            if req.is_finished:  # another choice of its request faulted earlier in this step
                continue
            try:
                outputs += self._advance(chunk, tokens.get(i), logits[i], now)
            except Exception as exc:  # noqa: BLE001 - fail_request re-raises fatal faults
                outputs += self.fail_request(req, exc, check=False)
                faulted = True
        if faulted:
            self.cache.check_integrity()
        self.stats.activity.observe_step_end(time.perf_counter() - t_schedule)
        return outputs

    def _advance(self, chunk, token: int | Exception | None, logits_row: torch.Tensor,
                 now: float) -> list[RequestOutput]:
        """Account for one chunk's computed tokens and, when it sampled, its new token."""
        req = chunk.request
        start = chunk.start
        req.num_computed_tokens = start + chunk.num_tokens
        # Prompt (and recompute) chunks publish their full blocks at once, so a request
        # admitted next step can match them. Generated blocks are published in batches of
        # publish_interval_blocks and when the request ends (Scheduler.finish and
        # preemption publish the rest): one insert per batch instead of per block.
        decode = chunk.num_tokens == 1 and start >= req.num_prompt_tokens
        if not decode or req.num_computed_tokens >= req.publish_at_tokens:
            self.cache.publish(req.request_id, req.token_bytes, req.num_computed_tokens)
            req.publish_at_tokens = (req.num_computed_tokens // self.block_size
                                     + self.config.cache.publish_interval_blocks
                                     ) * self.block_size
        if self._window_groups:  # blocks that left the window: cached or freed
            self.cache.release_window_blocks(req.request_id, req.num_computed_tokens)
        if not req.retention_applied and req.num_computed_tokens >= req.num_prompt_tokens:
            self._retain_prompt(req)
        if token is None:
            return []
        if isinstance(token, Exception):
            raise token  # sampling this row failed
        outputs = []
        if req.params.n > 1 and req.index == 0 and len(self._groups.get(req.group_id, ())) == 1:
            outputs += self._fork_choices(req, logits_row, now)
        outputs.append(self._append_token(req, token, now))
        return outputs

    def _window_tables(self, chunks) -> list[dict[int, list[int]]]:
        """Each chunk's window-group block table, the same for every window group (the cache
        sizes one table for the largest window)."""
        groups = self._window_groups
        out = []
        for c in chunks:
            table = self.cache.window_table(c.request.request_id)
            out.append({g: table for g in groups})
        return out

    def _retain_prompt(self, req: Request) -> None:
        """The prompt's blocks are all cached: refresh the retentions it covers and apply its
        breakpoints (a ``-1`` retains the prompt now and the whole sequence at finish), before
        its first output (once per request).

        Creation is counted past the request's reported hit (``num_cached_tokens``, its first
        admission's), not the cache's latest lookup (a resume after preemption may have found
        less), and clamped to the prompt's rest: ``num_cached_tokens`` + created ≤ N always.
        """
        req.retention_applied = True
        n = req.num_prompt_tokens
        m = req.num_cached_tokens
        result = self.cache.retain(
            req.request_id, [(n if bp.num_tokens == -1 else bp.num_tokens, bp.ttl_class)
                             for bp in req.retention], num_prompt_tokens=n,
            num_cached_tokens=m)
        req.cache_creation_tokens_by_ttl = clamp_created(result.created, n - m)
        req.num_retained_tokens = result.num_retained_tokens
        req.retention_ids = result.retention_ids

    def _append_token(self, req: Request, token: int, now: float) -> RequestOutput:
        req.append_token(token)
        self.stats.record_generated(1, tenant=req.tenant)
        if req.first_token_s is None:
            req.first_token_s = now
        return self._postprocess(req, token)

    def _fork_choices(self, parent: Request, logits_row: torch.Tensor, now: float) -> list[RequestOutput]:
        """Start choices 1..n-1 of ``parent`` from its prefilled prompt.

        Each child shares the prompt's full blocks and gets a copy of the partial tail block
        (copy-on-write), then samples its first token from the same logits with its own
        generator (``sampling.choice_seed(seed, index)``). If no block is left for a tail copy,
        the child waits in the queue instead and recomputes its tail on admission (the logits
        are identical). A fault here ends the whole request (``fail_request``).
        """
        outputs = []
        params = parent.params
        prompt_len = len(parent.token_ids)
        group = self._groups[parent.group_id]
        for index in range(1, params.n):
            child = Request(request_id=f"{parent.request_id}#{index}",
                            prompt_token_ids=parent.prompt_token_ids, params=params,
                            cache_root=parent.cache_root,
                            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
                            generator=make_generator(params, self.config.device, index),
                            admitted=True, num_cached_tokens=parent.num_cached_tokens,
                            group_id=parent.group_id, index=index, tenant=parent.tenant,
                            adapter=parent.adapter, session_key=parent.session_key,
                            retention_applied=True,
                            cache_creation_tokens_by_ttl=parent.cache_creation_tokens_by_ttl,
                            num_retained_tokens=parent.num_retained_tokens,
                            retention_ids=parent.retention_ids)
            group.append(child)
            copies = self.cache.fork(parent.request_id, child.request_id,
                                     num_computed_tokens=prompt_len)
            if copies is None:
                self.scheduler.add(child)
                continue
            self.runner.copy_blocks(copies)
            child.num_computed_tokens = prompt_len
            child.status = RequestStatus.RUNNING
            self.scheduler.running.append(child)
            (token,) = sample_each(logits_row[None], [params], [child.generator])
            if isinstance(token, Exception):
                raise token  # sampling this choice failed: the whole request ends
            outputs.append(self._append_token(child, token, now))
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
            group = self._groups.get(req.group_id)
            if group is not None and all(r.is_finished for r in group):
                del self._groups[req.group_id]
                self.end_group(group)
        return make_output(req, [token], text, finished=reason is not None)

    # ------------------------------------------------------------------ retention
    def list_retentions(self, tenant: str | None, *, all_tenants: bool = False
                        ) -> list[RetentionInfo]:
        """Live retentions of ``tenant`` (every tenant's when ``all_tenants``), soonest expiry
        first (engine thread)."""
        return self.cache.list_retentions(tenant, all_tenants=all_tenants)

    def release_retentions(self, tenant: str | None, retention_id: str | None = None, *,
                           all_tenants: bool = False) -> int:
        """Release ``tenant``'s retentions (only ``retention_id`` when given; any tenant's
        when ``all_tenants``): their blocks become ordinary cached blocks. Returns how many
        were released (engine thread)."""
        return self.cache.release_retentions(tenant, retention_id, all_tenants=all_tenants)

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no running request holds; returns how many.

        With KV events on, the event log records one ``AllBlocksCleared``.
        """
        return self.cache.reset_prefix_cache()

    def scheduler_gauges(self) -> dict[str, int]:
        """Sequences running and waiting (queued, loading from the store tier, or loaded)."""
        sched = self.scheduler
        return {"running": len(sched.running),
                "waiting": len(sched.waiting) + len(sched.loading) + len(sched.loaded)}

    def stats_snapshot(self) -> dict:
        # Under KV groups the tree's blocks are the full-attention layers' blocks.
        out = self.stats.snapshot(self.cache, self.runner.group_bytes_per_block.get(-1, 0)
                                  if self._window_groups else self.runner.bytes_per_block,
                                  kv_cache_dtype=self.runner.kv_cache_dtype,
                                  kv_bytes_per_token=self.runner.kv_bytes_per_token)
        # A fresh copy: the snapshot leaves the engine thread (a reader may keep or change it).
        out["hit_granularity"] = hit_granularity(self.model.shape, self.block_size,
                                                 self.window_kv)
        if self.cache.window is not None:
            out["pool"]["window"] = self.cache.window.snapshot()
        populate = getattr(self.runner, "pool_populate", None)
        if populate is not None:
            out["pool"]["populate"] = populate.snapshot()
        return out

    # ------------------------------------------------------------------ offline helper
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 cache_salt: str | None = None, lora_name: str | None = None,
                 max_steps: int = 100_000, session_key: str | None = None,
                 retention: Sequence[RetentionBreakpoint] = ()) -> list[Request]:
        """Run prompts to completion in this thread (tests, offline use).

        ``lora_name`` / ``session_key`` / ``retention``: as ``make_request``, for every prompt.

        Returns:
            The requests, in prompt order; with ``params.n > 1``, each prompt's n choices in
            index order (fewer when a fault ended the request before it forked: its requests
            have ``finish_reason == "error"``).
        """
        parents: list[Request] = []
        try:
            for p in prompts:
                parents.append(self.make_request(p, params, cache_salt=cache_salt,
                                                 lora_name=lora_name, session_key=session_key,
                                                 retention=retention))
        except Exception:
            for req in parents:  # made, never added: give their adapter holds back
                self.discard_request(req)
            raise
        groups = []
        for req in parents:
            self.add_request(req)
            groups.append(self._groups[req.group_id])
        for _ in range(max_steps):
            if all(all(r.is_finished for r in g)
                   and (len(g) == params.n or any(r.finish_reason == FAILED for r in g))
                   for g in groups):
                return [r for g in groups for r in sorted(g, key=lambda r: r.index)]
            self.step()
        raise RuntimeError(f"requests did not finish within {max_steps} steps")

"""``radixkv verify``: run prompts through every KV cache path of a model and find where they part.

For a model and settings, each prompt runs as

- ``recompute`` (a): no KV cache at all. Every step is a fresh forward of the whole sequence so
  far (reference attention over the step's own K/V); its greedy choices are the reference
  continuation;
- ``contiguous`` (b): a contiguous per-sequence cache (one ``[S, Hkv, D]`` tensor per layer,
  reference attention reading the prefix back from it), prefill then one token per step;
- ``paged`` (c): the paged pool of the configured attention backend (``ModelRunner``: prefill,
  then decode steps), with a block table that is not the identity;
- ``prefix-hit`` / ``prefix-hit+1`` (d): the same pool entered through a prefix hit: an earlier
  request prefills the first ``h`` tokens (``h`` a block boundary near the prompt's middle, or
  one token past it), the prompt's request reuses its full blocks (and a copy of the partial
  one, as copy-on-write does) and computes the rest as a suffix;
- ``kv-int8`` / ``kv-fp8_e4m3`` (e): the paged pool at each quantized ``--kv-cache-dtype``
  (plus ``kv-int8+prefix-hit``, entered through a prefix hit at the block boundary);
- ``model-<dtype>`` (``--compare-dtype``): the model at another weight dtype, paged.

Teacher-forced: every variant is fed the same tokens, the prompt plus the reference greedy
continuation of ``--max-new-tokens`` tokens, so the logits compare position by position (every
prompt position and every generated step). Each pair reports the first generation step where the
chosen (argmax) token differs, the first layer whose K or V (read back from the cache,
dequantized) differs beyond tolerance, top-1 agreement, max |Δlogit|, mean KL(baseline ‖ variant)
in nats over all teacher-forced positions, and the greedy continuation agreement (the variant's
own greedy continuation follows the baseline's until its first differing choice).

Pairs (b)-(d) against (a), at the model dtype, must be exact: every chosen token the same and
max |Δlogit| within the dtype's stated tolerance (:data:`LOGIT_ATOL`). A position whose two
candidate tokens the baseline itself scores within that tolerance of each other is a tie: it is
counted and shown, not failed (a last-bit difference may pick either). The other pairs are
reported, not gated. ``main`` returns 0 when every exact pair holds, 1 when one does not, 2 for
a usage error (bad flag value, model path, prompt file).

Building the parser imports no torch (``radixkv --help`` stays fast); :func:`main` imports what
it runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.arg_types import bounded_int, comma_choices, non_negative_int, positive_float, positive_int
from radixkv.config import MAX_BLOCK_SIZE

if TYPE_CHECKING:
    import torch

    from radixkv.kernels.kv_quant import KVFormat
    from radixkv.model.llama import LlamaForward
    from radixkv.model.loader import LoadedModel
    from radixkv.model.runner import ModelRunner
    from radixkv.model.tokenizer import ChatTokenizer

__all__ = ["add_arguments", "main", "QUANTIZED_KV_DTYPES", "LOGIT_ATOL", "KV_ATOL", "KV_RTOL",
           "StepHook", "VerifyError"]

QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
"""The quantized ``--kv-cache-dtype`` values (``radixkv.kernels.kv_quant``), spelled here so
that building the parser imports no torch (a test checks they agree)."""

LOGIT_ATOL = {"float32": 1e-3, "bfloat16": 2.0}
"""Stated tolerance of the exact pairs, max |Δlogit| per model dtype. fp32: SmolLM2's logits
are O(30) and transformers' own attention backends differ by ~5e-5 (the SmolLM2 model test
holds radixkv to 1e-3; measured on a 1,373-token tau-bench turn: paged vs recompute 9.3e-5).
bf16 is no exactness check: the C kernels compute in fp32 on bf16 data while the torch
reference rounds after every op, so the two differ by bf16 noise (same turn: max |Δlogit|
1.19, top-1 0.975 with every differing choice a tie, about as far as bf16 is from fp32); 2.0
still catches a wrong block or position. Verify cache paths at float32."""

KV_ATOL = {"float32": 1e-4, "bfloat16": 0.05}
KV_RTOL = {"float32": 1e-3, "bfloat16": 0.02}
"""K/V tolerance per model dtype: element ``|Δ| <= KV_ATOL + KV_RTOL * amax`` with ``amax`` the
baseline's max |x| over that (token, KV head) row; a quantized variant adds its format's
rounding (int8: half a step, ``amax / 254``; fp8_e4m3: ``|x| / 16 + amax / 458752``)."""

SOURCES = ("tau-bench", "swe-agent", "mini-swe-agent", "crewai")
"""Transcript sources with a shipped sample (``radixkv.tools.transcripts``)."""

RECOMPUTE, CONTIGUOUS, PAGED = "recompute", "contiguous", "paged"
HIT, HIT_PAST = "prefix-hit", "prefix-hit+1"

StepHook = Callable[[str, int, "Sequence[torch.Tensor]", "Sequence[torch.Tensor]"], None]
"""``hook(variant, step, k_caches, v_caches)``: called after each step of every cached variant
(step 0 = the prompt's prefill, step t = the decode that fed generated token t - 1) with the
per-layer K and V storage it just wrote (pools ``[M, B, Hkv, D]`` or contiguous ``[S, Hkv, D]``),
before the next step reads them. A test seam: perturbing a layer there must be reported."""


class VerifyError(ValueError):
    """A usage error (bad flag value, model path, prompt file): the message names the flag;
    ``main`` prints it and returns 2."""


# ---------------------------------------------------------------------------------------------
# Flags


kv_dtypes_arg = comma_choices(QUANTIZED_KV_DTYPES, none_word="none")
"""argparse type of ``--kv-cache-dtype``: a comma list of quantized KV dtypes, or ``none``."""

_block_size = bounded_int(1, MAX_BLOCK_SIZE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``radixkv verify``'s flags to ``p`` (imports no torch); every help line states its
    default."""
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
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


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass
class Prompt:
    """One prompt to verify: where it came from and its token ids."""

    label: str
    token_ids: list[int]


def _check_record(record: Any, where: str) -> None:
    """A ``--prompt-file`` JSONL record's shape, checked before the model loads."""
    if isinstance(record, str):
        return
    if not isinstance(record, dict):
        raise VerifyError(f"--prompt-file: {where}: expected an object with messages, prompt or "
                          f"prompt_token_ids, got {type(record).__name__}")
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise VerifyError(f"--prompt-file: {where}: prompt_token_ids must be a list of ints")
    elif "messages" in record:
        if not isinstance(record["messages"], list) or not record["messages"]:
            raise VerifyError(f"--prompt-file: {where}: messages must be a non-empty list")
    elif not isinstance(record.get("prompt"), str):
        raise VerifyError(f"--prompt-file: {where}: expected a key messages, prompt (a string) or "
                          f"prompt_token_ids")


def read_prompt_file(path: str) -> list[tuple[str, Any]]:
    """The prompts of ``--prompt-file`` (see its help) as ``(label, record)`` in file order,
    read and checked before the model loads: a record is a JSONL line's value, or the whole
    text of a non-JSONL file.

    Raises:
        VerifyError: naming ``--prompt-file`` when it cannot be read, holds no prompt, or a line
            is not JSON or not a prompt.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise VerifyError(f"--prompt-file: cannot read {file}: {exc}") from exc
    records: list[tuple[str, Any]] = []
    if file.suffix in (".jsonl", ".ndjson"):
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{file} line {number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise VerifyError(f"--prompt-file: {where}: not JSON: {exc}") from exc
            _check_record(record, where)
            records.append((f"{file.name}:{number}", record))
    elif text.strip():
        records.append((file.name, text))
    if not records:
        raise VerifyError(f"--prompt-file: {file} holds no prompt")
    return records


def tokenize_prompts(records: Sequence[tuple[str, Any]], tokenizer: ChatTokenizer) -> list[Prompt]:
    """Token ids of :func:`read_prompt_file`'s records: text encoded as is (no special tokens
    added), messages rendered with the model's chat template (generation prompt appended),
    token ids checked against the vocabulary.

    Raises:
        VerifyError: naming ``--prompt-file`` for a prompt with no tokens, an id outside the
            vocabulary or messages the template cannot render.
    """
    prompts: list[Prompt] = []
    for label, record in records:
        if isinstance(record, str):
            ids = tokenizer.encode(record)
        elif "prompt_token_ids" in record:
            ids = list(record["prompt_token_ids"])
            bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
            if bad:
                raise VerifyError(f"--prompt-file: {label}: token id {bad[0]} outside the "
                                  f"vocabulary [0, {tokenizer.vocab_size})")
        elif "messages" in record:
            try:
                ids = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"))
            except ValueError as exc:
                raise VerifyError(f"--prompt-file: {label}: {exc}") from exc
        else:
            ids = tokenizer.encode(record["prompt"])
        if not ids:
            raise VerifyError(f"--prompt-file: {label}: the prompt has no tokens")
        prompts.append(Prompt(label, ids))
    return prompts


def transcript_prompts(source: str, *, shared: bool, tokenizer: ChatTokenizer, num_prompts: int,
                       min_tokens: int, max_tokens: int) -> list[Prompt]:
    """``num_prompts`` turns of a transcript source whose rendered prompts have
    ``min_tokens..max_tokens`` tokens, spread evenly over the source's requests (every k-th
    request first, then the ones after them), each rendered with the model's chat template.

    Raises:
        VerifyError: naming ``--shared`` when the shared data is missing, or
            ``--min-prompt-tokens`` when no turn fits the range.
    """
    from radixkv.tools.data import SharedDataMissing, require_shared
    from radixkv.tools.transcripts import SOURCE_PATHS, TRANSCRIPTS, load_source

    try:
        path = require_shared(TRANSCRIPTS / SOURCE_PATHS[source]) if shared else None
    except SharedDataMissing as exc:
        raise VerifyError(f"--shared: {exc}") from exc
    requests = [r for session in load_source(source, path) for r in session]
    stride = max(1, len(requests) // num_prompts)
    order = [i for offset in range(stride) for i in range(offset, len(requests), stride)]
    prompts: list[Prompt] = []
    for i in order:
        request = requests[i]
        try:
            ids = tokenizer.apply_chat_template(request["messages"], tools=request.get("tools"))
        except ValueError:
            continue  # a turn this template cannot render is not a prompt to verify
        if min_tokens <= len(ids) <= max_tokens:
            prompts.append(Prompt(f"{source} {request['session_id']} turn {request['turn']}", ids))
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise VerifyError(f"--min-prompt-tokens/--max-prompt-tokens: no {source} turn has "
                          f"{min_tokens}..{max_tokens} tokens")
    return prompts


# ---------------------------------------------------------------------------------------------
# Variants


@dataclass
class Trace:
    """What one variant computed for one prompt, teacher-forced on ``S = prompt + continuation``.

    Attributes:
        logits: ``[N - 1, V]`` fp32; row ``i`` predicts token ``i + 1`` of S (N = len(S)).
        keys / values: per layer ``[N - 1, Hkv, D]`` fp32, the K/V of S's first N - 1 tokens
            as the variant's cache holds them (dequantized).
        detail: facts of the run (e.g. ``prefix_hit_tokens``).
    """

    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    detail: dict[str, Any] = field(default_factory=dict)


def _single_seq_meta(prefix_len: int, num_new: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_tables ``[[0]]``, prefix_lens ``[P]``, qo_indptr ``[0, L]``) of one sequence whose
    cache is one block holding it all."""
    import torch

    return (torch.zeros((1, 1), dtype=torch.int32, device=device),
            torch.tensor([prefix_len], dtype=torch.int32, device=device),
            torch.tensor([0, num_new], dtype=torch.int32, device=device))


def run_recompute(fwd: LlamaForward, prompt: Sequence[int], max_new_tokens: int,
                  window_left: int) -> tuple[Trace, list[int]]:
    """Variant (a): greedy generation with no cache, a full forward of the sequence per step.

    Returns:
        ``(trace, continuation)``: the continuation is the greedy tokens (``max_new_tokens``).
    """
    import torch

    from radixkv.kernels import reference

    device = fwd.device
    num_layers = fwd.shape.num_layers
    keys: list[torch.Tensor] = [torch.empty(0)] * num_layers
    values: list[torch.Tensor] = [torch.empty(0)] * num_layers
    capture = [False]

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num = q.shape[0]
        empty = k.new_zeros((1, 1, *k.shape[1:]))
        tables, prefix_lens, indptr = _single_seq_meta(0, num, device)
        if capture[0]:  # copies: k and v may be views of a buffer the next layer reuses
            keys[layer] = k.to(torch.float32, copy=True).cpu()
            values[layer] = v.to(torch.float32, copy=True).cpu()
        out = reference.extend_attention(q, k, v, empty, empty, tables, prefix_lens, indptr,
                                         max_q_len=num, window_left=window_left)
        assert isinstance(out, torch.Tensor)
        return out

    sequence = list(prompt)
    rows: list[torch.Tensor] = []
    generated: list[int] = []
    with torch.inference_mode():
        for step in range(max_new_tokens):
            capture[0] = step == max_new_tokens - 1  # the last step's forward covers N - 1 tokens
            ids = torch.tensor(sequence, dtype=torch.int64, device=device)
            positions = torch.arange(len(sequence), dtype=torch.int64, device=device)
            last = None if step == 0 else torch.tensor([len(sequence) - 1], device=device)
            logits = fwd.forward(ids, positions, attention, last).float().cpu()
            rows.append(logits)
            token = int(logits[-1].argmax())
            generated.append(token)
            sequence.append(token)
    return Trace(torch.cat(rows), keys, values), generated


def run_contiguous(fwd: LlamaForward, sequence: Sequence[int], prompt_len: int, window_left: int,
                   hook: StepHook | None) -> Trace:
    """Variant (b): prefill into a contiguous per-sequence cache, then one token per step."""
    import torch

    from radixkv.kernels import reference

    device, shape = fwd.device, fwd.shape
    total = len(sequence) - 1
    cache_shape = (total, shape.num_kv_heads, shape.head_dim)
    caches_k = [torch.zeros(cache_shape, dtype=fwd.dtype, device=device) for _ in range(shape.num_layers)]
    caches_v = [torch.zeros(cache_shape, dtype=fwd.dtype, device=device) for _ in range(shape.num_layers)]
    cursor = [0]

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, num = cursor[0], q.shape[0]
        cache_k, cache_v = caches_k[layer], caches_v[layer]
        cache_k[start:start + num] = k
        cache_v[start:start + num] = v
        tables, prefix_lens, indptr = _single_seq_meta(start, num, device)
        out = reference.extend_attention(q, k, v, cache_k[None], cache_v[None], tables, prefix_lens,
                                         indptr, max_q_len=num, window_left=window_left)
        assert isinstance(out, torch.Tensor)
        return out

    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        chunks = [(0, prompt_len)] + [(pos, pos + 1) for pos in range(prompt_len, total)]
        for step, (start, end) in enumerate(chunks):
            cursor[0] = start
            ids = torch.tensor(sequence[start:end], dtype=torch.int64, device=device)
            positions = torch.arange(start, end, dtype=torch.int64, device=device)
            rows.append(fwd.forward(ids, positions, attention, None).float().cpu())
            if hook is not None:
                hook(CONTIGUOUS, step, caches_k, caches_v)
    return Trace(torch.cat(rows), [c.float().cpu() for c in caches_k], [c.float().cpu() for c in caches_v])


def runner_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks a runner needs for the paged variants of an ``num_tokens``-token sequence: a
    cold table and a prefix-hit request's own blocks beside the earlier request's, plus block
    0 that no table uses (a write through a wrong table lands where no read looks)."""
    return 2 * -(-num_tokens // block_size) + 2


def _read_pool(runner: ModelRunner, table: Sequence[int], num_tokens: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the first ``num_tokens`` K and V of ``table`` as fp32 ``[num_tokens, Hkv, D]``,
    dequantized with the block's scale rows when the pools are quantized."""
    import torch

    from radixkv.kernels.kv_quant import dequantize_kv

    blocks = torch.tensor(list(table), dtype=torch.int64, device=runner.k_pools[0].device)
    k_scales = getattr(runner, "k_scales", None)
    v_scales = getattr(runner, "v_scales", None)

    def gather(pool: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        rows = pool.index_select(0, blocks).reshape(-1, *pool.shape[2:])[:num_tokens]
        if scales is None:
            return rows.float().cpu()
        scale_rows = scales.index_select(0, blocks).reshape(-1, scales.shape[2])[:num_tokens]
        return dequantize_kv(rows, scale_rows).cpu()

    keys = [gather(pool, None if k_scales is None else k_scales[i])
            for i, pool in enumerate(runner.k_pools)]
    values = [gather(pool, None if v_scales is None else v_scales[i])
              for i, pool in enumerate(runner.v_pools)]
    return keys, values


def run_paged(runner: ModelRunner, name: str, sequence: Sequence[int], prompt_len: int,
              hook: StepHook | None, *, hit_tokens: int | None = None) -> Trace:
    """Variants (c), (d), (e): the prompt through ``runner``'s paged pool, then one token per
    step.

    Without ``hit_tokens`` the prompt is one cold prefill over the table ``[M-1, M-2, …]``.
    With ``hit_tokens = h`` an earlier request prefills ``S[:h]`` over that table; the
    prompt's request shares its full blocks, copies its partial block (``copy_blocks``, as
    copy-on-write does) when ``h`` is not a block boundary, takes fresh blocks ``[1, 2, …]``
    for the rest and computes ``S[h:prompt_len]`` as a suffix.
    """
    import torch

    block_size, num_blocks = runner.block_size, runner.num_blocks
    total = len(sequence) - 1
    needed = -(-total // block_size)
    if runner_blocks_needed(total, block_size) > num_blocks:
        raise ValueError(f"num_blocks: the runner has {num_blocks} blocks, the sequence needs "
                         f"{runner_blocks_needed(total, block_size)}")
    top = [num_blocks - 1 - i for i in range(needed)]
    rows: list[torch.Tensor] = []
    detail: dict[str, Any] = {}
    if hit_tokens is None:
        table = top
        first = [(list(sequence[:prompt_len]), 0)]
    else:
        if not 0 < hit_tokens < prompt_len:
            raise ValueError(f"hit_tokens: must be in [1, {prompt_len - 1}], got {hit_tokens}")
        rows.append(runner.forward(runner.build_batch([(list(sequence[:hit_tokens]), 0, top)]),
                                   all_logits=True).float().cpu())
        shared = hit_tokens // block_size
        fresh = list(range(1, 1 + needed - shared))
        table = top[:shared] + fresh
        if hit_tokens % block_size:
            runner.copy_blocks([(top[shared], fresh[0])])
        first = [(list(sequence[hit_tokens:prompt_len]), hit_tokens)]
        detail = {"prefix_hit_tokens": hit_tokens, "shared_blocks": shared,
                  "copied_blocks": int(hit_tokens % block_size > 0)}
    steps = first + [([sequence[pos]], pos) for pos in range(prompt_len, total)]
    for step, (ids, prefix_len) in enumerate(steps):
        batch = runner.build_batch([(ids, prefix_len, table)])
        rows.append(runner.forward(batch, all_logits=True).float().cpu())
        if hook is not None:
            hook(name, step, runner.k_pools, runner.v_pools)
    keys, values = _read_pool(runner, table, total)
    return Trace(torch.cat(rows), keys, values, detail)


def hit_points(prompt_len: int, block_size: int) -> dict[str, int]:
    """The prefix-hit lengths of a prompt: the block boundary nearest its middle (at least one
    block) and one token past it, each kept only where a suffix token is left to compute."""
    boundary = max(block_size, round(prompt_len / 2 / block_size) * block_size)
    return {name: h for name, h in ((HIT, boundary), (HIT_PAST, boundary + 1)) if h < prompt_len}


# ---------------------------------------------------------------------------------------------
# Comparison


@dataclass
class Tolerances:
    """What the comparisons allow (see :data:`LOGIT_ATOL`, :data:`KV_ATOL`, :data:`KV_RTOL`)."""

    logit_atol: float
    kv_atol: float
    kv_rtol: float


def _kv_rounding(base: torch.Tensor, amax: torch.Tensor, fmt: KVFormat | None) -> torch.Tensor | float:
    """The extra K/V error a quantized format's own rounding allows per element."""
    if fmt is None or not fmt.quantized:
        return 0.0
    scale = (amax / fmt.qmax).unsqueeze(-1)
    if fmt.name == "int8":
        return scale * 0.5
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal spacing 2^-9 of the scale.
    return base.abs() * 2.0 ** -4 + scale * 2.0 ** -10


def compare_kv(variant: Trace, base: Trace, tol: Tolerances, fmt: KVFormat | None) -> dict[str, Any]:
    """Per layer max |ΔK|, |ΔV| and the first layer (K before V) with an element beyond
    tolerance: ``{"kv_max_abs_diff": [[k, v], ...], "first_kv_mismatch": None | {...}}``."""
    per_layer: list[list[float]] = []
    first: dict[str, Any] | None = None
    for layer in range(len(base.keys)):
        maxes = []
        for tensor, ours, theirs in (("k", variant.keys[layer], base.keys[layer]),
                                     ("v", variant.values[layer], base.values[layer])):
            diff = (ours - theirs).abs()
            amax = theirs.abs().amax(dim=-1)
            allowed = tol.kv_atol + tol.kv_rtol * amax.unsqueeze(-1) + _kv_rounding(theirs, amax, fmt)
            maxes.append(float(diff.max()) if diff.numel() else 0.0)
            beyond = (diff > allowed).flatten(1).any(dim=1).nonzero()
            if first is None and beyond.numel():
                first = {"layer": layer, "tensor": tensor, "position": int(beyond[0, 0]),
                         "max_abs_diff": maxes[-1]}
        per_layer.append(maxes)
    return {"kv_max_abs_diff": per_layer, "first_kv_mismatch": first}


def compare(variant: Trace, base: Trace, prompt_len: int, tol: Tolerances,
            fmt: KVFormat | None = None, chunk_rows: int = 256) -> dict[str, Any]:
    """One prompt's metrics of ``variant`` against ``base`` (see the module docstring).

    Returns:
        ``positions``, ``agreeing_positions``, ``tie_positions`` (differing choices the
        baseline scores within ``logit_atol``), ``top1_agreement``, ``max_abs_logit_diff``,
        ``mean_kl_nats``, ``first_token_mismatch_step`` (generation step, or None),
        ``first_argmax_mismatch_position`` (first token position, prompt or generated, whose
        chosen token differs, or None), ``first_logit_mismatch_position`` (first token position
        whose logits differ by more
        than logit_atol, or None; generation step t is position ``prompt_len - 1 + t``),
        ``greedy_agreement`` (leading steps agreeing / steps), ``greedy_steps``, plus
        :func:`compare_kv`'s fields.
    """
    import torch

    if variant.logits.shape != base.logits.shape:
        raise ValueError(f"logits: variant {tuple(variant.logits.shape)} vs baseline "
                         f"{tuple(base.logits.shape)}")
    num_rows = base.logits.shape[0]
    steps = num_rows - prompt_len + 1
    agree = torch.empty(num_rows, dtype=torch.bool)
    ties = 0
    max_diff = 0.0
    row_max = torch.empty(num_rows, dtype=torch.float64)
    kl_sum = 0.0
    for start in range(0, num_rows, chunk_rows):
        ours = variant.logits[start:start + chunk_rows]
        theirs = base.logits[start:start + chunk_rows]
        diff = (ours - theirs).abs().amax(dim=-1)
        row_max[start:start + ours.shape[0]] = diff.double()
        max_diff = max(max_diff, float(diff.max()))
        choice_ours, choice_theirs = ours.argmax(dim=-1), theirs.argmax(dim=-1)
        same = choice_ours == choice_theirs
        agree[start:start + ours.shape[0]] = same
        if not bool(same.all()):
            gap = theirs.gather(1, choice_theirs[:, None]) - theirs.gather(1, choice_ours[:, None])
            ties += int(((gap[:, 0] <= tol.logit_atol) & ~same).sum())
        logp = torch.log_softmax(theirs.double(), dim=-1)
        logq = torch.log_softmax(ours.double(), dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(dim=-1).clamp_(min=0.0)
        kl_sum += float(kl.sum())
    step_agree = agree[prompt_len - 1:]
    mismatched_steps = (~step_agree).nonzero()
    first_step = int(mismatched_steps[0, 0]) if mismatched_steps.numel() else None
    mismatched = (~agree).nonzero()
    first_argmax = int(mismatched[0, 0]) if mismatched.numel() else None
    beyond = (row_max > tol.logit_atol).nonzero()
    first_logit = int(beyond[0, 0]) if beyond.numel() else None
    agreeing = int(agree.sum())
    out = {
        "positions": num_rows,
        "agreeing_positions": agreeing,
        "tie_positions": ties,
        "top1_agreement": agreeing / num_rows,
        "max_abs_logit_diff": max_diff,
        "mean_kl_nats": kl_sum / num_rows,
        "first_token_mismatch_step": first_step,
        "first_argmax_mismatch_position": first_argmax,
        "first_logit_mismatch_position": first_logit,
        "greedy_agreement": (steps if first_step is None else first_step) / steps,
        "greedy_steps": steps,
    }
    out.update(compare_kv(variant, base, tol, fmt))
    return out


@dataclass
class Pair:
    """A variant against its baseline, over every prompt."""

    variant: str
    baseline: str
    must_match: bool
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, tol: Tolerances) -> dict[str, Any]:
        """Pooled metrics (positions pooled over prompts; the earliest mismatch over prompts)
        and ``ok``: for an exact pair, no differing choice beyond a tie and max |Δlogit| within
        ``logit_atol``; None for a reported-only pair."""
        runs = self.per_prompt
        out: dict[str, Any] = {"variant": self.variant, "baseline": self.baseline,
                               "must_match": self.must_match, "prompts": len(runs)}
        if not runs:
            out.update(ok=None, skipped=self.skipped, per_prompt=[])
            return out
        positions = sum(r["positions"] for r in runs)
        steps = sum(r["greedy_steps"] for r in runs)

        def earliest(key: str, unit: str) -> dict[str, Any] | None:
            found = [dict(r[key], prompt=r["prompt"]) if isinstance(r[key], dict)
                     else {"prompt": r["prompt"], unit: r[key]} for r in runs if r[key] is not None]
            return min(found, key=lambda m: (m[unit], m["prompt"])) if found else None

        out.update({
            "positions": positions,
            "top1_agreement": sum(r["agreeing_positions"] for r in runs) / positions,
            "tie_positions": sum(r["tie_positions"] for r in runs),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in runs),
            "mean_kl_nats": sum(r["mean_kl_nats"] * r["positions"] for r in runs) / positions,
            "greedy_agreement": sum(r["greedy_agreement"] * r["greedy_steps"] for r in runs) / steps,
            "first_token_mismatch": earliest("first_token_mismatch_step", "step"),
            "first_argmax_mismatch": earliest("first_argmax_mismatch_position", "position"),
            "first_logit_mismatch": earliest("first_logit_mismatch_position", "position"),
            "first_kv_mismatch": earliest("first_kv_mismatch", "layer"),
        })
        beyond_ties = positions - out["tie_positions"] - sum(r["agreeing_positions"] for r in runs)
        out["ok"] = (beyond_ties == 0 and out["max_abs_logit_diff"] <= tol.logit_atol
                     if self.must_match else None)
        out["skipped"] = self.skipped
        out["per_prompt"] = runs
        return out


# ---------------------------------------------------------------------------------------------
# Report


def _fmt_num(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}" if abs(value) < 1e-2 or abs(value) >= 1e3 else f"{value:.4f}"


def render_table(report: dict[str, Any]) -> str:
    """The plain-text report: settings, prompts, one row per pair."""
    lines = [
        f"radixkv verify: {report['model']} ({report['dtype']}), device {report['device']}, "
        f"paged backend {report['attention_backend']}, block size {report['block_size']}, "
        f"{report['max_new_tokens']} greedy steps per prompt",
        f"exact pairs: every chosen token the same (ties within the tolerance shown, not failed), "
        f"max |Δlogit| <= {report['tolerances']['logit_atol']:g}",
    ]
    for i, prompt in enumerate(report["prompts"]):
        lines.append(f"  prompt {i}: {prompt['label']} ({prompt['prompt_tokens']} tokens)")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    header = ("pair", "exact", "first token diff", "first K/V diff", "top-1", "max|Δlogit|",
              "mean KL", "greedy", "verdict")
    rows = []
    for pair in report["pairs"]:
        name = f"{pair['variant']} vs {pair['baseline']}"
        if not pair["prompts"]:
            reason = pair["skipped"][0]["reason"] if pair["skipped"] else "no prompt"
            rows.append((name, "yes" if pair["must_match"] else "no", "-", "-", "-", "-", "-", "-",
                         f"skipped: {reason}"))
            continue
        token, argmax = pair["first_token_mismatch"], pair["first_argmax_mismatch"]
        kv = pair["first_kv_mismatch"]
        if token is not None:
            token_cell = f"p{token['prompt']} step {token['step']}"
        elif argmax is not None:  # only prompt positions choose another token
            token_cell = f"p{argmax['prompt']} prompt pos {argmax['position']}"
        else:
            token_cell = "-"
        verdict = "reported" if pair["ok"] is None else "ok" if pair["ok"] else "FAIL"
        if pair["tie_positions"]:
            verdict += f" ({pair['tie_positions']} ties)"
        if pair["skipped"]:
            verdict += f" ({len(pair['skipped'])} prompts skipped)"
        rows.append((
            name, "yes" if pair["must_match"] else "no",
            token_cell,
            "-" if kv is None else f"p{kv['prompt']} layer {kv['layer']} {kv['tensor'].upper()}",
            f"{pair['top1_agreement']:.4f}", _fmt_num(pair["max_abs_logit_diff"]),
            _fmt_num(pair["mean_kl_nats"]), f"{pair['greedy_agreement']:.3f}", verdict))
    widths = [max(len(str(r[c])) for r in (header, *rows)) for c in range(len(header))]
    for row in (header, *rows):
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    lines.append("result: " + ("ok, every exact pair holds" if report["ok"] else
                               "FAIL, an exact pair differs (exit 1)"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main


def _progress(message: str) -> None:
    print(f"radixkv verify: {message}", file=sys.stderr, flush=True)


def _runner_accepts_kv_cache_dtype() -> bool:
    from radixkv.model.runner import ModelRunner

    return "kv_cache_dtype" in inspect.signature(ModelRunner.__init__).parameters


def _make_runner(model: LoadedModel, num_blocks: int, args: argparse.Namespace, device: str,
                 kv_cache_dtype: str | None = None) -> ModelRunner:
    from radixkv.model.runner import ModelRunner

    kwargs: dict[str, Any] = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    return ModelRunner(model, num_blocks=num_blocks, block_size=args.block_size, device=device,
                       attention_backend=args.attention_backend, **kwargs)


def _share_weights(runner: ModelRunner, donor: ModelRunner) -> None:
    """Point ``runner`` at ``donor``'s forward (its weights and packed copies) when both run
    the same model the same way (backend, kernels, dtype, device): the forward holds no pool
    state (pools and scales are passed per call), and one copy of the weights per quantized
    format is what a large model cannot afford."""
    if (runner.model is donor.model and runner.attention_backend == donor.attention_backend
            and runner.native is donor.native and runner.device == donor.device
            and type(runner.forward_model) is type(donor.forward_model)):
        runner.forward_model = donor.forward_model


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise VerifyError(f"--device: {exc}") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise VerifyError(f"--device: {device} asked for but CUDA is not available")
    return device


def _load(path: str | None, dtype_name: str, flag: str = "--model") -> LoadedModel:
    import torch

    from radixkv.model.loader import load_model

    try:
        return load_model(path, dtype=getattr(torch, dtype_name))
    except (ValueError, OSError, KeyError) as exc:  # missing, unreadable or malformed files
        raise VerifyError(f"{flag}: cannot load {path or 'the embedded SmolLM2'}: {exc}") from exc


def run(args: argparse.Namespace, *, step_hook: StepHook | None = None) -> dict[str, Any]:
    """Run every variant over the prompts and return the report (see :func:`main`).

    Raises:
        VerifyError: a usage error, naming the flag.
    """
    import torch

    device = _resolve_device(args.device)
    # The prompt file is read before the slow model load, so a bad one fails at once.
    records = None if args.prompt_file is None else read_prompt_file(args.prompt_file)
    model = _load(args.model, args.dtype)
    tokenizer = model.tokenizer
    shape = model.shape
    if records is not None:
        prompts = tokenize_prompts(records[:args.num_prompts], tokenizer)
    else:
        prompts = transcript_prompts(args.source, shared=args.shared, tokenizer=tokenizer,
                                     num_prompts=args.num_prompts, min_tokens=args.min_prompt_tokens,
                                     max_tokens=args.max_prompt_tokens)
    context = shape.max_position_embeddings
    for prompt in prompts:
        if len(prompt.token_ids) + args.max_new_tokens > context:
            raise VerifyError(f"--max-new-tokens: prompt {prompt.label} has {len(prompt.token_ids)} "
                              f"tokens; with {args.max_new_tokens} new tokens it exceeds the model's "
                              f"context of {context}")
    tol = Tolerances(
        logit_atol=args.logit_atol if args.logit_atol is not None else LOGIT_ATOL[args.dtype],
        kv_atol=KV_ATOL[args.dtype], kv_rtol=KV_RTOL[args.dtype])
    window_left = shape.window_left
    longest = max(len(p.token_ids) for p in prompts) + args.max_new_tokens
    num_blocks = runner_blocks_needed(longest, args.block_size)
    notes: list[str] = []

    from radixkv.model.llama import LlamaForward

    try:
        paged_runner = _make_runner(model, num_blocks, args, device)
    except ValueError as exc:
        raise VerifyError(f"--attention-backend: {exc}") from exc
    backend = paged_runner.attention_backend
    reference_fwd = LlamaForward(shape, model.state_dict, device=device, dtype=model.dtype)

    # (e): quantized KV runners, the runner's own refusal naming what it cannot run here.
    quant_runners: dict[str, ModelRunner] = {}
    wanted = args.kv_cache_dtype if args.kv_cache_dtype is not None else QUANTIZED_KV_DTYPES
    explicit = args.kv_cache_dtype is not None
    skipped_quant: dict[str, str] = {}
    for name in wanted:
        if not _runner_accepts_kv_cache_dtype():
            reason = "this radixkv's ModelRunner has no kv_cache_dtype"
        else:
            try:
                quant_runners[name] = _make_runner(model, num_blocks, args, device, kv_cache_dtype=name)
                _share_weights(quant_runners[name], paged_runner)
                continue
            except ValueError as exc:
                reason = str(exc)
        if explicit:
            raise VerifyError(f"--kv-cache-dtype: {name} cannot run here: {reason}")
        skipped_quant[name] = reason
        notes.append(f"kv-{name} skipped: {reason}")
    compare_runner = None
    if args.compare_dtype == args.dtype:
        notes.append(f"--compare-dtype {args.compare_dtype} is the --dtype already: nothing to compare")
    elif args.compare_dtype is not None:
        compare_model = _load(args.model, args.compare_dtype, "--compare-dtype")
        compare_runner = _make_runner(compare_model, num_blocks, args, device)

    pairs: dict[str, Pair] = {
        CONTIGUOUS: Pair(CONTIGUOUS, RECOMPUTE, True),
        PAGED: Pair(PAGED, RECOMPUTE, True),
        HIT: Pair(HIT, RECOMPUTE, True),
        HIT_PAST: Pair(HIT_PAST, RECOMPUTE, True),
    }
    for name in wanted:
        pairs[f"kv-{name}"] = Pair(f"kv-{name}", PAGED, False)
        if name in skipped_quant:
            pairs[f"kv-{name}"].skipped.append({"prompt": None, "reason": skipped_quant[name]})
        else:
            pairs[f"kv-{name}+{HIT}"] = Pair(f"kv-{name}+{HIT}", f"kv-{name}", False)
    if compare_runner is not None:
        pairs[f"model-{args.compare_dtype}"] = Pair(f"model-{args.compare_dtype}", PAGED, False)

    prompt_rows: list[dict[str, Any]] = []
    for index, prompt in enumerate(prompts):
        ids = prompt.token_ids
        prompt_len = len(ids)
        _progress(f"prompt {index + 1}/{len(prompts)} ({prompt_len} tokens): {RECOMPUTE}")
        recompute, continuation = run_recompute(reference_fwd, ids, args.max_new_tokens, window_left)
        sequence = ids + continuation
        prompt_rows.append({"label": prompt.label, "prompt_tokens": prompt_len,
                            "continuation": continuation,
                            "continuation_text": tokenizer.decode(continuation)})

        def record(name: str, trace: Trace, base: Trace, fmt: KVFormat | None = None, *,
                   index: int = index, prompt_len: int = prompt_len) -> None:
            result = compare(trace, base, prompt_len, tol, fmt)
            result.update(prompt=index, **trace.detail)
            pairs[name].per_prompt.append(result)

        _progress(f"prompt {index + 1}: {CONTIGUOUS}")
        record(CONTIGUOUS, run_contiguous(reference_fwd, sequence, prompt_len, window_left, step_hook),
               recompute)
        _progress(f"prompt {index + 1}: {PAGED} ({backend})")
        with torch.inference_mode():
            paged = run_paged(paged_runner, PAGED, sequence, prompt_len, step_hook)
        record(PAGED, paged, recompute)
        hits = hit_points(prompt_len, args.block_size)
        for name in (HIT, HIT_PAST):
            if name not in hits:
                pairs[name].skipped.append({"prompt": index, "reason": f"the prompt ({prompt_len} "
                                            f"tokens) is too short for a prefix hit"})
                continue
            _progress(f"prompt {index + 1}: {name} at {hits[name]} tokens")
            with torch.inference_mode():
                trace = run_paged(paged_runner, name, sequence, prompt_len, step_hook,
                                  hit_tokens=hits[name])
            record(name, trace, recompute)
            del trace
        del recompute
        for name, runner in quant_runners.items():
            label = f"kv-{name}"
            fmt = getattr(runner, "kv_format", None)
            _progress(f"prompt {index + 1}: {label}")
            with torch.inference_mode():
                quant = run_paged(runner, label, sequence, prompt_len, step_hook)
            record(label, quant, paged, fmt)
            if HIT in hits:
                with torch.inference_mode():
                    trace = run_paged(runner, f"{label}+{HIT}", sequence, prompt_len, step_hook,
                                      hit_tokens=hits[HIT])
                record(f"{label}+{HIT}", trace, quant)
                del trace
            else:
                pairs[f"{label}+{HIT}"].skipped.append({"prompt": index, "reason": "prompt too short"})
            del quant
        if compare_runner is not None:
            label = f"model-{args.compare_dtype}"
            _progress(f"prompt {index + 1}: {label}")
            with torch.inference_mode():
                trace = run_paged(compare_runner, label, sequence, prompt_len, step_hook)
            record(label, trace, paged)
            del trace
        del paged

    summaries = [pair.summary(tol) for pair in pairs.values()]
    return {
        "model": model.name,
        "dtype": args.dtype,
        "device": device,
        "attention_backend": backend,
        "block_size": args.block_size,
        "max_new_tokens": args.max_new_tokens,
        "kv_cache_dtypes": list(quant_runners),
        "compare_dtype": args.compare_dtype,
        "tolerances": {"logit_atol": tol.logit_atol, "kv_atol": tol.kv_atol, "kv_rtol": tol.kv_rtol},
        "prompts": prompt_rows,
        "notes": notes,
        "pairs": summaries,
        "ok": all(p["ok"] is not False for p in summaries),
    }


def main(args: argparse.Namespace, *, step_hook: StepHook | None = None) -> int:
    """``radixkv verify``: print the table (or JSON) and return 0 when every exact pair holds,
    1 when one does not, 2 on a usage error (message on stderr naming the flag).

    Args:
        args: the flags of :func:`add_arguments`, parsed.
        step_hook: test seam, see :data:`StepHook`.
    """
    try:
        report = run(args, step_hook=step_hook)
    except VerifyError as exc:
        print(f"radixkv verify: {exc}", file=sys.stderr)
        return 2
    if args.json is not None and args.json != "-":
        try:
            Path(args.json).expanduser().write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            print(f"radixkv verify: --json: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
    return 0 if report["ok"] else 1

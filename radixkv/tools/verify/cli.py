"""``radixkv verify``'s run: load the model, build one runner per cache path, run every variant
over every prompt, compare each pair and print the report (:func:`main`)."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.tools.verify.compare import KV_ATOL, KV_RTOL, LOGIT_ATOL, Pair, Tolerances, compare
from radixkv.tools.verify.flags import QUANTIZED_KV_DTYPES, VerifyError
from radixkv.tools.verify.prompts import read_prompt_file, tokenize_prompts, transcript_prompts
from radixkv.tools.verify.report import render_table
from radixkv.tools.verify.variants import (
    CONTIGUOUS,
    HIT,
    HIT_PAST,
    PAGED,
    RECOMPUTE,
    AttentionSettings,
    StepHook,
    Trace,
    hit_points,
    run_contiguous,
    run_paged,
    run_recompute,
    runner_blocks_needed,
)

if TYPE_CHECKING:
    from radixkv.kernels.kv_quant import KVFormat
    from radixkv.model.loader import LoadedModel
    from radixkv.model.runner import ModelRunner


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
    attn = AttentionSettings.of(shape)
    longest = max(len(p.token_ids) for p in prompts) + args.max_new_tokens
    num_blocks = runner_blocks_needed(longest, args.block_size)
    notes: list[str] = []

    from radixkv.model.family_forward import make_forward

    try:
        paged_runner = _make_runner(model, num_blocks, args, device)
    except ValueError as exc:
        raise VerifyError(f"--attention-backend: {exc}") from exc
    backend = paged_runner.attention_backend
    # The model's own forward class (LlamaForward, or FamilyForward for Qwen3 / Gemma), eager,
    # without the C kernels: (a) and (b) run the reference attention through it.
    reference_fwd = make_forward(shape, model.state_dict, device=device, dtype=model.dtype)

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
        recompute, continuation = run_recompute(reference_fwd, ids, args.max_new_tokens, attn)
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
        record(CONTIGUOUS, run_contiguous(reference_fwd, sequence, prompt_len, attn, step_hook),
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
        args: the flags of :func:`~radixkv.tools.verify.flags.add_arguments`, parsed.
        step_hook: test seam, see :data:`~radixkv.tools.verify.variants.StepHook`.
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

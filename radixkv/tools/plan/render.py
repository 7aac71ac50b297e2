"""A :class:`CapacityPlan` as the table ``radixkv plan`` prints, or as a JSON-ready dict."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .capacity import GIB, CapacityPlan
from .replay import ReplayResult

__all__ = ["plan_to_dict", "plan_to_text", "replay_to_dict", "replay_to_text", "format_bytes"]


def format_bytes(num_bytes: int | float) -> str:
    """``131,072 B (128 KiB)``: exact bytes, then binary units from KiB up."""
    text = f"{int(num_bytes):,} B"
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{text} ({num_bytes / scale:,.4g} {unit})"
    return text


def plan_to_dict(plan: CapacityPlan) -> dict[str, Any]:
    """Every number of the plan under unit-named keys (``--json``)."""
    layout = plan.layout
    out: dict[str, Any] = {
        "model": layout.model, "source": layout.source, "num_layers": layout.num_layers,
        "kv_cache_dtype": plan.kv_cache_dtype, "tp": plan.tp, "block_size_tokens": plan.block_size,
        "max_model_len_tokens": plan.max_model_len,
        "layer_groups": [{
            "name": c.group.name, "kind": c.group.kind, "num_layers": c.group.num_layers,
            "num_kv_heads": c.group.num_kv_heads, "kv_heads_per_rank": c.kv_heads_per_rank,
            "head_dim": c.group.head_dim, "window_tokens": c.group.window_tokens,
            "kv_lora_rank": c.group.kv_lora_rank, "qk_rope_head_dim": c.group.qk_rope_head_dim,
            "bytes_per_token_per_layer": c.bytes_per_token_per_layer,
            "bytes_per_token": c.bytes_per_token, "formula_bytes_per_token_per_layer": c.formula,
            "blocks_per_seq": c.blocks_per_seq,
        } for c in plan.groups],
        "bytes_per_token": plan.bytes_per_token, "bytes_per_block": plan.bytes_per_block,
        "bytes_per_seq": plan.bytes_per_seq,
        "bytes_per_seq_all_tokens_kept": plan.bytes_per_seq_all_tokens_kept,
        "num_params": layout.num_params, "notes": list(layout.notes),
    }
    if plan.budget is not None:
        b = plan.budget
        out.update({
            "kv_memory_bytes": b.kv_memory_bytes, "device_memory_bytes": b.device_memory_bytes,
            "memory_utilization": b.memory_utilization, "weights_bytes": b.weights_bytes,
            "workspace_bytes": b.workspace_bytes, "num_blocks": plan.num_blocks,
            "num_tokens": plan.num_tokens,
            "concurrent_seqs_at_max_model_len": plan.concurrent_seqs_at_max_model_len,
            "concurrent_seqs_all_tokens_kept": plan.concurrent_seqs_all_tokens_kept,
        })
    return out


def plan_to_text(plan: CapacityPlan) -> str:
    """The human table: one row per layer group, the totals, then the budget if any."""
    layout = plan.layout
    lines = [f"{layout.model} ({layout.source}): {layout.num_layers} layers, KV {plan.kv_cache_dtype}, "
             f"TP {plan.tp}, block {plan.block_size} tokens"
             + (f", max_model_len {plan.max_model_len:,}" if plan.max_model_len else ""), ""]
    header = ("layer group", "layers", "KV heads/rank", "B/token/layer = formula", "B/token")
    rows = [(c.group.name, str(c.group.num_layers), str(c.kv_heads_per_rank),
             f"{c.bytes_per_token_per_layer:,} = {c.formula}", f"{c.bytes_per_token:,}")
            for c in plan.groups]
    rows.append(("total", str(layout.num_layers), "", "", f"{plan.bytes_per_token:,}"))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    lines += ["", f"per token (one rank): {format_bytes(plan.bytes_per_token)}",
              f"per block of {plan.block_size}: {format_bytes(plan.bytes_per_block)}"]
    if plan.bytes_per_seq is not None and plan.max_model_len:
        lines.append(f"per {plan.max_model_len:,}-token sequence: {format_bytes(plan.bytes_per_seq)}")
        if plan.bytes_per_seq_all_tokens_kept != plan.bytes_per_seq:
            lines.append(f"  every layer keeping every token (radixkv's pool): "
                         f"{format_bytes(plan.bytes_per_seq_all_tokens_kept or 0)}")
    if plan.budget is not None:
        b = plan.budget
        lines.append("")
        if b.device_memory_bytes is not None:
            lines.append(f"KV memory per rank: {format_bytes(b.device_memory_bytes)} × "
                         f"{b.memory_utilization} − weights {format_bytes(b.weights_bytes or 0)} / "
                         f"{plan.tp} − workspace {format_bytes(b.workspace_bytes or 0)} = "
                         f"{format_bytes(b.kv_memory_bytes)}")
        else:
            lines.append(f"KV memory per rank: {format_bytes(b.kv_memory_bytes)}")
        lines.append(f"blocks: {plan.num_blocks:,}  tokens: {plan.num_tokens:,}")
        if plan.concurrent_seqs_at_max_model_len is not None:
            lines.append(f"worst-case concurrent sequences at {plan.max_model_len:,} tokens: "
                         f"{plan.concurrent_seqs_at_max_model_len:,}")
            if plan.concurrent_seqs_all_tokens_kept != plan.concurrent_seqs_at_max_model_len:
                lines.append(f"  every layer keeping every token (radixkv's pool): "
                             f"{plan.concurrent_seqs_all_tokens_kept:,}")
    lines += [f"note: {n}" for n in layout.notes]
    return "\n".join(lines) + "\n"


def replay_to_dict(result: ReplayResult) -> dict[str, Any]:
    """Every field of a replay (``--trace --json``, under ``replay``)."""
    return asdict(result)


def replay_to_text(result: ReplayResult, trace: str) -> str:
    """The replay's lines under the plan's table."""
    r = result
    return "\n".join([
        "",
        f"replay of {trace}: {r.num_sessions} sessions, {r.num_requests} requests, "
        f"{r.num_prompt_tokens:,} prompt tokens; concurrency {r.concurrency}, "
        f"{r.max_tokens} output tokens each, pool {r.num_blocks:,} blocks",
        f"token hit rate: {r.token_hit_rate:.4f} (per request p50 {r.request_hit_rate_p50:.4f}, "
        f"p90 {r.request_hit_rate_p90:.4f})",
        f"peak blocks: {r.peak_used_blocks:,} used (live + cached), {r.peak_live_blocks:,} live "
        f"(live p50 {r.live_blocks_p50:g}, p99 {r.live_blocks_p99:g})",
        f"tail waste: {r.tail_waste_fraction:.4f} of allocated slots; allocation failures: "
        f"{r.allocation_failures}",
    ]) + "\n"

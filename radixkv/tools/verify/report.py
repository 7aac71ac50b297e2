"""``radixkv verify``'s plain-text report: settings, prompts, one row per pair."""

from __future__ import annotations

from typing import Any


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

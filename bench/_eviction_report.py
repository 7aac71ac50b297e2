"""Report fields and tables of ``radixkv bench eviction``.

Per trace × capacity, against the offline optimum and LRU (FLOP hit rates, the
measure of docs/eviction.md):

- ``best_oracle`` = whichever of ``belady`` and ``belady-cost`` has the higher FLOP hit rate at
  that capacity (``belady`` on a tie), ``best_oracle_flop_hit_rate`` its rate;
- ``fraction_of_belady`` = the policy's FLOP hit rate ÷ ``best_oracle_flop_hit_rate``;
- ``gap_closed`` = (policy − lru) ÷ (best oracle − lru): the share of the LRU→Belady gap the
  policy closes (0 for LRU, 1 for the oracle; negative when below LRU; None when LRU or both
  oracles were not run, or when the oracle is less than :data:`MIN_GAP` above LRU: at large
  capacities every policy reaches the infinite cache and the ratio is noise).
"""

from __future__ import annotations

ORACLES = ("belady", "belady-cost")
MIN_GAP = 1e-3
"""Smallest oracle − LRU FLOP-hit difference for which ``gap_closed`` is reported."""


def annotate(results: list[dict]) -> list[dict]:
    """Add ``best_oracle``, ``best_oracle_flop_hit_rate``, ``fraction_of_belady`` and
    ``gap_closed`` to every record (module docstring), grouped by ``capacity_blocks``; returns
    ``results`` (changed in place)."""
    by_cap: dict[int, dict[str, dict]] = {}
    for r in results:
        by_cap.setdefault(r["capacity_blocks"], {})[r["policy"]] = r
    for rows in by_cap.values():
        oracles = [(rows[o]["flop_hit_rate"], -i, o) for i, o in enumerate(ORACLES) if o in rows]
        best_rate, _, best = max(oracles) if oracles else (None, 0, None)
        lru = rows["lru"]["flop_hit_rate"] if "lru" in rows else None
        for r in rows.values():
            rate = r["flop_hit_rate"]
            r["best_oracle"] = best
            r["best_oracle_flop_hit_rate"] = best_rate
            r["fraction_of_belady"] = rate / best_rate if best_rate else None
            r["gap_closed"] = (gap_closed(rate, lru, best_rate)
                               if lru is not None and best_rate is not None else None)
    return results


def gap_closed(rate: float, lru: float, best: float) -> float | None:
    """(rate − lru) ÷ (best − lru); None when ``best`` is not :data:`MIN_GAP` above ``lru``."""
    return (rate - lru) / (best - lru) if best - lru >= MIN_GAP else None


def _f(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(records: list[dict]) -> str:
    """The text table ``radixkv bench eviction`` prints."""
    head = (f"{'policy':<22} {'capacity':>9} {'blocks':>8} {'token_hit':>9} {'flop_hit':>9} "
            f"{'of_best':>7} {'gap':>7} {'us/evict':>8} {'bg_trn_s':>8} {'evicted':>9} "
            f"{'skipped':>7} {'wall_s':>7}")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r['policy']:<22} {100 * r['capacity_fraction']:>8.2f}% {r['capacity_blocks']:>8} "
            f"{r['token_hit_rate']:>9.4f} {r['flop_hit_rate']:>9.4f} "
            f"{_f(r['fraction_of_belady'], '.3f'):>7} {_f(r['gap_closed'], '.3f'):>7} "
            f"{_f(r['policy_us_per_eviction'], '.2f'):>8} "
            f"{_f(r.get('background_train_cpu_s'), '.2f'):>8} {r['evicted_blocks']:>9} "
            f"{r['skipped_requests']:>7} {r['wall_s']:>7.1f}")
    best = {r["best_oracle"] for r in records if r["best_oracle"]}
    if best:
        lines.append(f"of_best, gap: against the better oracle by FLOP hit ({', '.join(sorted(best))}"
                     " at some capacity); gap = (p - lru) / (best - lru); us/evict = CPU time in"
                     " the policy's hooks (sync training included) per evicted block")
    return "\n".join(lines)


def retention_table(records: list[dict], retained_target: float, others_target: float) -> str:
    """The retention report of ``bench eviction --retain-share``: per policy × capacity, the
    retained sessions' cached ÷ ideal tokens (with retention, and when nobody retains), the other
    sessions' token hit rate (with, without, and their ratio), and whether the targets are met
    (retained >= ``retained_target``, ratio >= ``others_target``)."""
    head = (f"{'policy':<22} {'capacity':>9} {'retained':>8} {'kept/ideal':>10} {'(none)':>7} "
            f"{'others':>6} {'hit':>7} {'(none)':>7} {'ratio':>7} {'met':>5}")
    lines = [head, "-" * len(head)]
    for r in records:
        met = r.get("retention_target_met")
        lines.append(
            f"{r['policy']:<22} {100 * r['capacity_fraction']:>8.2f}% "
            f"{r['retained_sessions']:>8} {_f(r['retained_cached_over_ideal'], '.4f'):>10} "
            f"{_f(r['retained_cached_over_ideal_no_retention'], '.4f'):>7} "
            f"{r['other_sessions']:>6} {_f(r['others_token_hit_rate'], '.4f'):>7} "
            f"{_f(r['others_token_hit_rate_no_retention'], '.4f'):>7} "
            f"{_f(r['others_hit_rate_ratio'], '.4f'):>7} "
            f"{'' if met is None else ('yes' if met else 'no'):>5}")
    lines.append(f"kept/ideal: retained sessions' cached / ideal (infinite-cache) tokens, (none): "
                 f"the same when nobody retains; hit: the other sessions' token hit rate with "
                 f"retention, (none) without, ratio = hit / (none); met: kept/ideal >= "
                 f"{retained_target:g} and ratio >= {others_target:g}")
    return "\n".join(lines)


def suite_markdown(summaries: list[dict], learned: str = "predicted-reuse") -> str:
    """One markdown table over several runs' ``results.json`` summaries: per trace × capacity,
    each online policy's FLOP hit, the best oracle's, the share of the LRU→oracle gap that
    ``learned`` closes, and the µs per evicted block of ``learned``."""
    policies: list[str] = []
    for s in summaries:
        for r in s["records"]:
            if r["policy"] not in ORACLES and r["policy"] not in policies:
                policies.append(r["policy"])
    head = (["trace", "capacity"] + policies + ["best oracle", f"gap closed by {learned}",
                                                 f"{learned} µs/eviction", "winner (online)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        label = s.get("label") or s.get("trace_name") or s["trace"]
        caps: dict[float, dict[str, dict]] = {}
        for r in s["records"]:
            caps.setdefault(r["capacity_fraction"], {})[r["policy"]] = r
        for frac in sorted(caps):
            rows = caps[frac]
            online = {p: rows[p]["flop_hit_rate"] for p in policies if p in rows}
            top = max(online.values()) if online else None
            cells = [label, f"{100 * frac:g} %"]
            for p in policies:
                v = online.get(p)
                cell = _f(v, ".3f")
                cells.append(f"**{cell}**" if v is not None and v == top else cell)
            any_row = next(iter(rows.values()))
            best = any_row.get("best_oracle")
            cells.append("" if best is None else
                         f"{any_row['best_oracle_flop_hit_rate']:.3f} ({best})")
            lr = rows.get(learned, {})
            cells.append(_f(lr.get("gap_closed"), ".2f"))
            cells.append(_f(lr.get("policy_us_per_eviction"), ".1f"))
            winners = [p for p, v in online.items() if v == top]
            cells.append(", ".join(winners))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python bench/_eviction_report.py DIR/results.json ... > table.md
    import json
    import sys

    print(suite_markdown([json.loads(open(p).read()) for p in sys.argv[1:]]), end="")

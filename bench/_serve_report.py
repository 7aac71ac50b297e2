"""``bench serve``'s printed table (one column per target) and TTFT plot (one curve per target)."""

# No ``from __future__ import annotations``: loaded by path (see bench/serve.py).
from pathlib import Path
from typing import Any

_ROWS = [("model", "model", "{}"), ("block size", "block_size_tokens", "{}"),
         ("requests", "requests", "{}"), ("skipped", "skipped_requests", "{}"),
         ("failed", "failed_requests", "{}"), ("prompt tokens", "prompt_tokens", "{}"),
         ("cached tokens", "cached_tokens", "{}"), ("computed tokens", "computed_tokens", "{}"),
         ("cached/prompt", "cached_over_prompt", "{:.3f}"),
         ("ideal cached", "ideal_cached_tokens", "{}"), ("cached/ideal", "cached_over_ideal", "{:.3f}"),
         ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"), ("TTFT p90 ms", "ttft_ms_p90", "{:.1f}"),
         ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"), ("TTFT mean ms", "ttft_ms_mean", "{:.1f}"),
         ("ITL p50 ms", "itl_ms_p50", "{:.1f}"), ("ITL p90 ms", "itl_ms_p90", "{:.1f}"),
         ("decode ms/token p50", "decode_ms_per_token_p50", "{:.1f}"),
         ("requests/s", "requests_per_s", "{:.3f}"), ("output tok/s", "output_tokens_per_s", "{:.1f}")]
_CACHED_KEYS = {"cached_tokens", "computed_tokens", "cached_over_prompt", "cached_over_ideal"}


def label(result: dict[str, Any]) -> str:
    """The target's label; unlabelled: ``cache on`` / ``cache off`` from the server's own
    /stats, else its URL; with several replicas, how many and the dispatch mode."""
    caching = result.get("prefix_caching")
    name = result.get("label") or (result["url"] if caching is None
                                   else ("cache on" if caching else "cache off"))
    urls = result.get("urls") or [result["url"]]
    return name if len(urls) < 2 else f"{name}, {len(urls)} replicas {result.get('dispatch')}"


def _cell(result: dict[str, Any], key: str, fmt: str) -> str:
    if key in _CACHED_KEYS and result.get("cached_tokens_reported") is False:
        return "not reported"
    value = result.get(key)
    return "-" if value is None else fmt.format(value)


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table, one column per target (label, then URL, then ``_ROWS``)."""
    cols = [[label(r), r["url"]] + [_cell(r, k, fmt) for _, k, fmt in _ROWS] for r in results]
    names = ["", "url"] + [name for name, _, _ in _ROWS]
    widths = [max(len(x) for x in names)] + [max(len(x) for x in c) for c in cols]
    lines = []
    for i, name in enumerate(names):
        cells = [name.ljust(widths[0])] + [c[i].rjust(w) for c, w in zip(cols, widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


_GROUP_ROWS = [("sessions", "sessions", "{}"), ("requests", "requests", "{}"),
               ("prompt tokens", "prompt_tokens", "{}"), ("cached tokens", "cached_tokens", "{}"),
               ("ideal cached", "ideal_cached_tokens", "{}"),
               ("cached/ideal", "cached_over_ideal", "{:.3f}"),
               ("cache creation", "cache_creation_tokens", "{}"),
               ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"), ("TTFT p90 ms", "ttft_ms_p90", "{:.1f}")]


def format_groups(results: list[dict[str, Any]]) -> str:
    """Per target, the sessions that sent retention against the rest (``groups`` of
    ``_serve_replay.summarise``): one column per target and group."""
    cols = []
    for r in results:
        for name, group in (r.get("groups") or {}).items():
            cells = [f"{label(r)}: {name.replace('_', ' ')}"]
            for _, key, fmt in _GROUP_ROWS:
                value = group.get(key)
                cells.append("-" if value is None else fmt.format(value))
            cols.append(cells)
    if not cols:
        return ""
    retention = results[0].get("retention")
    names = [f"retention {retention}, share {results[0].get('retain_share'):g}"] + [
        name for name, _, _ in _GROUP_ROWS]
    widths = [max(len(x) for x in names)] + [max(len(x) for x in c) for c in cols]
    lines = []
    for i, name in enumerate(names):
        cells = [name.ljust(widths[0])] + [c[i].rjust(w) for c, w in zip(cols, widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot_ttft(results: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Histogram (log-spaced bins) and CDF of TTFT per target (labelled), written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series = [(label(r), [x["ttft_ms"] for x in r["per_request"]
                          if x["ttft_ms"] is not None and "error" not in x]) for r in results]
    series = [(name, values) for name, values in series if values]
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    if series:
        low = max(min(min(v) for _, v in series), 1e-3)
        high = max(max(v) for _, v in series)
        bins = np.geomspace(low, high * 1.0001, 40)
        for name, values in series:
            p50 = float(np.median(values))
            hist.hist(values, bins=bins, alpha=0.55, label=f"{name} (p50 {p50:,.0f} ms)")
            xs = np.sort(values)
            cdf.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post",
                     label=f"{name} (p50 {p50:,.0f} ms)")
        for ax in (hist, cdf):
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (ms)")
            ax.grid(alpha=0.3)
            ax.legend()
    hist.set_ylabel("requests")
    cdf.set_ylabel("fraction of requests")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

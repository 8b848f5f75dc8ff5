"""The demo's plot: time to first token per request, with and without kvstore (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def plot_ttft(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Write a grouped bar chart of TTFT per request, without and with the cache, as PNG.

    The percentage above each "with" bar is that request's hit ratio: the share of
    its prompt tokens whose KV came from kvstore instead of being prefilled
    (``cached_tokens / prompt_tokens``; 0% for a cold miss). The legend says so.

    Args:
        rows: one dict per request with ``name``, ``ttft_no_cache_s``,
            ``ttft_cache_s`` (seconds) and ``hit_ratio`` (0..1), as in the demo's summary.
        path: output ``.png`` path; parent folders are created.
        title: figure title.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [r["name"] for r in rows]
    base = [r["ttft_no_cache_s"] for r in rows]
    cached = [r["ttft_cache_s"] for r in rows]
    xs = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2), dpi=120)
    ax.bar([x - width / 2 for x in xs], base, width, label="no cache (full prefill)", color="#9e9e9e")
    bars = ax.bar([x + width / 2 for x in xs], cached, width, color="#1f77b4",
                  label="kvstore prefix reuse; % above: share of the prompt's tokens served from kvstore")
    for bar, row in zip(bars, rows):
        ax.annotate(f"{row['hit_ratio']:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title or "TTFT per request, without and with kvstore", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

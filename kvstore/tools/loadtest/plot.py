"""PNG plots of a load test (matplotlib, Agg backend): hit ratio over time and latency CDFs."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.tools.loadtest.runner import LoadTestResult

logger = logging.getLogger(__name__)

HIT_RATIO_PNG = "loadtest_hit_ratio.png"
LATENCY_CDF_PNG = "loadtest_latency_cdf.png"


def _pyplot() -> Any:  # matplotlib.pyplot, imported on first use (it is optional)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_hit_ratio(result: LoadTestResult, path: str | os.PathLike[str], *, sim_hit_ratio: float | None = None) -> None:
    """Block and token hit ratio per window and cumulative, against seconds since the start.

    Args:
        result: the load test's result.
        path: the PNG to write.
        sim_hit_ratio: the simulator's hit ratio on the same requests, drawn as a dashed line.

    Raises:
        OSError: if the file cannot be written.
    """
    plt = _pyplot()
    windows = [w for w in result.windows if w["num_blocks"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    if windows:
        ends = np.array([w["end_s"] for w in windows], dtype=float)
        blocks = np.array([w["num_blocks"] for w in windows], dtype=float)
        hits = np.array([w["hit_blocks"] for w in windows], dtype=float)
        ax.plot(ends, hits / blocks, marker=".", label="block hit ratio (window)")
        ax.plot(ends, [w["token_hit_ratio"] for w in windows], linestyle=":", label="token hit ratio (window)")
        ax.plot(ends, np.cumsum(hits) / np.cumsum(blocks), linewidth=2, label="block hit ratio (cumulative)")
    if sim_hit_ratio is not None:
        ax.axhline(sim_hit_ratio, color="grey", linestyle="--", label=f"kvstore simulate ({sim_hit_ratio:.4f})")
    ax.set_xlabel(f"seconds since start (windows of {result.config.window_s:g} s)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_ylim(bottom=0)
    ax.set_title(f"kvstore loadtest: hit ratio {result.hit_ratio:.4f} over {result.num_requests} requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(result: LoadTestResult, path: str | os.PathLike[str]) -> None:
    """Empirical CDFs of lookup, get, put and whole-request latency (log milliseconds).

    Raises:
        OSError: if the file cannot be written.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("lookup", "get", "put", "request"):
        samples = np.sort(np.asarray(result.latency_samples_s.get(name, ()), dtype=float)) * 1e3
        if samples.size:
            ax.step(samples, np.arange(1, samples.size + 1) / samples.size, where="post",
                    label=f"{name} (p99 {result.latency_ms[name]['p99_ms']:.2f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of calls")
    ax.set_ylim(0, 1.01)
    ax.set_title("kvstore loadtest: latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    result: LoadTestResult, plot_dir: str | os.PathLike[str], *, sim_hit_ratio: float | None = None
) -> list[Path]:
    """Write :data:`HIT_RATIO_PNG` and :data:`LATENCY_CDF_PNG` into ``plot_dir`` (made if missing).

    Returns:
        The paths written.

    Raises:
        OSError: if the directory or a file cannot be written.
    """
    directory = Path(plot_dir)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / HIT_RATIO_PNG, directory / LATENCY_CDF_PNG]
    plot_hit_ratio(result, paths[0], sim_hit_ratio=sim_hit_ratio)
    plot_latency_cdf(result, paths[1])
    logger.info("wrote %s", ", ".join(map(str, paths)))
    return paths

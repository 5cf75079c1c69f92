"""PNG plots of benchmark runs: latency CDFs, throughput against request rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.loadgen.runner import RunResult
from services.loadgen.summary import samples


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'epd-serve[bench]'") from None
    return plt


def latency_cdfs(runs: dict[str, RunResult], path: Path, title: str = "") -> Path:
    """One panel per metric (TTFT, TPOT, E2E); one line per labelled run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
        for label, run in runs.items():
            values = sorted(1000 * v for v in samples([r for r in run.results if r.ok], metric))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_rate(
    series: dict[str, list[dict[str, Any]]], path: Path, title: str = ""
) -> Path:
    """Request throughput against offered request rate; one line per labelled sweep."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, summaries in series.items():
        points = sorted((s["request_rate"], s["request_throughput"]) for s in summaries)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("completed requests/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

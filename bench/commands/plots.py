"""PNG plots for `kvstore replay` (`--sweep`, `learned` admission's threshold) and
`kvstore ttft` (matplotlib, no display).

matplotlib is the optional extra `plots` (in `dev` too): without it the commands
still print and write their JSON, and say why the PNG is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.format.errors import KVStoreError


class PlotUnavailable(KVStoreError):
    """matplotlib is not installed."""


def _pyplot() -> Any:  # imported late: only the plotting commands need matplotlib
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("no plot: matplotlib is not installed (pip install -e .[plots])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, figure: Any, axes: Any, path: Path) -> Path:
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> Path:
    """Token hit ratio against total capacity, one line per tier and one for all tiers."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    capacity = [sum(t["capacity_bytes"] for t in row["tiers"]) / 2**30 for row in rows]
    axes.plot(capacity, [row["hit_ratio"] for row in rows], marker="o", label="all tiers")
    for i, tier in enumerate(rows[0]["tiers"]):
        axes.plot(capacity, [row["tiers"][i]["hit_ratio"] for row in rows], marker=".",
                  linestyle="--", label=f"from {tier['name']}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("total capacity of all tiers (GiB)")
    axes.set_ylabel("prompt tokens served from kvstore")
    axes.set_ylim(0, 1)
    return _save(plt, figure, axes, path)


def plot_ttft(rows: list[dict[str, Any]], value: str, path: Path) -> Path:
    """TTFT against context length, one line per mode."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(row["mode"] for row in rows):
        points = sorted((r["context_tokens"], r[value]) for r in rows if r["mode"] == mode)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("context (tokens)")
    axes.set_ylabel("time to first token (s)")
    return _save(plt, figure, axes, path)


def plot_threshold(path: dict[str, Any], title: str, out: Path) -> Path:
    """`learned` admission's threshold over the trace's time, and the share of hits its
    refusals cost lately against its budget (bench/support/admission_path.py's `threshold_path`)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    minutes = [t / 60 for t in path["time_s"]]
    axes.plot(minutes, path["threshold"], label="threshold (return rate admitted)")
    axes.set_xlabel("trace time (minutes)")
    axes.set_ylabel("threshold")
    axes.set_ylim(0, 1)
    if path["counted_from_s"]:
        axes.axvline(path["counted_from_s"] / 60, color="grey", linestyle=":", label="measured pass begins")
    loss = axes.twinx()
    loss.plot(minutes, path["loss_measured"], color="tab:red", alpha=0.7, label="hits lost lately (right)")
    if path["loss_budget"] is not None:
        loss.axhline(path["loss_budget"], color="tab:red", linestyle="--", label="loss budget (right)")
    loss.set_ylabel("share of hits lost")
    loss.set_ylim(0, max(0.03, 2 * (path["loss_budget"] or 0), *path["loss_measured"]))
    lines, labels = axes.get_legend_handles_labels()
    more, more_labels = loss.get_legend_handles_labels()
    axes.legend(lines + more, labels + more_labels, loc="upper left", fontsize="small")
    axes.set_title(title, fontsize="medium")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out

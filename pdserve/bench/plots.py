"""Benchmark plots (matplotlib, Agg): PNGs drawn from saved run dicts.

Input is what `RunResult.to_dict()` writes to the results JSON (`label`, `rate`, `report`,
`requests`), so plots can be redrawn from files of several configurations at once:

- `latency_cdf.png`: CDFs of TTFT and TPOT, one line per configuration (label, plus the
  rate when a label has several runs);
- `rate_sweep.png`: output-token throughput and P99 TPOT against offered request rate, one
  line per label (runs sent all at once have no rate and are left out).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

Run = Mapping[str, Any]


def _config_name(run: Run, several_rates: bool) -> str:
    label = run.get("label") or "run"
    if not several_rates:
        return label
    rate = run.get("rate")
    return f"{label} @ all at once" if rate is None else f"{label} @ {rate:g} req/s"


def plot_latency_cdfs(runs: Sequence[Run], path: str | Path) -> Path:
    """TTFT and TPOT CDFs side by side, one line per configuration; returns the path."""
    per_label: dict[str, int] = defaultdict(int)
    for run in runs:
        per_label[run.get("label") or "run"] += 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for run in runs:
            values = sorted(row[key] for row in run.get("requests", ()) if row.get(key) is not None)
            if not values:
                continue
            n = len(values)
            name = _config_name(run, per_label[run.get("label") or "run"] > 1)
            ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=name)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, path)


def plot_rate_sweep(runs: Sequence[Run], path: str | Path) -> Path:
    """Output throughput and P99 TPOT vs request rate, one line per label."""
    series: dict[str, list[tuple[float, float, float | None]]] = defaultdict(list)
    for run in runs:
        if run.get("rate") is None:
            continue
        report = run["report"]
        series[run.get("label") or "run"].append(
            (run["rate"], report["output_throughput"], report["tpot_ms"]["p99"])
        )
    fig, (ax_tput, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in series.items():
        points.sort()
        ax_tput.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        tpot = [p for p in points if p[2] is not None]
        ax_tpot.plot([p[0] for p in tpot], [p[2] for p in tpot], marker="o", label=label)
    ax_tput.set_title("Output throughput vs request rate")
    ax_tput.set_ylabel("output tokens/s")
    ax_tpot.set_title("P99 TPOT vs request rate")
    ax_tpot.set_ylabel("P99 TPOT (ms)")
    for ax in (ax_tput, ax_tpot):
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, path)


def plot_goodput(runs: Sequence[Run], path: str | Path) -> Path:
    """Goodput (requests/s meeting both SLOs) vs offered rate, one line per label, with the
    offered rate itself dashed for reference."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        if run.get("rate") is not None:
            series[run.get("label") or "run"].append((run["rate"], run["report"]["goodput"]))
    fig, ax = plt.subplots(figsize=(6, 4.2))
    rates = sorted({p[0] for points in series.values() for p in points})
    if rates:
        ax.plot(rates, rates, linestyle="--", color="grey", label="offered")
    for label, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_title("Goodput vs request rate")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting SLOs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_bars(values: Mapping[str, float], path: str | Path, *, title: str,
              ylabel: str) -> Path:
    """One bar per name (e.g. output tokens/s of each offline configuration)."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    names = list(values)
    bars = ax.bar(names, [values[n] for n in names])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def write_plots(runs: Sequence[Run], out_dir: str | Path) -> list[Path]:
    """Both figures into `out_dir` (created); the sweep figure only if a run has a rate."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdfs(runs, out / "latency_cdf.png")]
    if any(run.get("rate") is not None for run in runs):
        paths.append(plot_rate_sweep(runs, out / "rate_sweep.png"))
    return paths


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

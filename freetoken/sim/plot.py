"""Plots of the simulator (matplotlib, drawn off-screen): miss rate against cache slots per policy
(:func:`plot_miss_rates`); estimated tokens/s against the PCIe/CPU bandwidth ratio per mode
(:func:`plot_timing_sweep`)."""

from __future__ import annotations

import os
from collections.abc import Sequence


def _figure(width: float):
    """A matplotlib figure and axes on the Agg canvas (no display needed); RuntimeError without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=(width, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def plot_miss_rates(rows: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> None:
    """Write a PNG (or any format matplotlib infers from ``path``) of miss rate % against slots."""
    fig, ax = _figure(7)
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault((r["policy"], r["window"]), []).append((r["slots"], 100.0 * r["miss_rate"]))
    windows = {w for _, w in series}
    for (policy, window), pts in series.items():
        pts.sort()
        label = policy if len(windows) == 1 else f"{policy} ({window})"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label,
                linestyle="--" if policy.startswith("belady") else "-")
    ax.set_xlabel("cache slots")
    ax.set_ylabel("miss rate (%)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    if series:
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.fspath(path))


def plot_timing_sweep(rows: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> None:
    """Write a plot of estimated tokens/s against the PCIe/CPU bandwidth ratio, one line per mode (and slot count
    when there are several); ``rows`` from :func:`freetoken.sim.timing.sweep`."""
    fig, ax = _figure(9.5)
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault((r["mode"], r["slots"]), []).append((r["ratio"], r["tokens_per_s"]))
    slot_counts = sorted({s for _, s in series})
    modes = list(dict.fromkeys(m for m, _ in series))
    colors = {m: f"C{i}" for i, m in enumerate(modes)}
    styles = ("-", "--", ":", "-.")
    for (mode, slots), pts in series.items():
        pts.sort()
        label = mode if len(slot_counts) == 1 else f"{mode} ({slots} slots)"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label, color=colors[mode],
                linestyle=styles[slot_counts.index(slots) % len(styles)])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("PCIe / CPU bandwidth")
    ax.set_ylabel("tokens/s (estimated)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3, which="both")
    if title:
        ax.set_title(title)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path))

"""Figures as PNG files, and reliability diagrams (predicted vs observed prefix survival,
before/after calibration; docs/design/metrics.md#calibration-metrics).

Drawn with matplotlib's Agg canvas directly (no pyplot), so plotting never touches the global
backend of a process that also shows interactive figures; :func:`new_figure` and
:func:`save_figure` are how every plot of specforge makes and writes one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor

from specforge.components import CalibrationData
from specforge.metrics import calibration_report

__all__ = ["new_figure", "reliability_diagram", "save_figure"]


def new_figure(width: float, height: float, dpi: float = 100) -> Any:
    """A matplotlib ``Figure`` on its own Agg canvas (matplotlib is imported on first use)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: str | Path, title: str | None = None, dpi: float | None = None) -> Path:
    """Title, lay out and write ``fig`` as a PNG at ``path`` (parent folders are created)."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi or "figure")
    return path


def _reports(source: Any, after: Any, bins: int) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(source, CalibrationData):
        curves = [("raw", calibration_report(source, bins=bins))]
        if after is not None:
            calibrated = after if isinstance(after, Tensor) else after.apply(source.confidence)
            curves.append(("calibrated", calibration_report(source, calibrated, bins=bins)))
        return curves
    if isinstance(source, dict) and "before" in source and "after" in source:  # a fit() report
        return [("before", source["before"]), ("after", source["after"])]
    if isinstance(source, dict) and "positions" in source:  # one calibration_report()
        return [("confidence", source)]
    raise TypeError("reliability_diagram needs CalibrationData, a calibration report or a fit report")


def _curve(ax: Any, label: str, stats: dict[str, Any]) -> None:
    rel = stats["reliability"]
    pts = [(p, o) for p, o in zip(rel["mean_pred"], rel["mean_observed"]) if p is not None]
    if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{label} (ECE {stats['ece']:.3f})")


def reliability_diagram(
    source: CalibrationData | dict[str, Any],
    path: str | Path,
    *,
    after: Tensor | Any = None,
    per_position: bool = False,
    bins: int = 20,
    title: str | None = None,
) -> Path:
    """Write a PNG reliability diagram of the cumulative product Π_{i≤k} c_i and return its path.

    Args:
        source: a calibrator's ``fit`` report (draws its before/after curves), one
            :func:`~specforge.metrics.calibration_report`, or :class:`CalibrationData` (raw
            confidences; ``after`` adds a calibrated curve).
        path: the PNG to write (parent folders are created).
        after: with ``CalibrationData``: calibrated ``[N, G]`` confidences, or a calibrator
            whose ``apply`` produces them.
        per_position: one panel per position k instead of one pooled panel.
        bins: ECE bins when reports are computed here.
        title: figure title.
    """
    curves = _reports(source, after, bins)
    panels = (
        [(f"k = {p['k']}", [(lbl, rep["positions"][i]) for lbl, rep in curves])
         for i, p in enumerate(curves[0][1]["positions"])]
        if per_position
        else [("all positions", [(lbl, rep["overall"]) for lbl, rep in curves])]
    )
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = new_figure(3.2 * cols, 3.2 * rows)
    for i, (name, stats) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=0.8)
        for label, s in stats:
            _curve(ax, label, s)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=name, xlabel="predicted survival", ylabel="observed")
        ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path, title)

"""The learning curve of a run: held-out τ̂ against steps and against CPU-hours.

Read from the run's ``metrics.jsonl`` (the trainer's log): every ``train`` record carries its
step's wall time and the threads it ran on, every ``eval`` record the held-out τ̂.  CPU-hours are
Σ step time × threads, so runs on machines with different core counts line up by compute spent,
and evaluation and checkpoint time are left out (they buy no progress).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CurvePoint", "learning_curve", "plot_learning_curve"]

CurvePoint = dict[str, float]  # {"step", "hours", "cpu_hours", "tau", "loss"}


def learning_curve(records: list[dict[str, Any]] | str | Path) -> list[CurvePoint]:
    """One point per held-out evaluation: step, training hours and CPU-hours spent up to it, τ̂."""
    if not isinstance(records, list):
        lines = Path(records).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    # Steps are logged every log_interval only; the mean step time of the logged ones stands in
    # for the steps in between.
    points, seconds, cpu_seconds, last_step, last = [], 0.0, 0.0, 0, None
    for rec in sorted(records, key=lambda r: (r["step"], r["split"] != "train")):
        if rec["split"] == "train":
            steps = rec["step"] - last_step
            seconds += steps * rec["step_time"]
            cpu_seconds += steps * rec["step_time"] * rec.get("threads", 1)
            last_step, last = rec["step"], rec
        elif rec["split"] == "eval":
            points.append({"step": rec["step"], "hours": seconds / 3600, "cpu_hours": cpu_seconds / 3600,
                           "tau": rec["tau"], "loss": rec["loss"]})
    return points


def plot_learning_curve(points: list[CurvePoint], path: str | Path, title: str | None = None) -> Path:
    """PNG with held-out τ̂ against steps (left) and CPU-hours (right)."""
    from specforge.plots import new_figure, save_figure

    fig = new_figure(9, 3.4)
    for i, (key, label) in enumerate((("step", "optimizer steps"), ("cpu_hours", "CPU-hours (step time × threads)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.plot([p[key] for p in points], [p["tau"] for p in points], marker="o", markersize=3)
        ax.set(xlabel=label, ylabel="held-out τ̂ (γ-block, T = 1)")
        ax.grid(alpha=0.3)
    return save_figure(fig, path, title)

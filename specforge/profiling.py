"""``specforge profile``: measure the step curve SPS(B) of a target on this machine, as a table
and a plot.

Usage: docs/engine.md#hardware-profiles.  The measurement itself, and the cached curve a
hardware-aware scheduler reads, live in :mod:`specforge.toolkit.step_curve`; what drafting costs
(ρ) in :mod:`specforge.engine.draft_cost`.

Small B is memory-bound (reading the weights dominates, so SPS barely moves between B = 1 and
B = 8 on a CPU in bf16); large B becomes compute-bound and SPS falls like 1/B.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_profile", "profile_table"]


def profile_table(records: Sequence[dict[str, Any]]) -> str:
    base = records[0]["sps"]
    head = (f"{'B':>5} {'requests':>8} {'ms/pass':>8} {'measured':>9} {'SPS':>8} {'tokens/s':>9} "
            f"{'SPS/SPS(B0)':>11}")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r['batch']:>5} {r['requests']:>8} {1e3 * r['median_s']:>8.2f} "
                     f"{r.get('sps_measured', r['sps']):>9.2f} {r['sps']:>8.2f} "
                     f"{r['tokens_per_s']:>9.1f} {r['sps'] / base:>11.3f}")
    return "\n".join(lines)


def plot_profile(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """SPS(B) and tokens/s per pass against B (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bs = [r["batch"] for r in records]
    ax.plot(bs, [r["sps"] for r in records], marker="o", color="tab:blue", label="SPS(B): passes / s")
    if all("sps_measured" in r for r in records):  # the medians the non-increasing curve was fitted to
        ax.plot(bs, [r["sps_measured"] for r in records], linestyle="none", marker="x",
                color="tab:blue", alpha=0.6, label="measured (median)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("flattened verify batch B (tokens)")
    ax.set_ylabel("verify passes / s", color="tab:blue")
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    twin.plot(bs, [r["tokens_per_s"] for r in records], marker="s", color="tab:orange", label="B · SPS(B)")
    twin.set_ylabel("tokens verified / s", color="tab:orange")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path

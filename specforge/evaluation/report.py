"""Present an evaluation: a text table and the per-position acceptance plot (paper Fig. 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from specforge.files import write_atomic

__all__ = ["acceptance_plot", "comparison_table", "fmt", "save", "table"]


def fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table(result: dict[str, Any]) -> str:
    """One row per (dataset, temperature): τ, acceptance at each position, speed and speedup."""
    rows = result["results"]
    width = max((len(r["acceptance"]) for r in rows), default=0)
    coverage = any("vocab_coverage" in r for r in rows)  # a drafter with a draft vocabulary
    head = ["dataset", "T", "τ", *[f"acc@{k + 1}" for k in range(width)], "tok/s", "AR tok/s", "speedup", "head %",
            *(["vocab %"] if coverage else [])]
    lines = [head]
    for r in rows:
        acc = [fmt(a) for a in r["acceptance"]] + ["-"] * (width - len(r["acceptance"]))
        share = r.get("latency_share", {}).get("correction_head")
        cov = r.get("vocab_coverage")
        lines.append([r["dataset"], fmt(r["temperature"], "g"), fmt(r["tau"]), *acc, fmt(r.get("tok_s"), ".1f"),
                      fmt(r.get("ar_tok_s"), ".1f"), fmt(r.get("speedup")),
                      fmt(None if share is None else 100 * share, ".1f"),
                      *([fmt(None if cov is None else 100 * cov, ".1f")] if coverage else [])])
    for key, s in result.get("summary", {}).items():
        lines.append([f"mean ({key})", "", fmt(s["tau"]), *[""] * width, "", "", fmt(s.get("speedup")), "",
                      *([""] if coverage else [])])
    return _layout(lines)


def comparison_table(result: dict[str, Any], label: str = "evaluated") -> str:
    """Every arm of a run side by side (``label`` names the evaluated pipeline, the others are
    ``result["compare"]``): plain tokens/s, then τ and speedup over plain decoding per arm."""
    arms = {label: result["results"], **{name: arm["results"] for name, arm in result.get("compare", {}).items()}}
    head = ["dataset", "T", "plain tok/s"] + [f"{name} {col}" for name in arms for col in ("τ", "×plain")]
    lines = [head]
    for i, r in enumerate(result["results"]):
        lines.append([r["dataset"], fmt(r["temperature"], "g"), fmt(r.get("ar_tok_s"), ".1f"),
                      *[c for rows in arms.values() for c in (fmt(rows[i]["tau"]), fmt(rows[i].get("speedup")))]])
    summaries = {label: result.get("summary", {}),
                 **{name: arm["summary"] for name, arm in result.get("compare", {}).items()}}
    for key in result.get("summary", {}):
        lines.append([f"mean ({key})", "", "", *[c for s in summaries.values()
                                                for c in (fmt(s[key]["tau"]), fmt(s[key].get("speedup")))]])
    return _layout(lines)


def _layout(lines: list[list[Any]]) -> str:
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def acceptance_plot(result: dict[str, Any], path: str | Path) -> Path:
    """Conditional acceptance against draft position, one line per dataset, a panel per temperature."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = result["results"]
    temps = sorted({r["temperature"] for r in rows})
    fig = Figure(figsize=(5.2 * len(temps), 4.2))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, len(temps), i + 1) for i in range(len(temps))]
    for ax, t in zip(axes, temps):
        for r in (r for r in rows if r["temperature"] == t):
            ks = list(range(1, len(r["acceptance"]) + 1))
            ax.plot(ks, r["acceptance"], marker="o", label=f"{r['dataset']} (τ {r['tau']:.2f})")
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(x_k accepted | x_<k accepted)")
        ax.set_title(f"T = {t:g}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def save(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """``eval.json`` and ``acceptance.png`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "eval.json"
    write_atomic(json_path, json.dumps(result, indent=2, allow_nan=True))
    return json_path, acceptance_plot(result, out / "acceptance.png")

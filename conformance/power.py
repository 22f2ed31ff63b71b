"""The suite's power, proven on the negative controls of :mod:`specforge_conformance.controls`.

Each control is run in its case (:data:`~specforge_conformance.controls.CONTROL_CASES`) at the
fast tier's N over several seeds; the suite must reject it on (nearly) every seed.  Next to the
observed failure rate stands the predicted one: the non-centrality λ of the chi-square test,
computed from the control's own output law (estimated from all seeds' samples pooled, with the
pooled noise subtracted), and the power P(χ²_df(λ) > critical value) at the level each case of a
fast-tier run is tested at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from specforge.plugins import PluginHost
from specforge_conformance import controls
from specforge_conformance.harness import Case, run_case
from specforge_conformance.stats import power

__all__ = ["ControlReport", "control_case", "control_host", "run_controls"]

# A fast-tier run tests ~20 cases, each at α/20 (Bonferroni): the level the controls must beat.
CASE_ALPHA = 1e-6 / 20


def control_host(host: PluginHost | None = None) -> PluginHost:
    """A host with the shipped plug-ins, the probe drafters and the negative controls."""
    from specforge_conformance.suite import suite_host

    host = suite_host(host or PluginHost(autoload=False))
    host.add_plugin(controls, "specforge-conformance-controls", package="specforge-lossless (conformance)")
    return host


def control_case(name: str, n: int = 20_000, seed: int = 0) -> Case:
    spec = dict(controls.CONTROL_CASES[name])
    return Case(n=n, seed=seed, **spec)


@dataclass
class ControlReport:
    name: str
    n: int
    seeds: int
    rejected: int
    noncentrality: float
    df: int
    predicted_power: float
    min_tv: float
    max_p: float

    @property
    def ok(self) -> bool:
        return self.rejected == self.seeds

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, ok=self.ok)


def run_controls(names: Iterable[str] | None = None, seeds: int = 20, n: int = 20_000,
                 alpha: float = CASE_ALPHA, host: PluginHost | None = None,
                 progress: Callable[[str], None] | None = None,
                 on_report: Callable[[list[ControlReport]], None] | None = None) -> list[ControlReport]:
    """Run each control over ``seeds`` seeds at sample size ``n`` (``on_report`` sees the
    reports so far after each control, so a long run leaves usable partial results)."""
    host = control_host(host)
    out = []
    for name in names or controls.CONTROL_CASES:
        base = control_case(name, n)
        law = base.law()
        pooled = torch.zeros_like(law.probs)
        fits = []
        for s in range(seeds):
            result = run_case(replace(base, seed=s * n), host, law, alpha)
            pooled += result.counts.to(torch.float64)
            fits.append(result.fit)
            if progress:
                progress(f"{name} seed {s}: p = {result.fit.p_value:.3g}, TV = {result.fit.tv:.4f}")
        lam, df = _noncentrality(pooled, law.probs, n, seeds)
        out.append(ControlReport(
            name, n, seeds, sum(f.rejects(alpha) for f in fits), lam, df,
            1.0 if any(f.impossible for f in fits) else power(df, lam, alpha),
            min(f.tv for f in fits), max(f.p_value for f in fits)))
        if on_report:
            on_report(out)
    return out


def _noncentrality(pooled: torch.Tensor, probs: torch.Tensor, n: int, seeds: int) -> tuple[float, int]:
    """λ at sample size n of the law behind ``pooled`` (seeds·n samples), bias-corrected: the
    plug-in estimate exceeds the true λ by about df/seeds from the pooled sampling noise."""
    from specforge_conformance.stats import merge_cells

    group = merge_cells(probs, n)
    g = int(group.max()) + 1
    keep = group >= 0
    total = float(pooled.sum())
    pi = torch.zeros(g, dtype=torch.float64).index_add_(0, group[keep], pooled[keep] / total)
    p = torch.zeros(g, dtype=torch.float64).index_add_(0, group[keep], probs[keep])
    df = max(g - 1, 1)
    raw = float(n * ((pi - p) ** 2 / p).sum())
    return max(raw - df / seeds, 0.0), df


def controls_table(reports: list[ControlReport]) -> str:
    rows = [("control", "N", "seeds failed", "λ", "df", "predicted power", "min TV", "max p")]
    for r in reports:
        rows.append((r.name, f"{r.n:,}", f"{r.rejected}/{r.seeds}", f"{r.noncentrality:,.0f}", str(r.df),
                     f"{r.predicted_power:.6f}", f"{r.min_tv:.4f}", f"{r.max_p:.3g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

"""The suite's power, proven on the negative controls of :mod:`specforge_conformance.controls`.

Each control is run in its case over several seeds at the fast tier's N: the original controls in
the smallest pipeline that contains the bug (:data:`~specforge_conformance.controls.CONTROL_CASES`),
the subtle ones in the probe case of their kind — the case the suite runs on any third-party
component of that kind.  A seed counts as caught when one statistic rejects at the level a
statistic of a fast-tier case is tested at, in that single run (no second stage: stricter than the
suite itself).  Next to the observed rate stands the predicted one: the non-centrality λ of the
catching statistic, estimated as mean(X² − df) over the seeds, and the power P(χ²_df(λ) > critical
value) at that level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance import controls, probes
from specforge_conformance.harness import STATISTICS, Case, run_case
from specforge_conformance.stats import FitResult, power

__all__ = ["CASE_ALPHA", "ControlReport", "control_case", "control_host", "controls_table", "resumable",
           "run_controls"]

# A fast-tier run tests ~50 cases, each at α/50 (Bonferroni) and each of their statistics at a
# sixth of that: the level the controls must beat.
CASE_ALPHA = 1e-6 / 50
LEVEL = CASE_ALPHA / len(STATISTICS)


def control_host(host: PluginHost | None = None) -> PluginHost:
    """``host`` (default: the shipped plug-ins only) with the probe components and the negative
    controls."""
    from specforge_conformance.suite import suite_host

    host = suite_host(host or PluginHost(autoload=False))
    host.add_plugin(controls, "specforge-conformance-controls", package="specforge-lossless (conformance)")
    return host


def control_case(name: str, n: int | None = None, seed: int = 0, host: PluginHost | None = None) -> Case:
    """The case a control runs in (a subtle control: its kind's first probe case, the one
    :data:`~specforge_conformance.controls.SUBTLE_PROBE` names, or its mixed probe for one of
    :data:`~specforge_conformance.controls.MIXED`, with the control in its slot, at
    the fast tier's N for that kind; the others at N = 20,000), seeded with ``seed``."""
    if name in controls.SUBTLE:
        from specforge_conformance.suite import TIERS

        kind, params = controls.SUBTLE[name]
        host = host or control_host()
        cases = probes.probe_cases(host, kind, name, n or TIERS["fast"].size(kind))
        # a tree verifier's bug lives in its tree probe (the one whose drafter proposes trees), a
        # control named in SUBTLE_PROBE in the probe of that drafter
        trees = kind is ComponentKind.VERIFIER and host.get(kind, name).metadata.trees
        case = next((c for c in cases if c.pipeline["drafter"] == controls.SUBTLE_PROBE.get(name) or (
            trees and host.get(ComponentKind.DRAFTER, c.pipeline["drafter"][0]).metadata.trees)), cases[0])
        if name in controls.MIXED:  # a control that misroutes per-request settings: the mixed probe
            case = next(c for c in cases if c.mix)
        pipeline = {**case.pipeline, kind.value: (name, params)}
        return replace(case, pipeline=pipeline, seed=seed)
    spec = dict(controls.CONTROL_CASES[name])
    return Case(n=n or 20_000, seed=seed, **spec)


@dataclass
class ControlReport:
    name: str
    n: int
    seeds: int
    rejected: int
    statistic: str  # the one that caught it most strongly (smallest median p)
    noncentrality: float
    df: int
    predicted_power: float
    mean_tv: float
    max_p: float
    runs: list[dict[str, dict[str, Any]]] = field(default_factory=list, repr=False)  # per seed, per statistic

    @property
    def ok(self) -> bool:
        return self.rejected == self.seeds

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, ok=self.ok)


def _seed_record(tests: Mapping[str, FitResult]) -> dict[str, dict[str, Any]]:
    return {k: asdict(f) for k, f in tests.items()}


def _seed_tests(record: Mapping[str, Mapping[str, Any]]) -> dict[str, FitResult]:
    return {k: FitResult.from_dict(f) for k, f in record.items()}


def run_controls(names: Iterable[str] | None = None, seeds: int = 20, n: int | None = None,
                 level: float = LEVEL, host: PluginHost | None = None,
                 progress: Callable[[str], None] | None = None,
                 on_report: Callable[[list[ControlReport], dict[str, Any] | None], None] | None = None,
                 resume: Mapping[str, Sequence[Mapping[str, Any]]] | None = None) -> list[ControlReport]:
    """Run each control over ``seeds`` seeds at sample size ``n``.  ``on_report`` sees the reports
    so far and the control in progress (``{"name", "n", "runs"}``) after every seed, so a long run
    leaves usable partial results; ``resume`` maps a control's name to the per-seed statistics
    (``runs``) of an interrupted run at the same N: those seeds are not run again."""
    host = control_host(host)
    out = []
    for name in names or [*controls.SUBTLE, *controls.CONTROL_CASES]:
        base = control_case(name, n, host=host)
        runs = [_seed_tests(r) for r in (resume or {}).get(name, [])][:seeds]
        if runs and progress:
            progress(f"{name}: {len(runs)} of {seeds} seeds from the earlier run")
        laws = base.laws() if len(runs) < seeds else None
        for s in range(len(runs), seeds):
            result = run_case(replace(base, seed=base.seed + s * base.n * 11), host, laws)
            runs.append(result.tests)
            caught = [k for k, f in result.tests.items() if f.rejects(level)]
            if progress:
                progress(f"{name} seed {s}: caught by {', '.join(caught) or 'nothing'} "
                         f"(min p = {min(f.p_value for f in result.tests.values()):.3g})")
            if on_report:
                on_report(out, {"name": name, "n": base.n, "runs": [_seed_record(r) for r in runs]})
        stat = min(runs[0], key=lambda k: sorted(r[k].p_value for r in runs)[len(runs) // 2])
        fits = [r[stat] for r in runs]
        lam = max(sum(f.statistic - f.df for f in fits) / len(fits), 0.0)
        impossible = any(f.impossible for f in fits)
        out.append(ControlReport(
            name, base.n, seeds, sum(any(f.rejects(level) for f in r.values()) for r in runs), stat,
            lam, fits[0].df, 1.0 if impossible else power(fits[0].df, lam, level),
            sum(f.tv for f in fits) / len(fits), max(f.p_value for f in fits), [_seed_record(r) for r in runs]))
        if on_report:
            on_report(out, None)
    return out


def resumable(previous: Mapping[str, Any], names: Iterable[str], n: int | None,
              host: PluginHost | None = None) -> dict[str, list[dict[str, Any]]]:
    """The per-seed statistics of an earlier ``--controls --out`` file that a new run of ``names``
    at ``n`` may keep: finished controls and the one that was in progress, at the same N."""
    host = control_host(host)
    keep: dict[str, list[dict[str, Any]]] = {}
    entries = list(previous.get("controls", []))
    if previous.get("in_progress"):
        entries.append(previous["in_progress"])
    for rec in entries:
        name = rec.get("name")
        if name in names and rec.get("runs") and rec.get("n") == control_case(name, n, host=host).n:
            keep[name] = list(rec["runs"])
    return keep


def controls_table(reports: list[ControlReport]) -> str:
    rows = [("control", "N", "seeds caught", "statistic", "λ", "df", "predicted power", "mean TV", "max p")]
    for r in reports:
        rows.append((r.name, f"{r.n:,}", f"{r.rejected}/{r.seeds}", r.statistic, f"{r.noncentrality:,.0f}",
                     str(r.df), f"{r.predicted_power:.6f}", f"{r.mean_tv:.4f}", f"{r.max_p:.3g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

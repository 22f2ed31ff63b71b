"""The conformance suite: which combinations to check, at what size, and the report.

Two tiers:

``fast``  N = 2·10⁴ per case, one case per combination, combinations chosen so that every pair of
          components that can meet does meet (pairwise covering) — the CI tier;
``full``  N = 2·10⁵ per case, three cases per combination, every compatible combination.

The significance level α = 10⁻⁶ is for the whole run: each of the k statistical cases is tested
at α/k (Bonferroni), and a rejected case is re-run at 10·N before it is reported.  Combinations
that declare themselves unfit (a lossy verifier, a confidence estimator that is not pre-token)
are listed as such and never certified.  The suite's probe drafters (``random``, ``shadow``) are
added to whatever the host has registered, so the verifiers' sampling path is exercised even
when only deterministic drafters are installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from specforge.plugins import PluginHost
from specforge_conformance import drafters as probe_drafters
from specforge_conformance.combos import Combination, certification_blocker, combinations, covering_set
from specforge_conformance.deterministic import Check, deterministic_checks, non_finite
from specforge_conformance.harness import Case, CaseResult, check_case
from specforge_conformance.strategies import case_strategy, draw_cases

__all__ = ["TIERS", "ComboReport", "SuiteReport", "Tier", "run_suite", "suite_host"]


@dataclass(frozen=True)
class Tier:
    name: str
    n: int
    cases_per_combination: int
    every_combination: bool


TIERS = {
    "fast": Tier("fast", 20_000, 1, False),
    "full": Tier("full", 200_000, 3, True),
}
ALPHA = 1e-6
PROBE_PLUGIN = "specforge-conformance-probes"


def suite_host(host: PluginHost | None = None) -> PluginHost:
    """``host`` (default: a fresh host with every installed plug-in) plus the probe drafters."""
    host = (host or PluginHost()).load()
    host.add_plugin(probe_drafters, PROBE_PLUGIN, package="specforge-lossless (conformance)")
    return host


@dataclass
class ComboReport:
    combination: Combination
    status: str  # certified | failed | lossy | not-certifiable | error
    reason: str = ""
    results: list[CaseResult] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    label: str | None = None  # set for rows that stand for a group of untested combinations

    @property
    def title(self) -> str:
        return self.label or self.combination.label()

    @property
    def ok(self) -> bool:
        return self.status in ("certified", "not-certifiable", "lossy")

    def to_dict(self) -> dict[str, Any]:
        return {
            "combination": self.combination.to_dict(),
            "label": self.title,
            "status": self.status,
            "reason": self.reason,
            "cases": [r.to_dict() for r in self.results],
            "checks": [c.to_dict() for c in self.checks],
        }


@dataclass
class SuiteReport:
    tier: str
    alpha: float
    combos: list[ComboReport]
    verifier_checks: dict[str, Check]
    seconds: float
    seed: int

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.combos) and all(c.passed for c in self.verifier_checks.values())

    def assert_passed(self) -> None:
        """Raise ``AssertionError`` with the table and the reproduction lines if anything failed."""
        if not self.passed:
            raise AssertionError("specforge conformance failed\n" + self.table() + "\n\n" + self.explain())

    def failures(self) -> list[ComboReport]:
        return [c for c in self.combos if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier, "alpha": self.alpha, "seed": self.seed, "passed": self.passed,
            "seconds": round(self.seconds, 1),
            "combinations": [c.to_dict() for c in self.combos],
            "verifiers": {name: c.to_dict() for name, c in self.verifier_checks.items()},
        }

    def table(self) -> str:
        """A plain-text table, one line per combination."""
        rows = [("combination", "status", "N", "max TV", "min p", "τ", "checks")]
        for c in self.combos:
            if c.results:
                n = max(r.case.n for r in c.results)
                tv = max(r.fit.tv for r in c.results)
                p = min(r.fit.p_value for r in c.results)
                tau = sum(r.tau for r in c.results) / len(c.results)
                stats = (f"{n:,}", f"{tv:.4f}", f"{p:.3g}", f"{tau:.2f}")
            else:
                stats = ("-", "-", "-", "-")
            checks = "ok" if c.checks and all(k.passed for k in c.checks) else (
                "-" if not c.checks else "FAIL: " + ", ".join(k.name for k in c.checks if not k.passed))
            rows.append((c.title, c.status, *stats, checks))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        bad = [f"verifier {n}: {c.detail}" for n, c in self.verifier_checks.items() if not c.passed]
        return "\n".join(lines + bad)

    def explain(self) -> str:
        """What failed and how to reproduce it."""
        out = []
        for c in self.failures():
            out.append(f"FAILED {c.title}: {c.reason}")
            for r in c.results:
                if r.failed:
                    out.append(f"  reproduce: specforge conformance --case '{r.case.to_json()}'")
            for k in c.checks:
                if not k.passed:
                    out.append(f"  {k.name}: {k.detail}")
        return "\n".join(out)


def plan(host: PluginHost, tier: Tier, plugins: Iterable[str] = ()) -> tuple[list[Combination], list[ComboReport]]:
    """(combinations to test, combinations reported without testing)."""
    wanted = set(plugins)
    combos = combinations(host)
    if wanted:
        known = {name for c in combos for _, name in c.items()}
        missing = sorted(wanted - known)
        if missing:
            raise ValueError(f"no compatible combination uses {', '.join(missing)}; "
                             f"components in play: {', '.join(sorted(known))}")
        combos = [c for c in combos if c.involves(wanted)]
    testable = []
    blocked: dict[str, list[Combination]] = {}
    for combo in combos:
        blocker = certification_blocker(host, combo)
        if blocker is None:
            testable.append(combo)
        else:
            blocked.setdefault(blocker, []).append(combo)
    # One line per declared reason (e.g. per lossy verifier), not one per combination it spoils.
    untested = [ComboReport(group[0], "lossy" if "lossy" in reason else "not-certifiable",
                            f"{reason}: {len(group)} combination(s) not certified",
                            label=f"any pipeline / {group[0].verifier}" if "lossy" in reason
                            else f"any pipeline with {group[0].confidence}")
                for reason, group in blocked.items()]
    chosen = testable if tier.every_combination else covering_set(testable)
    return chosen, untested


def run_suite(host: PluginHost | None = None, tier: str = "fast", plugins: Iterable[str] = (),
              alpha: float = ALPHA, seed: int = 0, n: int | None = None,
              progress: Callable[[str], None] | None = None, deterministic: bool = True) -> SuiteReport:
    """Check every selected combination; see the module docstring."""
    start = time.perf_counter()
    host = suite_host(host)
    spec = TIERS[tier]
    chosen, untested = plan(host, spec, plugins)
    size = n or spec.n
    drawn = [(combo, draw_cases(case_strategy(host, combo, size), spec.cases_per_combination,
                                f"{seed}:{combo.label()}")) for combo in chosen]
    total = sum(len(cases) for _, cases in drawn)
    per_case = alpha / max(total, 1)
    reports = []
    bar = _progress(total, progress)
    for combo, cases in drawn:
        report = ComboReport(combo, "certified")
        try:
            for case in cases:
                result = check_case(case, host, per_case)
                report.results.append(result)
                bar(f"{combo.label()}: p={result.fit.p_value:.3g}")
            if deterministic and not combo.plain:
                report.checks = deterministic_checks(cases[0], host)
        except Exception as exc:  # noqa: BLE001 - a broken plug-in is reported, not fatal
            report.status, report.reason = "error", f"{type(exc).__name__}: {exc}"
        else:
            failed = [r for r in report.results if r.failed]
            bad_checks = [k for k in report.checks if not k.passed]
            if failed:
                worst = min(failed, key=lambda r: r.fit.p_value)
                report.status = "failed"
                report.reason = (f"output law differs from the target's: p = {worst.fit.p_value:.3g} at N = "
                                 f"{worst.case.n:,} and p = {worst.rerun.fit.p_value:.3g} at N = "
                                 f"{worst.rerun.case.n:,} (level {per_case:.2g}), TV = {worst.fit.tv:.4f}")
            elif bad_checks:
                report.status, report.reason = "failed", "; ".join(f"{k.name}: {k.detail}" for k in bad_checks)
        reports.append(report)
    verifiers = sorted({c.verifier for c in chosen} | {c.combination.verifier for c in untested})
    checks = {name: non_finite(name, host) for name in verifiers}
    return SuiteReport(tier, alpha, reports + untested, checks, time.perf_counter() - start, seed)


def _progress(total: int, sink: Callable[[str], None] | None):
    if sink is None:
        return lambda message: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="conformance", unit="case", leave=False)

    def step(message: str) -> None:
        bar.update(1)
        bar.set_postfix_str(message[-60:])
        if bar.n >= total:
            bar.close()
    return step

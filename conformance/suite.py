"""The conformance suite: which combinations to check, at what size, and the report.

Two tiers:

``fast``  N = 2·10⁴ for a verifier's probe, 10⁴ for every other case, one case per combination,
          combinations chosen so that every pair of components that can meet does meet
          (pairwise covering) — the CI tier;
``full``  N = 2·10⁵ per case, three cases per combination, every compatible combination.

Both tiers first run every component in play through the probe cases of its kind
(:mod:`specforge_conformance.probes`) and its own deterministic checks (a verifier's declared law,
a scheduler's causality), then the combinations.  The significance level α = 10⁻⁶ is for the whole
run: each of the k cases is tested at α/k and each of its statistics at α/(k·6) (Bonferroni); a
case that looks suspicious is measured again at 10·N before it is reported.  Combinations that
declare themselves unfit (a lossy verifier, a confidence estimator that is not pre-token) are
listed as such and never certified.  A combination that reads per-request sampling settings (a
sampling verifier's) also runs a *mixed* case beside its drawn one: the same pipeline with its
requests at two or three settings at once, each tested against its own setting's law.  The suite's
probe drafters (``random``, ``shadow``) are added
to whatever the host has registered, so the verifiers' sampling path is exercised even when only
deterministic drafters are installed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance import drafters as probe_drafters
from specforge_conformance import probes
from specforge_conformance.combos import Combination, certification_blocker, combinations, covering_set
from specforge_conformance.deterministic import Check, component_checks, deterministic_checks
from specforge_conformance.fingerprint import code_fingerprint
from specforge_conformance.harness import (CASE_THREADS, MIN_TAU, MIN_VERIFIED, STATISTICS, Case, CaseResult,
                                          check_case, exercised, setting_label, shares, torch_threads)
from specforge_conformance.rounds import SIBLING_STRATA
from specforge_conformance.stats import ACCEPT_BANDS, band_label
from specforge_conformance.summary import OTHER_SHARD
from specforge_conformance.strategies import (CANDIDATES, case_strategy, draw_cases, informative_cases, mixed_case,
                                             reads_settings)

__all__ = ["TIERS", "ComboReport", "SuiteReport", "Tier", "run_suite", "suite_host"]


@dataclass(frozen=True)
class Tier:
    name: str
    n: int
    cases_per_combination: int
    every_combination: bool
    others: int  # N of every case but a verifier's probes

    def size(self, kind: ComponentKind | None) -> int:
        """N of a probe case of ``kind`` (``None``: a combination's case)."""
        return self.n if kind is ComponentKind.VERIFIER else self.others


TIERS = {
    # The round-level statistics see several draws per request, so cases other than the
    # verifiers' probes keep their power at half the requests.
    "fast": Tier("fast", 20_000, 1, False, 10_000),
    "full": Tier("full", 200_000, 3, True, 200_000),
}
ALPHA = 1e-6
PROBE_PLUGIN = "specforge-conformance-probes"


def suite_host(host: PluginHost | None = None) -> PluginHost:
    """``host`` (default: a fresh host with every installed plug-in) plus the probe drafters."""
    host = (host or PluginHost()).load()
    host.add_plugin(probe_drafters, PROBE_PLUGIN, package="specforge-lossless (conformance)")
    host.add_plugin(probes, PROBE_PLUGIN + "-parts", package="specforge-lossless (conformance)")
    return host


@dataclass
class ComboReport:
    combination: Combination
    status: str  # certified | failed | lossy | not-certifiable | not exercised | error | not run | other shard
    reason: str = ""
    results: list[CaseResult] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    label: str | None = None  # set for rows that stand for a group of untested combinations or a probe
    role: str | None = None  # for a probe row: the kind of the component under test

    @property
    def title(self) -> str:
        return self.label or self.combination.label()

    @property
    def ok(self) -> bool:
        return self.status in ("certified", "not-certifiable", "lossy", "not exercised", OTHER_SHARD)

    def to_dict(self) -> dict[str, Any]:
        return {
            "combination": self.combination.to_dict(),
            "label": self.title,
            "status": self.status,
            "role": self.role,
            "reason": self.reason,
            "cases": [r.to_dict() for r in self.results],
            "checks": [c.to_dict() for c in self.checks],
        }


@dataclass
class SuiteReport:
    tier: str
    alpha: float
    combos: list[ComboReport]
    component_checks: dict[str, list[Check]]  # "kind name" -> its own deterministic checks
    seconds: float
    seed: int
    n: int | None = None  # the samples per case asked for (None: the tier's)
    shard: tuple[int, int] = (1, 1)  # (i, k): this run did the i-th of k shares of the rows

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.combos) and all(k.passed for ks in self.component_checks.values() for k in ks)

    def assert_passed(self) -> None:
        """Raise ``AssertionError`` with the table and the reproduction lines if anything failed."""
        if not self.passed:
            raise AssertionError("specforge conformance failed\n" + self.table() + "\n\n" + self.explain())

    def failures(self) -> list[ComboReport]:
        return [c for c in self.combos if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier, "alpha": self.alpha, "seed": self.seed, "n": self.n, "passed": self.passed,
            "seconds": round(self.seconds, 1), "code": code_fingerprint(),
            **({"shard": list(self.shard)} if self.shard[1] > 1 else {}),
            "combinations": [c.to_dict() for c in self.combos],
            "components": {name: [k.to_dict() for k in ks] for name, ks in self.component_checks.items()},
            "detectable": self.detectable_by_kind(),
            "detectable_bands": {row: {label: None if math.isinf(t) else t for label, t in book.items()}
                                 for row, book in self.detectable_by_band().items()},
            "detectable_settings": {kind: {label: None if math.isinf(t) else t for label, t in book.items()}
                                    for kind, book in self.detectable_by_setting().items()},
        }

    def detectable_by_kind(self) -> dict[str, dict[str, float]]:
        """Per component kind under test and statistic, what this run could not have missed.

        A component's own probe cases all run that component, so a deviation it makes in all of
        them is caught by the most sensitive one: its minimum detectable effect is the smallest
        over its cases; the kind's is the largest (worst) over its components.  Each combination
        of the covering set stands for itself (``pipeline``: the worst over them).  A tree walk's
        statistics are stated apart from a chain's (``verifier (trees)``): other rounds, other
        power; and so are a mixed case's (``pipeline (mixed)``: its N split over its settings,
        each statistic split by setting)."""
        per_row: dict[tuple[str, str], dict[str, float]] = {}
        for c in self.combos:
            for r in c.results:
                kind = (c.role or "pipeline") + (" (trees)" if r.trees else "") + (" (mixed)" if r.case.mix else "")
                key = (kind, c.title if c.role else f"{c.title} #{id(r)}")
                book = per_row.setdefault(key, {})
                for stat, t in r.detectable().items():
                    if math.isfinite(t):
                        book[stat] = min(book.get(stat, math.inf), t)
        out: dict[str, dict[str, float]] = {}
        for (kind, _), book in per_row.items():
            worst = out.setdefault(kind, {})
            for stat, t in book.items():
                worst[stat] = max(worst.get(stat, 0.0), t)
        return out

    def detectable_by_band(self) -> dict[str, dict[str, float]]:
        """Per verifier probed, the smallest shift of the acceptance rate of each band of declared
        acceptance probabilities (:data:`~specforge_conformance.stats.ACCEPT_BANDS`) that its probe
        cases detect: the smallest over its cases, as for :meth:`detectable_by_kind`; a token tree's
        bands per sibling index (``rejection (trees, child 2)``).  A band no case put a draft in is
        absent; ``inf``: too few there to be tested."""
        out: dict[str, dict[str, float]] = {}
        for c in self.combos:
            if c.role != ComponentKind.VERIFIER.value:
                continue
            for r in c.results:
                if r.case.mix:  # its bands are split by setting too: the per-kind table states it
                    continue
                for band, t in r.detectable_bands():
                    child = f"{band.stratum + 1}{'+' if band.stratum + 1 >= SIBLING_STRATA else ''}"
                    book = out.setdefault(c.combination.verifier + (f" (trees, child {child})" if r.trees else ""), {})
                    book[band.label] = min(book.get(band.label, math.inf), t)
        return out

    def detectable_by_setting(self) -> dict[str, dict[str, float]]:
        """Per kind under test (as in :meth:`detectable_by_kind`, mixed cases only) and sampling
        setting, the ``sequence`` statistic's minimum detectable TV on that setting's requests
        (:meth:`~specforge_conformance.harness.CaseResult.detectable_by_setting`): the worst over
        the mixed cases that had the setting."""
        out: dict[str, dict[str, float]] = {}
        for c in self.combos:
            for r in (r for r in c.results if r.case.mix):
                book = out.setdefault(f"{c.role or 'pipeline'} (mixed)", {})
                for setting, _, t in r.detectable_by_setting():
                    label = setting_label(setting)
                    book[label] = max(book.get(label, 0.0), t)
        return out

    def table(self) -> str:
        """A plain-text table, one line per combination or probe; then the minimum detectable
        effects per kind."""
        rows = [("combination", "status", "N", "τ", "verified", "accepted", "min p (statistic)", "MDE seq", "checks")]
        for c in self.combos:
            if c.status == OTHER_SHARD:
                continue
            if c.results:
                n = max(r.case.n for r in c.results)
                worst = min(c.results, key=lambda r: r.min_p)
                stat = min(worst.tests, key=lambda k: worst.tests[k].p_value) if worst.tests else "sequence"
                tau = sum(r.tau for r in c.results) / len(c.results)
                verified, accepted = (sum(s) / len(c.results) for s in zip(*(shares(r) for r in c.results)))
                mde = max(r.detectable().get("sequence", math.inf) for r in c.results)
                stats = (f"{n:,}", f"{tau:.2f}", "-" if c.combination.plain else f"{verified:.0%}",
                         "-" if c.combination.plain else f"{accepted:.0%}", f"{worst.min_p:.3g} ({stat})", f"{mde:.3f}")
            else:
                stats = ("-",) * 6
            checks = "ok" if c.checks and all(k.passed for k in c.checks) else (
                "-" if not c.checks else "FAIL: " + ", ".join(k.name for k in c.checks if not k.passed))
            rows.append((c.title, c.status, *stats, checks))
        lines = _columns(rows)
        others = sum(c.status == OTHER_SHARD for c in self.combos)
        if others:
            lines.append(f"(shard {self.shard[0]}/{self.shard[1]}: {others} rows left to the other shards)")
        for name, ks in self.component_checks.items():
            for k in ks:
                lines.append(f"{name}: {k.name} {'ok' if k.passed else 'FAILED'} — {k.detail}")
        return "\n".join(lines) + "\n\n" + self.detectable_table() + self.band_table() + self.setting_table()

    def detectable_table(self) -> str:
        """What the run detects with probability ≥ 99 %, per kind under test: the worst case's
        minimum detectable TV (an acceptance-probability shift for ``acceptance``)."""
        book = self.detectable_by_kind()
        if not book:
            return ""
        stats = [s for s in STATISTICS if any(s in b for b in book.values())]
        rows = [("tested as", *stats)]
        for kind, b in book.items():
            rows.append((kind, *(("≥ 0.5" if b[s] >= 0.5 else f"{b[s]:.3f}") if s in b else "-" for s in stats)))
        return ("minimum detectable effect (≥ 99 % power, worst case per kind; '-': statistic not applicable; "
                "≥ 0.5: some case of that kind gives it (almost) no data)\n"
                + "\n".join(_columns(rows)))

    def band_table(self) -> str:
        """What each verifier's probes detect in each band of declared acceptance probabilities
        (empty when no verifier was probed)."""
        book = self.detectable_by_band()
        if not book:
            return ""
        bounds = (0.0, *ACCEPT_BANDS, 1.0)
        labels = [band_label(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        rows = [("verifier", *labels)]
        for row, b in book.items():
            rows.append((row, *(_detectable_cell(b, label) for label in labels)))
        return ("\n\nacceptance rate per band of the declared acceptance probability a (min(1, p/q) under the "
                "rejection rule): the smallest shift of one band's rate the verifier's probes detect (≥ 99 % power; "
                "'-': no draft there; ∞: too few to test)\n" + "\n".join(_columns(rows)))

    def explain(self) -> str:
        """What failed and how to reproduce it."""
        out = []
        for c in self.failures():
            out.append(f"{'NOT RUN' if c.status == 'not run' else 'FAILED'} {c.title}: {c.reason}")
            for r in c.results:
                if r.failed:
                    out.append(f"  reproduce: specforge conformance --case '{r.case.to_json()}'")
            for k in c.checks:
                if not k.passed:
                    out.append(f"  {k.name}: {k.detail}")
        for name, ks in self.component_checks.items():
            out.extend(f"FAILED {name}: {k.name}: {k.detail}" for k in ks if not k.passed)
        return "\n".join(out)


    def setting_table(self) -> str:
        """What the mixed cases' sequence statistic detects on each setting's requests (empty when
        no mixed case ran)."""
        book = self.detectable_by_setting()
        labels = sorted({label for b in book.values() for label in b}, key=_setting_order)
        if not labels:
            return ""
        rows = [("tested as", *labels)]
        for kind, b in book.items():
            rows.append((kind, *(_detectable_cell(b, label) for label in labels)))
        return ("\n\nmixed cases, sequence statistic per sampling setting: the smallest TV on that setting's "
                "requests detected (≥ 99 % power, worst case; greedy: a point mass, any deviation is a draw of "
                "probability 0)\n" + "\n".join(_columns(rows)))


def _setting_order(label: str) -> tuple:
    return (label != "greedy", label)


def _detectable_cell(book: dict[str, float], label: str) -> str:
    """A table cell of a smallest detectable effect: '-' none drawn there, ∞ too few to test."""
    if label not in book:
        return "-"
    x = book[label]
    return "∞" if math.isinf(x) else "≥ 0.5" if x >= 0.5 else f"{x:.3f}"


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def plan(host: PluginHost, tier: Tier, plugins: Iterable[str] = ()) -> tuple[list[Combination], list[ComboReport]]:
    """(combinations to test, combinations reported without testing)."""
    wanted = set(plugins)
    combos = [c for c in combinations(host) if not c.involves(set(probes.PROBE_ONLY))]
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


def components_in_play(host: PluginHost, combos: Iterable[Combination], plugins: Iterable[str] = ()
                       ) -> list[tuple[ComponentKind, str]]:
    """(kind, name) of every component to probe: the named ones, or every one in ``combos``
    (the suite's own probe parts excepted)."""
    wanted = set(plugins)
    seen: list[tuple[ComponentKind, str]] = []
    for combo in combos:
        for slot, name in combo.items():
            item = (ComponentKind(slot), name)
            if item in seen or name in probes.PROBE_ONLY or (wanted and name not in wanted):
                continue
            if item[0] is ComponentKind.DRAFTER and name in probe_drafters.SUITE_DRAFTERS:
                continue
            seen.append(item)
    return seen


@dataclass
class _Job:
    report: ComboReport
    cases: list[Case] | Callable[[], list[Case]]  # a combination's draw: made by the shard that checks it
    size: int  # the cases it checks
    pipeline_checks: bool  # run the deterministic checks of the pipeline of cases[0]
    keep: int | None = None  # choose this many informative cases among ``cases`` first (a pilot run each)
    mixed: str | None = None  # then add the mixed case of the first, drawn for this key


def run_suite(host: PluginHost | None = None, tier: str = "fast", plugins: Iterable[str] = (),
              alpha: float = ALPHA, seed: int = 0, n: int | None = None,
              progress: Callable[[str], None] | None = None, deterministic: bool = True,
              fail_fast: bool = False, max_seconds: float | None = None,
              shard: tuple[int, int] = (1, 1)) -> SuiteReport:
    """Probe every component in play, then check every selected combination; see the module
    docstring.  ``fail_fast`` stops at the first failure, ``max_seconds`` starts nothing new once
    that much time is spent; what was not run is reported as ``not run`` (and the run does not
    pass).  ``shard=(i, k)`` runs the i-th of k interleaved shares of the probes and combinations
    (the components' own checks in the first): the k runs of one seed, on several cores or
    machines, test exactly what one run would, at the same levels (``conformance summary`` joins
    them)."""
    index, count = shard
    if not 1 <= index <= count:
        raise ValueError(f"shard {index}/{count}: the index must be between 1 and {count}")
    # the exact laws, draws and statistics too: like the cases, they gain nothing from a second thread
    with torch_threads(CASE_THREADS):
        return _run_suite(host, tier, plugins, alpha, seed, n, progress, deterministic, fail_fast, max_seconds,
                          shard)


def _run_suite(host: PluginHost | None, tier: str, plugins: Iterable[str], alpha: float, seed: int, n: int | None,
               progress: Callable[[str], None] | None, deterministic: bool, fail_fast: bool,
               max_seconds: float | None, shard: tuple[int, int]) -> SuiteReport:
    index, count = shard
    start = time.perf_counter()
    host = suite_host(host)
    spec = TIERS[tier]
    chosen, untested = plan(host, spec, plugins)
    jobs, component_results = [], {}
    for kind, name in components_in_play(host, chosen + [c.combination for c in untested], plugins):
        title = f"{kind.value.replace('_', ' ')} {name}"
        own = component_checks(kind, name, host) if deterministic and index == 1 else []
        if own:
            component_results[title] = own
        cases = probes.probe_cases(host, kind, name, n or spec.size(kind), seed)
        if cases:
            jobs.append(_Job(ComboReport(cases[0].combination, "certified", label=f"probes of {title}",
                                         role=kind.value), cases, len(cases), False))
    if fail_fast and any(not k.passed for ks in component_results.values() for k in ks):
        jobs_stop = "--fail-fast: a component's own check failed"
    else:
        jobs_stop = ""
    for combo in chosen:
        def draw(combo: Combination = combo) -> list[Case]:
            return draw_cases(case_strategy(host, combo, n or spec.size(None)),
                              spec.cases_per_combination + (0 if combo.plain else CANDIDATES), f"{seed}:{combo.label()}")
        mixed = reads_settings(host, combo)
        jobs.append(_Job(ComboReport(combo, "certified"), draw, spec.cases_per_combination + mixed,
                         deterministic and not combo.plain, None if combo.plain else spec.cases_per_combination,
                         f"{seed}:{combo.label()}:mixed" if mixed else None))
    total = sum(j.size for j in jobs)
    per_case = alpha / max(total, 1)
    mine = range(index - 1, len(jobs), count)  # the shard's interleaved share
    bar = _progress(sum(jobs[j].size for j in mine), progress)
    stop = jobs_stop
    for j, job in enumerate(jobs):
        report = job.report
        if j not in mine:
            report.status = OTHER_SHARD
            continue
        if stop:
            report.status, report.reason = "not run", stop
            continue
        try:
            if callable(job.cases):
                job.cases = job.cases()
            if job.keep is not None:  # the pilots run the plug-ins too: a broken one is reported here
                job.cases = informative_cases(job.cases, job.keep, host)
            if job.mixed is not None:  # (last: the deterministic checks take the first, homogeneous case)
                job.cases = job.cases + [c for c in [mixed_case(job.cases[0], job.mixed)] if c is not None]
            for case in job.cases:
                result = check_case(case, host, per_case)
                report.results.append(result)
                bar(f"{report.title}: p={result.min_p:.3g}")
            if job.pipeline_checks:
                report.checks = deterministic_checks(job.cases[0], host)
        except Exception as exc:  # noqa: BLE001 - a broken plug-in is reported, not fatal
            report.status, report.reason = "error", f"{type(exc).__name__}: {exc}"
        else:
            failed = [r for r in report.results if r.failed]
            bad_checks = [k for k in report.checks if not k.passed]
            if failed:
                report.status, report.reason = "failed", _failure(failed)
            elif bad_checks:
                report.status, report.reason = "failed", "; ".join(f"{k.name}: {k.detail}" for k in bad_checks)
            elif not report.combination.plain and not any(exercised(r) for r in report.results):
                report.status, report.reason = "not exercised", _idle(report.results)
        if fail_fast and report.status in ("failed", "error"):
            stop = f"--fail-fast: stopped after {report.title} failed"
        elif max_seconds is not None and time.perf_counter() - start > max_seconds:
            stop = f"--max-seconds {max_seconds:g} spent"
    return SuiteReport(tier, alpha, [j.report for j in jobs] + untested, component_results,
                       time.perf_counter() - start, seed, n, shard)


def _idle(results: list[CaseResult]) -> str:
    """Why a combination's cases certify nothing: how little of what was drafted was verified,
    and where it stopped — rounds run plain (a draft gate that judged drafting does not pay at
    this load), drafts the scheduler did not admit, or verified drafts all rejected."""
    parts = []
    for r in results:
        verified, accepted = shares(r)
        per_round = r.drafted / max(r.rounds, 1)
        why = ("most rounds ran plain (a draft gate judged that drafting does not pay at this load)" if per_round < 0.5
               else "the scheduler admitted few drafts (its step curve or threshold at this batch)"
               if verified < MIN_VERIFIED else "nearly every verified draft was rejected")
        parts.append(f"{per_round:.2f} tokens drafted a round, {verified:.0%} of them verified and {accepted:.0%} "
                     f"accepted (τ {r.tau:.3f}): {why}")
    return ("no case verifies enough to test the components that verification exercises (" + "; ".join(parts)
            + f"; exercised: some verified and τ ≥ {MIN_TAU})")


def _failure(failed: list[CaseResult]) -> str:
    """Why the worst failed case failed, statistic by statistic."""
    worst = min(failed, key=lambda r: r.rerun.min_p if r.rerun else 0.0)
    impossible = [k for k, f in worst.tests.items() if f.impossible]
    if impossible:
        f = worst.tests[impossible[0]]
        return (f"{impossible[0]}: {f.impossible} draw(s) of probability 0 at N = {worst.case.n:,} "
                f"(a token the declared law cannot produce)")
    again = worst.rerun
    names = again.rejected()
    parts = [f"{k}: p = {worst.tests[k].p_value:.3g} at N = {worst.case.n:,}, p = {again.tests[k].p_value:.3g} "
             f"at N = {again.case.n:,}, TV = {again.tests[k].tv:.4f}" for k in names if k in worst.tests]
    return f"{', '.join(names)} differ(s) from the exact law (level {again.level:.2g}): " + "; ".join(parts)


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

"""The suite's power against subtle bugs: mechanism statistics, probe cases, deterministic
contract checks, stated minimum detectable effects, and what a third party needs to use it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from specforge import hookimpl
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance import controls, probes
from specforge_conformance.deterministic import calibrator_causality, declared_law, scheduler_causality
from specforge_conformance.harness import STATISTICS, exercised, run_case, shares
from specforge_conformance.power import CASE_ALPHA, LEVEL, control_case, control_host
from specforge_conformance.stats import FitResult, band_detectable, bernoulli_fit, detectable_tv, pit, uniformity_fit
from specforge_conformance.suite import run_suite
from specforge_plugins.verifiers import RejectionConfig, RejectionVerifier


@pytest.fixture(scope="module")
def chost():
    return control_host()


# --- statistics ------------------------------------------------------------------------------------


def test_pit_is_uniform_for_the_declared_law_and_not_for_a_cooler_one():
    gen = torch.Generator().manual_seed(0)
    law = torch.softmax(torch.randn(40_000, 8, generator=gen) * 2, -1)
    right = torch.multinomial(law, 1, generator=gen).squeeze(1)
    cooler = torch.multinomial(torch.softmax(law.log() / 0.9, -1), 1, generator=gen).squeeze(1)
    strata = torch.randint(0, 3, (40_000,), generator=gen)
    u = torch.rand(40_000, generator=gen, dtype=torch.float64)
    ok = uniformity_fit(pit(law, right, u)[0], strata)
    bad = uniformity_fit(pit(law, cooler, u)[0], strata)
    assert ok.p_value > 1e-3 and bad.p_value < 1e-12
    values, impossible = pit(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([2]), torch.tensor([0.3]))
    assert bool(impossible[0]) and 0 <= float(values[0]) < 1


def test_bernoulli_fit_sees_five_percent_over_acceptance():
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(40_000, generator=gen)
    u = torch.rand(40_000, generator=gen)
    assert bernoulli_fit(a, u < a).p_value > 1e-3
    assert bernoulli_fit(a, u < (1.05 * a).clamp(max=1)).p_value < 1e-12
    # accepted at probability 0 / rejected at probability 1: impossible, whatever the statistic
    assert bernoulli_fit(torch.tensor([0.0, 1.0]), torch.tensor([True, False])).impossible == 2


def test_minimum_detectable_effect_shrinks_with_samples_and_with_the_second_stage():
    small, big = (FitResult(n, 101, 0.0, 100, 1.0, 0.0, 0) for n in (10_000, 40_000))
    level = 1e-6 / 300
    assert detectable_tv(big, level) < detectable_tv(small, level)
    assert detectable_tv(small, level, screen=1e-3) < detectable_tv(small, level)
    assert detectable_tv(FitResult(0, 0, 0.0, 1, 1.0, 0.0, 0, 0.0), level) == float("inf")


# --- deterministic contract checks -----------------------------------------------------------------


class _PrimitiveOverAccept(RejectionVerifier):
    """A 5 % over-acceptance written into the declared rule itself."""

    def accept_probability(self, p, q, x):
        return (super().accept_probability(p, q, x) * 1.05).clamp(max=1.0)


class _LookAheadCalibrator:
    """Averages each slot with the next: reads a later slot."""

    def __init__(self, config=None):
        pass

    def apply(self, c):
        nxt = torch.cat([c[:, 1:], c[:, -1:]], 1)
        return (c + nxt) / 2


class _Extra:
    @hookimpl
    def specforge_register_verifiers(self, register):
        register("primitive-over-accept", _PrimitiveOverAccept, config=RejectionConfig, lossless=True)

    @hookimpl
    def specforge_register_calibrators(self, register):
        from pydantic import BaseModel, ConfigDict

        class Cfg(BaseModel):
            model_config = ConfigDict(extra="forbid")

        register("look-ahead", _LookAheadCalibrator, config=Cfg)


@pytest.fixture(scope="module")
def xhost(chost):
    host = control_host()
    host.add_plugin(_Extra(), "extra")
    return host


@pytest.mark.parametrize("name", ["rejection", "match", "greedy"])
def test_shipped_verifiers_declare_a_lossless_law(name, chost):
    check = declared_law(name, chost)
    assert check.passed, check.detail


def test_a_lossy_declared_law_is_caught_exactly(xhost):
    check = declared_law("primitive-over-accept", xhost)
    assert not check.passed and "not lossless" in check.detail


@pytest.mark.parametrize("name", ["fixed", "threshold", "hw-prefix", "async-topk"])
def test_shipped_schedulers_are_causal(name, chost):
    check = scheduler_causality(name, chost)
    assert check.passed, check.detail


@pytest.mark.parametrize("name", ["peek-next", "retrospective-global"])
def test_schedulers_that_read_later_slots_are_caught_exactly(name, chost):
    check = scheduler_causality(name, chost)
    assert not check.passed and "later slots" in check.detail


def test_calibrator_causality(xhost):
    assert calibrator_causality("identity", xhost).passed
    assert calibrator_causality("sts", xhost).passed
    assert not calibrator_causality("look-ahead", xhost).passed


# --- probes and subtle controls --------------------------------------------------------------------


def test_probe_cases_reach_their_mechanism(chost):
    """Each probe case is sized by the power calculation and leaves room for a whole block."""
    verifier = probes.probe_cases(chost, ComponentKind.VERIFIER, "rejection", 20_000)
    assert len(verifier) == 5 and all(c.horizon == 4 and c.vocab == 8 for c in verifier)
    assert verifier[0].pipeline["drafter"][1]["spike"] > 0
    # a chain whose drafts sit just below and above p/q = 1, at the tier's N
    near = verifier[1]
    assert near.pipeline["drafter"] == probes.NEAR_ONE and near.temperature == probes.NEAR_T and near.n == 20_000
    # it verifies trees: the top-k tree of the target's law at full N, the iid one at half
    top, iid, mixed = verifier[2:]
    assert top.pipeline["drafter"] == ("random-tree", {"branching": [4, 2], "children": "top", "source": "target"})
    assert top.n == 20_000 and iid.pipeline["drafter"][0] == "random-tree" and iid.n == 10_000
    # the spiky chain again with greedy, T = 1 and truncated rows in every batch, on a target of its own
    assert mixed.mix == probes.PROBE_MIX and mixed.pipeline == verifier[0].pipeline and mixed.n == 20_000
    assert (mixed.family, mixed.target_seed, mixed.seed) != (verifier[0].family, verifier[0].target_seed,
                                                             verifier[0].seed)
    assert not any(c.mix for c in verifier[:4])
    assert not probes.probe_cases(chost, ComponentKind.VERIFIER, "typical", 20_000)  # lossy
    # at T = 0 every decision is certain: a greedy-only verifier gets no case near the threshold
    greedy = probes.probe_cases(chost, ComponentKind.VERIFIER, "greedy", 20_000)
    assert [c.pipeline["drafter"][0] for c in greedy] == ["shadow", "random-tree"]
    assert all(c.temperature == 0 and not c.mix for c in greedy)  # its requests are all at T = 0: no mix
    scheduler = probes.probe_cases(chost, ComponentKind.SCHEDULER, "threshold", 20_000)
    assert scheduler[0].pipeline["confidence"][0] == "probe-prev"


def test_a_probe_case_reports_every_statistic_and_its_detectable_effect(chost):
    case = replace(probes.probe_cases(chost, ComponentKind.VERIFIER, "rejection", 4000)[0], n=4000)
    result = run_case(case, chost, alpha=CASE_ALPHA)
    assert set(result.tests) == set(STATISTICS)
    assert not result.rejected() and result.tau > 1.5
    mde = result.detectable()
    assert all(0 < mde[k] < 0.5 for k in STATISTICS)
    payload = result.to_dict()
    assert payload["tests"]["emission"]["detectable"] == pytest.approx(mde["emission"])


@pytest.mark.parametrize("name", sorted(controls.SUBTLE))
def test_every_subtle_control_is_caught_by_the_statistic_that_claims_it(name, chost):
    case = control_case(name, seed=3, host=chost)  # at the fast tier's N for its kind
    result = run_case(case, chost, alpha=CASE_ALPHA)
    claimed = result.tests[controls.CLAIMS[name]]
    assert claimed.rejects(LEVEL), (name, {k: f.p_value for k, f in result.tests.items()})


def test_the_acceptance_test_sees_an_error_just_below_one_in_its_band():
    """Acceptance events spread over (0.85, 1): a rule that accepts outright where a ≥ 0.95 is
    off by at most 5 % in two narrow bands; each band reports its rate against the declared one,
    and the smallest shift of that rate the test detects."""
    g = torch.Generator().manual_seed(4)
    a = 0.85 + 0.15 * torch.rand(60_000, generator=g, dtype=torch.float64)
    u = torch.rand(60_000, generator=g, dtype=torch.float64)
    assert bernoulli_fit(a, u < a).p_value > 1e-3
    fit = bernoulli_fit(a, (u < a) | (a >= 0.95))
    assert fit.p_value < 1e-12
    bands = {b.label: b for b in fit.bands}
    assert list(bands) == ["0.75–0.9", "0.9–0.95", "0.95–0.98", "0.98–0.99", "0.99–1"]
    assert bands["0.95–0.98"].observed == 1.0 and 0.96 < bands["0.95–0.98"].declared < 0.97
    assert abs(bands["0.9–0.95"].observed - bands["0.9–0.95"].declared) < 0.01
    # a band's minimum detectable shift: smaller the more events it holds and the nearer a is to 1
    mde = {label: band_detectable(fit, b, LEVEL, screen=1e-3) for label, b in bands.items()}
    assert mde["0.99–1"] < mde["0.98–0.99"] < 0.02 and mde["0.95–0.98"] < 0.02
    assert FitResult.from_dict(fit.to_dict()) == fit


def test_the_fast_tier_rejects_a_near_one_over_acceptance_at_its_first_combination(chost):
    """A verifier that accepts outright where p/q ≥ 0.95 (its declared law exact, so the
    component checks pass) fails the first row of its fast-tier run — its probes, by the
    acceptance rate of the band just below 1, at the tier's N and levels — and the report states
    what each band can detect."""
    report = run_suite(chost, plugins=["near-one"], fail_fast=True)
    assert all(k.passed for k in report.component_checks["verifier near-one"])  # the declared law is lossless
    rows = [c for c in report.combos if c.status not in ("lossy", "not-certifiable")]
    first = rows[0]
    assert first.title == "probes of verifier near-one" and first.status == "failed", report.table()
    assert first.reason.startswith("acceptance") and {c.status for c in rows[1:]} == {"not run"}
    near = next(r for r in first.results if r.case.pipeline["drafter"] == probes.NEAR_ONE)
    assert near.failed and near.rerun.tests["acceptance"].p_value < near.level
    rates = {b.label: b.observed - b.declared for b in near.tests["acceptance"].bands}
    assert rates["0.95–0.98"] > 0.02 and abs(rates["0.9–0.95"]) < 0.01
    bands = report.to_dict()["detectable_bands"]["near-one"]
    assert all(0 < bands[label] < 0.05 for label in ("0.9–0.95", "0.95–0.98", "0.98–0.99", "0.99–1"))
    assert "acceptance rate per band" in report.table()


def test_a_learning_scheduler_s_probe_verifies_what_its_pilot_promised(chost):
    """async-topk sizes round t from round t − 2 and verifies every draft of its first two rounds;
    its draft gate shuts once drafting does not pay.  The pilot runs a batch first, so the chosen
    parameter set still verifies over the whole case (it used to verify 0.3 % of the drafts)."""
    case = probes.probe_cases(chost, ComponentKind.SCHEDULER, "async-topk", 2_000)[0]
    result = run_case(case, chost)
    assert exercised(result) and shares(result)[0] > 0.25, (case.pipeline["scheduler"], shares(result), result.tau)


def test_a_case_reproduces_bit_for_bit_at_its_thread_count(chost):
    case = replace(probes.probe_cases(chost, ComponentKind.SCHEDULER, "hw-prefix", 600)[0], n=600, threads=2)
    first = run_case(case, chost).counts
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = run_case(case, chost).counts
    finally:
        torch.set_num_threads(before)
    assert torch.equal(first, again)


# --- a third party's run ---------------------------------------------------------------------------


class _Crashing(RejectionVerifier):
    def verify(self, *args):
        raise RuntimeError("boom in verify")


class _CrashPlugin:
    @hookimpl
    def specforge_register_verifiers(self, register):
        register("crashing", _Crashing, config=RejectionConfig, lossless=True)


def test_fail_fast_and_time_budget_leave_the_rest_not_run():
    host = PluginHost(autoload=False).load()
    host.add_plugin(_CrashPlugin(), "crash")
    report = run_suite(host, plugins=["crashing"], n=500, deterministic=False, fail_fast=True)
    statuses = [c.status for c in report.combos if c.status not in ("lossy", "not-certifiable")]
    assert statuses[0] == "error" and set(statuses[1:]) == {"not run"} and not report.passed
    assert "--fail-fast" in report.explain()
    budget = run_suite(PluginHost(autoload=False), plugins=["threshold"], n=300, deterministic=False,
                       max_seconds=0)
    ran = [c for c in budget.combos if c.results]
    assert len(ran) == 1 and not budget.passed
    assert any(c.status == "not run" and "--max-seconds" in c.reason for c in budget.combos)


def test_the_report_states_the_minimum_detectable_effect_per_kind(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "specforge", "conformance", "--plugin", "threshold", "--n", "800",
                          "--max-seconds", "1", "--no-deterministic", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 1  # the budget left combinations untested: not certified
    assert "minimum detectable effect" in run.stdout and "not run" in run.stdout
    report = json.loads(out.read_text())
    assert "scheduler" in report["detectable"] and report["detectable"]["scheduler"]["sequence"] > 0


def test_the_power_run_resumes_an_interrupted_out_file_seed_by_seed(tmp_path):
    """`--controls … --out F` rewrites F after every seed; a second call at the same N keeps the
    seeds F holds (finished controls and the one in progress) and runs only the rest."""
    out = tmp_path / "controls.json"
    args = [sys.executable, "-m", "specforge", "conformance", "--controls", "tree-stale-residual",
            "--n", "2000", "--out", str(out)]
    first = subprocess.run([*args, "--seeds", "1"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    done = json.loads(out.read_text())
    assert done["complete"] and len(done["controls"][0]["runs"]) == 1
    # as an interrupted 2-seed run would have left it: the first seed of the control in progress
    out.write_text(json.dumps({"controls": [], "in_progress": {"name": "tree-stale-residual", "n": 2000,
                                                               "runs": done["controls"][0]["runs"]},
                               "complete": False}))
    second = subprocess.run([*args, "--seeds", "2"], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming tree-stale-residual" in second.stderr and "1 of 2 seeds from the earlier run" in second.stderr
    assert "seed 0:" not in second.stderr and "seed 1:" in second.stderr
    report = json.loads(out.read_text())["controls"][0]
    assert report["seeds"] == report["rejected"] == 2 and report["runs"][0] == done["controls"][0]["runs"][0]
    # another N is another experiment: nothing is kept
    third = subprocess.run([*args[:-4], "--n", "3000", "--out", str(out), "--seeds", "1"], capture_output=True, text=True)
    assert third.returncode == 0 and "resuming" not in third.stderr

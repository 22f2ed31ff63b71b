"""The suite end to end: the fast tier certifies every shipped combination, every negative
control is rejected, failures are reproducible and broken plug-ins are reported, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from specforge import hookimpl
from specforge.plugins import PluginHost
from specforge_conformance import controls
from specforge_conformance.deterministic import greedy_parity, rollback
from specforge_conformance.drafters import RandomDrafter, RandomDrafterConfig
from specforge_conformance.harness import Case, run_case
from specforge_conformance.power import CASE_ALPHA, control_case, control_host
from specforge_conformance.suite import run_suite


@pytest.fixture(scope="module")
def chost():
    return control_host()


@pytest.mark.slow
def test_fast_tier_certifies_every_shipped_combination():
    # Every case of the fast tier at a fifth of its N: the same plan, probes and checks (15+ min on
    # one core, hence the slow tier).  The tier at its own N is `specforge conformance` (its
    # 50-seed false-alarm run and its power are in docs/conformance.md).
    report = run_suite(PluginHost(autoload=False), tier="fast", n=4_000)
    print("\n" + report.table())
    assert report.passed, report.explain()
    certified = [c for c in report.combos if c.status == "certified"]
    assert len(certified) >= 12
    # N as given, doubled where the power calculation says so; a combination's mixed case at half
    # its kept case's, a kept case no pilot found informative at a quarter (it pays for the mixed)
    homogeneous = [r.case.n for c in certified for r in c.results if not r.case.mix]
    assert set(homogeneous) <= {4_000, 8_000, 1_000, 2_000} and homogeneous.count(4_000) > len(homogeneous) / 2
    assert {r.case.n for c in certified for r in c.results if r.case.mix} <= {4_000, 2_000, 1_000, 500}
    assert any(r.case.mix for c in certified if not c.role for r in c.results)
    # every shipped lossless verifier, drafter and scheduler met its probes
    probed = {c.title for c in certified if c.role}
    assert {"probes of verifier rejection", "probes of verifier match", "probes of drafter dspark",
            "probes of scheduler hw-prefix", "probes of scheduler async-topk"} <= probed
    assert all(k.passed for ks in report.component_checks.values() for k in ks)
    assert "scheduler hw-prefix" in report.component_checks
    # The probes make the sampling path real: some pipelines accept long prefixes.
    assert max(r.tau for c in certified for r in c.results) > 1.5
    # every probe is informative; a drawn combination may verify too little to certify anything
    # (a step curve that admits nothing at its batch, a draft gate that keeps rounds plain), and
    # the report then says which of those it was
    assert all(c.status == "certified" for c in report.combos if c.role)
    assert {c.status for c in report.combos} <= {"certified", "lossy", "not exercised"}
    idle = [c for c in report.combos if c.status == "not exercised"]
    assert all(any(why in c.reason for why in ("ran plain", "admitted few", "was rejected")) for c in idle)


@pytest.mark.slow
def test_the_fast_tier_certifies_a_component_through_its_probes_and_combinations():
    """The suite end to end for one shipped component, as `specforge conformance --plugin` runs it:
    its own checks, the probes of its kind, and every combination drawn with it — here the
    online calibrator, whose `observe` runs between the rounds of every case (37 cases: slow
    tier; `make test` runs the suite end to end on the example plug-in's scheduler)."""
    report = run_suite(PluginHost(autoload=False), tier="fast", plugins=["online-sts"], n=3_000)
    assert report.passed, report.explain()
    certified = [c for c in report.combos if c.status == "certified"]
    assert any(c.title == "probes of calibrator online-sts" for c in certified)
    combos = [c for c in certified if not c.role]
    assert len(combos) >= 2 and all(c.combination.calibrator == "online-sts" for c in combos)
    assert all(k.passed for k in report.component_checks["calibrator online-sts"])


@pytest.mark.parametrize("name", sorted(controls.CONTROL_CASES))
def test_every_negative_control_is_rejected_at_the_fast_tier_n(name, chost):
    # N: their effects are large (λ ≥ 10³ at 20,000, docs/conformance.md), so a quarter to a half
    # of it is plenty; retrospective-global runs at batch 1 (slow)
    n = {"retrospective-global": 4_000, "typical": 20_000}.get(name, 10_000)
    case = control_case(name, n=n, seed=7)
    result = run_case(case, chost, alpha=CASE_ALPHA)
    assert result.rejected() or any(f.impossible for f in result.tests.values()), (name, result.tests)


def test_a_correct_pipeline_passes_in_the_control_harness(chost):
    # The same harness and case shapes as the controls, with the bug taken out.
    case = control_case("resample-target", n=20_000, seed=7)
    fixed = replace(case, pipeline={**case.pipeline, "verifier": ("rejection", {})})
    result = run_case(fixed, chost, alpha=CASE_ALPHA)
    assert not result.rejected() and not result.failed, result.tests


def test_deterministic_checks_catch_a_wrong_bonus_row(chost):
    case = control_case("bonus-wrong-row", n=100)
    check = greedy_parity(case, chost)
    assert not check.passed and "plain decoding gives" in check.detail
    good = replace(case, pipeline={**case.pipeline, "verifier": ("rejection", {})})
    assert greedy_parity(good, chost).passed and rollback(good, chost).passed


def test_case_json_round_trip_and_cli_reproduction(tmp_path):
    case = control_case("typical", n=3000, seed=11)
    assert Case.from_json(case.to_json()) == case
    out = tmp_path / "case.json"
    run = subprocess.run([sys.executable, "-m", "specforge", "conformance", "--case", case.to_json(),
                          "--out", str(out)], capture_output=True, text=True)
    payload = json.loads(out.read_text())
    assert payload["case"] == case.to_dict()
    assert run.returncode == (0 if payload["passed"] else 1)
    assert "typical" in run.stdout


class _Crashing(RandomDrafter):
    def draft(self, ctx):
        raise RuntimeError("boom in draft")


class _CrashPlugin:
    @hookimpl
    def specforge_register_drafters(self, register):
        register("crashing", _Crashing, config=RandomDrafterConfig, provides=("probs", "logits"))


def test_a_broken_plugin_is_reported_and_the_rest_still_runs():
    host = PluginHost(autoload=False).load()
    host.add_plugin(_CrashPlugin(), "crash")
    report = run_suite(host, plugins=["crashing"], n=300, deterministic=False)
    errors = [c for c in report.combos if c.status == "error"]
    # every probe and combination of the crashing drafter ran and was reported, none stopped the run
    assert len(errors) >= 3 and all("boom in draft" in c.reason for c in errors)
    assert not any(c.status == "not run" for c in report.combos)
    assert not report.passed


def test_unknown_plugin_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no compatible combination uses nope"):
        run_suite(PluginHost(autoload=False), plugins=["nope"])


def test_uniforms_are_never_shared_by_requests(chost):
    # Two runs that differ only in the seed base give different samples; the same seed base
    # gives the same samples (requests are seeded, never drawn from a global generator).
    case = control_case("resample-target", n=200)
    a = run_case(case, chost).counts
    b = run_case(case, chost).counts
    c = run_case(replace(case, seed=10_000), chost).counts
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_multi_seed_run_resumes_from_its_output_file(tmp_path):
    """The false-alarm run is long: an interrupted one keeps its finished seeds and runs only the rest."""
    out = tmp_path / "seeds.json"
    base = [sys.executable, "-m", "specforge", "conformance", "--plugin", "ngram", "--n", "200",
            "--no-deterministic", "--out", str(out)]
    first = subprocess.run([*base, "--seeds", "2"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    done = json.loads(out.read_text())
    assert [r["seed"] for r in done["seeds"]] == [0, 1] and done["passed"]
    second = subprocess.run([*base, "--seeds", "3"], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "2 of 3 seeds already done, resuming" in second.stderr
    assert "seed 0:" not in second.stderr and "seed 2: passed" in second.stderr
    again = json.loads(out.read_text())
    assert [r["seed"] for r in again["seeds"]] == [0, 1, 2] and again["complete"]
    assert again["seeds"][:2] == done["seeds"]  # kept as they were, not re-run
    # a seed run on other code (the run spans sessions, the code moved on) is run again
    again["seeds"][1]["code"] = "0123456789abcdef"
    out.write_text(json.dumps(again))
    third = subprocess.run([*base, "--seeds", "3"], capture_output=True, text=True)
    assert third.returncode == 0, third.stderr[-2000:]
    assert "1 seeds were run on other code" in third.stderr and "seed 1: passed" in third.stderr
    assert "seed 0:" not in third.stderr
    assert len({r["code"] for r in json.loads(out.read_text())["seeds"]}) == 1


@pytest.mark.slow
def test_the_shards_of_a_seed_run_exactly_what_one_run_does(tmp_path):
    """``--shard I/K`` splits one seed's probes and combinations over K processes; `summary` joins
    them into the report one unsharded run writes (same rows, same cases, same p-values)."""
    from specforge_conformance.summary import read_seeds

    base = [sys.executable, "-m", "specforge", "conformance", "--plugin", "ngram", "--n", "200", "--seed", "5",
            "--no-deterministic"]
    for name, extra in (("whole", []), ("a", ["--shard", "1/2"]), ("b", ["--shard", "2/2"])):
        run = subprocess.run([*base, *extra, "--out", str(tmp_path / f"{name}.json")], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["shard"] == [1, 2] and any(c["status"] == "other shard" for c in a["combinations"])
    incomplete: list[str] = []
    assert read_seeds([str(tmp_path / "a.json")], incomplete) == {} and incomplete == ["seed 5 (shards 1/2 only)"]
    joined = read_seeds([str(tmp_path / "a.json"), str(tmp_path / "b.json")])[5]
    whole = json.loads((tmp_path / "whole.json").read_text())

    def rows(report):
        return [(c["label"], c["status"], [(case["alpha"], k, t["p_value"]) for case in c["cases"]
                                           for k, t in case["tests"].items()])
                for c in report["combinations"]]
    assert rows(joined) == rows(whole) and joined["passed"]
    bad = subprocess.run([*base, "--shard", "3/2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "I must be between 1 and K" in bad.stderr


def test_a_shard_runs_its_share_of_the_rows_at_the_whole_run_s_levels():
    """The second of two shards runs every other row (the first leaves them to it) at the level
    the whole run would use; the components' own checks belong to the first shard."""
    host = PluginHost(autoload=False)
    second = run_suite(host, plugins=["random"], n=200, seed=5, shard=(2, 2))
    rows = [c for c in second.combos if c.status not in ("lossy", "not-certifiable")]
    assert [c.status == "other shard" for c in rows] == [j % 2 == 0 for j in range(len(rows))]
    ran = [r for c in rows for r in c.results]
    assert ran and not second.component_checks and second.passed
    assert len({r.alpha for r in ran}) == 1  # one level: the whole run's (the slow test compares them)
    assert "(shard 2/2: " in second.table() and second.to_dict()["shard"] == [2, 2]
    with pytest.raises(ValueError, match="shard 3/2"):
        run_suite(host, plugins=["random"], shard=(3, 2))

"""Mixed cases: requests at different sampling settings in one batch, each tested against its own
setting's exact law (docs/conformance.md, "Mixed cases") — the draws that put them in front of
every combination that reads settings, and the two controls that misroute settings between rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance import controls, probes
from specforge_conformance.combos import SLOTS
from specforge_conformance.exact import ExactLaw, exact_law
from specforge_conformance.harness import MIXED_SHARE, Case, independence, run_case
from specforge_conformance.power import CASE_ALPHA, control_case, control_host
from specforge_conformance.stats import DETECT, goodness_of_fit
from specforge_conformance.strategies import MENU, case_strategy, draw_cases, mixed_case, reads_settings
from specforge_conformance.suite import TIERS, plan, run_suite, suite_host

MIX = ((1.0, 0, 1.0), (0.7, 3, 0.8), (0.0, 0, 1.0))


@pytest.fixture(scope="module")
def chost():
    return control_host()


def _plain_case(**fields) -> Case:
    """Plain decoding with ``rejection`` (no drafter) on the first well-conditioned small target."""
    pipeline = {slot: None for slot in SLOTS}
    pipeline["verifier"] = ("rejection", {})
    for target_seed in range(50):
        case = Case(pipeline=pipeline, vocab=8, horizon=3, target_seed=target_seed, batch=64, threads=1, **fields)
        if case.well_conditioned:
            return case
    raise AssertionError("no well-conditioned target")


def test_a_mixed_case_tests_each_request_against_its_own_setting_s_law(chost):
    case = _plain_case(mix=MIX, n=3_000, seed=5)
    # the case's law is the per-request laws: one exact law per setting, that setting's
    laws = case.laws()
    assert laws == tuple(exact_law(case.reference, case.prompt, case.horizon, *s) for s in MIX)
    with pytest.raises(ValueError, match="one law per setting"):
        case.law()
    setting = case.setting_index(range(case.n))
    assert torch.bincount(setting, minlength=3).min() > case.n / 3 - 150
    assert not torch.equal(setting[:64], torch.arange(64) % 3)  # drawn per request, not in a cycle

    result = run_case(case, chost, alpha=CASE_ALPHA)
    assert not result.rejected() and not result.failed, {k: f.p_value for k, f in result.tests.items()}
    # each setting's requests counted apart, and each setting's law tested on its own requests
    assert result.counts.shape == (3, 8 ** 3)
    assert result.counts.sum(1).tolist() == torch.bincount(setting, minlength=3).tolist()
    per = [goodness_of_fit(c, law.probs) for c, law in zip(result.counts, laws)]
    assert result.tests["sequence"].statistic == pytest.approx(sum(f.statistic for f in per if f.cells > 1))
    # the greedy requests all gave the arg-max continuation, the one sequence of probability 1
    (only,) = result.counts[2].nonzero().flatten().tolist()
    assert laws[2].probs[only] == 1
    # the batch's requests together follow no single law: pooled, they fail against any one of them
    pooled = result.counts.sum(0)
    assert all(goodness_of_fit(pooled, law.probs).rejects(1e-6) for law in laws)
    # the sequence statistic's power, setting by setting, in the report
    mde = {s: (n, t) for s, n, t in result.detectable_by_setting()}
    n_greedy = int(result.counts[2].sum())
    assert mde[MIX[2]] == (n_greedy, pytest.approx(1 - (1 - DETECT) ** (1 / n_greedy)))
    assert all(0.05 < mde[s][1] < 0.5 for s in MIX[:2])
    settings = result.to_dict()["tests"]["sequence"]["settings"]
    assert [s["label"] for s in settings] == ["T=1", "T=0.7 k=3 p=0.8", "greedy"]


def test_a_mixed_case_round_trips_and_a_homogeneous_one_keeps_its_json():
    mixed = _plain_case(mix=MIX, n=100)
    again = Case.from_json(mixed.to_json())
    assert again == mixed and again.mix == MIX
    homogeneous = _plain_case(n=100)
    assert "mix" not in homogeneous.to_dict() and Case.from_json(homogeneous.to_json()) == homogeneous
    assert homogeneous.laws() == (homogeneous.law(),) and homogeneous.settings == ((1.0, 0, 1.0),)


def _law(probs: torch.Tensor) -> ExactLaw:
    return ExactLaw(probs.to(torch.float64), probs.numel(), 1, float("inf"))


def test_independence_of_neighbours_at_different_settings_is_exact_and_sees_shared_randomness():
    gen = torch.Generator().manual_seed(3)
    laws = [_law(torch.softmax(torch.randn(8, generator=gen) * scale, -1)) for scale in (1.5, 1.0)]
    n = 40_000
    setting = torch.randint(0, 2, (n,), generator=gen)
    cdf = torch.stack([law.probs.cumsum(0) for law in laws])

    def draw(u):
        return torch.searchsorted(cdf[setting], u[:, None], right=True).clamp(max=7)

    fresh = draw(torch.rand(n, generator=gen, dtype=torch.float64))
    fit = independence(fresh, laws, setting)
    assert fit.p_value > 1e-3 and not fit.impossible
    u = torch.rand(n // 2, generator=gen, dtype=torch.float64).repeat_interleave(2)  # neighbours share a uniform
    assert independence(draw(u), laws, setting).p_value < 1e-12


def _base_case(host: PluginHost, combo) -> Case:
    """A kept case of ``combo`` as the suite would hand it to :func:`mixed_case` (its components at
    their first declared parameters), on a small target so that the draw stays cheap."""
    pipeline = {slot: None if name is None else
                (name, dict((host.get(ComponentKind(slot), name).metadata.examples or ({},))[0]))
                for slot, name in combo.to_dict().items()}
    return Case(pipeline=pipeline, vocab=8, horizon=2, batch=128, n=10_000, seed=7, threads=1)


def test_the_strategies_put_mixed_batches_in_front_of_every_combination_that_reads_settings():
    """Every combination of the fast tier whose verifier samples meets a mixed case: its kept
    case's pipeline, target and batch at two or three settings at once, at half its N; a
    greedy-only verifier's requests are all at T = 0, and its combinations have none."""
    host = suite_host(PluginHost(autoload=False))
    chosen, _ = plan(host, TIERS["fast"])
    readers = [c for c in chosen if reads_settings(host, c)]
    assert {c.verifier for c in readers} == {"rejection", "match"}
    assert {c.verifier for c in chosen if not reads_settings(host, c)} == {"greedy"}
    mixes = []
    for combo in readers:
        case = _base_case(host, combo)
        mixed = mixed_case(case, f"0:{combo.label()}:mixed")
        assert mixed is not None and mixed.well_conditioned, combo.label()
        assert 2 <= len(mixed.mix) <= 3 and len(set(mixed.mix)) == len(mixed.mix)
        assert set(mixed.mix) <= set(MENU) and any(t > 0 for t, _, _ in mixed.mix)
        assert mixed.n == int(case.n * MIXED_SHARE)
        assert replace(mixed, mix=(), temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                       n=case.n) == case
        mixes.append(mixed.mix)
    # so every drafter that samples (and may warp) and every scheduler meets mixed batches
    sampling = {d for d in host.names(ComponentKind.DRAFTER)
                if not host.get(ComponentKind.DRAFTER, d).metadata.deterministic}
    assert sampling & {c.drafter for c in chosen} <= {c.drafter for c in readers}
    assert {c.scheduler for c in chosen if c.scheduler} <= {c.scheduler for c in readers}
    # greedy rows beside sampling ones in every mix; two sampling settings in about half
    assert all(mix[-1] == MENU[0] for mix in mixes)
    assert len(mixes) // 4 <= sum(len(mix) == 3 for mix in mixes) <= 3 * len(mixes) // 4
    # and through the suite's own draw (hypothesis, sized and filtered), for one combination
    combo = next(c for c in readers if c.drafter == "dspark")
    (case,) = draw_cases(case_strategy(host, combo, 1_000), 1, f"0:{combo.label()}")
    mixed = mixed_case(case, f"0:{combo.label()}:mixed")
    assert mixed.mix and mixed.pipeline == case.pipeline and mixed.well_conditioned


def test_sampling_verifiers_and_drafters_have_a_mixed_probe(chost):
    for name in ("rejection", "match"):
        assert probes.probe_cases(chost, ComponentKind.VERIFIER, name, 20_000)[-1].mix == probes.PROBE_MIX
    assert not any(c.mix for c in probes.probe_cases(chost, ComponentKind.VERIFIER, "greedy", 20_000))
    dspark = probes.probe_cases(chost, ComponentKind.DRAFTER, "dspark", 10_000)
    assert [bool(c.mix) for c in dspark] == [False, False, True] and dspark[2].n == 5_000  # (half its N)
    # a deterministic drafter's one-hot q reads no settings
    assert not any(c.mix for c in probes.probe_cases(chost, ComponentKind.DRAFTER, "ngram", 10_000))


# swapped-settings' fast-tier run costs ~70 s, so it runs in the slow tier; the fast tier still
# catches it by its claimed statistic (test_conformance_power, every subtle control).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "swapped-settings" else n
                                  for n in sorted(controls.MIXED)])
def test_a_verifier_that_misroutes_settings_is_rejected_at_its_first_combination(name, chost):
    """A verifier that warps rows with other rows' settings (its declared law exact, so its
    component checks pass; in a batch of one setting it is exact) fails the first row of its
    fast-tier run — its probes, by the mixed one — at the tier's N and the suite's α."""
    report = run_suite(chost, plugins=[name], fail_fast=True)
    assert all(k.passed for k in report.component_checks[f"verifier {name}"])
    rows = [c for c in report.combos if c.status not in ("lossy", "not-certifiable")]
    first = rows[0]
    assert first.title == f"probes of verifier {name}" and first.status == "failed", report.table()
    assert {c.status for c in rows[1:]} == {"not run"}
    homogeneous, mixed = [r for r in first.results if not r.case.mix], [r for r in first.results if r.case.mix]
    assert homogeneous and not any(r.failed for r in homogeneous)
    (result,) = mixed
    assert result.failed and result.case.n == TIERS["fast"].n
    caught = result.tests[controls.CLAIMS[name]]
    assert caught.rejects(result.level)
    print(f"\n{name}: N = {result.case.n:,}, level {result.level:.3g}: " + ", ".join(
        f"{k} p = {f.p_value:.3g} ({f.impossible} impossible)" for k, f in result.tests.items()))


def test_the_shipped_rejection_rule_passes_the_mixed_probe(chost):
    # the control harness with the bug taken out: greedy, T = 1 and truncated rows verified together
    case = control_case("swapped-settings", n=10_000, seed=2, host=chost)
    fixed = replace(case, pipeline={**case.pipeline, "verifier": ("rejection", {})})
    result = run_case(fixed, chost, alpha=CASE_ALPHA)
    assert not result.rejected() and not result.failed, {k: f.p_value for k, f in result.tests.items()}

"""What drafting costs (ρ(R)) and the draft gate of the hardware-aware schedulers.

Behaviour only: the cost curve's lookup and file, that ρ makes admission more generous and never
changes the paper's rule at ρ = 0, that the gate closes where drafting does not pay — what the
rounds promise, scaled by how the promises of reported rounds held — and looks again every
``probe_every + 1`` rounds, and that ``draft_cost: auto`` measures the engine's own
drafting once, caches it and leaves the engine as it found it.  Never how fast anything ran.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specforge.components import RoundOutcome
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.hardware import DraftCost, HardwareProfile, HardwareProfileError
from specforge.plugins import PluginHost
from specforge.engine.draft_cost import DRAFT_COST_REQUESTS
from specforge.runtime import TargetModel
from specforge.toolkit.admission import admission_path, causal_count
from specforge_plugins.schedulers import AsyncTopKConfig, AsyncTopKScheduler, HardwareConfig, HwPrefixScheduler
from tiny_models import tiny_model

STEEP = [1.0, 0.8, 0.6, 0.5, 0.42, 0.36, 0.3, 0.25]


def test_draft_cost_is_piecewise_linear_in_r_and_flat_outside():
    cost = DraftCost({1: 0.2, 4: 0.5, 16: 0.3})
    assert cost.ratio(1) == pytest.approx(0.2) and cost.ratio(0) == pytest.approx(0.2)
    assert cost.ratio(2) == pytest.approx(0.3)
    assert cost.ratio(10) == pytest.approx(0.4)
    assert cost.ratio(64) == pytest.approx(0.3)
    assert DraftCost(0.25).ratio(37) == pytest.approx(0.25)


@pytest.mark.parametrize("points", [{0: 0.1}, {1: -0.1}, {1: float("nan")}, {}, "x"])
def test_draft_cost_rejects_bad_points(points):
    with pytest.raises(HardwareProfileError):
        DraftCost(points)


def test_draft_cost_file_round_trips_and_a_bad_one_names_itself(tmp_path):
    cost = DraftCost({1: 0.1, 8: 0.3}, device="cpu", target="tiny")
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(cost.to_dict()))
    assert DraftCost.load(path).points() == cost.points()
    path.write_text('{"format": "specforge.hardware_profile", "points": [[1, 2.0]]}')
    with pytest.raises(HardwareProfileError, match="cost.json"):
        DraftCost.load(path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4), st.floats(0.01, 3.0), st.integers(1, 3))
def test_draft_cost_only_makes_admission_more_generous(values, rho, rows):
    c = torch.tensor(values * rows, dtype=torch.float64).view(rows, 4)
    path = admission_path(c, torch.full((rows,), 4))
    profile = HardwareProfile(STEEP)
    free, paid = causal_count(path.throughput(profile)), causal_count(path.throughput(profile, rho))
    assert paid >= free
    # ρ = 0 is the paper's Θ_n = τ_n · SPS(B_n), bit for bit
    assert torch.equal(path.throughput(profile, 0.0), path.throughput(profile))


def _hw(cls=HwPrefixScheduler, config=HardwareConfig, **kw):
    return cls(config(sps=STEEP, **kw))


def test_without_a_drafting_cost_the_gate_is_always_open():
    s = _hw()
    s.schedule(torch.full((2, 4), 0.01), torch.full((2,), 4))
    assert all(s.draft_gate(2) for _ in range(50))


@pytest.mark.parametrize("cls,config", [(HwPrefixScheduler, HardwareConfig), (AsyncTopKScheduler, AsyncTopKConfig)])
def test_the_gate_closes_where_drafting_does_not_pay_and_looks_again(cls, config):
    s = _hw(cls, config, draft_cost=0.5, probe_every=3)
    assert s.draft_gate(2)  # nothing known yet: draft
    s.schedule(torch.full((2, 4), 0.01), torch.full((2,), 4))  # hopeless drafts: the round loses to plain
    decisions = [s.draft_gate(2) for _ in range(3 + 1 + 6 + 1 + 12 + 1 + 24 + 1 + 48 + 1 + 48 + 1)]
    # a look after 3 plain rounds, then after twice as many each time, up to 16 × probe_every
    assert [i for i, d in enumerate(decisions) if d] == [3, 10, 23, 48, 97, 146]
    assert not s.draft_gate(3)  # 2 and 3 requests are one load band
    assert s.draft_gate(5)  # a band above has its own history
    assert not s.draft_gate(1)  # a band below not reached yet goes by the band above it
    s.schedule(torch.full((2, 4), 0.99), torch.full((2,), 4))  # a look that paid: look again soon
    # (after 3 plain rounds of the band; the 3-request round above was the first of them)
    assert [s.draft_gate(2) for _ in range(3)] == [False, False, True]


def test_the_gate_stays_open_where_drafting_pays():
    s = _hw(draft_cost=0.1)
    s.schedule(torch.full((2, 4), 0.95), torch.full((2,), 4))
    assert all(s.draft_gate(2) for _ in range(20))
    s.forget()
    assert s.draft_gate(2)


def _outcome(accepted, verified):
    n = len(accepted)
    return RoundOutcome(request_ids=list(range(n)), confidence=torch.full((n, 4), 0.95),
                        available=torch.full((n,), 4), verified=torch.tensor(verified),
                        accepted=torch.tensor(accepted), temperature=torch.zeros(n))


@pytest.mark.parametrize("cls,config", [(HwPrefixScheduler, HardwareConfig), (AsyncTopKScheduler, AsyncTopKConfig)])
def test_the_gate_scales_what_rounds_promise_by_how_the_promises_held(cls, config):
    promising, available = torch.full((2, 4), 0.95), torch.full((2,), 4)  # a gain of 1.23 on this curve

    def rounds(scheduler, accept, n=32):
        for _ in range(n):
            assert scheduler.draft_gate(2)
            lengths = scheduler.schedule(promising, available)
            assert lengths.sum() > 0
            scheduler.observe(_outcome(accept(lengths.tolist()), lengths.tolist()))

    kept = _hw(cls, config, draft_cost=0.1)
    rounds(kept, lambda lengths: lengths)  # every verified draft accepted: more than promised
    assert kept.promises_held() > 1 and all(kept.draft_gate(2) for _ in range(20))
    unheard = _hw(cls, config, draft_cost=0.1)  # never told an outcome: goes by the promises
    for _ in range(32):
        unheard.schedule(promising, available)
    assert unheard.promises_held() == 1 and all(unheard.draft_gate(2) for _ in range(20))
    broken = _hw(cls, config, draft_cost=0.1, probe_every=3)
    rounds(broken, lambda lengths: [0, 0], n=31)  # none accepted, but not yet 64 request-rounds reported
    assert broken.promises_held() == 1
    rounds(broken, lambda lengths: [0, 0], n=1)
    assert broken.promises_held() < 0.5
    assert [broken.draft_gate(2) for _ in range(4)] == [False, False, False, True]  # closed; a look
    lengths = broken.schedule(promising, available)
    broken.observe(_outcome([0, 0], lengths.tolist()))  # the look promised a gain that did not hold
    assert [broken.draft_gate(2) for _ in range(7)] == [False] * 6 + [True]  # so the wait doubled


def test_how_promises_held_is_pooled_over_the_last_1024_request_rounds():
    s = _hw(draft_cost=0.1)
    promising, available = torch.full((16, 4), 0.95), torch.full((16,), 4)
    for accept in (0, 1):  # 64 rounds of 16 requests accepting nothing, then 64 accepting all
        for _ in range(64):
            lengths = s.schedule(promising, available)
            s.observe(_outcome((lengths * accept).tolist(), lengths.tolist()))
    assert s.promises_held() > 1  # the first 64 rounds have left the pool
    s.forget()
    assert s.promises_held() == 1


def test_the_engine_reports_each_verified_round_to_a_scheduler_that_observes():
    seen = []
    host = PluginHost().load()
    target = TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None), None, torch.float32, name="tiny")

    class Observing:
        def schedule(self, confidence, available):
            return available

        def observe(self, outcome):
            seen.append(outcome)

    e = Engine(target, host.create_verifier("rejection"), drafter=host.create_drafter("ngram", {"gamma": 3}),
               confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
               scheduler=Observing(), sampling=SamplingConfig(temperature=0.0, max_new_tokens=8),
               engine=EngineConfig(max_batch=2, max_context=64))
    out = e.generate([GenerationRequest(prompt_ids=[5, 6, 5, 6, 5, 6], max_new_tokens=8)])[0]
    assert seen and sum(int(o.accepted.sum()) for o in seen) == out.stats.accepted
    assert all(o.verified.tolist() == o.available.tolist() for o in seen)  # the lengths it scheduled


def test_draft_cost_defaults_to_auto_only_with_a_measured_step_curve():
    assert HwPrefixScheduler(HardwareConfig(profile="auto"))._auto_cost
    assert not _hw()._auto_cost and _hw().draft_cost is None
    asked = []
    s = _hw()
    s.bind_draft_cost(lambda: asked.append(1) or DraftCost(0.3))  # inline curve, no draft_cost: not measured
    assert not asked and s.draft_cost is None
    s = _hw(draft_cost="auto")
    s.bind_draft_cost(lambda: DraftCost(0.3))
    assert s.draft_cost.ratio(4) == pytest.approx(0.3)


def test_auto_measures_the_engines_own_drafting_once_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path))
    host = PluginHost().load()
    target = TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None), None, torch.float32, name="tiny")

    def engine():
        return Engine(target, host.create_verifier("rejection"),
                      drafter=host.create_drafter("dspark", {"gamma": 3, "layers": 1}),
                      correction_head=host.create_correction_head("markov", {"rank": 8}),
                      confidence=host.create_confidence("dspark-head", {"rank": 8}),
                      calibrator=host.create_calibrator("online-sts", {}),
                      scheduler=host.create_scheduler("hw-prefix", {"sps": STEEP, "draft_cost": "auto"}),
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=6),
                      engine=EngineConfig(max_batch=2, max_context=64))

    first = engine()
    files = list((tmp_path / "profiles").glob("tiny-draft-*.json"))
    assert len(files) == 1
    cost = first.scheduler.draft_cost
    assert [r for r, _ in cost.points()] == list(DRAFT_COST_REQUESTS)
    assert all(v > 0 for _, v in cost.points())
    # The engine is as it was: its own cache and limits, no rounds counted, nothing observed.
    assert len(first.cache.lengths) == 2 and first.context_limit == 64
    assert not any(first.phase_seconds.values()) and first.plain_rounds == 0
    assert first.calibrator.state()["rounds_seen"] == 0
    outs = first.generate([GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=6)])
    assert outs[0].error is None and len(outs[0].token_ids) == 6
    # A second engine of the same pipeline reads the file instead of measuring.
    monkeypatch.setattr("specforge.engine.draft_cost.measure_draft_cost", lambda engine: pytest.fail("measured twice"))
    assert engine().scheduler.draft_cost.points() == cost.points()

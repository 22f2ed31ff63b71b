"""Which combinations the suite forms, from declared metadata only."""

from __future__ import annotations

import itertools

import torch
from pydantic import BaseModel, ConfigDict

from specforge import hookimpl
from specforge.plugins import PluginHost
from specforge_conformance.combos import Combination, certification_blocker, combinations, covering_set
from specforge_conformance.suite import TIERS, plan, suite_host


def host():
    return suite_host(PluginHost(autoload=False))


def test_declared_incompatibilities_are_respected():
    combos = combinations(host())
    # entropy needs the draft law or logits; ngram provides neither.
    assert not [c for c in combos if c.drafter == "ngram" and c.confidence == "entropy"]
    assert [c for c in combos if c.drafter == "random" and c.confidence == "entropy"]
    assert {c.verifier for c in combos if c.plain} == {"rejection", "match", "greedy", "typical"}


def test_lossy_verifiers_are_reported_never_certified():
    h = host()
    chosen, untested = plan(h, TIERS["fast"])
    assert all(c.verifier != "typical" for c in chosen)
    (lossy,) = [r for r in untested if r.status == "lossy"]
    assert lossy.combination.verifier == "typical" and "declares itself lossy" in lossy.reason
    assert certification_blocker(h, Combination(None, None, None, None, None, "typical"))


def test_covering_set_meets_every_pair():
    combos = combinations(host())
    testable = [c for c in combos if c.verifier != "typical"]
    chosen = covering_set(testable)
    assert len(chosen) < len(testable) / 2
    needed = {p for c in testable for p in itertools.combinations(c.items(), 2)}
    have = {p for c in chosen for p in itertools.combinations(c.items(), 2)}
    assert needed <= have


class _EchoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    length: int = 2


class _EchoScheduler:
    def __init__(self, config):
        self.length = config.length

    def schedule(self, confidence, available):
        return torch.clamp(available, max=self.length)


class _ThirdParty:
    @hookimpl
    def specforge_register_schedulers(self, register):
        register("echo", _EchoScheduler, config=_EchoConfig, examples=({"length": 1},))


def test_a_component_the_suite_never_saw_enters_through_the_registry():
    h = host()
    assert h.add_plugin(_ThirdParty(), "third-party")
    chosen, _ = plan(h, TIERS["fast"], plugins=["echo"])
    assert chosen and all(c.scheduler == "echo" for c in chosen)
    assert {c.drafter for c in chosen} >= {"ngram", "random", "shadow"}


def test_case_draws_are_reproducible_varied_and_respect_greedy_only():
    from specforge_conformance.strategies import case_strategy, draw_cases

    h = host()
    combo = Combination("random", "none", "entropy", "sts", "hw-prefix", "rejection")
    a = draw_cases(case_strategy(h, combo, 1000), 3, "k1")
    assert a == draw_cases(case_strategy(h, combo, 1000), 3, "k1")
    b = draw_cases(case_strategy(h, combo, 1000), 3, "k2")
    assert a != b and len(a) == 3
    assert all(c.law().well_conditioned and c.pipeline["scheduler"][0] == "hw-prefix" for c in a + b)
    # declared examples are what the components get (the drafter's γ may be redrawn)
    assert all(c.pipeline["scheduler"][1] in [dict(e) for e in h.get("scheduler", "hw-prefix").metadata.examples]
               for c in a + b)
    greedy = Combination("ngram", "none", "constant", "identity", "fixed", "greedy")
    assert all(c.temperature == 0 for c in draw_cases(case_strategy(h, greedy, 1000), 3, "k"))

"""Compositions no source project ships, because the parts are separate plug-ins: Medusa and DFlash
with the Markov correction head; Eagle3 and DFlash with the DSpark confidence head and the
hardware-aware scheduler.  Each is certified by the conformance harness like a drawn case — the
law of the output, its independence across requests and every round-level statistic — on a
probe target at T = 1 (the parameter set of hw-prefix is the one that verifies closest to half of
the drafts, as in the scheduler probes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specforge.registry import ComponentKind
from specforge_conformance import probes
from specforge_conformance.harness import Case, check_case
from specforge_conformance.suite import suite_host

N = 10_000
ALPHA = 1e-6 / 7  # one case, its statistics Bonferroni-corrected

COMPOSITIONS = {
    "medusa + markov": {"drafter": ("medusa", {"gamma": 3, "seed": 1}), "correction_head": "markov"},
    "dflash + markov": {"drafter": ("dflash", {"gamma": 3, "layers": 1}), "correction_head": "markov"},
    "eagle3 + dspark-head + hw-prefix": {"drafter": ("eagle3", {"gamma": 3, "seed": 1}),
                                         "confidence": "dspark-head", "scheduler": "hw-prefix"},
    "dflash + dspark-head + hw-prefix": {"drafter": ("dflash", {"gamma": 3, "layers": 1}),
                                         "confidence": "dspark-head", "scheduler": "hw-prefix"},
}


@pytest.fixture(scope="module")
def host():
    return suite_host()


def _cases(host, parts: dict) -> list[Case]:
    pipeline = {"drafter": parts["drafter"], "correction_head": ("none", {}), "confidence": ("constant", {}),
                "calibrator": ("identity", {}), "scheduler": ("fixed", {}), "verifier": ("rejection", {})}
    examples = {}
    for slot in ("correction_head", "confidence", "scheduler"):
        if slot in parts:
            name = parts[slot]
            examples[slot] = [(name, dict(e)) for e in host.get(ComponentKind(slot), name).metadata.examples or ({},)]
    variants = examples.pop("scheduler", [pipeline["scheduler"]])
    for slot, options in examples.items():
        pipeline[slot] = options[0]
    return [probes._finish(Case(pipeline={**pipeline, "scheduler": s}, batch=32), N, 0, "composition")
            for s in variants]


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_the_composition_is_certified(host, name):
    cases = _cases(host, COMPOSITIONS[name])
    case = probes._most_selective(cases, host)
    result = check_case(replace(case, n=N), host, ALPHA)
    assert not result.failed, (name, {k: t.p_value for k, t in result.tests.items()})
    assert result.drafted > 0 and result.verified > 0, name  # it reached the mechanism

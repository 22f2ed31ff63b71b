"""Optional component methods are protocols, checked once when the engine binds the pipeline."""

from __future__ import annotations

import pytest
import torch

from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import get_host
from specforge.protocols import (
    OPTIONAL,
    ComponentContractError,
    DraftGate,
    ObservesRounds,
    check_optional,
)
from specforge.runtime import TargetModel
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=3, vocab=32, eos=None), None, torch.float32)


def engine(target, scheduler=None, calibrator=None):
    host = get_host()
    return Engine(target, host.create_verifier("greedy"), drafter=host.create_drafter("ngram", {}),
                  correction_head=host.create_correction_head("none", {}),
                  confidence=host.create_confidence("constant", {}),
                  calibrator=calibrator or host.create_calibrator("identity", {}),
                  scheduler=scheduler or host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=0.0, max_new_tokens=8),
                  engine=EngineConfig(max_batch=2, max_context=64))


class GateWithoutArgument:
    def schedule(self, confidence, available):
        return available

    def draft_gate(self):  # the engine passes the number of requests
        return True


class ObserveNotAMethod:
    observe = 3

    def apply(self, confidence):
        return confidence


def test_a_half_implemented_optional_method_is_one_clear_error_at_bind(target):
    with pytest.raises(ComponentContractError, match=r"scheduler .*GateWithoutArgument: `draft_gate` cannot be "
                                                     r"called as draft_gate\(num_requests\).*DraftGate"):
        engine(target, scheduler=GateWithoutArgument())
    with pytest.raises(ComponentContractError, match=r"calibrator .*ObserveNotAMethod: `observe` is not a method; "
                                                     r"ObservesRounds needs observe\(outcome\)"):
        engine(target, calibrator=ObserveNotAMethod())


def test_the_engine_calls_an_optional_method_it_finds_through_its_protocol(target):
    class Gate:
        def __init__(self):
            self.asked = []

        def schedule(self, confidence, available):
            return available

        def draft_gate(self, num_requests: int) -> bool:
            self.asked.append(num_requests)
            return False  # every round plain

    gate = Gate()
    assert isinstance(gate, DraftGate) and not isinstance(gate, ObservesRounds)
    e = engine(target, scheduler=gate)
    out = e.generate([GenerationRequest(prompt_ids=[5, 6, 5, 6, 5], max_new_tokens=6)])[0]
    assert len(out.token_ids) == 6 and gate.asked and set(gate.asked) == {1}
    assert e.plain_rounds == len(gate.asked) and out.stats.drafted == 0


def test_every_shipped_component_passes_its_own_checks():
    host = get_host()
    checked = 0
    for slot in OPTIONAL:
        for name in host.names(slot):
            registration = host.get(slot, name)
            try:
                part = registration.create(registration.config())
            except Exception:  # a component whose config has required fields (a checkpoint): skip
                continue
            check_optional(slot, part)
            checked += 1
    assert checked >= 15

"""The black-box tier's mixed arm: requests of one prompt at several temperatures at once, each
tested against its own temperature's law (docs/engines.md), on the simulated engine whose law is
known exactly — certified when exact, its control rejected, and an engine that serves a batch at
one request's temperature caught."""

from __future__ import annotations

from collections.abc import Sequence

from specforge_conformance.blackbox import MIX, Arm, check_arm, default_arms, run_arms, run_level
from specforge_conformance.engines import SimulatedEngine

PROMPTS = [[3], [7], [11]]
LEVEL = run_level(clean_arms=5, statistics=4)
N = 18_000


def _mixed(n: int, **kw) -> Arm:
    return Arm(kw.pop("name", "mixed"), MIX[0], MIX[0], n, mix=MIX, **kw)


class _OneTemperature(SimulatedEngine):
    """Serves every request of a batch at the first request's temperature (what an engine written
    for homogeneous batches does with per-request settings)."""

    def sample(self, prompt, n_tokens, temperature, seeds, progress=None):
        first = temperature if isinstance(temperature, (int, float)) else temperature[0]
        return super().sample(prompt, n_tokens, first, seeds, progress)


def test_a_mixed_arm_serves_each_request_at_its_own_temperature_and_tests_it_against_its_own_law():
    arm = _mixed(N)
    assert arm.claims(4) == [0.7, 1.0, 1.3, 0.7] and arm.serves(4) == arm.claims(4)
    engine = SimulatedEngine()
    result = check_arm(engine, engine.reference, PROMPTS, arm, LEVEL)
    assert result.status == "certified", {k: f.p_value for k, f in result.tests.items()}
    assert result.drafted > 0
    # one group per prompt and temperature: the first-token statistic sums 9 chi-squares
    plain = check_arm(engine, engine.reference, PROMPTS, Arm("T=1", 1.0, 1.0, N), LEVEL)
    assert result.tests["first token"].df > 2 * plain.tests["first token"].df


def test_the_mixed_control_is_rejected_and_its_power_stated():
    engine = SimulatedEngine()
    control = _mixed(6_000, name="control", control=True, shift=1)
    assert control.serves(3) == [1.0, 1.3, 0.7] and control.claims(3) == [0.7, 1.0, 1.3]
    (result,) = run_arms(engine, engine.reference, PROMPTS, [control], LEVEL)
    assert result.status == "rejected" and result.min_p < LEVEL
    assert result.predicted_power >= 0.99


def test_an_engine_that_serves_a_batch_at_one_request_s_temperature_fails_the_mixed_arm_only():
    engine = _OneTemperature("one-temperature")
    assert check_arm(engine, engine.reference, PROMPTS, Arm("T=1", 1.0, 1.0, N), LEVEL).status == "certified"
    mixed = check_arm(engine, engine.reference, PROMPTS, _mixed(N), LEVEL)
    assert mixed.status == "FAILED" and mixed.tests["first token"].p_value < LEVEL


def test_the_default_arms_include_the_mixed_arm_and_its_control_where_there_is_a_reference():
    arms = default_arms(4_000)
    names = [a.name for a in arms]
    assert names[3:] == ["mixed T=0.7/1/1.3", "control: mixed, served at a neighbour's T"]
    assert arms[3].mix == MIX and not arms[3].control and arms[4].control and arms[4].shift == 1
    spec, plain = SimulatedEngine(), SimulatedEngine("simulated-plain", gamma=0)
    # without a reference the mixed control cannot be told apart (the engine's own law, and
    # speculation off, are at the temperatures it served): it is not run
    results = run_arms(spec, None, PROMPTS, arms, LEVEL, baseline=plain)
    assert [r.arm.name for r in results] == names[:4]
    assert all(r.status == "certified" for r in results if not r.arm.control)


def _temperatures(t: float | Sequence[float], m: int) -> list[float]:
    return [t] * m if isinstance(t, (int, float)) else list(t)


def test_the_simulated_engine_draws_each_request_at_its_own_temperature():
    engine = SimulatedEngine("plain", gamma=0)
    seeds = list(range(30_000))
    temps = _temperatures([0.5, 2.0] * 15_000, 30_000)
    got = engine.sample([3], 1, temps, seeds)
    cold = [t[0] for t, x in zip(got.tokens, temps) if x == 0.5]
    hot = [t[0] for t, x in zip(got.tokens, temps) if x == 2.0]
    # the colder requests concentrate on the most likely token
    top = int(engine.reference.law(3, 1.0).argmax())
    assert cold.count(top) / len(cold) > hot.count(top) / len(hot) + 0.1

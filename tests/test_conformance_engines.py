"""The black-box tier (``specforge conformance --engine NAME``, docs/engines.md).

Fast: the statistics on a simulated engine whose law is known exactly — exact speculative
sampling certified, 3 % over-acceptance rejected at the N stated below, the control rejected —
the two-sample fallback, and an engine that returns fewer tokens than asked, or no law where one
was promised, or nothing to test against, reported by its name and never counted as a pass.
With llama.cpp's tools built (``make llama.cpp``): a real ``llama-server`` started by the tier is
gone once the block ends with an error.  Slow: real engine cases end to end at a small N.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from specforge_conformance.blackbox import (Arm, CaseReport, EngineFault, EngineReport, Sampled, check_arm,
                                            conditional_fit, default_arms, run_arms, run_level, sized_control,
                                            two_sample_fit)
from specforge_conformance.engines import ENGINES, LlamaServerEngine, SimulatedEngine, run_engines

PROMPTS = [[3], [7], [11]]
LEVEL = run_level(clean_arms=4, statistics=4)  # the level of a run of four clean arms: 6.25e-8
OVER_N = 180_000  # the stated N at which 3 % over-acceptance is rejected (first-token TV ≈ 0.016)


def _arm(n: int, **kw) -> Arm:
    return Arm(kw.pop("name", "T=1"), kw.pop("temperature", 1.0), kw.pop("claimed", 1.0), n, **kw)


def test_a_control_too_small_to_be_rejected_is_sized_up_before_drawing():
    """The control's N grows until its predicted power reaches 0.99 (at most 8×); one large
    enough already is left as it is; the sized control is then rejected."""
    engine = SimulatedEngine()
    small = _arm(2_000, name="control", temperature=0.9, control=True)  # predicted power 0.004 here
    sized = sized_control(small, PROMPTS, engine.reference, LEVEL)
    assert small.n < sized.n <= 8 * small.n
    result = check_arm(engine, engine.reference, PROMPTS, sized, LEVEL)
    assert result.predicted_power >= 0.99
    assert result.status == "rejected"
    tiny = _arm(250, name="control", temperature=0.9, control=True)  # even 8× cannot reach it: the cap
    assert sized_control(tiny, PROMPTS, engine.reference, LEVEL).n == 8 * tiny.n
    large = _arm(15_000, name="control", temperature=0.9, control=True)
    assert sized_control(large, PROMPTS, engine.reference, LEVEL) == large


def test_exact_speculative_sampling_is_certified_and_over_acceptance_rejected_at_the_stated_n():
    clean = check_arm(SimulatedEngine(), SimulatedEngine().reference, PROMPTS, _arm(OVER_N), LEVEL)
    assert clean.status == "certified", clean.tests
    assert clean.drafted > 0 and 0 < clean.accepted < clean.drafted
    assert min(f.p_value for f in clean.tests.values()) > LEVEL
    # what the statistics could have detected at this N, in TV (first token and each later position)
    assert clean.detectable["first token"] < 0.015
    assert all(clean.detectable[f"position {k}"] < 0.04 for k in (2, 3, 4))
    assert all(clean.covered[f"position {k}"] > 0.9 for k in (2, 3, 4))

    over = SimulatedEngine("simulated-over-accept", over=0.03)
    bad = check_arm(over, over.reference, PROMPTS, _arm(OVER_N), LEVEL)
    assert bad.status == "FAILED"
    assert bad.tests["first token"].p_value < LEVEL
    assert bad.tests["first token"].tv > 0.01  # the deviation the over-acceptance makes


def test_the_control_is_rejected_and_its_power_stated():
    engine = SimulatedEngine()
    control = check_arm(engine, engine.reference, PROMPTS,
                        _arm(15_000, name="control", temperature=0.9, control=True), LEVEL)
    assert control.status == "rejected"
    assert control.min_p < LEVEL
    assert 0.9 < control.predicted_power <= 1.0
    # the same draws claimed at the temperature they were served at pass
    honest = check_arm(engine, engine.reference, PROMPTS, _arm(15_000, temperature=0.9, claimed=0.9), LEVEL)
    assert honest.status == "certified"


def test_conditional_fit_sums_its_groups():
    gen = torch.Generator().manual_seed(0)
    laws = [torch.softmax(torch.randn(12, generator=gen, dtype=torch.float64), -1) for _ in range(3)]
    groups = [(torch.bincount(torch.multinomial(law, 4000, True, generator=gen), minlength=12), law) for law in laws]
    fit = conditional_fit(groups)
    assert fit.n == 12_000 and fit.df == sum(int((law * 4000 >= 5).sum()) - 1 for law in laws)
    assert fit.p_value > 1e-4
    shifted = [(c, torch.softmax(law.log() * 1.2, -1)) for c, law in groups]  # claimed sharper than drawn
    assert conditional_fit(shifted).p_value < 1e-8
    # a token the claimed law cannot produce is a failure by itself
    impossible = laws[0].clone()
    impossible[0] = 0
    assert conditional_fit([(groups[0][0], impossible / impossible.sum())]).impossible > 0


def test_two_sample_fit_has_half_the_information_and_sees_a_difference():
    gen = torch.Generator().manual_seed(1)
    law = torch.softmax(torch.randn(20, generator=gen, dtype=torch.float64), -1)

    def sample(p, n):
        return Counter((int(x),) for x in torch.multinomial(p, n, True, generator=gen))

    same = two_sample_fit(sample(law, 20_000), sample(law, 20_000))
    assert same.p_value > 1e-4 and same.info == pytest.approx(2 * 20_000)
    other = two_sample_fit(sample(law, 20_000), sample(torch.softmax(law.log() * 1.3, -1), 20_000))
    assert other.p_value < 1e-8


def test_without_logits_the_engine_is_compared_with_itself_with_speculation_off():
    spec, plain = SimulatedEngine(), SimulatedEngine("simulated-plain", gamma=0)
    result = check_arm(spec, None, PROMPTS, _arm(30_000), LEVEL, baseline=plain)
    assert result.status == "certified" and set(result.tests) == {"two-sample first token", "two-sample sequence"}
    assert result.tests["two-sample sequence"].info == pytest.approx(2 * 30_000)
    # half the information of a one-sample test at the same N per arm: a larger detectable TV
    one = check_arm(spec, spec.reference, PROMPTS, _arm(30_000), LEVEL)
    assert result.detectable["two-sample first token"] > one.detectable["first token"] * 1.3
    over = check_arm(SimulatedEngine("over", over=0.03), None, PROMPTS, _arm(OVER_N), LEVEL, baseline=plain)
    assert over.status == "FAILED"


def test_a_control_without_a_reference_is_drawn_as_often_as_the_largest_clean_arm():
    # no reference: its power cannot be predicted before drawing (vLLM's control at N/4 survived)
    spec, plain = SimulatedEngine(), SimulatedEngine("simulated-plain", gamma=0)
    results = run_arms(spec, None, PROMPTS, default_arms(4_000), LEVEL, baseline=plain)
    # (the mixed arm at n/2; its control needs a reference: not run here)
    assert [r.arm.n for r in results] == [4_000, 2_000, 4_000, 2_000]


def test_an_engine_whose_law_is_nan_is_compared_with_itself_with_speculation_off():
    # vLLM 0.32 CPU returns NaN processed log-probabilities at the tokens of a verify pass: the
    # arm falls back to the two-sample test, and the report says why
    plain = SimulatedEngine("simulated-plain", gamma=0)
    result = check_arm(_NonFinite(), None, PROMPTS, _arm(3_000), LEVEL, baseline=plain)
    assert result.status == "certified" and set(result.tests) == {"two-sample first token", "two-sample sequence"}
    assert "the law of 9000 of its 12000 tokens" in result.fault
    assert "(by position: {2: 3000, 3: 3000, 4: 3000})" in result.fault and "speculation off instead" in result.fault


class _Short:
    """An engine that drops the last token of every other request."""

    name, returns_laws = "short-engine", False

    def sample(self, prompt, n_tokens, temperature, seeds, progress=None):
        got = SimulatedEngine().sample(prompt, n_tokens, temperature, seeds)
        return Sampled([t[:-1] if i % 2 else t for i, t in enumerate(got.tokens)], got.drafted, got.accepted)


class _Lawless:
    """An engine that promises the law of its tokens and returns none."""

    name, returns_laws = "lawless-engine", True

    def sample(self, prompt, n_tokens, temperature, seeds, progress=None, claimed=None):
        return SimulatedEngine().sample(prompt, n_tokens, temperature, seeds)


class _NonFinite:
    """An engine whose stated law is NaN after the first token (vLLM 0.32 CPU's processed
    log-probabilities under speculation)."""

    name, returns_laws = "nan-law-engine", True

    def sample(self, prompt, n_tokens, temperature, seeds, progress=None, claimed=None):
        got = SimulatedEngine().sample(prompt, n_tokens, temperature, seeds)
        law = [([0, 1], [0.5, 0.5])] + [([0, 1], [math.nan, math.nan])] * (n_tokens - 1)
        return Sampled(got.tokens, got.drafted, got.accepted, [law for _ in got.tokens])


@pytest.mark.parametrize("engine, reference, words", [
    (_Short(), SimulatedEngine().reference, "with 3 tokens where 4 were asked"),
    (_Lawless(), None, "no law"),
    (_NonFinite(), None, "non-finite probabilities (NaN or inf) as the law of 900 of its 1200 tokens"),
    (SimulatedEngine("no-logits"), None, "returns no logits"),
])
def test_an_engine_that_does_not_deliver_is_named_and_never_a_pass(engine, reference, words):
    result = check_arm(engine, reference, PROMPTS, _arm(300), LEVEL)
    assert result.status == "engine fault" and engine.name in result.fault and words in result.fault
    assert not result.tests
    case = CaseReport(engine.name, "-", "-", arms=[result])
    report = EngineReport([case], 1e-6, LEVEL)
    assert not case.ok and not report.passed
    assert engine.name in report.table() and words in report.table()


def test_a_sampler_that_is_not_pure_temperature_is_refused():
    engine = LlamaServerEngine.__new__(LlamaServerEngine)
    engine.name = "llama.cpp-x"
    with pytest.raises(EngineFault, match="top_k"):
        engine._check_settings({"generation_settings": {"top_k": 40, "top_p": 1.0, "samplers": ["temperature"]}})
    with pytest.raises(EngineFault, match="samplers"):
        engine._check_settings({"generation_settings": {"top_k": 0, "samplers": ["top_k", "temperature"]}})
    engine._check_settings({"generation_settings": {"top_k": 0, "top_p": 1, "min_p": 0.0, "samplers": ["temperature"]}})


def test_the_command_lists_engines_and_refuses_an_unknown_one():
    listed = subprocess.run([sys.executable, "-m", "specforge", "conformance", "--engine", "list"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0
    for name in ENGINES:
        assert name in listed.stdout
    bad = subprocess.run([sys.executable, "-m", "specforge", "conformance", "--engine", "llama.cpp-nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "llama.cpp-ngram" in bad.stderr and "llama.cpp-nope" in bad.stderr
    with pytest.raises(ValueError, match="choose from"):
        run_engines(["nope"])


def test_the_simulated_case_runs_from_the_command_line(tmp_path):
    out = tmp_path / "engines.json"
    run = subprocess.run([sys.executable, "-m", "specforge", "conformance", "--engine", "simulated", "--n", "30000",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "certified" in run.stdout and "rejected" in run.stdout and "PASSED" in run.stdout
    import json

    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["level"] > 0
    arms = {a["arm"]["name"]: a for a in doc["cases"][0]["arms"]}
    assert arms["control: T=0.9 claimed as 1"]["status"] == "rejected"
    assert arms["T=1"]["tests"]["first token"]["detectable"] < 0.05


def _llama_server_missing() -> str | None:
    from specforge.peers.llamacpp_tools import missing_reason

    return missing_reason("llama-server")


def test_a_real_llama_server_is_gone_when_the_block_ends_with_an_error():
    reason = _llama_server_missing()
    if reason:
        pytest.skip(reason)
    from specforge.model_files import resolve_model

    directory, name = resolve_model("smollm2")
    engine = LlamaServerEngine("llama.cpp-ngram", directory / name, ENGINES["llama.cpp-ngram"].flags, threads=1)
    with pytest.raises(RuntimeError, match="boom"):
        with engine:
            pid = engine.server.process.pid
            assert engine.tokenize("red green blue")  # it answers
            raise RuntimeError("boom")
    assert engine.server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_killed_command_stops_the_llama_server_it_started(tmp_path):
    """SIGTERM (kill, a scheduler, a timeout) ends `specforge conformance --engine …` as Ctrl-C
    does: the llama-server it started goes with it."""
    import signal
    import time

    reason = _llama_server_missing()
    if reason:
        pytest.skip(reason)
    log = tmp_path / "engines.json"
    run = subprocess.Popen([sys.executable, "-m", "specforge", "conformance", "--engine", "llama.cpp-ngram",
                            "--n", "100000", "--out", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    deadline, server = time.monotonic() + 180, None
    while server is None and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(run.pid), "llama-server"], capture_output=True, text=True)
        server = int(children.stdout.split()[0]) if children.stdout.strip() else None
    assert server is not None, "the command never started llama-server"
    time.sleep(2)  # drawing
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) != 0
    assert "interrupted" in run.stderr.read()
    with pytest.raises(ProcessLookupError):
        for _ in range(40):  # its exit is waited for by the block that started it
            os.kill(server, 0)
            time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama.cpp-ngram", "llama.cpp-draft"])
def test_a_llama_cpp_case_end_to_end(name):
    report = run_engines([name], n=1_500)
    (case,) = report.cases
    if case.skipped:
        pytest.skip(case.skipped)
    statuses = {a.arm.name: a.status for a in case.arms}
    assert all(s in ("certified", "not exercised", "rejected", "SURVIVED") for s in statuses.values()), report.table()
    assert case.arms[0].drafted > 0  # speculation was exercised
    assert any("max |Δp|" in n for n in case.notes)  # the reference was compared with the server's own law


@pytest.mark.slow
def test_the_vllm_case_end_to_end():
    report = run_engines(["vllm-ngram"], n=600)
    (case,) = report.cases
    if case.skipped:
        pytest.skip(case.skipped)
    assert all(a.status != "engine fault" for a in case.arms), report.table()
    assert "engine law" in case.arms[0].tests

"""``specforge calibrate`` on a tiny target: every verified round reaches the recorder, STS is
fitted on half of the prompts and scored on the other half, its file serves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specforge.calibration import RoundRecorder
from specforge.components import RoundOutcome
from tiny_models import tiny_training_files


def test_the_recorder_pads_blocks_and_keeps_only_what_was_verified():
    rec = RoundRecorder()
    rec(RoundOutcome([0, 1], torch.tensor([[0.9, 0.8], [0.7, 0.6]]), torch.tensor([2, 2]), torch.tensor([2, 1]),
                     torch.tensor([1, 1]), torch.ones(2)))
    rec(RoundOutcome([1], torch.tensor([[0.5, 0.4, 0.3]]), torch.tensor([3]), torch.tensor([3]), torch.tensor([0]),
                     torch.ones(1)))
    data = rec.data(lambda rid: rid == 1)
    assert data.confidence.shape == (2, 3) and data.verified.tolist() == [1, 3] and data.accepted.tolist() == [1, 0]
    assert data.confidence[0].tolist() == pytest.approx([0.7, 0.6, 0.5])  # padding: never verified


def test_calibrate_fits_on_half_the_prompts_and_scores_the_other_half(tmp_path):
    model, _, prompts = tiny_training_files(tmp_path, prompts=8)
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(f"target: {{model: '{model}', dtype: float32}}\n"
                   "drafter: {name: dspark, gamma: 3, layers: 1, seed: 1}\ncorrection_head: {name: markov, rank: 8}\n"
                   "confidence: {name: entropy}\nscheduler: {name: threshold, theta: 0.9}\n")
    out = tmp_path / "cal"
    r = subprocess.run([sys.executable, "-m", "specforge", "calibrate", "--config", str(cfg), "--dataset", str(prompts),
                        "--prompts", "4", "--max-new-tokens", "12", "--temperature", "0", "1", "--out", str(out),
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["prompts"] == 4 and set(result["temperatures"]) == {"0", "1"}
    for t, res in result["temperatures"].items():
        assert res["rounds_fit"] > 0 and res["rounds_held_out"] > 0
        before, after = res["held_out"]["before"], res["held_out"]["after"]
        # every drafted token was verified (the threshold scheduler was replaced by fixed)
        assert before["positions"][0]["n"] == res["rounds_held_out"]
        for pb, pa in zip(before["positions"], after["positions"]):  # a temperature keeps the order
            if pb["auroc_conditional"] == pb["auroc_conditional"]:
                assert pa["auroc_conditional"] == pytest.approx(pb["auroc_conditional"])
        assert (out / f"calibrator-T{t}.safetensors").is_file() and (out / f"reliability-T{t}.png").stat().st_size
        assert len(res["fit"]["temperatures"]) == 3
    saved = json.loads((out / "calibration.json").read_text())
    assert saved["temperatures"].keys() == result["temperatures"].keys()
    # the recorded rounds replay: the same fit and scores without decoding, plus the online replay
    again = subprocess.run([sys.executable, "-m", "specforge", "calibrate", "--replay",
                            str(out / "rounds-T1.safetensors"), "--online", "--out", str(tmp_path / "re"), "--json"],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    replayed = json.loads(again.stdout)["temperatures"]["1"]
    assert replayed["rounds_fit"] == result["temperatures"]["1"]["rounds_fit"]
    assert replayed["fit"]["temperatures"] == result["temperatures"]["1"]["fit"]["temperatures"]
    assert replayed["held_out"]["after"]["overall"]["ece"] == result["temperatures"]["1"]["held_out"]["after"]["overall"]["ece"]
    assert replayed["online"]["mixed"]["rounds"] == replayed["rounds_fit"]
    platt = subprocess.run([sys.executable, "-m", "specforge", "calibrate", "--replay", str(out / "rounds-T1.safetensors"),
                            "--calibrator-option", "offsets=true", "--out", str(tmp_path / "platt"), "--json"],
                           capture_output=True, text=True)
    assert platt.returncode == 0, platt.stderr[-3000:]
    assert len(json.loads(platt.stdout)["temperatures"]["1"]["fit"]["offsets"]) == 3
    bad = subprocess.run([sys.executable, "-m", "specforge", "calibrate", "--replay", str(out / "calibrator-T1.safetensors"),
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a rounds file written by specforge calibrate" in bad.stderr, bad.stderr[-2000:]
    # the fitted file serves
    served = subprocess.run([sys.executable, "-m", "specforge", "generate", "--config", str(cfg), "--prompt", "w7 w8",
                             "calibrator.name=sts", f"calibrator.path={out / 'calibrator-T1.safetensors'}",
                             "sampling.max_new_tokens=4"], capture_output=True, text=True)
    assert served.returncode == 0, served.stderr[-3000:]
    # ... for this drafter only: another γ (or checkpoint, or drafter) is one clear error
    other = subprocess.run([sys.executable, "-m", "specforge", "generate", "--config", str(cfg), "--prompt", "w7 w8",
                            "calibrator.name=sts", f"calibrator.path={out / 'calibrator-T1.safetensors'}",
                            "drafter.gamma=2"], capture_output=True, text=True)
    assert other.returncode == 2 and "fitted on the rounds of another drafter — gamma 3 (this pipeline: 2)" in \
        other.stderr, other.stderr[-3000:]


def test_the_engine_tells_an_online_calibrator_each_verified_round_after_it():
    """observe() sees every request's round once it is verified, and only then: the calibrated
    confidences a round is scheduled with come from the rounds before it."""
    from specforge.config import EngineConfig, SamplingConfig
    from specforge.engine import Engine, GenerationRequest
    from specforge.plugins import PluginHost
    from specforge.runtime import TargetModel
    from specforge_plugins.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from tiny_models import tiny_model

    host = PluginHost().load()
    target = TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None), None, torch.float32)
    calibrator = host.create_calibrator("online-sts", {"window": 64, "refit_every": 4, "min_rounds": 4, "width": 3,
                                                       "grid_size": 21})
    events = []
    observe, apply = calibrator.observe, calibrator.apply
    calibrator.observe = lambda outcome: (events.append(("observe", outcome.request_ids)), observe(outcome))[1]
    calibrator.apply = lambda c: (events.append(("apply", c.shape[0])), apply(c))[1]
    engine = Engine(target, host.create_verifier("rejection"), drafter=Eagle3Drafter(Eagle3Config(gamma=3, seed=1)),
                    correction_head=host.create_correction_head("none", {}),
                    confidence=host.create_confidence("entropy", {}), calibrator=calibrator,
                    scheduler=host.create_scheduler("threshold", {"theta": 0.01}),
                    sampling=SamplingConfig(temperature=1.0, max_new_tokens=12),
                    engine=EngineConfig(max_batch=2, max_context=96))
    outs = engine.generate([GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=12, seed=i) for i in range(3)])
    assert all(o.error is None for o in outs)
    kinds = [k for k, _ in events]
    # each round: apply (scheduling), then observe (after verification) — never the other way round
    assert kinds[:2] == ["apply", "observe"] and all(a != b for a, b in zip(kinds, kinds[1:]))
    drafted = sum(o.stats.rounds for o in outs)
    state = calibrator.state()
    assert 0 < state["rounds_seen"] <= drafted and state["fits"] >= 1


def _rounds(n: int, temperature: float, first_id: int, g: torch.Generator) -> list[RoundOutcome]:
    """Rounds whose raw confidences are miscalibrated by a known temperature: the true chance of
    accepting slot k is sigmoid(logit(c_k) / temperature)."""
    out = []
    for i in range(n):
        c = 0.2 + 0.7 * torch.rand(3, generator=g, dtype=torch.float64)
        true = torch.sigmoid(torch.logit(c) / temperature)
        ok = torch.rand(3, generator=g, dtype=torch.float64) < true
        accepted = int(ok.long().cumprod(0).sum())
        out.append(RoundOutcome([first_id + i], c[None], torch.tensor([3]), torch.tensor([3]), torch.tensor([accepted]),
                                torch.ones(1)))
    return out


def test_online_replay_reaches_the_offline_fit_and_recovers_after_a_shift():
    from specforge.calibration import CalibrateSettings, online_replay
    from specforge.plugins import PluginHost

    g = torch.Generator().manual_seed(0)
    # code: confidences far too timid (true logits 4x theirs); chat: calibrated as they are
    code, chat = _rounds(1000, 0.25, 0, g), _rounds(1000, 1.0, 10_000, g)
    # even request ids fit, odd ones score; the serving order interleaves the two sets' requests
    stream = [r for pair in zip(code, chat) for r in pair]
    order = {r.request_ids[0]: r.request_ids[0] for r in stream}
    sets = {r.request_ids[0]: ("humaneval" if r.request_ids[0] < 10_000 else "mt-bench") for r in stream}
    settings = CalibrateSettings(online="online-sts", online_every=50, tolerance=0.01,
                                 online_extra={"window": 256, "refit_every": 32, "min_rounds": 64})
    online = online_replay(stream, order, sets, settings, PluginHost().load())
    mixed, shift = online["mixed"], online["shift"]
    assert mixed["curve"][0][0] == 0 and mixed["curve"][-1][0] == mixed["rounds"] == 1000
    assert mixed["curve"][0][1] > mixed["offline_ece"] + 0.01  # identity: miscalibrated
    assert mixed["reached_after"] is not None and mixed["reached_after"] < 1000
    assert shift["switch"] == 500 and shift["ece_at_switch"] > shift["offline_ece"] + 0.01  # fitted for code
    assert shift["recovered_after"] is not None and shift["recovered_after"] <= 500
    assert online["state"]["fits"] > 0 and online["state"]["rounds_seen"] == 1000

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
    # the fitted file serves
    served = subprocess.run([sys.executable, "-m", "specforge", "generate", "--config", str(cfg), "--prompt", "w7 w8",
                             "calibrator.name=sts", f"calibrator.path={out / 'calibrator-T1.safetensors'}",
                             "sampling.max_new_tokens=4"], capture_output=True, text=True)
    assert served.returncode == 0, served.stderr[-3000:]

"""`specforge profile`: the measured step curve is a hardware profile the schedulers load.

Behaviour only — which B were timed, over how many requests, that the passes leave the cache as
they found it, and that the file round-trips into `hw-prefix` — never how fast anything ran.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specforge.hardware import HardwareProfile
from specforge.passes import split_tokens
from specforge.toolkit.step_curve import measure_sps, non_increasing
from specforge.runtime import TargetModel
from tiny_models import save_tiny, tiny_model


@pytest.mark.parametrize(("batch", "requests", "expected"), [
    (1, 16, [1]), (5, 16, [1] * 5), (16, 16, [1] * 16), (20, 16, [2] * 4 + [1] * 12), (64, 16, [4] * 16),
])
def test_split_spreads_tokens_evenly_over_at_most_requests(batch, requests, expected):
    runs = split_tokens(batch, requests)
    assert runs == expected and sum(runs) == batch


def test_split_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="positive"):
        split_tokens(0, 4)


def test_measure_sps_times_every_batch_and_builds_a_profile():
    target = TargetModel(tiny_model("llama", seed=1), None, torch.float32, name="tiny")
    profile, records = measure_sps(target, [8, 1, 3, 3], context=12, requests=4, reps=2, warmup=1, progress=False)
    assert [r["batch"] for r in records] == [1, 3, 8]  # sorted, duplicates dropped
    assert [r["requests"] for r in records] == [1, 3, 4]
    assert all(len(r["seconds"]) == 2 and r["sps"] > 0 for r in records)
    assert [b for b, _ in profile.points()] == [1, 3, 8]
    assert profile.target == "tiny"
    for r in records:  # the measured SPS is the reciprocal of the median pass time
        assert r["sps_measured"] == pytest.approx(1 / r["median_s"], rel=1e-3)
    fitted = [r["sps"] for r in records]
    assert all(a >= b for a, b in zip(fitted, fitted[1:]))  # a bigger pass is never faster
    assert [v for _, v in profile.points()] == pytest.approx(fitted, rel=1e-3)


def test_non_increasing_pools_a_slow_minute_into_its_neighbours():
    # A curve measured on this 2-core machine while its speed drifted (bench-engine-s13).
    measured = [16.5, 19.2, 24.0, 24.6, 20.5, 13.4, 17.2, 18.4, 14.3, 12.4, 10.7]
    fit = non_increasing(measured)
    assert fit == pytest.approx([21.075] * 4 + [20.5] + [49 / 3] * 3 + [14.3, 12.4, 10.7])


@given(st.lists(st.floats(0.1, 1e3), min_size=1, max_size=30))
def test_non_increasing_is_the_monotone_least_squares_fit(values):
    fit = non_increasing(values)
    assert len(fit) == len(values)
    assert all(a >= b - 1e-9 * max(1.0, abs(b)) for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(sum(values), rel=1e-9)  # pooling keeps every run's mean
    assert non_increasing(fit) == pytest.approx(fit)  # already monotone: left alone
    if all(a >= b for a, b in zip(values, values[1:])):
        assert fit == pytest.approx(values)


def test_measure_sps_refuses_a_context_beyond_the_model():
    target = TargetModel(tiny_model("llama", seed=1), None, torch.float32, name="tiny")
    with pytest.raises(ValueError, match="exceed the target"):
        measure_sps(target, [4], context=target.max_positions, requests=2, reps=1, progress=False)


def test_profile_cli_writes_a_profile_hw_prefix_loads(tmp_path):
    model = save_tiny("llama", tmp_path / "model", seed=2)
    out = tmp_path / "prof"
    r = subprocess.run([sys.executable, "-m", "specforge", "profile", "--model", str(model), "--dtype", "float32",
                        "--batches", "1", "2", "6", "--context", "10", "--requests", "3", "--reps", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "SPS" in r.stdout
    profile = HardwareProfile.load(out / "profile.json")
    assert [b for b, _ in profile.points()] == [1, 2, 6]
    timings = json.loads((out / "timings.json").read_text())
    assert [rec["requests"] for rec in timings["records"]] == [1, 2, 3]
    assert (out / "profile.png").stat().st_size > 0
    from specforge.plugins import PluginHost
    scheduler = PluginHost().load().create_scheduler("hw-prefix", {"profile": str(out / "profile.json")})
    assert scheduler.profile == profile

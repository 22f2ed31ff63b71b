"""Calibrators: STS on synthetic over-confident rounds with known truth, censoring, files."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from specforge.components import CalibrationData, Calibrator
from specforge.metrics import calibration_report
from specforge.plots import reliability_diagram
from specforge.plugins import PluginHost
from specforge.components import RoundOutcome
from specforge_plugins.calibrators import (
    CalibratorFileError,
    IdentityCalibrator,
    OnlineSTS,
    OnlineSTSConfig,
    SequentialTemperatureScaling,
    STSConfig,
)

G = 5
OVERCONFIDENCE = 2.5


def rounds(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """True conditional acceptance s[n, k] (varying per round), drawn acceptance, raw scores."""
    gen = torch.Generator().manual_seed(seed)
    level = torch.linspace(1.5, 0.0, G, dtype=torch.float64)  # acceptance drops along the block
    difficulty = torch.randn(n, 1, generator=gen, dtype=torch.float64)  # per-round (prompt) effect
    noise = 0.8 * torch.randn(n, G, generator=gen, dtype=torch.float64)
    s = torch.sigmoid(level + difficulty + noise)
    ok = torch.rand(n, G, generator=gen, dtype=torch.float64) < s
    accepted = ok.long().cumprod(1).sum(1)  # accepted prefix: up to the first rejection
    raw = torch.sigmoid(OVERCONFIDENCE * torch.logit(s))  # over-confident: pushed away from ½
    return s, accepted, raw


@pytest.fixture(scope="module")
def halves():
    _, accepted, raw = rounds(8000, seed=1234)
    fit = CalibrationData(raw[:4000], accepted[:4000])
    held = CalibrationData(raw[4000:], accepted[4000:])
    return fit, held


@pytest.fixture(scope="module")
def fitted(halves):
    cal = SequentialTemperatureScaling()
    report = cal.fit(halves[0])
    return cal, report


@pytest.fixture(scope="module")
def comparisons(halves, fitted):
    """(before, after) reports on the fit half and on the held-out half."""
    fit, held = halves
    cal, report = fitted
    held_before = calibration_report(held)
    held_after = calibration_report(held, cal.apply(held.confidence))
    return [(report["before"], report["after"]), (held_before, held_after)]


def test_sts_lowers_ece_at_every_position_on_fit_and_held_out_rounds(comparisons):
    for before, after in comparisons:
        for b, a in zip(before["positions"], after["positions"]):
            assert a["ece"] < b["ece"], (b["k"], b["ece"], a["ece"])
            # Raw ECE is 0.11–0.19 per position; after STS it is at the sampling-noise floor of
            # a 20-bin ECE on 4000 rounds (≈ 0.01–0.03).
            assert a["ece"] < 0.04 and a["ece"] < b["ece"] / 3
            assert a["brier"] < b["brier"]
        assert after["overall"]["ece"] < before["overall"]["ece"]


def test_sts_temperatures_exceed_one_for_overconfident_scores(fitted):
    cal, report = fitted
    temps = report["temperatures"]
    assert len(temps) == G and all(t > 1 for t in temps)
    # The truth is σ(logit(raw) / 2.5) at every position.  t_1 sees it directly; later t_k
    # also absorb the (noisy) error of the frozen prefix they multiply, so they scatter more.
    assert abs(temps[0] - OVERCONFIDENCE) < 0.3, temps
    assert all(1.5 < t < 3.5 for t in temps), temps
    assert cal.temperatures.tolist() == temps


def test_sts_leaves_conditional_auroc_exactly_unchanged(comparisons):
    # Each ĉ_k is a strictly increasing function of c_k alone, so the ranking of the
    # conditional c_k (on the rounds that reached k) — and its AUROC — is identical.  The
    # cumulative product's AUROC is not guaranteed: Π_{i≤k} ĉ_i re-weights earlier positions
    # by different temperatures, which can reorder two rounds whose c_1..c_k trade off
    # (e.g. (0.9, 0.5) vs (0.6, 0.75) swap when t_1 ≠ t_2), so it is reported, not asserted.
    for before, after in comparisons:
        for b, a in zip(before["positions"], after["positions"]):
            assert not math.isnan(b["auroc_conditional"])
            assert a["auroc_conditional"] == b["auroc_conditional"]


def test_sts_is_order_preserving_per_position(fitted):
    cal, _ = fitted
    c = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)[:, None].expand(99, G)
    out = cal.apply(c)
    assert (out.diff(dim=0) > 0).all() and out.shape == c.shape and out.dtype == c.dtype


def test_censoring_excludes_unverified_positions():
    _, true_accepted, raw = rounds(2000, seed=7)
    gen = torch.Generator().manual_seed(8)
    verified = torch.randint(1, G + 1, (2000,), generator=gen)  # scheduler stopped early
    accepted = torch.minimum(true_accepted, verified)
    data = CalibrationData(raw, accepted, verified)

    def sts():
        return SequentialTemperatureScaling(STSConfig(grid_size=101))

    temps = sts().fit(data)["temperatures"]

    # Scores at unverified positions carry no information: replacing them changes nothing.
    unverified = torch.arange(G)[None, :] >= verified[:, None]
    scrambled = torch.where(unverified, torch.full_like(raw, 0.999), raw)
    assert sts().fit(CalibrationData(scrambled, accepted, verified))["temperatures"] == temps
    # Counting unverified positions as rejections (verified = G) would change the fit.
    naive = sts().fit(CalibrationData(raw, accepted))["temperatures"]
    assert naive[1:] != temps[1:]
    assert calibration_report(data)["positions"][G - 1]["n"] == int((verified == G).sum())


def test_apply_past_the_fitted_block_reuses_the_last_temperature(fitted):
    cal, _ = fitted
    c = torch.full((3, G + 2), 0.7, dtype=torch.float64)
    out = cal.apply(c)
    last = torch.sigmoid(torch.logit(torch.tensor(0.7, dtype=torch.float64)) / cal.temperatures[-1])
    assert torch.equal(out[:, G:], last.expand(3, 2))
    assert torch.equal(cal.apply(c[:, :2]), out[:, :2])


def test_apply_keeps_dtype_and_clamps_extremes(fitted):
    cal, _ = fitted
    c = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.9]], dtype=torch.float32)
    out = cal.apply(c)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert 0 < out[0, 0] < out[0, 2] < out[0, 1] <= 1


def test_unfitted_sts_refuses_to_apply_or_save(tmp_path):
    cal = SequentialTemperatureScaling()
    with pytest.raises(RuntimeError, match="not fitted"):
        cal.apply(torch.full((1, 2), 0.5))
    with pytest.raises(RuntimeError, match="not fitted"):
        cal.save(str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="non-finite"):
        cal.fit(CalibrationData(torch.tensor([[math.nan, 0.5]]), torch.tensor([0])))


def test_positions_never_verified_carry_the_previous_temperature():
    _, accepted, raw = rounds(500, seed=3)
    verified = torch.full((500,), 2)
    data = CalibrationData(raw, torch.minimum(accepted, verified), verified)
    temps = SequentialTemperatureScaling().fit(data)["temperatures"]
    assert temps[2:] == [temps[1]] * (G - 2)


# --- files ------------------------------------------------------------------------------------


def test_sts_save_load_round_trip_and_path_config(fitted, tmp_path):
    cal, _ = fitted
    path = tmp_path / "cal" / "sts.safetensors"
    cal.save(str(path))
    c = torch.rand(10, G + 1, generator=torch.Generator().manual_seed(0))
    loaded = SequentialTemperatureScaling()
    loaded.load(str(path))
    assert torch.equal(loaded.apply(c), cal.apply(c))
    from_config = SequentialTemperatureScaling(STSConfig(path=str(path)))
    assert torch.equal(from_config.apply(c), cal.apply(c))
    from_host = PluginHost().create_calibrator("sts", {"path": str(path)})
    assert torch.equal(from_host.apply(c), cal.apply(c))
    assert path.read_bytes()[8:].lstrip().startswith(b"{")  # a safetensors JSON header, no pickle


def test_loading_another_calibrators_file_names_the_file(fitted, tmp_path):
    cal, _ = fitted
    ident, sts = tmp_path / "identity.safetensors", tmp_path / "sts.safetensors"
    IdentityCalibrator().save(str(ident))
    cal.save(str(sts))
    with pytest.raises(CalibratorFileError, match=r"identity\.safetensors.*'identity', not 'sts'"):
        SequentialTemperatureScaling().load(str(ident))
    with pytest.raises(CalibratorFileError, match=r"sts\.safetensors.*'sts', not 'identity'"):
        IdentityCalibrator().load(str(sts))
    with pytest.raises(CalibratorFileError, match="identity.safetensors"):
        SequentialTemperatureScaling(STSConfig(path=str(ident)))


def test_malformed_files_name_the_file(tmp_path):
    header = {"specforge.calibrator": "sts", "specforge.format": "1"}
    cases = {
        "matrix": ({"temperatures": torch.ones(2, 2, dtype=torch.float64)}, header, "1-D"),
        "negative": ({"temperatures": torch.tensor([1.0, -2.0], dtype=torch.float64)}, header, "positive"),
        "extra": ({"temperatures": torch.ones(2), "bias": torch.ones(2)}, header, r"'temperatures' \(and 'offsets'\)"),
        "offsets": ({"temperatures": torch.ones(2), "offsets": torch.ones(3)}, header, "shaped like the temperatures"),
        "no_header": ({"temperatures": torch.ones(2)}, None, "not written by a specforge"),
        "old_format": ({"temperatures": torch.ones(2)}, {**header, "specforge.format": "0"}, "format"),
    }
    for name, (tensors, meta, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(CalibratorFileError, match=f"{name}.safetensors.*{message}"):
            SequentialTemperatureScaling().load(str(path))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(CalibratorFileError, match="junk.safetensors.*not a safetensors"):
        SequentialTemperatureScaling().load(str(junk))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        SequentialTemperatureScaling().load(str(tmp_path / "missing.safetensors"))


def test_identity_calibrator(halves, tmp_path):
    fit, _ = halves
    cal = IdentityCalibrator()
    report = cal.fit(fit)
    assert report["before"] == report["after"] and report["calibrator"] == "identity"
    assert cal.apply(fit.confidence) is fit.confidence
    cal.save(str(tmp_path / "id.safetensors"))
    IdentityCalibrator().load(str(tmp_path / "id.safetensors"))
    assert isinstance(cal, Calibrator) and isinstance(SequentialTemperatureScaling(), Calibrator)


def test_sts_config_is_validated():
    with pytest.raises(ValueError, match="t_min"):
        STSConfig(t_min=2.0, t_max=1.0)
    with pytest.raises(ValueError):
        STSConfig(grid=3)  # unknown key


def test_registration_through_the_host():
    host = PluginHost().load()
    assert {"identity", "sts"} <= set(host.names("calibrator"))
    assert host.get("calibrator", "sts").metadata.trainable is True
    assert host.get("calibrator", "identity").metadata.trainable is False
    assert host.get("calibrator", "sts").package == "specforge-lossless"
    assert isinstance(host.create_calibrator("sts", {"grid_size": 11}), SequentialTemperatureScaling)
    assert isinstance(host.create_calibrator("identity"), IdentityCalibrator)


# --- reliability diagram ----------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram_writes_png(halves, fitted, comparisons, tmp_path):
    _, held = halves
    cal, report = fitted
    pooled = reliability_diagram(report, tmp_path / "pooled.png", title="STS")
    per_pos = reliability_diagram(held, tmp_path / "plots" / "held.png", after=cal, per_position=True)
    single = reliability_diagram(comparisons[1][0], tmp_path / "raw.png")
    for path in (pooled, per_pos, single):
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    with pytest.raises(TypeError):
        reliability_diagram({"nope": 1}, tmp_path / "x.png")


def _feed(cal: OnlineSTS, raw: torch.Tensor, accepted: torch.Tensor, batch: int = 8) -> None:
    """Rounds as the engine reports them: ``batch`` requests per verified round, whole blocks verified."""
    for lo in range(0, raw.shape[0], batch):
        c, a = raw[lo:lo + batch], accepted[lo:lo + batch]
        n = c.shape[0]
        cal.observe(RoundOutcome(list(range(n)), c, torch.full((n,), G), torch.full((n,), G), a, torch.ones(n)))


def test_online_sts_is_the_identity_until_it_has_seen_enough_rounds_then_matches_an_offline_fit():
    _, accepted, raw = rounds(3000, seed=7)
    cal = OnlineSTS(OnlineSTSConfig(window=2048, refit_every=64, min_rounds=512, width=G, grid_size=101))
    _feed(cal, raw[:504], accepted[:504])
    assert cal.state()["fits"] == 0 and torch.equal(cal.apply(raw[:3]), raw[:3])
    _feed(cal, raw[504:3000], accepted[504:3000])
    state = cal.state()
    assert state["rounds_seen"] == 3000 and state["rounds_kept"] == 2048 and state["fits"] >= 30
    # The last fit saw exactly the last rounds of the window: the offline fit on them agrees.
    last = state["fits"] and (3000 - (3000 - 512) % 64)  # rounds seen at the last refit
    offline = SequentialTemperatureScaling(STSConfig(grid_size=101))
    offline.fit(CalibrationData(raw[last - 2048:last], accepted[last - 2048:last]))
    assert state["temperatures"] == pytest.approx(offline.temperatures.tolist())
    _, held_acc, held_raw = rounds(4000, seed=8)
    held = CalibrationData(held_raw, held_acc)
    before, after = calibration_report(held), calibration_report(held, cal.apply(held_raw))
    for b, a in zip(before["positions"], after["positions"]):  # down to the noise floor, as offline
        assert a["ece"] < 0.04 and a["ece"] < b["ece"] / 3


def test_online_sts_forgets_old_rounds_and_recovers_after_a_shift():
    """After a shift in the prompt mix (the same true survival now comes with scores three times as
    over-confident), a window later the online temperatures are an offline fit's on the new mix."""
    _, acc_a, raw_a = rounds(2000, seed=9)
    s_b, acc_b, _ = rounds(1200, seed=10)
    raw_b = torch.sigmoid(3 * OVERCONFIDENCE * torch.logit(s_b))
    cal = OnlineSTS(OnlineSTSConfig(window=1024, refit_every=64, min_rounds=256, width=G, grid_size=101))
    _feed(cal, raw_a, acc_a)
    before_shift = list(cal.state()["temperatures"])
    _feed(cal, raw_b, acc_b)  # more than a window after the shift
    s_t, acc_t, _ = rounds(4000, seed=11)
    held = CalibrationData(torch.sigmoid(3 * OVERCONFIDENCE * torch.logit(s_t)), acc_t)
    stale = calibration_report(held, SequentialTemperatureScaling(STSConfig(temperatures=before_shift)).apply(
        held.confidence))
    now = calibration_report(held, cal.apply(held.confidence))
    assert now["overall"]["ece"] < 0.03 and stale["overall"]["ece"] > 3 * now["overall"]["ece"]
    assert min(cal.state()["temperatures"]) > max(before_shift)


def test_online_sts_saves_its_temperatures_and_warm_starts_from_an_offline_fit(tmp_path, fitted):
    sts, _ = fitted
    sts.save(str(tmp_path / "sts.safetensors"))
    warm = OnlineSTS(OnlineSTSConfig(path=str(tmp_path / "sts.safetensors")))
    x = torch.rand(4, G, dtype=torch.float64)
    torch.testing.assert_close(warm.apply(x), sts.apply(x))
    warm.save(str(tmp_path / "online.safetensors"))
    again = OnlineSTS(OnlineSTSConfig(path=str(tmp_path / "online.safetensors")))
    torch.testing.assert_close(again.apply(x), sts.apply(x))
    with pytest.raises(RuntimeError, match="has not fitted yet"):
        OnlineSTS().save(str(tmp_path / "none.safetensors"))
    with pytest.raises(CalibratorFileError, match="written by calibrator 'online-sts', not 'sts'"):
        SequentialTemperatureScaling(STSConfig(path=str(tmp_path / "online.safetensors")))


def test_sts_offsets_fix_a_shift_that_a_temperature_cannot_and_keep_the_order(tmp_path):
    # raw scores shifted (too low by 1 in logit) and over-confident: one temperature per position
    # cannot undo a shift; a temperature and an offset can
    gen = torch.Generator().manual_seed(7)
    s = torch.sigmoid(torch.linspace(1.0, -0.5, G, dtype=torch.float64) + torch.randn(12000, G, generator=gen,
                                                                                      dtype=torch.float64))
    accepted = (torch.rand(12000, G, generator=gen, dtype=torch.float64) < s).long().cumprod(1).sum(1)
    raw = torch.sigmoid(1.5 * torch.logit(s) - 1.0)
    fit, held = CalibrationData(raw[:6000], accepted[:6000]), CalibrationData(raw[6000:], accepted[6000:])
    plain, shifted = SequentialTemperatureScaling(), SequentialTemperatureScaling(STSConfig(offsets=True))
    plain.fit(fit)
    report = shifted.fit(fit)
    assert len(report["offsets"]) == G and report["offsets"][0] > 0.3  # it raises the too-low scores
    ece_plain = calibration_report(held, plain.apply(held.confidence))["positions"][0]["ece"]
    ece_shift = calibration_report(held, shifted.apply(held.confidence))["positions"][0]["ece"]
    assert ece_shift < 0.6 * ece_plain
    out = shifted.apply(held.confidence)
    for k in range(G):  # order-preserving per position
        order = torch.argsort(held.confidence[:, k])
        assert bool((out[order, k].diff() >= 0).all())
    path = tmp_path / "sts-offsets.safetensors"
    shifted.save(str(path))
    again = SequentialTemperatureScaling(STSConfig(path=str(path)))
    assert torch.equal(again.offsets, shifted.offsets) and torch.equal(again.apply(held.confidence), out)
    with pytest.raises(CalibratorFileError, match=r"online-sts refits temperatures only"):
        OnlineSTS(OnlineSTSConfig(path=str(path)))
    assert plain.offsets is None and "offsets" not in plain.fit(fit)  # the default stays temperature-only

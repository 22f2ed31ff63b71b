"""Calibration metrics against values worked out by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from specforge.components import CalibrationData
from specforge.metrics import (
    auroc,
    batched_ece,
    brier,
    calibration_report,
    conditional_acceptance,
    ece,
    ece_floor,
    prefix_survival,
    reliability_bins,
    survival_outcomes,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


# --- ECE ------------------------------------------------------------------------------------


def test_ece_by_hand_with_an_empty_bin():
    # 4 bins [0,.25) [.25,.5) [.5,.75) [.75,1]; the third is empty.
    # bin 0: {.1,.2} vs {0,1}: 2/5·|.15−.5| = .14;  bin 1: {.3} vs {0}: 1/5·.3 = .06
    # bin 3: {.9,1} vs {1,1}: 2/5·|.95−1| = .02   → .22
    assert ece(t(0.1, 0.2, 0.3, 0.9, 1.0), t(0, 1, 0, 1, 1), bins=4) == pytest.approx(0.22, abs=1e-12)


def test_ece_last_bin_is_closed_at_one():
    assert ece(t(1.0), t(0.0)) == pytest.approx(1.0)
    rel = reliability_bins(t(1.0, 0.99), t(0, 1), bins=20)
    assert rel["count"][-1] == 2 and sum(rel["count"]) == 2


def test_ece_default_twenty_bins_single_bin():
    assert ece(t(0.7, 0.7, 0.7, 0.7), t(1, 0, 1, 1)) == pytest.approx(0.05, abs=1e-12)


def test_ece_perfect_and_empty():
    assert ece(t(0.0, 1.0), t(0, 1)) == 0.0
    assert math.isnan(ece(t(), t()))


def test_batched_ece_matches_ece():
    gen = torch.Generator().manual_seed(0)
    pred = torch.rand(3, 50, generator=gen, dtype=torch.float64)
    obs = (torch.rand(50, generator=gen) < 0.5).double()
    rows = batched_ece(pred, obs, bins=20)
    for i in range(3):
        assert rows[i].item() == pytest.approx(ece(pred[i], obs), abs=1e-15)


def test_ece_floor_is_what_calibrated_outcomes_score_and_shrinks_as_one_over_root_n():
    g = torch.Generator().manual_seed(1)
    small, large = torch.rand(500, generator=g, dtype=torch.float64), torch.rand(8000, generator=g, dtype=torch.float64)
    # outcomes drawn from the predictions themselves: their ECE scatters around the floor
    scores = [ece(small, (torch.rand(500, generator=g, dtype=torch.float64) < small).double()) for _ in range(200)]
    floor = ece_floor(small)
    assert abs(sum(scores) / len(scores) - floor) < 0.1 * floor
    assert ece_floor(large) == pytest.approx(floor * (500 / 8000) ** 0.5, rel=0.15)
    assert math.isnan(ece_floor(torch.tensor([], dtype=torch.float64)))
    assert ece_floor(torch.tensor([0.0, 1.0, 1.0])) == 0.0  # certain predictions: nothing to scatter


def test_reliability_bins_by_hand():
    rel = reliability_bins(t(0.1, 0.2, 0.9), t(0, 1, 1), bins=2)
    assert rel["count"] == [2, 1]
    assert rel["mean_pred"] == pytest.approx([0.15, 0.9])
    assert rel["mean_observed"] == pytest.approx([0.5, 1.0])
    assert reliability_bins(t(0.9), t(1), bins=2)["mean_pred"][0] is None


# --- AUROC and Brier ------------------------------------------------------------------------


def test_auroc_by_hand():
    # positives {.35,.8}, negatives {.1,.4}: .35>.1, .35<.4, .8>.1, .8>.4 → 3/4
    assert auroc(t(0.1, 0.4, 0.35, 0.8), t(0, 0, 1, 1)) == 0.75


def test_auroc_ties_count_half():
    # positives {.5,.9}, negatives {.5,.5}: two ties (½ each) + two wins → 3/4
    assert auroc(t(0.5, 0.5, 0.5, 0.9), t(1, 0, 0, 1)) == 0.75
    assert auroc(t(0.3, 0.3, 0.3), t(1, 0, 1)) == 0.5
    assert auroc(t(0.9, 0.1), t(0, 1)) == 0.0


def test_auroc_one_class_is_nan_and_nonbinary_is_an_error():
    assert math.isnan(auroc(t(0.2, 0.7), t(1, 1)))
    assert math.isnan(auroc(t(0.2, 0.7), t(0, 0)))
    with pytest.raises(ValueError, match="binary"):
        auroc(t(0.2, 0.7), t(0.5, 1))


def test_auroc_depends_only_on_order():
    gen = torch.Generator().manual_seed(1)
    p = torch.rand(200, generator=gen, dtype=torch.float64)
    o = (torch.rand(200, generator=gen) < p).double()
    assert auroc(p, o) == auroc(torch.sigmoid(3 * torch.logit(p)), o)


def test_brier_by_hand():
    assert brier(t(0.2, 0.9), t(0, 1)) == pytest.approx(0.025)
    assert math.isnan(brier(t(), t()))


def test_metric_input_errors():
    with pytest.raises(ValueError, match="pred has 2"):
        ece(t(0.1, 0.2), t(1))
    with pytest.raises(ValueError, match="non-finite"):
        brier(t(math.nan), t(1))


# --- per-position statistics ----------------------------------------------------------------

# Three rounds, G = 2.  Round 1 verified only position 1 (its position 2 is unobserved).
DATA = CalibrationData(
    confidence=torch.tensor([[0.5, 0.4], [0.8, 0.5], [0.9, 0.9]], dtype=torch.float64),
    accepted=torch.tensor([0, 1, 2]),
    verified=torch.tensor([2, 1, 2]),
)


def test_survival_outcomes_and_observed_rates():
    verified, survived = survival_outcomes(DATA)
    assert verified.tolist() == [[True, True], [True, False], [True, True]]
    assert survived.tolist() == [[False, False], [True, False], [True, True]]
    # k=1: 2 of 3 rounds; k=2: rounds 0 and 2 verified it, round 2 survived → 1/2
    assert prefix_survival(DATA).tolist() == pytest.approx([2 / 3, 1 / 2])
    # k=2 is reached (verified, x_1 accepted) only in round 2, which accepted it → 1
    assert conditional_acceptance(DATA).tolist() == pytest.approx([2 / 3, 1.0])


def test_rates_are_nan_where_nothing_was_verified():
    data = CalibrationData(torch.full((2, 3), 0.5), torch.tensor([1, 0]), torch.tensor([1, 1]))
    assert math.isnan(prefix_survival(data)[1]) and math.isnan(conditional_acceptance(data)[2])


def test_calibration_report_by_hand():
    rep = calibration_report(DATA, bins=20)
    k1, k2 = rep["positions"]
    assert (k1["n"], k2["n"]) == (3, 2)
    # k=1: pred (.5,.8,.9) vs (0,1,1)
    assert k1["brier"] == pytest.approx((0.25 + 0.04 + 0.01) / 3)
    assert k1["auroc"] == 1.0
    assert k1["ece"] == pytest.approx((0.5 + 0.2 + 0.1) / 3)
    # k=2: cumulative products (.2, .81) on rounds 0 and 2 vs (0, 1)
    assert k2["predicted"] == pytest.approx((0.2 + 0.81) / 2)
    assert k2["brier"] == pytest.approx((0.04 + 0.0361) / 2)
    assert k2["ece"] == pytest.approx((0.2 + 0.19) / 2)
    assert k2["observed"] == 0.5
    # conditional at k=2: only round 2 reached it → one class → nan
    assert k2["n_conditional"] == 1 and math.isnan(k2["auroc_conditional"])
    assert k1["auroc_conditional"] == 1.0
    # pooled: (.5,.8,.9,.2,.81) vs (0,1,1,0,1)
    pooled = t(0.5, 0.8, 0.9, 0.2, 0.81), t(0, 1, 1, 0, 1)
    assert rep["overall"]["n"] == 5
    assert rep["overall"]["ece"] == pytest.approx(ece(*pooled))
    assert rep["overall"]["brier"] == pytest.approx(brier(*pooled))
    assert rep["overall"]["auroc"] == 1.0


def test_calibration_report_scores_replacement_confidences():
    rep = calibration_report(DATA, torch.ones(3, 2, dtype=torch.float64))
    assert rep["positions"][0]["ece"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="shape"):
        calibration_report(DATA, torch.ones(3, 3))


def test_inconsistent_rounds_are_rejected():
    with pytest.raises(ValueError, match="accepted ≤ verified"):
        survival_outcomes(CalibrationData(torch.full((1, 2), 0.5), torch.tensor([2]), torch.tensor([1])))
    with pytest.raises(ValueError, match="verified ≤ G"):
        survival_outcomes(CalibrationData(torch.full((1, 2), 0.5), torch.tensor([0]), torch.tensor([3])))

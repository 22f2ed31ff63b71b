"""Calibration metrics (docs/design/metrics.md): plain functions from tensors to numbers.

Every function flattens its inputs and works in float64 on the CPU, so results do not depend on
the dtype or device the confidences arrived in.  Conventions shared by all of them:

* ``pred`` are probabilities in [0, 1]; ``observed`` are outcomes (0/1; :func:`ece` and
  :func:`brier` also accept fractional targets).
* An empty input has no defined ECE or Brier score: the result is ``nan``.  AUROC is ``nan`` when
  either class is empty (every round accepted, or none), because no positive/negative pair exists
  to rank.  ``nan`` rather than an exception lets a per-position report cover positions that
  were never verified, or always accepted, without special cases at every call site.

Positions are 1-based in the reports (k = 1..G), 0-based in tensors (column ``k - 1``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from specforge.acceptance import position_masks, rates
from specforge.components import CalibrationData

__all__ = [
    "auroc",
    "batched_ece",
    "brier",
    "calibration_report",
    "conditional_acceptance",
    "ece",
    "ece_floor",
    "prefix_survival",
    "reliability_bins",
    "survival_outcomes",
]


def _flat(x: Tensor | Any, what: str) -> Tensor:
    t = torch.as_tensor(x).detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(t).all():
        raise ValueError(f"{what} contains non-finite values")
    return t


def _pair(pred: Tensor, observed: Tensor) -> tuple[Tensor, Tensor]:
    p, o = _flat(pred, "pred"), _flat(observed, "observed")
    if p.shape != o.shape:
        raise ValueError(f"pred has {p.numel()} values but observed has {o.numel()}")
    return p, o


def _bin_index(p: Tensor, bins: int) -> Tensor:
    # Equal-width bins on [0, 1].  floor(p * bins) sends p = 1 one past the end, so clamping it
    # into the last bin makes that bin closed at 1: [1 - 1/bins, 1].
    return (p * bins).floor().clamp_(0, bins - 1).long()


def batched_ece(pred: Tensor, observed: Tensor, bins: int = 20) -> Tensor:
    """ECE of each row of ``pred [T, n]`` against ``observed`` (``[n]`` or ``[T, n]``) → ``[T]``.

    Used by grid searches that score many candidate calibrations of the same rounds at once.
    Σ_b (n_b/N)|mean pred − mean observed| equals Σ_b |Σ pred − Σ observed| / N, which needs only
    per-bin sums.
    """
    pred = pred.to(torch.float64)
    t, n = pred.shape
    if n == 0:
        return torch.full((t,), math.nan, dtype=torch.float64)
    obs = observed.to(torch.float64, copy=False).expand(t, n)
    idx = _bin_index(pred, bins)
    diff = torch.zeros(t, bins, dtype=torch.float64, device=pred.device)
    diff.scatter_add_(1, idx, pred - obs)
    return diff.abs().sum(1) / n


def ece(pred: Tensor, observed: Tensor, bins: int = 20) -> float:
    """Expected calibration error with ``bins`` equal-width bins, the last one closed at 1."""
    p, o = _pair(pred, observed)
    return float(batched_ece(p[None], o, bins)[0])


def ece_floor(pred: Tensor, bins: int = 20, draws: int = 200, seed: int = 0) -> float:
    """The ECE a *perfectly calibrated* predictor scores with these predictions: the mean ECE of
    outcomes drawn from ``pred`` itself.  ECE is biased upwards by sampling noise (≈ Σ_b (n_b/N)
    √(2 p_b(1−p_b)/(π n_b))), so a measured ECE means little until compared with this floor:
    a few thousand rounds alone put it near 1–2 %."""
    p = pred.detach().to(device="cpu", dtype=torch.float64).flatten().clamp(0, 1)
    if p.numel() == 0:
        return math.nan
    g = torch.Generator().manual_seed(seed)
    drawn = (torch.rand(draws, p.numel(), generator=g, dtype=torch.float64) < p).to(torch.float64)
    return float(batched_ece(p.expand(draws, -1), drawn, bins).mean())


def reliability_bins(pred: Tensor, observed: Tensor, bins: int = 20) -> dict[str, list]:
    """Per-bin ``count``, ``mean_pred`` and ``mean_observed`` (``None`` for empty bins)."""
    p, o = _pair(pred, observed)
    idx = _bin_index(p, bins)
    count = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(p))
    sp = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, p)
    so = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, o)
    nonempty = [c > 0 for c in count.tolist()]
    return {
        "count": [int(c) for c in count.tolist()],
        "mean_pred": [s / c if ok else None for s, c, ok in zip(sp.tolist(), count.tolist(), nonempty)],
        "mean_observed": [s / c if ok else None for s, c, ok in zip(so.tolist(), count.tolist(), nonempty)],
    }


def _average_ranks(x: Tensor) -> Tensor:
    """1-based ranks with ties given the mean of the ranks they span."""
    sorted_x, order = torch.sort(x, stable=True)
    _, group, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).to(torch.float64)  # rank of each tie group's last member
    mean_rank = last - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(x)
    ranks[order] = mean_rank[group]
    return ranks


def auroc(pred: Tensor, observed: Tensor) -> float:
    """Area under the ROC curve: P(pred of a positive > pred of a negative), ties counting ½.

    Computed as the Mann–Whitney U statistic from average ranks, so it depends only on the order
    of ``pred`` (any strictly increasing map of ``pred`` leaves it bit-for-bit unchanged).
    ``observed`` must be 0/1.  Returns ``nan`` when either class is empty.
    """
    p, o = _pair(pred, observed)
    if not ((o == 0) | (o == 1)).all():
        raise ValueError("auroc needs binary observed outcomes (0 or 1)")
    pos = o == 1
    n_pos = int(pos.sum())
    n_neg = p.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    u = _average_ranks(p)[pos].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def brier(pred: Tensor, observed: Tensor) -> float:
    """Mean squared difference between predictions and outcomes."""
    p, o = _pair(pred, observed)
    return float(((p - o) ** 2).mean()) if p.numel() else math.nan


# --- per-position statistics over held-out rounds ---------------------------------------------


def _position_masks(data: CalibrationData) -> tuple[Tensor, Tensor, Tensor]:
    """``(verified, reached, accepted)`` ``[N, G]`` masks of the rounds (specforge.acceptance)."""
    conf = data.confidence
    if conf.dim() != 2:
        raise ValueError(f"confidence must be [N, G], got shape {tuple(conf.shape)}")
    n, g = conf.shape
    acc = data.accepted.detach().reshape(-1).cpu().long()
    ver = data.verified_lengths().detach().reshape(-1).cpu().long()
    if acc.numel() != n or ver.numel() != n:
        raise ValueError(f"accepted and verified need {n} entries, got {acc.numel()} and {ver.numel()}")
    if (acc < 0).any() or (acc > ver).any() or (ver > g).any():
        raise ValueError("need 0 ≤ accepted ≤ verified ≤ G in every round")
    return position_masks(ver, acc, g)


def survival_outcomes(data: CalibrationData) -> tuple[Tensor, Tensor]:
    """``(verified, survived)``, both ``[N, G]`` bool, from the rounds' accept/verify counts.

    ``verified[n, k-1]`` says position k was verified in round n (k ≤ verified_n): only those
    positions have an observed outcome.  ``survived[n, k-1]`` is 1[accepted_n ≥ k], the event
    that the first k draft tokens were all accepted.
    """
    verified, _, survived = _position_masks(data)
    return verified, survived


def _rates(hits: Tensor, trials: Tensor) -> Tensor:
    return torch.tensor(rates(hits.sum(0).tolist(), trials.sum(0).tolist()), dtype=torch.float64)


def prefix_survival(data: CalibrationData) -> Tensor:
    """``[G]`` observed prefix survival P(first k accepted), over the rounds that verified k.

    ``nan`` where no round verified position k.  Unlike the product of the conditional
    acceptances (:func:`specforge.acceptance.survival`), a round that verified k after an
    earlier rejection counts here, as the failure it is.
    """
    verified, _, survived = _position_masks(data)
    return _rates(survived, verified)


def conditional_acceptance(data: CalibrationData) -> Tensor:
    """``[G]`` observed P(x_k accepted | x_<k accepted), over the rounds that reached position k.

    ``nan`` where no round reached position k.
    """
    _, reached, survived = _position_masks(data)
    return _rates(survived, reached)


def calibration_report(
    data: CalibrationData, confidence: Tensor | None = None, bins: int = 20
) -> dict[str, Any]:
    """Per-position and pooled calibration of the cumulative product Π_{i≤k} c_i.

    Args:
        data: held-out rounds (their outcomes, and the raw confidences).
        confidence: ``[N, G]`` confidences to score instead of ``data.confidence`` — typically a
            calibrator's output on the same rounds.
        bins: ECE bins.

    For each k, on rounds that verified k, the prediction is Π_{i≤k} c_i and the outcome is
    1[accepted ≥ k].  ``auroc_conditional`` ranks the conditional c_k itself on the rounds that
    reached k (first k−1 accepted), which is what a per-position temperature cannot change.
    ``overall`` pools every verified (round, position) pair.
    """
    conf = data.confidence if confidence is None else confidence
    conf = conf.detach().to(device="cpu", dtype=torch.float64)
    if conf.shape != data.confidence.shape:
        raise ValueError(f"confidence shape {tuple(conf.shape)} != data {tuple(data.confidence.shape)}")
    verified, reached, survived = _position_masks(data)
    cum = conf.cumprod(dim=1)
    obs = survived.to(torch.float64)
    positions = []
    for j in range(conf.shape[1]):
        m, r = verified[:, j], reached[:, j]
        pred, out = cum[m, j], obs[m, j]
        positions.append({
            "k": j + 1,
            "n": int(m.sum()),
            "predicted": float(pred.mean()) if pred.numel() else math.nan,
            "observed": float(out.mean()) if out.numel() else math.nan,
            "ece": ece(pred, out, bins),
            "ece_floor": ece_floor(pred, bins),
            "auroc": auroc(pred, out),
            "brier": brier(pred, out),
            "n_conditional": int(r.sum()),
            "observed_conditional": float(obs[r, j].mean()) if r.any() else math.nan,
            "auroc_conditional": auroc(conf[r, j], obs[r, j]),
            "reliability": reliability_bins(pred, out, bins),
        })
    pred, out = cum[verified], obs[verified]
    overall = {
        "n": int(verified.sum()),
        "ece": ece(pred, out, bins),
        "ece_floor": ece_floor(pred, bins),
        "auroc": auroc(pred, out),
        "brier": brier(pred, out),
        "reliability": reliability_bins(pred, out, bins),
    }
    return {"n_rounds": conf.shape[0], "bins": bins, "positions": positions, "overall": overall}

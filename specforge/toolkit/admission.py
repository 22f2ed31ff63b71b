"""The greedy admission path shared by the hardware-aware schedulers (paper Algorithm 1).

Every draft position (r, j) with survival a_{r,j} = Π_{i≤j} c_{r,i} > 0 and j ≤ available_r is a
candidate.  Candidates are admitted in decreasing a, ties broken by j and then by r.  Because a is
non-increasing along a request and ties go to the smaller j, every prefix of this order is
prefix-closed per request: admitting the first n candidates gives each request a contiguous
verify length.  Admitting n candidates forms a flattened batch B_n = R + n with expected accepted
tokens τ_n = R + Σ_{m≤n} a_(m) (each request always gets its correction/bonus token), and an
expected throughput Θ_n = τ_n · SPS(B_n).

Schedulers differ only in how they pick n from Θ_0..Θ_N; they all live on this one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specforge.hardware import HardwareProfile

__all__ = ["AdmissionPath", "admission_path", "causal_count", "global_count", "masked_confidence", "round_seconds"]


def masked_confidence(confidence: Tensor, available: Tensor) -> tuple[Tensor, Tensor]:
    """Check the scheduler inputs; return float64 confidences zeroed past ``available`` and
    ``available`` as int64.

    Slots past a request's ``available`` are padding and may hold anything (NaN included); zeroing
    them makes their survival 0, which removes them from every candidate set.
    """
    if confidence.dim() != 2:
        raise ValueError(f"confidence must be [R, G], got shape {tuple(confidence.shape)}")
    r, g = confidence.shape
    if available.shape != (r,):
        raise ValueError(f"available must be [R] = [{r}], got shape {tuple(available.shape)}")
    if available.dtype.is_floating_point or available.dtype == torch.bool:
        raise ValueError(f"available must hold integers, got {available.dtype}")
    avail = available.to(device=confidence.device, dtype=torch.long)
    if r and (int(avail.min()) < 0 or int(avail.max()) > g):
        raise ValueError(f"available must lie in [0, G={g}], got {avail.tolist()}")
    valid = torch.arange(g, device=confidence.device) < avail[:, None]
    c = torch.where(valid, confidence.to(torch.float64), 0.0)
    bad = valid & ~((c >= 0) & (c <= 1))  # also catches NaN
    if bool(bad.any()):
        req, pos = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"confidence of request {req} at position {pos + 1} is {float(c[req, pos])!r}; "
            "calibrated confidences must lie in [0, 1]"
        )
    return c, avail


@dataclass(frozen=True)
class AdmissionPath:
    """Candidates in admission order.

    Attributes:
        rows: ``[N]`` the request of each candidate.
        cols: ``[N]`` its 1-based position j.
        survival: ``[N]`` float64 a_{r,j}, non-increasing.
        num_requests: R.
    """

    rows: Tensor
    cols: Tensor
    survival: Tensor
    num_requests: int

    def __len__(self) -> int:
        return int(self.rows.numel())

    def lengths(self, n: int) -> Tensor:
        """``[R]`` int64 verify lengths from admitting the first ``n`` candidates."""
        # Prefix-closedness makes the count of admitted positions of a request equal its length.
        return torch.bincount(self.rows[:n], minlength=self.num_requests).to(torch.long)

    def throughput(self, profile: HardwareProfile, draft_cost: float = 0.0) -> Tensor:
        """``[N+1]`` float64 Θ_0..Θ_N along the path.

        ``draft_cost`` is ρ, what this round's drafting cost in plain steps of R requests
        (:class:`~specforge.hardware.DraftCost`): with it a round of n verified drafts takes
        1/SPS(R + n) + ρ/SPS(R) seconds and Θ_n = τ_n / that.  The drafting is already paid when
        the round is scheduled, so a larger ρ makes admission more generous, never less; ρ = 0 is
        the paper's Θ_n = τ_n · SPS(B_n) (drafting hidden behind verification)."""
        r = self.num_requests
        # τ_n accumulated as ((R + a_1) + a_2) + …, the order Algorithm 1 adds in, so that the
        # stopping decision agrees bit for bit with a sequential implementation.
        tau = torch.cumsum(torch.cat([self.survival.new_full((1,), float(r)), self.survival]), 0)
        drafts = torch.arange(len(self) + 1, device=self.survival.device, dtype=torch.float64)
        if not draft_cost:
            return tau * profile.sps(r + drafts)
        return tau / round_seconds(profile, r, drafts, draft_cost)


def round_seconds(profile: HardwareProfile, num_requests: int, verified: Any, draft_cost: float) -> Any:
    """A round's time by the step curve: its pass of R + ``verified`` rows (an int or a tensor of
    them) and its drafting, ρ plain steps of R requests."""
    return 1.0 / profile.sps(num_requests + verified) + draft_cost / profile.sps(max(num_requests, 1))


def admission_path(confidence: Tensor, available: Tensor) -> AdmissionPath:
    """Build the sorted candidate list from ``[R, G]`` confidences and ``[R]`` availability."""
    c, _ = masked_confidence(confidence, available)
    r, _ = c.shape
    a = torch.cumprod(c, dim=1)
    # Flatten position-major so that flat order is (j, r): a stable sort on -a then breaks ties
    # by j and then by r, exactly the order Algorithm 1 needs to stay prefix-closed.
    flat = a.T.reshape(-1)
    idx = (flat > 0).nonzero().squeeze(1)
    vals = flat[idx]
    order = torch.sort(-vals, stable=True).indices
    idx, vals = idx[order], vals[order]
    return AdmissionPath(rows=idx % max(r, 1), cols=idx // max(r, 1) + 1, survival=vals, num_requests=r)


def causal_count(theta: Tensor) -> int:
    """Algorithm 1's stopping rule: admit while Θ strictly improves, stop at the first step that
    does not.  Θ_best always equals the previous Θ under this rule, so the count is the number of
    leading strict increases of the sequence."""
    improves = theta[1:] > theta[:-1]
    return int(torch.cumprod(improves.to(torch.long), 0).sum())


def global_count(theta: Tensor) -> int:
    """The unconstrained search: the n of the largest Θ on the whole path (fewest tokens on ties).

    Lossy when fed the current round's confidences (paper Appendix A); causal only when Θ comes
    from information that predates the draft being scheduled (``async-topk``)."""
    return int(torch.argmax(theta))

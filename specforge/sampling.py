"""Warping and sampling shared by drafters and verifiers.

Losslessness needs the verifier to see *exactly* the distribution a token was drawn from, so both
sides warp with the same function.  The order is the one Hugging Face ``generate`` uses:
temperature, then top-k, then top-p (on the temperature-scaled, top-k-truncated distribution).

* temperature ``T = 0`` means greedy: a one-hot on the first arg-max.
* ``top_k = 0`` disables top-k; ties at the k-th value are broken by vocabulary index (lower id
  wins), so exactly k tokens survive.
* ``top_p = 1`` disables top-p; otherwise the smallest set of highest-probability tokens whose mass
  reaches ``top_p`` survives (at least one token).  Sorting is stable, so ties are again broken by
  vocabulary index.

Randomness never comes from a global generator: callers pass uniforms, which the engine draws
from per-request seeded generators, so a request's output does not depend on its batch-mates.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "NonFiniteError",
    "SamplingParams",
    "check_logits",
    "check_probs",
    "draw_uniforms",
    "sample_with_uniform",
    "sampling_problem",
    "warp",
]


class NonFiniteError(ValueError):
    """Raised when logits or probabilities that would be sampled from are not finite.

    ``request`` and ``position`` locate the first bad row (batch index and row index), so an
    engine can fail that request alone.
    """

    def __init__(self, message: str, request: int | None = None, position: int | None = None) -> None:
        super().__init__(message)
        self.request = request
        self.position = position


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, one entry per request (all tensors ``[R]``)."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor

    @classmethod
    def uniform(
        cls, batch: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
    ) -> SamplingParams:
        """The same settings for every request of a batch."""
        return cls(
            temperature=torch.full((batch,), float(temperature), dtype=torch.float64),
            top_k=torch.full((batch,), int(top_k), dtype=torch.long),
            top_p=torch.full((batch,), float(top_p), dtype=torch.float64),
        )

    @classmethod
    def stack(cls, rows: list[tuple[float, int, float]]) -> SamplingParams:
        """Build from ``(temperature, top_k, top_p)`` per request."""
        t, k, p = zip(*rows) if rows else ((), (), ())
        return cls(
            temperature=torch.tensor(t, dtype=torch.float64),
            top_k=torch.tensor(k, dtype=torch.long),
            top_p=torch.tensor(p, dtype=torch.float64),
        )

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    def rows(self, index: list[int]) -> SamplingParams:
        """The settings of the requests at ``index``, in that order."""
        return SamplingParams(self.temperature[index], self.top_k[index], self.top_p[index])

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first request with an out-of-range setting."""
        rows = zip(self.temperature.tolist(), self.top_k.tolist(), self.top_p.tolist())
        for r, row in enumerate(rows):
            problem = sampling_problem(*row)
            if problem:
                raise ValueError(f"request {r}: {problem}")


def sampling_problem(temperature: float, top_k: int, top_p: float) -> str | None:
    """What is out of range in one request's settings (``None``: nothing).  Plain floats: the
    engine checks every request it admits, where building tensors would cost more than the rule."""
    if not (temperature >= 0 and math.isfinite(temperature)):
        return f"temperature={temperature} is out of range"
    if top_k < 0:
        return f"top_k={top_k} is out of range"
    if not 0 < top_p <= 1:
        return f"top_p={top_p} is out of range"
    return None


def check_logits(logits: Tensor, valid: Tensor | None = None, what: str = "logits") -> None:
    """Raise :class:`NonFiniteError` naming request and position of the first bad row.

    ``logits`` is ``[R, P, V]``; ``valid`` (``[R, P]`` bool) restricts the check to rows that are
    actually used.  ``-inf`` entries are allowed (they express masked tokens) but NaN, ``+inf`` and
    rows without a single finite entry are not.
    """
    bad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
    bad |= ~torch.isfinite(logits).any(-1)
    _raise_first(bad, valid, f"{what} are not finite")


def check_probs(probs: Tensor, valid: Tensor | None = None, what: str = "probabilities") -> None:
    """Raise :class:`NonFiniteError` naming request and position of the first bad row.

    ``probs`` is ``[R, P, V]``; a row is bad if it holds NaN, an infinity or a negative entry, or
    has no mass at all (nothing could have been sampled from it).  ``valid`` (``[R, P]`` bool)
    restricts the check to rows that are actually used.
    """
    # Two reductions decide every row: a row whose smallest entry is ≥ 0 and whose sum is finite
    # and positive holds no NaN, no infinity, no negative entry and some mass.  (A sum can also
    # overflow on huge finite entries, which no probability has.)  This runs every round over
    # [R, γ+1, V]: one pass each, no boolean tensors of that size.
    sums = probs.sum(-1)
    bad = ~torch.isfinite(sums) | (sums <= 0) | (probs.amin(-1) < 0)
    _raise_first(bad, valid, f"{what} must be finite, non-negative and not all zero")


def _raise_first(bad: Tensor, valid: Tensor | None, message: str) -> None:
    if valid is not None:
        bad = bad & valid
    if bool(bad.any()):
        r, j = (int(i) for i in bad.nonzero()[0])
        raise NonFiniteError(f"request {r}, position {j}: {message}", r, j)


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """Warped probabilities ``[R, ..., V]`` from raw logits ``[R, ..., V]``.

    Settings are per request (dimension 0) and broadcast over any middle dimensions.  The result is
    computed in float32, or float64 when the logits are float64 (exact tests): bf16/fp16 logits
    are upcast first, because probabilities at half precision are too coarse for acceptance
    ratios and top-p cut-offs.  Every row is warped on its
    own, so a row of garbage (NaN) yields garbage in that row only and never raises: callers check
    the rows they use with :func:`check_logits`.
    """
    shape = logits.shape
    r, v = shape[0], shape[-1]
    if len(params) != r:
        raise ValueError(f"sampling params describe {len(params)} requests, logits have {r}")
    x = logits.reshape(r, -1, v)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    dtype, device = x.dtype, x.device
    t = params.temperature.to(device=device, dtype=dtype).view(r, 1, 1)
    k = params.top_k.to(device).view(r, 1, 1)
    top_p = params.top_p.to(device=device, dtype=dtype).view(r, 1, 1)

    greedy = (t <= 0).view(r)
    truncate = ~greedy & (((k > 0) & (k < v)) | (top_p < 1)).view(r)  # top-k ≥ V keeps everything
    plain = ~greedy & ~truncate
    # Each row takes one of three paths, chosen by its own settings only (so a row's result never
    # depends on its batch-mates): greedy rows put everything on the first arg-max; untruncated
    # rows are a plain softmax; only rows with top-k/top-p pay for sorting the vocabulary.
    if bool(plain.all()):  # the common batches are homogeneous: no row selection, no copies
        return torch.softmax(x / t, dim=-1).reshape(shape)
    if bool(greedy.all()):
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0).reshape(shape)
    probs = torch.empty_like(x)
    if bool(greedy.any()):
        first = x[greedy].argmax(dim=-1, keepdim=True)  # argmax returns the first maximal index
        probs[greedy] = torch.zeros_like(x[greedy]).scatter_(-1, first, 1.0)
    if bool(plain.any()):
        probs[plain] = torch.softmax(x[plain] / t[plain], dim=-1)
    if bool(truncate.any()):
        probs[truncate] = _truncated(x[truncate] / t[truncate], k[truncate], top_p[truncate])
    return probs.reshape(shape)


def _truncated(scaled: Tensor, k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k then top-p (ties broken towards the lower id) of temperature-scaled logits."""
    v = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=scaled.device).view(1, 1, v)
    keep = (k <= 0) | (rank < k)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p; the first always stays.
    # The exclusive prefix sum is built by shifting (not as cumsum - p) so that it is the exact
    # running sum; top_p >= 1 is tested on its own because that running sum can round up to 1.0
    # and would then drop tail tokens that "top_p = 1 disables top-p" promises to keep.
    before = torch.nn.functional.pad(torch.cumsum(sorted_probs, dim=-1)[..., :-1], (1, 0))
    keep = keep & ((top_p >= 1) | (before < top_p) | (rank == 0))
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def sample_with_uniform(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sample: one id per row of ``probs`` ``[..., V]`` from ``u`` ``[...]`` in [0, 1).

    ``probs`` need not be normalised: the row is sampled in proportion to its entries.  A token
    with zero probability is never returned, whatever rounding does to the CDF.
    """
    # Compare in the wider of the two dtypes: casting a float64 uniform down to float32 can round
    # it up to exactly 1.0, which would pile its mass onto the last token.
    dtype = torch.promote_types(probs.dtype, u.dtype)
    cdf = torch.cumsum(probs.to(dtype), dim=-1)
    total = cdf[..., -1:]
    target = u.to(device=cdf.device, dtype=dtype).unsqueeze(-1) * total
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    # The first id whose running sum exceeds u·total has mass of its own (the sum rose there).
    # Only when u·total rounds up to the total does the search run past the last token with
    # mass; that rare case alone pays for finding it (a flip and arg-max over the vocabulary).
    v = probs.shape[-1]
    if not bool((idx >= v).any()):
        return idx
    last = v - 1 - torch.argmax(torch.flip((probs > 0).to(torch.int8), dims=[-1]), dim=-1)
    return torch.minimum(idx, last)


def draw_uniforms(generators: list[torch.Generator], positions: int | Sequence[int], width: int = 2) -> Tensor:
    """``[R, P, width]`` float64 uniforms, each request from its own generator.

    ``positions`` is one count for every request or one per request (``P`` is the largest; rows
    past a request's own count are zero).  Request r consumes exactly ``positions[r] * width``
    numbers, in row order, so its stream depends only on its own history, never on which other
    requests share the batch or how many numbers they draw.  Every per-request random number of a
    round — a drafter's sampling, the verifier's accept/emit pairs — is drawn here.
    """
    if isinstance(positions, int):
        counts, rows = [positions] * len(generators), positions
    else:
        counts = [int(n) for n in positions]
        rows = max(counts, default=0)
    if len(counts) != len(generators):
        raise ValueError(f"{len(counts)} counts for {len(generators)} generators")
    if generators and rows and all(n == rows for n in counts):  # the usual round: one stack, not R slice writes
        return torch.stack([torch.rand(rows, width, generator=g, dtype=torch.float64) for g in generators])
    out = torch.zeros(len(generators), rows, width, dtype=torch.float64)
    for r, (g, n) in enumerate(zip(generators, counts)):
        if n:
            out[r, :n] = torch.rand(n, width, generator=g, dtype=torch.float64)
    return out

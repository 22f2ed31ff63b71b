"""Shipped calibrators: ``identity``, ``sts``, Sequential Temperature Scaling (paper §3.2.1), and
``online-sts``, which keeps re-fitting STS while serving (docs/design/calibration-scheduling.md).

A calibrator's file is a safetensors file (never a pickle: loading it cannot run code) whose
metadata header names the calibrator that wrote it, so a file from another calibrator — or from
something else entirely — is refused with an error naming the file instead of being misread.

Header keys: ``specforge.calibrator`` (the registered name), ``specforge.format`` (``"1"``), and
for a file written by ``specforge calibrate`` ``specforge.fitted_for`` (JSON: the drafter, its
checkpoint and γ the rounds came from, and their temperature), which the engine checks against the
pipeline it serves.
``sts`` and ``online-sts`` store one tensor, ``temperatures`` (float64 ``[G]``); ``identity``
stores none.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from specforge import hookimpl
from specforge.components import CalibrationData
from specforge.errors import SpecforgeError
from specforge.files import replace_atomically
from specforge.metrics import batched_ece, calibration_report, survival_outcomes

__all__ = [
    "CalibratorFileError",
    "IdentityCalibrator",
    "IdentityConfig",
    "OnlineSTS",
    "OnlineSTSConfig",
    "STSConfig",
    "SequentialTemperatureScaling",
]

FORMAT = "1"
_NAME_KEY = "specforge.calibrator"
_FORMAT_KEY = "specforge.format"
_FITTED_KEY = "specforge.fitted_for"
# Raw confidences are clamped into [EPS, 1 - EPS] before taking the logit so that a head that
# outputs exactly 0 or 1 gives a finite logit; the clamp is the only place order can be lost.
EPS = 1e-6
# Bound on grid × rounds elements scored at once, to keep the grid search's memory flat.
_CHUNK = 1 << 22


class CalibratorFileError(SpecforgeError, ValueError):
    """A calibrator file that cannot be loaded (wrong calibrator, bad shapes, not safetensors)."""


def _write(path: str | Path, name: str, tensors: dict[str, Tensor], fitted_for: dict[str, Any] | None = None) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    meta = {_NAME_KEY: name, _FORMAT_KEY: FORMAT}
    if fitted_for is not None:
        meta[_FITTED_KEY] = json.dumps(fitted_for, sort_keys=True)
    with replace_atomically(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)


def _fitted_for(path: str | Path) -> dict[str, Any] | None:
    """What a calibrator file says it was fitted for (None: it does not say)."""
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(_FITTED_KEY)
    try:
        return None if raw is None else dict(json.loads(raw))
    except (ValueError, TypeError):
        raise CalibratorFileError(f"{path}: its {_FITTED_KEY!r} header is not a JSON object") from None


def _read(path: str | Path, name: str) -> dict[str, Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibrator file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:
        raise CalibratorFileError(f"{path} is not a safetensors calibrator file: {exc}") from None
    writer = meta.get(_NAME_KEY)
    if writer is None:
        raise CalibratorFileError(f"{path} was not written by a specforge calibrator (no {_NAME_KEY!r} header)")
    if writer != name:
        raise CalibratorFileError(f"{path} was written by calibrator {writer!r}, not {name!r}")
    if meta.get(_FORMAT_KEY) != FORMAT:
        raise CalibratorFileError(f"{path} has format {meta.get(_FORMAT_KEY)!r}; expected {FORMAT!r}")
    return tensors


def _offsets(path: str | Path, tensors: dict[str, Tensor], temperatures: Tensor) -> Tensor | None:
    """The optional offsets of an ``sts`` file (``offsets: true``), checked against its temperatures."""
    b = tensors.get("offsets")
    if b is None:
        return None
    if b.shape != temperatures.shape or not b.is_floating_point() or not torch.isfinite(b).all():
        raise CalibratorFileError(f"{path}: 'offsets' must be finite and shaped like the temperatures "
                                  f"{tuple(temperatures.shape)}, got {tuple(b.shape)}")
    return b.to(torch.float64)


def _temperatures(path: str | Path, tensors: dict[str, Tensor], offsets: bool = False) -> Tensor:
    """The temperatures of a calibrator file, checked: non-empty, 1-D, finite and positive
    (``offsets``: an ``offsets`` tensor may sit beside them)."""
    t = tensors.get("temperatures")
    allowed = {"temperatures", "offsets"} if offsets else {"temperatures"}
    if t is None or not set(tensors) <= allowed:
        expected = "'temperatures' (and 'offsets')" if offsets else "exactly one tensor 'temperatures'"
        raise CalibratorFileError(f"{path}: expected {expected}, found {sorted(tensors)}")
    if t.dim() != 1 or t.numel() == 0:
        raise CalibratorFileError(f"{path}: 'temperatures' must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_floating_point() or not (torch.isfinite(t) & (t > 0)).all():
        raise CalibratorFileError(f"{path}: temperatures must be finite and positive")
    return t.to(torch.float64)


def _log_loss(pred: Tensor, observed: Tensor) -> Tensor:
    """Mean log loss of each row of ``pred [T, n]`` against ``observed [n]`` → ``[T]``."""
    p = pred.clamp(EPS, 1 - EPS)
    return -(observed * p.log() + (1 - observed) * (-p).log1p()).mean(-1)


def _logit(c: Tensor) -> Tensor:
    return torch.logit(c.to(torch.float64).clamp(EPS, 1 - EPS))


# --- identity ----------------------------------------------------------------------------------


class IdentityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bins: int = Field(20, ge=1, description="ECE bins of the fit report")


class IdentityCalibrator:
    """Leaves confidences unchanged; ``fit`` only reports how calibrated they already are."""

    name = "identity"

    def __init__(self, config: IdentityConfig | None = None) -> None:
        self.config = config or IdentityConfig()

    def fit(self, data: CalibrationData) -> dict[str, Any]:
        report = calibration_report(data, bins=self.config.bins)
        return {"calibrator": self.name, "before": report, "after": report}

    def apply(self, confidence: Tensor) -> Tensor:
        return confidence

    def save(self, path: str) -> None:
        _write(path, self.name, {})

    def load(self, path: str) -> None:
        if tensors := _read(path, self.name):
            raise CalibratorFileError(f"{path}: identity file holds unexpected tensors {sorted(tensors)}")


# --- sequential temperature scaling ------------------------------------------------------------


class _GridConfig(BaseModel):
    """The temperature grid and ECE bins an STS fit searches (``sts`` and ``online-sts``)."""

    model_config = ConfigDict(extra="forbid")
    t_min: float = Field(0.05, gt=0, description="smallest temperature on the grid")
    t_max: float = Field(20.0, gt=0, description="largest temperature on the grid")
    grid_size: int = Field(401, ge=2, description="log-spaced grid points (t = 1 is always added)")
    bins: int = Field(20, ge=1, description="ECE bins")

    @model_validator(mode="after")
    def _grid(self) -> _GridConfig:
        if self.t_min >= self.t_max:
            raise ValueError(f"t_min ({self.t_min}) must be below t_max ({self.t_max})")
        return self


class STSConfig(_GridConfig):
    path: str | None = Field(None, description="load fitted temperatures from this file at construction")
    offsets: bool = Field(
        False, description="also fit an offset b_k per position, ĉ_k = σ(logit(c_k)/t_k + b_k) (Platt scaling, "
                           "still order-preserving; the pair minimises the log loss of the cumulative product): "
                           "for a position whose error is a shift, which a temperature alone cannot undo")
    offset_max: float = Field(2.0, gt=0, description="offsets searched in [-offset_max, offset_max]")
    offset_grid: int = Field(41, ge=3, description="offset grid points (b = 0 is always among them)")
    temperatures: list[PositiveFloat] | None = Field(
        None, description="fitted temperatures t_1..t_G given inline (instead of path)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> STSConfig:
        if self.path is not None and self.temperatures is not None:
            raise ValueError("give fitted temperatures either inline or as a path, not both")
        if self.temperatures is not None and not self.temperatures:
            raise ValueError("temperatures must not be empty")
        return self


class SequentialTemperatureScaling:
    """ĉ_k = σ(logit(c_k) / t_k), with t_1..t_G fitted left to right (DSpark §3.2.1).

    ``fit`` chooses t_k from a log-spaced grid to minimise the ECE of the cumulative product
    Π_{i≤k} ĉ_i against 1[accepted ≥ k] on the rounds that verified k, with t_1..t_{k-1} already
    frozen.  Calibrating the product (not each c_k alone) is the point: the scheduler consumes
    prefix survival, and errors of the conditionals compound along the block.  A positive
    temperature is strictly increasing in c_k, so every position's ranking — and its AUROC — is
    unchanged.
    """

    name = "sts"

    def __init__(self, config: STSConfig | None = None) -> None:
        self.config = config or STSConfig()
        self.temperatures: Tensor | None = None
        self.offsets: Tensor | None = None  # b_k (``offsets: true``); None: zero
        # The drafter, checkpoint, γ and temperature of the rounds it was fitted on, when known
        # (``specforge calibrate`` sets it; the engine refuses a mismatch with its pipeline).
        self.fitted_for: dict[str, Any] | None = None
        if self.config.path is not None:
            self.load(self.config.path)
        elif self.config.temperatures is not None:
            self.temperatures = torch.tensor(self.config.temperatures, dtype=torch.float64)

    def _grid(self) -> Tensor:
        c = self.config
        grid = torch.logspace(math.log10(c.t_min), math.log10(c.t_max), c.grid_size, dtype=torch.float64)
        # t = 1 (leave the position alone) is always a candidate, so a position that is already
        # calibrated given its frozen prefix is never made worse on the fit rounds.
        return torch.cat([grid, torch.ones(1, dtype=torch.float64)]).unique()

    def _offset_grid(self) -> Tensor:
        c = self.config
        if not c.offsets:
            return torch.zeros(1, dtype=torch.float64)
        grid = torch.linspace(-c.offset_max, c.offset_max, c.offset_grid, dtype=torch.float64)
        return torch.cat([grid, torch.zeros(1, dtype=torch.float64)]).unique()

    def _search(self, logits: Tensor, prefix: Tensor, outcome: Tensor, grid: Tensor) -> tuple[float, float]:
        """The (t, b) of the grids minimising the ECE of the cumulative product at this position."""
        temps, offs = torch.cartesian_prod(grid, self._offset_grid()).unbind(1)
        n = logits.numel()
        step = max(1, _CHUNK // max(n, 1))
        # One parameter: the paper's ECE.  Two: ECE alone is degenerate — a huge temperature and an
        # offset flatten every score to the base rate, ECE ≈ 0 with no resolution left (measured on
        # the shipped drafter at T = 0: Brier 0.175 → 0.198) — so the pair minimises the log loss,
        # a proper score that rewards calibration and resolution together (Platt's own criterion).
        score = _log_loss if self.config.offsets else (lambda p, y: batched_ece(p, y, self.config.bins))
        scores = torch.cat([
            score(prefix * torch.sigmoid(logits / t[:, None] + b[:, None]), outcome)
            for t, b in zip(temps.split(step), offs.split(step))
        ])
        # Among (numerically) equal minima prefer the smallest change the data supports: the
        # temperature closest to 1, then the offset closest to 0.
        best = scores <= scores.min() + 1e-12
        distance = torch.where(best, temps.log().abs() + 1e-6 * offs.abs(), torch.full_like(temps, math.inf))
        i = distance.argmin()
        return float(temps[i]), float(offs[i])

    def fit(self, data: CalibrationData) -> dict[str, Any]:
        before = calibration_report(data, bins=self.config.bins)
        temps, offs = self.fit_parameters(data)
        after = calibration_report(data, self.apply(data.confidence), bins=self.config.bins)
        report = {"calibrator": self.name, "temperatures": temps, "before": before, "after": after}
        if self.config.offsets:
            report["offsets"] = offs
        return report

    def fit_parameters(self, data: CalibrationData) -> tuple[list[float], list[float]]:
        """Fit and set the per-position (temperature, offset) pairs, without :meth:`fit`'s
        before/after report — the part an online refit needs (the report costs more than the
        search itself: 9.4 of 10.9 s of a conformance case's refits, under cProfile)."""
        verified, survived = survival_outcomes(data)
        if not torch.isfinite(data.confidence).all():
            raise ValueError("sts fit: confidences contain non-finite values")
        logits = _logit(data.confidence.detach().cpu())
        grid = self._grid()
        prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # Π_{i<k} ĉ_i, frozen
        temps: list[float] = []
        offs: list[float] = []
        for j in range(logits.shape[1]):
            m = verified[:, j]
            if m.any():
                t, b = self._search(logits[m, j], prefix[m], survived[m, j].to(torch.float64), grid)
            else:
                # No round verified this position: nothing to fit, so carry the previous
                # parameters (the same rule apply uses past the fitted block).
                t, b = (temps[-1], offs[-1]) if temps else (1.0, 0.0)
            temps.append(t)
            offs.append(b)
            prefix = prefix * torch.sigmoid(logits[:, j] / t + b)
        self.temperatures = torch.tensor(temps, dtype=torch.float64)
        self.offsets = torch.tensor(offs, dtype=torch.float64) if self.config.offsets else None
        return temps, offs

    def apply(self, confidence: Tensor) -> Tensor:
        if self.temperatures is None:
            raise RuntimeError("sts calibrator is not fitted: call fit() or give config.path")
        g, fitted = confidence.shape[-1], self.temperatures.numel()
        t = self.temperatures
        b = self.offsets if self.offsets is not None else torch.zeros_like(t)
        if g > fitted:  # longer blocks than were fitted reuse the last position's parameters
            t, b = torch.cat([t, t[-1:].expand(g - fitted)]), torch.cat([b, b[-1:].expand(g - fitted)])
        out = torch.sigmoid(_logit(confidence) / t[:g].to(confidence.device) + b[:g].to(confidence.device))
        return out.to(confidence.dtype) if confidence.is_floating_point() else out

    def save(self, path: str) -> None:
        if self.temperatures is None:
            raise RuntimeError("sts calibrator is not fitted: nothing to save")
        tensors = {"temperatures": self.temperatures}
        if self.offsets is not None:
            tensors["offsets"] = self.offsets
        _write(path, self.name, tensors, self.fitted_for)

    def load(self, path: str) -> None:
        tensors = _read(path, self.name)
        self.temperatures = _temperatures(path, tensors, offsets=True)
        self.offsets = _offsets(path, tensors, self.temperatures)
        self.fitted_for = _fitted_for(path)


# --- online recalibration ---------------------------------------------------------------------


class OnlineSTSConfig(_GridConfig):
    # 4,096: measured on the shipped drafter's rounds in serving order, 1,024 rounds are the few
    # prompts in flight and the fit hovers after them; 4,096 settles within 0.005 of the offline fit
    # (docs/design/calibration-scheduling.md#measured-the-shipped-drafter)
    window: int = Field(4096, ge=8, description="most recent rounds kept (bounded memory; older ones are forgotten)")
    refit_every: int = Field(64, ge=1, description="rounds observed between refits")
    min_rounds: int = Field(128, ge=1, description="rounds observed before the first fit (identity until then)")
    width: int = Field(16, ge=1, description="positions kept per round (longer blocks reuse the last temperature)")
    path: str | None = Field(None, description="start from temperatures fitted offline (an sts or online-sts file)")


class OnlineSTS:
    """STS re-fitted while serving, from the outcomes of rounds already verified.

    The engine hands every verified chain round to :meth:`observe` *after* the round, so what
    the calibrator learns reaches only later rounds: a round's verify lengths depend on its own
    confidences and on the past, never on its own outcome (docs/design/verification.md#causality).
    The last ``window`` rounds are kept in a ring buffer (fixed memory); every ``refit_every``
    rounds, once ``min_rounds`` have been seen, the temperatures are fitted on the buffer
    exactly as ``sts`` fits them offline — so old evidence leaves the fit as new rounds arrive,
    and the calibrator follows a shift in the prompt mix within about one window.  Until the
    first fit it is the identity (or the temperatures of ``path``).  :meth:`state` reports what
    it holds.
    """

    name = "online-sts"

    def __init__(self, config: OnlineSTSConfig | None = None) -> None:
        self.config = c = config or OnlineSTSConfig()
        self._sts = SequentialTemperatureScaling(STSConfig(**{k: getattr(c, k) for k in _GridConfig.model_fields}))
        self._conf = torch.full((c.window, c.width), 0.5, dtype=torch.float64)
        self._verified = torch.zeros(c.window, dtype=torch.long)
        self._accepted = torch.zeros(c.window, dtype=torch.long)
        self.seen = 0  # rounds observed (requests that drafted, one row each)
        self.fits = 0
        self._since_fit = 0
        if c.path is not None:
            self.load(c.path)

    def observe(self, outcome: Any) -> None:
        """Keep the rows of a verified round (:class:`~specforge.components.RoundOutcome`) and
        re-fit when due."""
        drafted = outcome.available > 0
        if not bool(drafted.any()):
            return
        w, width = self.config.window, self.config.width
        conf = outcome.confidence[drafted].to(torch.float64)[-w:, :width]  # a round wider than the ring: its last rows
        n = conf.shape[0]
        slots = (self.seen + torch.arange(n)) % w
        self._conf[slots] = 0.5
        self._conf[slots, : conf.shape[1]] = conf
        self._verified[slots] = outcome.verified[drafted][-w:].clamp(max=conf.shape[1])
        self._accepted[slots] = torch.minimum(outcome.accepted[drafted][-w:], self._verified[slots])
        self.seen += n
        self._since_fit += n
        if self.seen >= self.config.min_rounds and self._since_fit >= self.config.refit_every:
            self._refit()

    def _refit(self) -> None:
        kept = min(self.seen, self.config.window)
        data = CalibrationData(self._conf[:kept], self._accepted[:kept], self._verified[:kept])
        self._sts.fit_parameters(data)  # no report: nobody reads one between rounds
        self.fits += 1
        self._since_fit = 0

    def fit(self, data: CalibrationData) -> dict[str, Any]:
        """An offline fit (a warm start); serving then keeps refining it."""
        report = self._sts.fit(data)
        return {**report, "calibrator": self.name}

    def apply(self, confidence: Tensor) -> Tensor:
        return confidence if self._sts.temperatures is None else self._sts.apply(confidence)

    @property
    def fitted_for(self) -> dict[str, Any] | None:
        """What its warm start was fitted for (checked by the engine like an ``sts`` file's)."""
        return self._sts.fitted_for

    @fitted_for.setter
    def fitted_for(self, value: dict[str, Any] | None) -> None:
        self._sts.fitted_for = value

    def state(self) -> dict[str, Any]:
        """What the calibrator holds: rounds seen and kept, fits so far, current temperatures."""
        t = self._sts.temperatures
        return {"rounds_seen": self.seen, "rounds_kept": min(self.seen, self.config.window), "fits": self.fits,
                "temperatures": None if t is None else t.tolist()}

    def save(self, path: str) -> None:
        if self._sts.temperatures is None:
            raise RuntimeError("online-sts has not fitted yet: nothing to save")
        _write(path, self.name, {"temperatures": self._sts.temperatures}, self._sts.fitted_for)

    def load(self, path: str) -> None:
        """Temperatures written by ``online-sts`` or by an offline ``sts`` fit."""
        try:
            self._sts.load(path)
        except CalibratorFileError as exc:
            if "was written by calibrator 'online-sts'" not in str(exc):
                raise
            self._sts.temperatures = _temperatures(path, _read(path, self.name))
            self._sts.fitted_for = _fitted_for(path)
        if self._sts.offsets is not None:
            raise CalibratorFileError(f"{path}: an sts fit with offsets; online-sts refits temperatures only — start "
                                      "it from a fit without offsets")


@hookimpl
def specforge_register_calibrators(register):
    register("identity", IdentityCalibrator, config=IdentityConfig, trainable=False,
             description="leave confidences unchanged (reports their calibration)")
    register("sts", SequentialTemperatureScaling, config=STSConfig, trainable=True,
             examples=({"temperatures": [2.0, 0.5, 1.5]}, {"temperatures": [0.3]}),
             description="sequential temperature scaling of the cumulative product (DSpark §3.2.1)")
    register("online-sts", OnlineSTS, config=OnlineSTSConfig, trainable=False,
             examples=({"window": 256, "refit_every": 16, "min_rounds": 32, "width": 4, "grid_size": 41},),
             description="STS re-fitted while serving from the outcomes of rounds already verified "
                         "(a window of recent rounds; identity until the first fit)")

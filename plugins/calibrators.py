"""Shipped calibrators: ``identity`` and ``sts``, Sequential Temperature Scaling (paper §3.2.1;
docs/design/calibration-scheduling.md).

A calibrator's file is a safetensors file (never a pickle: loading it cannot run code) whose
metadata header names the calibrator that wrote it, so a file from another calibrator — or from
something else entirely — is refused with an error naming the file instead of being misread.

Header keys: ``specforge.calibrator`` (the registered name), ``specforge.format`` (``"1"``).
``sts`` stores one tensor, ``temperatures`` (float64 ``[G]``); ``identity`` stores none.
"""

from __future__ import annotations

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
    "STSConfig",
    "SequentialTemperatureScaling",
]

FORMAT = "1"
_NAME_KEY = "specforge.calibrator"
_FORMAT_KEY = "specforge.format"
# Raw confidences are clamped into [EPS, 1 - EPS] before taking the logit so that a head that
# outputs exactly 0 or 1 gives a finite logit; the clamp is the only place order can be lost.
EPS = 1e-6
# Bound on grid × rounds elements scored at once, to keep the grid search's memory flat.
_CHUNK = 1 << 22


class CalibratorFileError(SpecforgeError, ValueError):
    """A calibrator file that cannot be loaded (wrong calibrator, bad shapes, not safetensors)."""


def _write(path: str | Path, name: str, tensors: dict[str, Tensor]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with replace_atomically(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={_NAME_KEY: name, _FORMAT_KEY: FORMAT})


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


class STSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    t_min: float = Field(0.05, gt=0, description="smallest temperature on the grid")
    t_max: float = Field(20.0, gt=0, description="largest temperature on the grid")
    grid_size: int = Field(401, ge=2, description="log-spaced grid points (t = 1 is always added)")
    bins: int = Field(20, ge=1, description="ECE bins")
    path: str | None = Field(None, description="load fitted temperatures from this file at construction")
    temperatures: list[PositiveFloat] | None = Field(
        None, description="fitted temperatures t_1..t_G given inline (instead of path)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> STSConfig:
        if self.path is not None and self.temperatures is not None:
            raise ValueError("give fitted temperatures either inline or as a path, not both")
        if self.temperatures is not None and not self.temperatures:
            raise ValueError("temperatures must not be empty")
        if self.t_min >= self.t_max:
            raise ValueError(f"t_min ({self.t_min}) must be below t_max ({self.t_max})")
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

    def _search(self, logits: Tensor, prefix: Tensor, outcome: Tensor, grid: Tensor) -> float:
        n = logits.numel()
        step = max(1, _CHUNK // max(n, 1))
        scores = torch.cat([
            batched_ece(prefix * torch.sigmoid(logits / g[:, None]), outcome, self.config.bins)
            for g in grid.split(step)
        ])
        # Among (numerically) equal minima prefer the temperature closest to 1: the smallest
        # change the data supports.
        best = scores <= scores.min() + 1e-12
        distance = torch.where(best, grid.log().abs(), torch.full_like(grid, math.inf))
        return float(grid[distance.argmin()])

    def fit(self, data: CalibrationData) -> dict[str, Any]:
        verified, survived = survival_outcomes(data)
        if not torch.isfinite(data.confidence).all():
            raise ValueError("sts fit: confidences contain non-finite values")
        logits = _logit(data.confidence.detach().cpu())
        grid = self._grid()
        prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # Π_{i<k} ĉ_i, frozen
        temps: list[float] = []
        for j in range(logits.shape[1]):
            m = verified[:, j]
            if m.any():
                t = self._search(logits[m, j], prefix[m], survived[m, j].to(torch.float64), grid)
            else:
                # No round verified this position: nothing to fit, so carry the previous
                # temperature (the same rule apply uses past the fitted block).
                t = temps[-1] if temps else 1.0
            temps.append(t)
            prefix = prefix * torch.sigmoid(logits[:, j] / t)
        before = calibration_report(data, bins=self.config.bins)
        self.temperatures = torch.tensor(temps, dtype=torch.float64)
        after = calibration_report(data, self.apply(data.confidence), bins=self.config.bins)
        return {"calibrator": self.name, "temperatures": temps, "before": before, "after": after}

    def apply(self, confidence: Tensor) -> Tensor:
        if self.temperatures is None:
            raise RuntimeError("sts calibrator is not fitted: call fit() or give config.path")
        g, fitted = confidence.shape[-1], self.temperatures.numel()
        t = self.temperatures
        if g > fitted:  # longer blocks than were fitted reuse the last temperature
            t = torch.cat([t, t[-1:].expand(g - fitted)])
        out = torch.sigmoid(_logit(confidence) / t[:g].to(confidence.device))
        return out.to(confidence.dtype) if confidence.is_floating_point() else out

    def save(self, path: str) -> None:
        if self.temperatures is None:
            raise RuntimeError("sts calibrator is not fitted: nothing to save")
        _write(path, self.name, {"temperatures": self.temperatures})

    def load(self, path: str) -> None:
        tensors = _read(path, self.name)
        t = tensors.get("temperatures")
        if t is None or set(tensors) != {"temperatures"}:
            raise CalibratorFileError(f"{path}: expected exactly one tensor 'temperatures', found {sorted(tensors)}")
        if t.dim() != 1 or t.numel() == 0:
            raise CalibratorFileError(f"{path}: 'temperatures' must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
        if not t.is_floating_point() or not (torch.isfinite(t) & (t > 0)).all():
            raise CalibratorFileError(f"{path}: temperatures must be finite and positive")
        self.temperatures = t.to(torch.float64)


@hookimpl
def specforge_register_calibrators(register):
    register("identity", IdentityCalibrator, config=IdentityConfig, trainable=False,
             description="leave confidences unchanged (reports their calibration)")
    register("sts", SequentialTemperatureScaling, config=STSConfig, trainable=True,
             examples=({"temperatures": [2.0, 0.5, 1.5]}, {"temperatures": [0.3]}),
             description="sequential temperature scaling of the cumulative product (DSpark §3.2.1)")

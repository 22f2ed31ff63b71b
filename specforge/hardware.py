"""The hardware step curve SPS(B): target verify steps per second at a flattened batch of B tokens.

Hardware-aware schedulers weigh the expected accepted tokens of a round against what the extra
verified tokens cost, so they need SPS(B) for every B they might form.  A profile stores the
measured points; between them SPS is piecewise linear, and past the largest measured batch the
target is assumed compute-bound (time per step grows linearly with B), i.e.
SPS(B) = SPS(B_max)·B_max / B.  Below the smallest measured batch SPS stays at its value there:
a step cannot get faster than the smallest batch that was timed.

On disk a profile is one JSON object (``specforge profile`` writes it)::

    {
      "format": "specforge.hardware_profile",
      "version": 1,
      "device": "cpu: 2 cores",                 # free text: where it was measured
      "target": "SmolLM2-135M-Instruct",        # which target model (checked against the served one)
      "dtype": "bfloat16",                      # the dtype it ran in (checked too; optional)
      "points": [[1, 18.2], [2, 18.0], [4, 17.1], [8, 15.9]]   # [B, SPS(B)], B ≥ 1 integer
    }

``format`` and ``version`` may be omitted when writing by hand; anything else is an error that
names the file.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor

from specforge.errors import SpecforgeError

__all__ = ["FORMAT", "VERSION", "DraftCost", "HardwareProfile", "HardwareProfileError"]

FORMAT = "specforge.hardware_profile"
VERSION = 1
_KEYS = {"format", "version", "device", "target", "dtype", "points"}
UNKNOWN = "unknown"  # a profile that does not say (inline points, an older file): not checked


class HardwareProfileError(SpecforgeError, ValueError):
    """A step curve that cannot be built: bad points, or a profile file with bad content."""


def _checked_points(pairs: Sequence[tuple[Any, Any]], key: str, value: str, *, zero_ok: bool) -> list[tuple[int, float]]:
    """``(x, y)`` points sorted by x, each x a positive integer given once and each y a finite
    number, positive (or ≥ 0 with ``zero_ok``); ``key`` names x, ``value`` formats y's name."""
    clean: dict[int, float] = {}
    for x, y in pairs:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise HardwareProfileError(f"{key} {x!r} is not a positive integer")
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not (math.isfinite(y) and (y > 0 or zero_ok and y == 0)):
            raise HardwareProfileError(f"{value.format(x)} = {y!r} is not a {'non-negative' if zero_ok else 'positive'} "
                                       "finite number")
        if x in clean:
            raise HardwareProfileError(f"{key} {x} is given twice")
        clean[x] = float(y)
    return sorted(clean.items())


class HardwareProfile:
    """Measured SPS(B) points with lookup between and beyond them.

    Args:
        points: ``{B: sps}``, or a sequence of sps values where index 0 is B = 1.  Every B is a
            positive integer and every sps a positive finite number.
        device: where the points were measured (free text, kept in the JSON file).
        target: which target model they were measured for (its name as the runtime reports it).
        dtype: the dtype the target ran in (``bfloat16``, ``float32``…).
    """

    def __init__(
        self,
        points: Mapping[int, float] | Sequence[float],
        *,
        device: str = UNKNOWN,
        target: str = UNKNOWN,
        dtype: str = UNKNOWN,
    ) -> None:
        if isinstance(points, Mapping):
            pairs = list(points.items())
        elif isinstance(points, (str, bytes)) or not isinstance(points, Sequence):
            raise HardwareProfileError(
                f"SPS points must be a {{B: sps}} mapping or a list of sps values, got {points!r}"
            )
        else:
            pairs = [(i + 1, v) for i, v in enumerate(points)]
        self._set(pairs, device, target, dtype)

    def _set(self, pairs: Sequence[tuple[Any, Any]], device: str, target: str, dtype: str = UNKNOWN) -> None:
        if not pairs:
            raise HardwareProfileError("a hardware profile needs at least one SPS point")
        ordered = _checked_points(pairs, "batch size", "SPS({})", zero_ok=False)
        self.device = str(device)
        self.target = str(target)
        self.dtype = str(dtype)
        self.batch = torch.tensor([b for b, _ in ordered], dtype=torch.float64)
        self.values = torch.tensor([v for _, v in ordered], dtype=torch.float64)

    # -- lookup ------------------------------------------------------------------------------

    @overload
    def sps(self, batch: int | float) -> float: ...
    @overload
    def sps(self, batch: Tensor) -> Tensor: ...

    def sps(self, batch: int | float | Tensor) -> float | Tensor:
        """SPS at flattened batch size(s) ``batch``; a tensor gives a float64 tensor of its shape."""
        if not isinstance(batch, Tensor):
            return float(self.sps(torch.tensor(float(batch), dtype=torch.float64)))
        b = batch.to(torch.float64)
        xs, ys = self.batch.to(b.device), self.values.to(b.device)
        if len(xs) == 1:
            inside = ys[0]  # no interior: every B is at, below or beyond the one point
        else:
            hi = torch.searchsorted(xs, b.contiguous(), right=True).clamp(1, len(xs) - 1)
            lo = hi - 1
            t = (b - xs[lo]) / (xs[hi] - xs[lo])
            inside = ys[lo] + t * (ys[hi] - ys[lo])
        out = torch.where(b <= xs[0], ys[0], inside)
        # Compute-bound tail: step time grows linearly past the largest batch that was measured.
        tail = ys[-1] * xs[-1] / torch.where(b > xs[-1], b, xs[-1])
        return torch.where(b > xs[-1], tail, out)

    def points(self) -> list[tuple[int, float]]:
        """The measured ``(B, sps)`` pairs in increasing B."""
        return [(int(b), float(v)) for b, v in zip(self.batch.tolist(), self.values.tolist())]

    def __repr__(self) -> str:
        return (f"HardwareProfile({dict(self.points())!r}, device={self.device!r}, target={self.target!r}, "
                f"dtype={self.dtype!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HardwareProfile):
            return NotImplemented
        return (self.points(), self.device, self.target, self.dtype) == (other.points(), other.device, other.target,
                                                                          other.dtype)

    # -- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "device": self.device,
            "target": self.target,
            "dtype": self.dtype,
            "points": [[b, v] for b, v in self.points()],
        }

    @classmethod
    def from_dict(cls, data: Any) -> HardwareProfile:
        """Build from the JSON object described in the module docstring."""
        if not isinstance(data, dict):
            raise HardwareProfileError(f"expected a JSON object, got {type(data).__name__}")
        unknown = set(data) - _KEYS
        if unknown:
            raise HardwareProfileError(
                f"unknown key(s) {sorted(unknown)}; valid keys: {sorted(_KEYS)}"
            )
        if data.get("format", FORMAT) != FORMAT:
            raise HardwareProfileError(f"format is {data['format']!r}, expected {FORMAT!r}")
        if data.get("version", VERSION) != VERSION:
            raise HardwareProfileError(f"version {data['version']!r} is not supported (expected {VERSION})")
        if "points" not in data:
            raise HardwareProfileError('missing "points": a list of [B, sps] pairs')
        raw = data["points"]
        if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 for p in raw):
            raise HardwareProfileError(f'"points" must be a list of [B, sps] pairs, got {raw!r}')
        for key in ("device", "target", "dtype"):
            if not isinstance(data.get(key, ""), str):
                raise HardwareProfileError(f'"{key}" must be a string, got {data[key]!r}')
        # Through _set rather than a dict so that a batch size listed twice is reported.
        profile = cls.__new__(cls)
        profile._set(
            [(b, v) for b, v in raw], data.get("device", UNKNOWN), data.get("target", UNKNOWN),
            data.get("dtype", UNKNOWN))
        return profile

    def check_fits(self, target_name: str, dtype: str, source: str = "the hardware profile") -> None:
        """Refuse a step curve measured for another target or dtype (one :class:`HardwareProfileError`
        naming both); a profile that does not say (``unknown``) is accepted."""
        wrong = [f"{what} {mine!r} (this pipeline serves {theirs!r})"
                 for what, mine, theirs in (("target", self.target, target_name), ("dtype", self.dtype, dtype))
                 if mine != UNKNOWN and mine != theirs]
        if wrong:
            raise HardwareProfileError(f"{source} was measured for {' and '.join(wrong)}; measure this one with "
                                       f"`specforge profile --model {target_name} --dtype "
                                       f"{'auto' if '@' in dtype else dtype}` or use profile: auto")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        """Read a profile written by :meth:`save` (or by hand); errors name the file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"hardware profile {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise HardwareProfileError(f"hardware profile {str(path)!r} cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HardwareProfileError(f"hardware profile {str(path)!r} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except HardwareProfileError as exc:
            raise HardwareProfileError(f"hardware profile {str(path)!r}: {exc}") from None


DRAFT_COST_FORMAT = "specforge.draft_cost"


class DraftCost:
    """What drafting costs per round, ρ(R): the seconds the drafter, confidence estimator and
    calibrator spend on a round of R requests over the seconds of the target's plain pass of those
    R requests (so 0.2 = drafting adds a fifth of a plain step).

    A dimensionless ratio, measured in the same loop as its denominator, carries over to the step
    curve: a round that verifies n drafts costs (1/SPS(R + n) + ρ(R)/SPS(R)) seconds.  Between
    measured R it is piecewise linear; outside them it stays at the nearest point.

    Args:
        points: ``{R: ρ}`` (R ≥ 1 integer, ρ ≥ 0 finite), or one number for every R.
    """

    def __init__(self, points: Mapping[int, float] | float, *, device: str = UNKNOWN, target: str = UNKNOWN) -> None:
        if isinstance(points, (int, float)) and not isinstance(points, bool):
            points = {1: float(points)}
        if not isinstance(points, Mapping) or not points:
            raise HardwareProfileError(f"drafting cost needs {{R: ratio}} points or one number, got {points!r}")
        self._points = _checked_points(list(points.items()), "drafting cost: R =", "drafting cost ρ({})",
                                       zero_ok=True)
        self._requests = [r for r, _ in self._points]  # the bisect keys, read every round
        self.device, self.target = str(device), str(target)

    def ratio(self, num_requests: int) -> float:
        """ρ at ``num_requests`` requests."""
        hi = bisect.bisect_left(self._requests, num_requests)
        if hi == 0:
            return self._points[0][1]
        if hi == len(self._points):
            return self._points[-1][1]
        (r0, v0), (r1, v1) = self._points[hi - 1], self._points[hi]
        return v0 + (num_requests - r0) / (r1 - r0) * (v1 - v0)

    def points(self) -> list[tuple[int, float]]:
        return list(self._points)

    def __repr__(self) -> str:
        return f"DraftCost({dict(self._points)!r}, device={self.device!r}, target={self.target!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"format": DRAFT_COST_FORMAT, "version": VERSION, "device": self.device, "target": self.target,
                "points": [[r, v] for r, v in self._points]}

    @classmethod
    def from_dict(cls, data: Any) -> DraftCost:
        """Build from :meth:`to_dict`'s object."""
        try:
            if data.get("format") != DRAFT_COST_FORMAT:
                raise HardwareProfileError(f"format is {data.get('format')!r}, expected {DRAFT_COST_FORMAT!r}")
            return cls({int(r): v for r, v in data["points"]}, device=data.get("device", UNKNOWN),
                       target=data.get("target", UNKNOWN))
        except HardwareProfileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HardwareProfileError(f"not a drafting cost: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> DraftCost:
        """Read a file written from :meth:`to_dict`; errors name the file."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise HardwareProfileError(f"drafting cost {str(path)!r} cannot be read: {exc}") from None

"""Which matmul kernel a runtime's projections use, by the row count of the matmul.

A :class:`LinearPlan` is shared by every :class:`~specforge.toolkit.projection.Projection` of one
runtime; :func:`specforge.runtime.torch.precision.measure_precision` measures it on the target's own
passes (every kernel at every pass size, beside the precision) and caches it with the precision
plan.  docs: docs/engine.md#precision
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specforge.toolkit.bands import band_for, check_bands

__all__ = ["KERNELS", "LinearPlan", "measured_plan", "record_measured"]

KERNELS = ("linear", "wx", "packed")

# The plan measured on this machine for each dtype, by the last target that measured one: which
# kernel runs a matmul of r rows fastest is a fact about the CPU and the library more than about
# one model, so projections built later (a drafter's layers, its LM head) start from it.
_MEASURED: dict[torch.dtype, LinearPlan] = {}


def record_measured(dtype: torch.dtype, plan: LinearPlan) -> None:
    _MEASURED[dtype] = plan


def measured_plan(dtype: torch.dtype) -> LinearPlan | None:
    """The plan a target measured for ``dtype`` in this process, if any."""
    return _MEASURED.get(dtype)


@dataclass(frozen=True)
class LinearPlan:
    """``bands``: ``(first_rows, kernel)`` in increasing ``first_rows``, the first at 1; a matmul of
    r rows uses the kernel of the last band starting at or below r."""

    bands: tuple[tuple[int, str], ...] = ((1, "linear"),)

    def __post_init__(self) -> None:
        check_bands(self.bands, KERNELS, "matmul kernel")

    @classmethod
    def fixed(cls, kernel: str) -> LinearPlan:
        return cls(((1, kernel),))

    @classmethod
    def default(cls, packed: bool) -> LinearPlan:
        """Before any measurement: oneDNN's packed weights where they exist, else ``F.linear``."""
        return cls.fixed("packed" if packed else "linear")

    @property
    def plain(self) -> bool:
        """``F.linear`` for every row count (nothing to choose per call)."""
        return self.bands == ((1, "linear"),)

    def kernel_for(self, rows: int) -> str:
        return band_for(self.bands, rows)

    @property
    def label(self) -> str:
        return ",".join(f"{k}@{first}" for first, k in self.bands)

"""Numeric tolerances derived from the dtype and the size of the reductions involved.

Two computations of the same values that differ only in how sums are ordered or blocked (a cached
pass against a full prefill, a batch of 8 rows against one row: other matmul shapes, other kernel
blocking) differ by rounding alone.  A dot product of n terms rounded in a type of unit roundoff u
moves by about √n·u relative to its terms' magnitude when the errors are independent (n·u at
worst); a network of ``depth`` such layers adds one such error per layer.  A tolerance written as
a constant fits the machine it was measured on (a float32 difference of 1.07e-4 against a 1e-4
bound failed on an AVX2-only CPU, whose kernels block the sums differently); this one follows
from the computation.
"""

from __future__ import annotations

import math

import torch

__all__ = ["order_tolerance"]

# Headroom over the √n model: the errors of one matmul are not quite independent, and a residual
# stream carries every earlier layer's rounding forward.
_HEADROOM = 8.0


def order_tolerance(dtype: torch.dtype, reduction: int, scale: float, depth: int = 1) -> float:
    """Largest expected |a - b| between two reorderings of a ``depth``-layer computation in
    ``dtype`` whose longest dot product has ``reduction`` terms and whose values are of magnitude
    ``scale`` (say, the reference's largest absolute value)."""
    eps = torch.finfo(dtype).eps
    return _HEADROOM * depth * math.sqrt(reduction) * eps * scale

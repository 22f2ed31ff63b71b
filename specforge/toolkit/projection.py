"""A dense projection ``y = x Wᵀ (+ b)`` run by the matmul kernel measured fastest on this CPU.

The target's runtime projects through it, and so may a drafter's or a head's own layers: a small
matmul beside the target's runs fastest the way the target's own were measured to (oneDNN's
pre-packed layout for bf16/fp16 on CPU, ``F.linear`` elsewhere), and it goes through the same
opaque op under ``torch.compile``.  The kernel choice (:class:`~specforge.toolkit.linear_plan.
LinearPlan`) and the compile op (:func:`~specforge.toolkit.compiled.register_projection`) are leaf
modules of the runtime's package; importing them loads no runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specforge.toolkit.compiled import register_projection
from specforge.toolkit.linear_plan import LinearPlan, measured_plan

__all__ = ["PACK_ROWS", "Projection", "onednn_linear", "pack_for_onednn"]


# The row count oneDNN lays the packed weights out for.  Packed for 16 rows, SmolLM2's 121
# projections streamed faster at every row count from 1 to 96 than packed for 1 (rows 1: 29.8 vs
# 39.6 ms; 16: 30.6 vs 41.6; 96: 45.6 vs 68.9, 2 threads), and in paired engine trials
# (compiled forward) plain decoding ran 1.09x faster at one request and 1.11x at 16, ngram at
# one request unchanged (1.01x) — medians of 10-20 interleaved trials on this 2-core kind.
PACK_ROWS = 16


def pack_for_onednn(weight: Tensor) -> Tensor | None:
    """``weight`` in oneDNN's blocked layout for :data:`PACK_ROWS` rows, or ``None`` where oneDNN
    cannot take it (not a CPU weight, a half type this CPU has no oneDNN kernel for — bf16 on an
    AVX2-only CPU — or a build without the op).

    float32 is packed too: on an AMD EPYC with AVX2 only, SmolLM2's 121 float32 projections took
    33/35/39/51/56 ms at 1/2/4/8/16 rows packed against 47/88/100/93/97 through ``F.linear``
    (2 threads), whose BLAS re-blocks the weights on every call once there are several rows."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    except (RuntimeError, AttributeError):  # a build without the op
        return None


def onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x Wᵀ (+ b)`` over a weight from :func:`pack_for_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Projection:
    """``y = x Wᵀ (+ b)`` through the matmul kernel measured fastest for the pass's row count.

    Which BLAS call runs a small matmul fastest depends on the CPU and the row count, not only on
    the maths: on an AMD EPYC with AVX2 only, the whole stack of SmolLM2's float32 projections
    took 52 ms for one row through ``F.linear`` but 93 ms for two (the library re-blocks the
    weights for every call once there are several rows), while ``W @ xᵀ`` — the weights as the
    left operand, streamed once — took 53 ms for two rows and 58 for four (one thread).  So a
    runtime's projections share a :class:`~specforge.toolkit.linear_plan.LinearPlan` (rows → kernel,
    measured per machine, see :mod:`specforge.toolkit.linear_plan`):

    * ``linear``: ``F.linear``;
    * ``wx``: ``(W @ xᵀ)ᵀ``, the weight streamed as the left operand;
    * ``packed``: bf16/fp16 weights pre-packed in oneDNN's blocked layout (where this torch and
      CPU can), which on a Xeon with AMX ran decoding 1.29x faster end to end than ``F.linear``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, plan: LinearPlan | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self._packed: Tensor | None | bool = False  # False: not packed yet (see `packed`)
        # Without a plan: the one a target measured for this dtype in this process (a drafter's
        # layers built after the target), else half types packed where oneDNN can (measured
        # faster on every CPU that has the kernel) and float32 on F.linear — bit for bit Hugging
        # Face's own matmul, what the parity tests compare with.
        half = weight.dtype in (torch.bfloat16, torch.float16)
        self.plan = plan or measured_plan(weight.dtype) or LinearPlan.default(half and self.packed is not None)
        # torch.compile reaches the packed weight, or a measured kernel, through an opaque op
        # (see target.compiled)
        self.key = register_projection(self)

    @property
    def packed(self) -> Tensor | None:
        """The weight in oneDNN's layout (made on first use; ``None`` where oneDNN cannot take it)."""
        if self._packed is False:
            self._packed = pack_for_onednn(self.weight)
        return self._packed  # type: ignore[return-value]

    def use(self, plan: LinearPlan) -> None:
        """Run by ``plan``; a plan that never names ``packed`` frees the packed copy."""
        self.plan = plan
        if all(kernel != "packed" for _, kernel in plan.bands):
            self._packed = False

    def packed_linear(self, x: Tensor) -> Tensor:
        """The projection by the kernel the plan names for ``x``'s rows."""
        kernel = self.plan.kernel_for(x.shape[0]) if x.dim() == 2 else "linear"
        if kernel == "packed" and self.packed is not None:
            return onednn_linear(x, self.packed, self.bias)
        if kernel == "wx":
            y = torch.mm(self.weight, x.t()).t().contiguous()
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: Tensor) -> Tensor:
        # Branch on the plan, not on `self.packed`: traced, the opaque packed tensor would become
        # a guarded graph input with symbolic sizes (~8 guards per projection, 2 of them Python
        # lambdas; a decode graph of SmolLM2 drops from ~2,500 guards to ~1,500 — no end-to-end
        # speed difference measured, 0.99x in 16 paired trials).
        if self.plan.plain:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return torch.ops.specforge.linear(x, self.key)
        return self.packed_linear(x)

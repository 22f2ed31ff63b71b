"""The torch sibling's backend: specforge's own transformer (:mod:`.model`), each pass in the
precision of its size band (:mod:`.precision`).  It serves every need — any layer's output, every
row's final hidden state — so teacher-forced feature extraction and training always run here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from specforge.passes import VarlenBatch
from specforge.runtime.contract import ForwardOutput, Needs
from specforge.runtime.torch.model import Transformer
from specforge.runtime.torch.precision import PrecisionPlan
from specforge.toolkit.linear_plan import record_measured

__all__ = ["TorchBackend"]


class TorchBackend:
    """The project's transformer: each pass in the runtime of its size band's precision."""

    name = "torch"

    def __init__(self, runtimes: Mapping[str, Transformer], precision: PrecisionPlan) -> None:
        """``runtimes``: one per precision of the plan, each given the matmul kernels the plan
        measured for it here — before anything times or compiles them."""
        self.runtimes, self.precision = dict(runtimes), precision
        for p, runtime in self.runtimes.items():
            kernels = precision.linear_plan(p)
            if kernels is not None:
                runtime.set_linear_plan(kernels)
                record_measured(runtime.dtype, kernels)  # what the drafters' projections read
        self.runtime = self.runtimes[precision.primary]

    @property
    def vocab_size(self) -> int:
        return int(self.runtime.lm_head.shape[0])

    def compile(self, enabled: bool = True) -> bool:
        """Run every runtime's passes through its compiled trunk (``False``: eager again); whether
        all of them are compiled (:meth:`Transformer.compile`)."""
        return all([runtime.compile(enabled) for runtime in self.runtimes.values()])

    @property
    def trunks(self) -> dict[str, Any]:
        """Each runtime's compiled trunk (None: eager), to switch back on with :meth:`use_trunks`."""
        return {p: runtime.compiled for p, runtime in self.runtimes.items()}

    def use_trunks(self, trunks: Mapping[str, Any] | None) -> None:
        """Switch to trunks from :attr:`trunks` (compiled once, kept), or eager with ``None``."""
        for p, runtime in self.runtimes.items():
            runtime.compiled = (trunks or {}).get(p)

    def new_cache(self, slots: int, capacity: int) -> Any:
        """A cache every runtime of the plan reads (in the primary runtime's KV dtype; a pass in
        another precision casts its q/k/v to it)."""
        return self.runtime.new_cache(slots, capacity)

    def cache_bytes(self, slots: int, capacity: int) -> int:
        """K and V of every layer at every position (the cache's pages are touched as it fills)."""
        a, itemsize = self.runtime.args, self.runtime.cache_dtype().itemsize
        return 2 * a.n_layers * slots * a.n_kv_heads * capacity * a.head_dim * itemsize

    def lacks(self, needs: Needs) -> str | None:
        """Nothing: every layer's output and the final hidden state come out of each pass."""
        return None

    def forward(self, batch: VarlenBatch, cache: Any, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        """One pass in the precision of its band; hidden states come back in the primary one."""
        if len(self.runtimes) == 1:
            return self.runtime(batch, cache, logits_rows, taps)
        runtime = self.runtimes[self.precision.precision_for(batch.num_tokens)]
        out = runtime(batch, cache, logits_rows, taps)
        if runtime.dtype == self.runtime.dtype:
            return out
        dtype = self.runtime.dtype
        return ForwardOutput(out.logits, out.hidden.to(dtype), {layer: t.to(dtype) for layer, t in out.taps.items()})

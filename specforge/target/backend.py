"""Which runtime computes a target's passes: the contract, its torch implementation, and the choice.

The engine, the step-curve measurement and the conformance suite talk to a target through two
calls: ``new_cache(slots, capacity)`` and ``forward(batch, cache, logits_rows, taps)``.  A backend
implements them; :class:`TorchBackend` runs the project's own transformer (:mod:`.model`) in the
precisions of its plan, :class:`~specforge.target.llamacpp.LlamaCppBackend` runs a GGUF in
libllama.  Sampling and verification stay in the project, over the logits a backend returns, so
the backend changes speed, never the law a pipeline samples from.

``target.backend: auto`` picks llama.cpp for a GGUF target on a CPU where the binding loads and
llama.cpp reads the file (the runtime CPU users already run a GGUF with), torch otherwise, and
says why once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from specforge.target.batch import VarlenBatch
from specforge.target.model import ForwardOutput, Transformer
from specforge.target.precision import PrecisionPlan

__all__ = ["BACKENDS", "TargetBackend", "TorchBackend", "auto_backend"]

BACKENDS = ("auto", "torch", "llama.cpp")


@runtime_checkable
class TargetBackend(Protocol):
    name: str

    def new_cache(self, slots: int, capacity: int) -> Any: ...

    def forward(self, batch: VarlenBatch, cache: Any, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput: ...

    def check_taps(self, taps: tuple[int, ...]) -> None: ...


class TorchBackend:
    """The project's transformer: each pass in the runtime of its size band's precision."""

    name = "torch"

    def __init__(self, runtimes: Mapping[str, Transformer], precision: PrecisionPlan) -> None:
        self.runtimes, self.precision = runtimes, precision
        self.runtime = runtimes[precision.primary]

    def new_cache(self, slots: int, capacity: int) -> Any:
        """A cache every runtime of the plan reads (in the primary runtime's KV dtype; a pass in
        another precision casts its q/k/v to it)."""
        return self.runtime.new_cache(slots, capacity)

    def check_taps(self, taps: tuple[int, ...]) -> None:
        """Every layer's output can be tapped."""

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


def auto_backend(gguf: Path | None) -> tuple[str, str]:
    """``(backend, reason)`` for ``target.backend: auto``."""
    if gguf is None:
        return "torch", "the target is a safetensors directory (llama.cpp runs GGUF files)"
    if torch.cuda.is_available():
        return "torch", "a CUDA device is present (the llama.cpp binding specforge builds is CPU-only)"
    from specforge.llamacpp.binding import BindingError, load

    try:
        load()
    except BindingError as exc:
        return "torch", str(exc)
    return "llama.cpp", "a GGUF target on a CPU, and the llama.cpp binding loads"

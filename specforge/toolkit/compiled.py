"""The target's forward through ``torch.compile``, with matmuls and most attention left out of it.

Eager decoding of a small model on a CPU spends a third of each step outside the matmuls: ~450
tiny kernels (norms, rotary, residual adds, casts), each paying dispatch and a pass over memory.
Inductor fuses them into a few C++ loops.  Two things it must not see, each behind an opaque
custom op: the pre-packed matmuls (``specforge::linear``) and, for prefills and float32
batches, the attention (``specforge::attend``), whose per-request loop would be unrolled into
one graph per batch size.  That attention's real implementation is the pass's eager varlen
attention, handed over through a context variable for the duration of the call.  Decode and
verify passes trace their attention instead: see :class:`CompiledTrunk`.

Sizes are symbolic from the first pass, so a handful of graphs (tens of seconds each for
SmolLM2) serve an engine configuration.  A machine without a working C++ toolchain gets a
warning and the eager forward, never an error.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specforge.runtime.torch.model import Transformer

__all__ = ["Attend", "CompiledTrunk", "compile_available", "register_projection"]

# (q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D], layer) -> o [N, Hq, D]: writes k/v into the cache
# at the pass's positions, then attends each token to its own request's keys.
Attend = Callable[[Tensor, Tensor, Tensor, int], Tensor]

_PASS_ATTENTION: ContextVar[Attend] = ContextVar("specforge_pass_attention")


# Both ops are declared with the low-level torch.library API rather than ``custom_op``: its
# Python wrapper (autograd check, aliasing check, dynamo guard) cost ~9 µs a call in inference
# mode, and a decoding step of SmolLM2 makes 120 projection calls (measured: 120 packed
# projections of one row, 11.1 ms through ``custom_op``, 10.2 ms through these, 9.4 ms direct).
_LIB = torch.library.Library("specforge", "DEF")  # held for the life of the process
_LIB.define("attend(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_LIB.define("linear(Tensor x, int key) -> Tensor")


def attend_op(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    # The cache write is a side effect the graph does not see; it stays ordered because every
    # layer's input depends on the previous layer's attention output.
    return _PASS_ATTENTION.get()(q, k, v, layer).contiguous()


_LIB.impl("attend", attend_op, "CompositeExplicitAutograd")


@torch.library.register_fake("specforge::attend")
def _(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    return q.new_empty(q.shape)


# Packed projections by key (anything with ``packed_linear`` and ``out_features``: the dense
# Projection, or target.quantized's Int4Projection).  oneDNN's pre-packed bf16 weights (see Projection) are opaque
# tensors inductor cannot lower, and its own packing (freezing) picks a blocking that runs the
# one-row matmuls of decoding about 2x slower.  So each packed projection is one custom op call
# the compiler leaves alone, keyed by an int: the weights never enter the graph at all.
_PROJECTIONS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_next_key = itertools.count()


def register_projection(projection: Any) -> int:
    """Key under which ``specforge::linear`` finds ``projection`` (held weakly)."""
    key = next(_next_key)
    _PROJECTIONS[key] = projection
    return key


def linear_op(x: Tensor, key: int) -> Tensor:
    return _PROJECTIONS[key].packed_linear(x)


_LIB.impl("linear", linear_op, "CompositeExplicitAutograd")


@torch.library.register_fake("specforge::linear")
def _(x: Tensor, key: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], _PROJECTIONS[key].out_features))


def compile_available() -> bool:
    """Whether inductor can build CPU kernels here (it needs a C++ compiler)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return True
    except Exception:  # no compiler found, or an inductor without the helper
        return False


# Errors of the compiler itself; anything else (a full cache, a bad token) is the pass's own.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = tuple(
    err for err in (getattr(torch._dynamo.exc, "BackendCompilerFailed", None),
                    getattr(torch._inductor.exc, "InductorError", None))
    if err is not None
)


class CompiledTrunk:
    """``runtime.trunk`` compiled, with the pass's attention bound for each call.

    Two families of graphs.  Passes whose attention is one SDPA per layer — a single request
    decoding one token, or the padded layout of short decode/verify runs in bf16/fp16 — trace it
    into the graph with the cache writes (each layer's cache is a graph input updated in place),
    so a decoding or verify step is one call of fused kernels.  Every other pass (prefills,
    float32 batches) calls attention through the opaque ``specforge::attend`` (see
    ``_PassAttention.traceable``).
    """

    def __init__(self, runtime: Transformer) -> None:
        self.runtime = runtime
        self.failed: str | None = None
        self._fns: dict[tuple[bool, tuple[int, ...]], Callable] = {}
        # Graphs specialise on a few layout facts (one token or several, prefill from position 0
        # or not); with taps variants and one trunk per loaded target that can exceed dynamo's
        # default of 8 graphs per function, after which it would silently run eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # On CPU the graph's wrapper is generated as C++ rather than Python: a SmolLM2 step runs
        # ~1,100 Python statements of wrapper (buffer allocation, size asserts, one call per kernel)
        # otherwise.  Paired trials, C++ wrapper ÷ Python wrapper: 1.09x at one request
        # (12 trials, quartiles 1.00-1.19), 1.07x at 16 (8 trials, 0.82-1.27); the first
        # compilation takes about twice as long (it builds the wrapper with the C++ compiler).
        self.options = {"cpp_wrapper": runtime.embed.device.type == "cpu"}

    def _compiled(self, traced: bool, taps: tuple[int, ...]) -> Callable:
        # The tapped layers are baked in as a constant (a closure), one function per tuple.  As a
        # frozenset: under dynamic=True the ints of an argument, or even of a closed-over tuple,
        # are traced as symbols, and `layer in taps` then comes out False.
        fn = self._fns.get((traced, taps))
        if fn is None:
            runtime, tapped = self.runtime, frozenset(taps)
            if traced:
                def trunk(tokens: Tensor, positions: Tensor, attend: Attend):
                    return runtime.trunk(tokens, positions, tapped, attend)
            else:
                def trunk(tokens: Tensor, positions: Tensor, attend: Attend):
                    return runtime.trunk(tokens, positions, tapped, torch.ops.specforge.attend)
            fn = self._fns[(traced, taps)] = torch.compile(trunk, dynamic=True, options=self.options)
        return fn

    def __call__(self, tokens: Tensor, positions: Tensor, taps: tuple[int, ...], attend: Attend):
        if self.failed is not None:
            return self.runtime.trunk(tokens, positions, taps, attend)
        traced = bool(getattr(attend, "traceable", False))
        bound = _PASS_ATTENTION.set(attend)
        try:
            return self._compiled(traced, taps)(tokens, positions, attend)
        except _COMPILE_ERRORS as exc:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"torch.compile of the target failed ({self.failed}); running it eagerly",
                          RuntimeWarning, stacklevel=2)
        finally:
            _PASS_ATTENTION.reset(bound)
        return self.runtime.trunk(tokens, positions, taps, attend)

"""Which backend the statistical runs' target decodes on: torch (the default) or llama.cpp.

The exact law always comes from the reference model's float64 forward; only the engine's target
changes.  On ``llama.cpp`` a Llama-family reference model is written as a GGUF file (float32
tensors, :func:`specforge.llamacpp.target_gguf.write_llama_gguf`) and run in libllama, so the
suite checks that a combination keeps the target's law when the passes are llama.cpp's — its
rollback, its sequences, its float16 KV cache.  Other families have no such writer and keep torch.
"""

from __future__ import annotations

import contextvars
import functools
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["current_backend", "llamacpp_target", "target_backend"]

_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("specforge_conformance_backend", default="torch")


@contextmanager
def target_backend(name: str) -> Iterator[None]:
    """Run the statistical cases inside the block on ``name`` (``torch`` or ``llama.cpp``)."""
    if name not in ("torch", "llama.cpp"):
        raise ValueError(f"backend must be torch or llama.cpp, not {name!r}")
    token = _BACKEND.set(name)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_backend() -> str:
    return _BACKEND.get()


@functools.lru_cache(maxsize=8)
def llamacpp_target(spec):
    """``spec``'s reference model on the llama.cpp backend (its GGUF written once per process)."""
    from specforge.llamacpp.target_gguf import write_llama_gguf
    from specforge.target import TargetModel
    from specforge_conformance.exact import reference_hf_model

    model = reference_hf_model(spec)
    folder = Path(tempfile.mkdtemp(prefix="specforge-conformance-gguf-"))
    gguf = write_llama_gguf(model, folder / f"reference-{spec.family}-{spec.vocab}-{spec.seed}.gguf")
    return TargetModel(model, None, torch.float32, name=f"reference-{spec.family}-llama.cpp", gguf=gguf,
                       backend="llama.cpp")

"""Which backend the statistical runs' target decodes on: torch (the default) or llama.cpp.

The exact law always comes from the reference model's float64 forward; only the engine's target
changes.  On ``llama.cpp`` a Llama-family reference model is written as a GGUF file (float32
tensors, :func:`specforge.runtime.llamacpp.write_gguf.write_llama_gguf`) and run in libllama, so the
suite checks that a combination keeps the target's law when the passes are llama.cpp's — its
rollback, its sequences, its float16 KV cache.  Other families have no such writer and keep torch.
"""

from __future__ import annotations

import contextvars
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["current_backend", "gguf_target", "target_backend"]

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


def gguf_target(model, name: str):
    """``model`` (a Llama-family reference model) written as a GGUF and loaded on the llama.cpp backend."""
    from specforge.model_args import ModelArgs
    from specforge.runtime import TargetModel
    from specforge.runtime.llamacpp.backend import LlamaCppBackend
    from specforge.runtime.llamacpp.write_gguf import write_llama_gguf

    folder = Path(tempfile.mkdtemp(prefix="specforge-conformance-gguf-"))
    # The reference model in memory, its passes in libllama: the law is the model's, the arithmetic
    # llama.cpp's (a target built from parts, not loaded from files: no backend to decide).
    args = ModelArgs.from_hf_config(model.config)
    llama = LlamaCppBackend(write_llama_gguf(model, folder / f"{name}.gguf"), args.n_layers, args.dim,
                            int(model.get_output_embeddings().weight.shape[0]))
    return TargetModel(model, None, torch.float32, name=f"{name}-llama.cpp", backend=llama)

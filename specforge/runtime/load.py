"""The one way to get a target: :func:`load_target` reads the files, builds the torch runtime in
the precisions its plan measures, and decides — once, with what the caller needs — which backend
computes the passes (:mod:`.choice`).  The :class:`~specforge.runtime.target.TargetModel` it
returns keeps that backend for good.

Everything that can be refused is refused before the (slow) load; the defaults are the pipeline
configuration's (:class:`~specforge.config.TargetConfig`), whether a caller passes that section or
a model name with a few of its fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specforge.config import BACKENDS, TargetConfig
from specforge.machine import machine_key
from specforge.model_args import ModelArgs
from specforge.model_files import load_hf, resolve_model
from specforge.runtime.contract import Needs
from specforge.runtime.target import DTYPES, TargetModel, build_runtime, dtype_name
from specforge.runtime.torch.backend import TorchBackend
from specforge.runtime.torch.kv_dtype import KV_DTYPES
from specforge.runtime.torch.model import Transformer
from specforge.runtime.torch.precision import (
    PrecisionError,
    method_key,
    precision_candidates,
    require_float16,
    resolve_precision,
)
from specforge.runtime.torch.quantized import NativeWeightsError, require_bfloat16

__all__ = ["load_target"]

FIELDS = tuple(f for f in TargetConfig.model_fields if f != "model")


def _settings(spec: TargetConfig | str, fields: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"load_target: unknown field {unknown[0]!r}; the target's fields are {', '.join(FIELDS)}")
    base = spec if isinstance(spec, TargetConfig) else TargetConfig.model_construct(model=spec)
    settings = {**{f: getattr(base, f) for f in ("model", *FIELDS)}, **fields}
    if isinstance(settings["dtype"], torch.dtype):
        settings["dtype"] = dtype_name(settings["dtype"])
    return settings


def _refuse(s: dict[str, Any]) -> None:
    """Every setting checked once, each with the message that names its valid values."""
    if s["dtype"] != "auto" and s["dtype"] not in DTYPES:
        raise PrecisionError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {s['dtype']!r}")
    if s["kv_dtype"] not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {s['kv_dtype']!r}")
    if s["compile"] not in (True, False, "auto"):
        raise ValueError(f"compile must be true, false or 'auto', not {s['compile']!r}")
    if s["weights"] not in ("auto", "dense", "native"):
        raise ValueError(f"weights must be 'auto', 'dense' or 'native', not {s['weights']!r}")
    if s["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {s['backend']!r}")


def load_target(spec: TargetConfig | str = "smollm2", *, needs: Needs | Callable[[ModelArgs], Needs] = Needs(),
                log: Callable[[str], None] | None = None, **fields: Any) -> TargetModel:
    """Load the embedded default, an HF directory or a GGUF file (:mod:`specforge.model_files`).

    ``spec`` is a pipeline's ``target`` section or a model name; ``fields`` override its
    ``dtype``, ``compile``, ``weights``, ``kv_dtype`` and ``backend`` (the defaults are the
    section's).  ``dtype`` is a precision or ``auto`` (measured on this machine per pass size, once,
    cached: :mod:`.torch.precision`); ``weights="native"`` runs a GGUF's 4-bit blocks as stored;
    ``compile`` turns on the compiled forward, ``"auto"`` where it measured faster here;
    ``kv_dtype`` is the KV cache's dtype.

    ``needs`` says what the caller reads from the passes besides logits (or, given the target's
    shape, computes it: a drafter's taps depend on the target's depth); ``backend`` (``torch``,
    ``llama.cpp`` or ``auto``) is decided with it, once (:func:`.choice.choose_backend`).  The torch
    runtime is built whatever computes the passes: drafters share its embedding and LM head, and
    teacher-forced feature extraction and training run on it."""
    s = _settings(spec, fields)
    _refuse(s)
    model, dtype, compile, weights, kv_dtype, backend = (s[k] for k in ("model", "dtype", "compile", "weights",
                                                                        "kv_dtype", "backend"))
    directory, gguf_file = resolve_model(model)
    gguf = directory / gguf_file if gguf_file else None
    if backend == "llama.cpp":
        from specforge.runtime.llamacpp.backend import BackendUnsupported
        from specforge.runtime.llamacpp.libllama import load as load_binding

        if gguf is None:
            raise BackendUnsupported(f"target.backend=llama.cpp runs GGUF files; {model} is a safetensors "
                                     "directory (use target.backend=torch)")
        if weights == "native" or compile:
            key = "target.weights=native" if weights == "native" else "target.compile"
            raise BackendUnsupported(f"{key} configures the torch backend; target.backend is llama.cpp")
        load_binding()  # a missing binding is refused before the slow load
        # The torch runtime still serves drafters, heads, features and training, in the
        # precision dtype names or measures (dense: the 4-bit runtime is a pass kernel).
        weights, compile = "dense", False
    if weights == "native":
        if gguf is None:
            raise NativeWeightsError(f"{model}: native weights are a GGUF's own 4-bit blocks; "
                                     "this target is a safetensors directory (use weights=dense)")
        if dtype != "auto":
            require_bfloat16(DTYPES[dtype])
    if dtype == "float16":
        require_float16()
    hf_model, tokenizer = load_hf(model, torch.float32)
    args = ModelArgs.from_hf_config(hf_model.config)
    built: dict[str, Transformer] = {}

    def build(precision: str) -> Transformer:
        if precision not in built:
            # Built outside inference mode even when the measurement (which runs in it) asks
            # first: the runtimes it builds are kept, and a drafter trained on them saves the
            # shared LM head for its backward pass, which an inference tensor cannot be.
            with torch.inference_mode(False):
                runtime = build_runtime(args, hf_model, precision, gguf)
            runtime.kv_dtype = kv_dtype
            built[precision] = runtime
        return built[precision]

    if weights == "native":
        candidates, skipped, auto = ("q4",), {}, False
    elif dtype != "auto":
        candidates, skipped, auto = (dtype,), {}, False
    else:
        candidates, skipped = precision_candidates(gguf if weights == "auto" else None, weights)
        auto = True
    key = machine_key(kind="precision", target=model, candidates=candidates, auto=auto, kv_dtype=kv_dtype,
                      method=method_key())
    plan = resolve_precision(model, build, candidates, skipped, key, log=log, auto=auto)
    torch_backend = TorchBackend({p: build(p) for p in plan.precisions}, plan)
    compile_choice = None
    if compile == "auto":
        from specforge.runtime.torch import compile_choice as compile_mod
        from specforge.toolkit.compiled import compile_available

        compile_key = machine_key(kind="compile", target=model, precision=plan.label, kv_dtype=kv_dtype,
                                  compiler=compile_available(), method=compile_mod.method_key())
        compile_choice = compile_mod.resolve_compile(torch_backend, model, compile_key, log=log)
    elif compile:
        torch_backend.compile()

    def open_llamacpp() -> Any:
        from specforge.runtime.llamacpp.backend import LlamaCppBackend

        return LlamaCppBackend(gguf, args.n_layers, args.dim, torch_backend.vocab_size)

    def backend_key() -> str:
        from specforge.runtime import choice
        from specforge.runtime.llamacpp.libllama import load as load_binding

        return machine_key(kind="backend", target=model, precision=plan.label, kv_dtype=kv_dtype,
                           compiled=torch_backend.runtime.compiled is not None, binding=load_binding().version,
                           method=choice.method_key())

    from specforge.runtime.choice import choose_backend

    wanted = needs(args) if callable(needs) else needs
    passes = choose_backend(backend, torch_backend, open_llamacpp, gguf, wanted, name=model,
                            vocab=torch_backend.vocab_size, key=backend_key, log=log)
    return TargetModel(hf_model, tokenizer, name=model, backend=passes, torch_backend=torch_backend,
                       compile_choice=compile_choice)

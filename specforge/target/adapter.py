"""The target adapter: one object the engine, drafters and trainers talk to."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specforge.target.args import ModelArgs
from specforge.target.backend import BACKENDS, TargetBackend, TorchBackend, auto_backend
from specforge.target.batch import VarlenBatch
from specforge.target.cache import SlotTable
from specforge.target.kv_dtype import KV_DTYPES
from specforge.target.loading import load_hf, resolve_model
from specforge.machine import machine_key
from specforge.target.linear_plan import record_measured
from specforge.target.model import ForwardOutput, Transformer
from specforge.target.precision import (
    DTYPE,
    PrecisionError,
    PrecisionPlan,
    method_key,
    precision_candidates,
    require_float16,
    resolve_precision,
)
from specforge.target.quantized import NativeWeightsError, require_bfloat16, use_native_weights

__all__ = ["DTYPES", "TargetModel", "build_runtime", "dtype_name"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the name configs, manifests and profiles use."""
    return str(dtype).removeprefix("torch.")


def build_runtime(args: ModelArgs, hf_model: Any, precision: str, gguf: Path | None = None) -> Transformer:
    """The runtime transformer of ``hf_model`` in ``precision`` (``q4``: bf16 with the GGUF
    ``gguf``'s 4-bit blocks as its projections; :class:`NativeWeightsError` where none can be)."""
    with torch.no_grad():
        runtime = Transformer(args, hf_model, DTYPE[precision]).eval()
        if precision == "q4":
            if gguf is None:
                raise NativeWeightsError("q4 runs a GGUF's own 4-bit blocks; this target is not a GGUF")
            runtime.native_counts = use_native_weights(runtime, hf_model, gguf)
            if runtime.native_counts["native"] == 0:
                raise NativeWeightsError(f"{gguf.name}: no projection is stored as Q4_0/Q4_1 with a row count the "
                                         "int4 kernel packs (a multiple of 16)")
    return runtime


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TargetModel:
    """A Hugging Face causal LM behind the specforge runtime.

    ``runtime`` is the fast flattened-batch transformer in the primary precision; ``runtimes``
    holds one per precision the plan uses (:mod:`.precision`: ``target.dtype: auto`` may run
    one-row passes in bf16 and bigger ones in float32), and :meth:`forward` sends each pass to its
    band's.  ``hf_model`` (kept in float32) is the unchanged Hugging Face model, the oracle tests
    compare against.
    """

    def __init__(self, hf_model: Any, tokenizer: Any = None, dtype: torch.dtype = torch.float32,
                 name: str = "model", precision: PrecisionPlan | None = None,
                 runtimes: Mapping[str, Transformer] | None = None, gguf: Path | None = None,
                 backend: str = "torch", backend_auto: bool = False) -> None:
        self.name = name
        self.compile_choice: Any = None  # target.compile: auto's verdict (compile_choice.CompileChoice)
        self.args = ModelArgs.from_hf_config(hf_model.config)
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.precision = precision or PrecisionPlan.fixed(dtype_name(dtype))
        # projections running natively on 4-bit blocks vs dense (see load(weights="native"))
        self.weights = {"native": 0, "dense": 4 * self.args.n_layers + 1}  # + the LM head
        built = dict(runtimes or {})
        self.runtimes: dict[str, Transformer] = {}
        for p in self.precision.precisions:
            self.runtimes[p] = built.get(p) or build_runtime(self.args, hf_model, p, gguf)
            kernels = self.precision.linear_plan(p)
            if kernels is not None:
                self.runtimes[p].set_linear_plan(kernels)
                record_measured(self.runtimes[p].dtype, kernels)
            if p == "q4":
                self.weights = self.runtimes[p].native_counts
        self.runtime = self.runtimes[self.precision.primary]
        self.dtype = self.runtime.dtype
        self.eos_ids = self._eos_ids(hf_model, tokenizer)
        # Who computes the passes (:mod:`.backend`).  The torch runtime above stays either way: the
        # drafters share its embedding and LM head, and training reads it.
        # ``torch`` stays the runtime of teacher-forced feature extraction (long prefills with taps and
        # the final hidden state), whatever computes the engine's passes.
        self.torch = TorchBackend(self.runtimes, self.precision)
        self.backend: TargetBackend = self.torch
        self.backend_auto = backend_auto  # chosen by target.backend: auto (see serve_taps)
        if backend == "llama.cpp":
            from specforge.target.llamacpp import BackendUnsupported, LlamaCppBackend

            if gguf is None:
                raise BackendUnsupported(f"target.backend=llama.cpp runs GGUF files; {name} is not one (use "
                                         "target.backend=torch)")
            self.backend = LlamaCppBackend(gguf, self.args.n_layers, self.args.dim, self.vocab_size)
        elif backend != "torch":
            raise ValueError(f"backend must be one of torch, llama.cpp; got {backend!r}")

    @classmethod
    def from_config(cls, config: Any) -> TargetModel:
        """Load the target a pipeline's ``target`` section (:class:`~specforge.config.TargetConfig`) names."""
        return cls.load(config.model, config.dtype, config.compile, config.weights, config.kv_dtype,
                        backend=config.backend)

    @classmethod
    def load(cls, model: str = "smollm2", dtype: str | torch.dtype = "auto",
             compile: bool | str = False, weights: str = "auto", kv_dtype: str = "auto",
             log: Any = None, backend: str = "torch") -> TargetModel:
        """Load the embedded default, an HF directory or a GGUF file (see :mod:`.loading`).

        ``dtype`` is a precision (``float32``, ``bfloat16``, ``float16``) or ``"auto"``: measured
        on this machine per pass size, once, cached (:mod:`.precision`).  ``weights="native"``
        runs a GGUF's 4-bit blocks as stored (:mod:`.quantized`; bf16 activations), ``"auto"`` lets
        ``dtype: auto`` try them; ``compile`` turns on the compiled forward
        (:meth:`Transformer.compile`), ``"auto"`` where it measured faster on this machine
        (:mod:`.compile_choice`); ``kv_dtype`` is the KV cache's dtype (:mod:`.kv_dtype`).

        ``backend`` computes the engine's passes (:mod:`.backend`): ``torch``, ``llama.cpp`` (a GGUF
        in libllama; the torch runtime is still built, dense, for what drafters, features and
        training share with the target) or ``auto`` (chosen here, and said why through ``log``)."""
        dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
        # Everything that can be refused is refused before the (slow) load.
        if dtype != "auto" and dtype not in DTYPES:
            raise PrecisionError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be true, false or 'auto', not {compile!r}")
        if weights not in ("auto", "dense", "native"):
            raise ValueError(f"weights must be 'auto', 'dense' or 'native', not {weights!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        directory, gguf_file = resolve_model(model)
        gguf = directory / gguf_file if gguf_file else None
        chosen = backend == "auto"
        if chosen:
            backend, why = auto_backend(gguf)
            if backend == "torch":
                (log or _say)(f"target.backend: auto → torch ({why})")
        if backend == "llama.cpp" and not chosen:
            from specforge.target.llamacpp import BackendUnsupported

            if gguf is None:
                raise BackendUnsupported(f"target.backend=llama.cpp runs GGUF files; {model} is a safetensors "
                                         "directory (use target.backend=torch)")
            if weights == "native" or compile:
                key = "target.weights=native" if weights == "native" else "target.compile"
                raise BackendUnsupported(f"{key} configures the torch backend; target.backend is llama.cpp")
            from specforge.llamacpp.binding import load as load_binding

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
        target = cls(hf_model, tokenizer, name=model, precision=plan,
                     runtimes={p: build(p) for p in plan.precisions}, gguf=gguf, backend=backend,
                     backend_auto=chosen)
        if compile == "auto":
            from specforge.target import compile_choice
            from specforge.target.compiled import compile_available

            compile_key = machine_key(kind="compile", target=model, precision=plan.label, kv_dtype=kv_dtype,
                                      compiler=compile_available(), method=compile_choice.method_key())
            target.compile_choice = compile_choice.resolve_compile(target, compile_key, log=log)
        elif compile:
            target.compile()
        if chosen and backend == "llama.cpp":  # both can decode it: keep the faster here
            from specforge.llamacpp.binding import load as load_binding
            from specforge.target import backend_choice

            backend_key = machine_key(kind="backend", target=model, precision=plan.label, kv_dtype=kv_dtype,
                                      compiled=target.runtime.compiled is not None, binding=load_binding().version,
                                      method=backend_choice.method_key())
            if backend_choice.resolve_backend(target, backend_key, log=log).backend == "torch":
                target.backend = target.torch
        return target

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

    @property
    def precision_label(self) -> str:
        """The precision every pass runs in (``bfloat16``), or the plan's bands
        (``bfloat16@1,float32@2+``), or ``llama.cpp`` (the GGUF's own types, in libllama): what
        profiles, manifests and benchmark records name."""
        return self.backend.name if self.backend.name != "torch" else self.precision.label

    @staticmethod
    def _eos_ids(hf_model: Any, tokenizer: Any) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # -- text ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.runtime.lm_head.shape[0])

    @property
    def max_positions(self) -> int:
        return self.args.max_positions

    def encode(self, prompt: str | Sequence[dict[str, str]], chat: bool = True) -> list[int]:
        """Token ids of a prompt: a user message (or a message list) through the chat template
        when the tokenizer has one, the plain text otherwise."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer; pass token ids instead")
        if chat and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(i) for i in ids]
        if not isinstance(prompt, str):
            raise ValueError("a message list needs a tokenizer with a chat template")
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- compute ---------------------------------------------------------------------------------

    def serve_taps(self, taps: tuple[int, ...], log: Any = None) -> None:
        """Make sure the backend can extract ``taps`` (the layers a drafter reads): a llama.cpp
        backend that ``target.backend: auto`` chose and that cannot hands the passes back to torch
        (said once); one asked for by name is a :class:`~specforge.errors.ConfigError`."""
        from specforge.errors import ConfigError, SpecforgeError

        try:
            self.backend.check_taps(taps)
        except SpecforgeError as exc:
            if not self.backend_auto:
                raise ConfigError([f"target.backend: {exc}"]) from exc
            (log or _say)(f"target.backend: auto → torch ({exc})")
            self.backend = self.torch

    def new_cache(self, slots: int, capacity: int) -> SlotTable:
        """A cache of ``slots`` requests × ``capacity`` positions for this target's backend."""
        return self.backend.new_cache(slots, capacity)

    @torch.inference_mode()
    def forward(self, batch: VarlenBatch, cache: SlotTable, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        """One pass over ``batch`` (:class:`~specforge.target.backend.TargetBackend`)."""
        return self.backend.forward(batch, cache, logits_rows, taps)

    @torch.inference_mode()
    def reference_logits(self, ids: Sequence[int]) -> Tensor:
        """``[T, V]`` float32 logits of the Hugging Face forward over ``ids`` (the oracle)."""
        out = self.hf_model(torch.tensor([list(ids)]), use_cache=False)
        return out.logits[0].float()

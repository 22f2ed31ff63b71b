"""The target: one object the engine, drafters and trainers talk to — the model's weights, tokenizer
and shape, its torch runtime (what drafters share and teacher-forced passes run on), and the backend
its passes run on, decided once by :func:`~specforge.runtime.load.load_target` and kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specforge.errors import ConfigError
from specforge.model_args import ModelArgs
from specforge.passes import VarlenBatch
from specforge.runtime.contract import ForwardOutput, Needs, SlotTable, TargetBackend
from specforge.runtime.torch.backend import TorchBackend
from specforge.runtime.torch.model import Transformer
from specforge.runtime.torch.precision import DTYPE, PrecisionPlan
from specforge.runtime.torch.quantized import NativeWeightsError, use_native_weights

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


class TargetModel:
    """A Hugging Face causal LM behind the specforge runtime.

    ``runtime`` is the fast flattened-batch transformer in the primary precision; ``runtimes``
    holds one per precision the plan uses (:mod:`.precision`: ``target.dtype: auto`` may run
    one-row passes in bf16 and bigger ones in float32), and :meth:`forward` sends each pass to its
    band's.  ``hf_model`` (kept in float32) is the unchanged Hugging Face model, the oracle tests
    compare against.
    """

    def __init__(self, hf_model: Any, tokenizer: Any = None, dtype: torch.dtype = torch.float32,
                 name: str = "model", precision: PrecisionPlan | None = None, gguf: Path | None = None,
                 backend: TargetBackend | None = None, torch_backend: TorchBackend | None = None,
                 compile_choice: Any = None) -> None:
        """A target over ``hf_model``'s weights; :func:`~specforge.runtime.load.load_target` is how
        jobs get one (it builds ``torch_backend`` and decides ``backend``).  Built here directly —
        tests, tiny models — its runtimes are built in ``precision`` (default: ``dtype`` for every
        pass) and its passes run on them unless ``backend`` is given."""
        self.name = name
        self.compile_choice = compile_choice  # target.compile: auto's verdict (compile_choice.CompileChoice)
        self.args = ModelArgs.from_hf_config(hf_model.config)
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        if torch_backend is None:
            plan = precision or PrecisionPlan.fixed(dtype_name(dtype))
            torch_backend = TorchBackend({p: build_runtime(self.args, hf_model, p, gguf) for p in plan.precisions}, plan)
        # The torch runtime stays whatever computes the passes: the drafters share its embedding and
        # LM head, and teacher-forced feature extraction and training run on it (:meth:`teacher`).
        self.torch = torch_backend
        self.precision, self.runtimes, self.runtime = torch_backend.precision, torch_backend.runtimes, torch_backend.runtime
        self.dtype = self.runtime.dtype
        # projections running natively on 4-bit blocks vs dense (see load_target(weights="native"))
        q4 = self.runtimes.get("q4")
        self.weights = q4.native_counts if q4 is not None else {"native": 0, "dense": 4 * self.args.n_layers + 1}
        self.eos_ids = self._eos_ids(hf_model, tokenizer)
        self.backend: TargetBackend = backend or self.torch  # decided once (load_target); never swapped

    def compile(self, enabled: bool = True) -> bool:
        """Run the torch runtime's passes through its compiled trunks (:meth:`TorchBackend.compile`)."""
        return self.torch.compile(enabled)

    @property
    def trunks(self) -> dict[str, Any]:
        return self.torch.trunks

    def use_trunks(self, trunks: Mapping[str, Any] | None) -> None:
        self.torch.use_trunks(trunks)

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
        return self.torch.vocab_size

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

    def require(self, needs: Needs) -> None:
        """A :class:`~specforge.errors.ConfigError` when the passes' backend lacks ``needs`` — what
        a caller that did not say them at load (``load_target(needs=…)``) learns before its first pass."""
        why = self.backend.lacks(needs)
        if why:
            raise ConfigError([f"target.backend: {self.backend.name} was decided when the target loaded, and {why}; "
                               "load it with what the pipeline needs (specforge.engine.load_pipeline_target) or use "
                               "target.backend=torch"])

    def teacher(self) -> TorchBackend:
        """The backend of teacher-forced passes (feature extraction, training, the oracle tests): the
        torch runtime, the one that returns every row's final hidden state and any layer's output."""
        return self.torch

    def new_cache(self, slots: int, capacity: int) -> SlotTable:
        """A cache of ``slots`` requests × ``capacity`` positions for this target's backend."""
        return self.backend.new_cache(slots, capacity)

    def cache_bytes(self, slots: int, capacity: int) -> int:
        """The most memory such a cache can take (:meth:`TargetBackend.cache_bytes`)."""
        return self.backend.cache_bytes(slots, capacity)

    @torch.inference_mode()
    def forward(self, batch: VarlenBatch, cache: SlotTable, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        """One pass over ``batch`` (:class:`~specforge.runtime.torch.backend.TargetBackend`)."""
        return self.backend.forward(batch, cache, logits_rows, taps)

    @torch.inference_mode()
    def reference_logits(self, ids: Sequence[int]) -> Tensor:
        """``[T, V]`` float32 logits of the Hugging Face forward over ``ids`` (the oracle)."""
        out = self.hf_model(torch.tensor([list(ids)]), use_cache=False)
        return out.logits[0].float()

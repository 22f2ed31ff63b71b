"""The target adapter: one object the engine, drafters and trainers talk to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specforge.target.args import ModelArgs
from specforge.target.batch import VarlenBatch
from specforge.target.cache import KVCache
from specforge.target.kv_dtype import KV_DTYPES
from specforge.target.loading import load_hf, resolve_model
from specforge.target.model import ForwardOutput, Transformer
from specforge.target.quantized import NativeWeightsError, require_bfloat16, use_native_weights

__all__ = ["DTYPES", "TargetModel", "dtype_name"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the name configs, manifests and profiles use."""
    return str(dtype).removeprefix("torch.")


class TargetModel:
    """A Hugging Face causal LM behind the specforge runtime.

    ``runtime`` is the fast flattened-batch transformer; ``hf_model`` (kept in float32) is the
    unchanged Hugging Face model, the oracle tests compare against.
    """

    def __init__(self, hf_model: Any, tokenizer: Any = None, dtype: torch.dtype = torch.float32,
                 name: str = "model") -> None:
        self.name = name
        self.args = ModelArgs.from_hf_config(hf_model.config)
        self.dtype = dtype
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        # no_grad, not inference_mode: drafters train through the shared embedding and LM head,
        # and autograd refuses to save inference tensors for backward.
        with torch.no_grad():
            self.runtime = Transformer(self.args, hf_model, dtype).eval()
        self.eos_ids = self._eos_ids(hf_model, tokenizer)
        # projections running natively on 4-bit blocks vs dense (see load(weights="native"))
        self.weights = {"native": 0, "dense": 4 * self.args.n_layers + 1}  # + the LM head

    @classmethod
    def from_config(cls, config: Any) -> TargetModel:
        """Load the target a pipeline's ``target`` section (:class:`~specforge.config.TargetConfig`) names."""
        return cls.load(config.model, config.dtype, config.compile, config.weights, config.kv_dtype)

    @classmethod
    def load(cls, model: str = "smollm2", dtype: str | torch.dtype = "bfloat16",
             compile: bool = False, weights: str = "dense", kv_dtype: str = "auto") -> TargetModel:
        """Load the embedded default, an HF directory or a GGUF file (see :mod:`.loading`);
        ``compile`` turns on the compiled forward (:meth:`Transformer.compile`); ``weights="native"``
        runs a GGUF's 4-bit blocks as stored (:mod:`.quantized`); ``kv_dtype`` is the KV cache's
        dtype (:mod:`.kv_dtype`: ``"auto"`` measures this CPU)."""
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if kv_dtype not in KV_DTYPES:  # refused before the (slow) load
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
        if weights not in ("dense", "native"):
            raise ValueError(f"weights must be 'dense' or 'native', not {weights!r}")
        if weights == "native":  # refused before the (slow) load when it cannot work
            directory, gguf = resolve_model(model)
            if gguf is None:
                raise NativeWeightsError(f"{model}: native weights are a GGUF's own 4-bit blocks; "
                                         "this target is a safetensors directory (use weights=dense)")
            require_bfloat16(dtype)
        hf_model, tokenizer = load_hf(model, torch.float32)
        target = cls(hf_model, tokenizer, dtype, name=model)
        target.runtime.kv_dtype = kv_dtype
        if weights == "native":
            with torch.no_grad():
                target.weights = use_native_weights(target.runtime, hf_model, directory / gguf)
        if compile:
            target.runtime.compile()
        return target

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

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        return self.runtime.new_cache(slots, capacity)

    @torch.inference_mode()
    def forward(self, batch: VarlenBatch, cache: KVCache, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput:
        return self.runtime(batch, cache, logits_rows, taps)

    @torch.inference_mode()
    def reference_logits(self, ids: Sequence[int]) -> Tensor:
        """``[T, V]`` float32 logits of the Hugging Face forward over ``ids`` (the oracle)."""
        out = self.hf_model(torch.tensor([list(ids)]), use_cache=False)
        return out.logits[0].float()

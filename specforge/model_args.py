"""Architecture arguments of the runtime transformer, read off a Hugging Face config.

One decoder covers the families specforge supports; the differences between them are a handful of
switches (Qwen3's per-head q/k norm, Gemma's scaled embeddings, (1 + w) norms and tanh-GELU, Qwen2's
q/k/v biases).  Anything outside that set is refused by name rather than run wrongly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specforge.errors import SpecforgeError

__all__ = ["ModelArgs", "UnsupportedModelError", "SUPPORTED_MODEL_TYPES"]


class UnsupportedModelError(SpecforgeError, ValueError):
    """The checkpoint's architecture is not one the runtime implements."""


# model_type -> family.  Mistral is Llama with a different name (sliding window aside, below).
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
}


@dataclass(frozen=True)
class ModelArgs:
    family: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_positions: int
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0  # Gemma stores w and scales by (1 + w)
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(dim)
    activation: str = "silu"  # "silu" | "gelu_tanh"
    tie_embeddings: bool = False

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArgs:
        model_type = getattr(config, "model_type", None)
        family = SUPPORTED_MODEL_TYPES.get(model_type or "")
        if family is None:
            raise UnsupportedModelError(
                f"architecture {model_type!r} is not supported by the specforge runtime; "
                f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
            raise UnsupportedModelError(
                f"{model_type} with sliding-window attention ({window}) is not supported"
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") == "dynamic":
            raise UnsupportedModelError("dynamic NTK RoPE changes with the sequence; not supported")
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in ("silu", "gelu_pytorch_tanh", "gelu"):
            raise UnsupportedModelError(f"activation {act!r} is not supported")
        return cls(
            family=family,
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            norm_offset=1.0 if family == "gemma" else 0.0,
            embed_scale=math.sqrt(config.hidden_size) if family == "gemma" else 1.0,
            activation="silu" if act == "silu" else "gelu_tanh",
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

"""What the ``eagle3`` layouts share: the names of the tensors (every layout stores our one
decoder layer under a prefix of its own), the activations' Hugging Face names, and the dtype a
checkpoint was saved in (an export writes the weights in it)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["ACTIVATIONS", "GATE_UP", "layer_keys", "stored_dtype"]

# The decoder layer's tensors after the layout's prefix -> ours (``model.*``).
_LAYER = {
    "input_layernorm.weight": "layer.input_norm.weight",
    "hidden_norm.weight": "layer.hidden_norm.weight",
    "self_attn.q_proj.weight": "layer.wq.weight",
    "self_attn.k_proj.weight": "layer.wk.weight",
    "self_attn.v_proj.weight": "layer.wv.weight",
    "self_attn.o_proj.weight": "layer.wo.weight",
    "post_attention_layernorm.weight": "layer.mlp_norm.weight",
    "mlp.down_proj.weight": "layer.w2.weight",
}
_QK_NORM = {"self_attn.q_norm.weight": "layer.q_norm.weight", "self_attn.k_norm.weight": "layer.k_norm.weight"}
# The MLP's gate and up projections after the prefix: the two halves of our w13, in that order.
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")

# Ours -> the ``hidden_act`` of a Hugging Face config.
ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def layer_keys(prefix: str, qk_norm: bool = False) -> dict[str, str]:
    """The layout's key -> ours for every tensor but gate/up (:data:`GATE_UP`): ``fc``, the layer
    under ``prefix`` (with its per-head q/k norms when ``qk_norm``), ``norm`` and ``lm_head``."""
    layer = {**_LAYER, **(_QK_NORM if qk_norm else {})}
    return {"fc.weight": "fc.weight", **{prefix + key: ours for key, ours in layer.items()},
            "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


def stored_dtype(source: Path) -> torch.dtype:
    """The dtype an eagle3 checkpoint's weights were saved in (its ``fc`` weight alone is read)."""
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.fc.weight").dtype

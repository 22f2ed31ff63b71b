"""A Hugging Face Llama-family model written as a GGUF file llama.cpp reads (float32 tensors).

What it is for: running a *small* Hugging Face target on the llama.cpp backend where no GGUF of it
exists — the conformance suite's tiny reference targets, whose exact law is computed from the same
weights, and fast tests of the backend.  It writes what llama.cpp's own converter writes for the
``llama`` architecture (hyper-parameters, tensor names, q/k rows in GGML's rotary layout) with an
id-only vocabulary: the engine hands llama.cpp token ids, never text.  Real checkpoints go through
llama.cpp's converter and quantizer; this writer refuses anything but a Llama-family model with
plain rotary embeddings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_llama_gguf"]

_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL = 1, 2, 3


def _rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face stores each head's q/k rows as two halves (rotate-half rotary); GGML's llama
    graph rotates adjacent pairs: interleave the halves, head by head."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` (a ``LlamaForCausalLM``-shaped model) to ``path`` atomically; returns it."""
    import gguf

    config = model.config
    if getattr(config, "model_type", None) not in ("llama", "mistral"):
        raise ValueError(f"write_llama_gguf writes Llama-family models; this one is {config.model_type!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(config, "attention_bias", False):
        raise ValueError("write_llama_gguf writes plain rotary embeddings without attention biases")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # An id-only vocabulary (the engine never asks llama.cpp to tokenize): bos, eos, unk as the
    # config names them, every other id a plain piece.
    special = {config.bos_token_id: "<s>", config.eos_token_id: "</s>"}
    writer.add_tokenizer_model("llama")
    writer.add_token_list([special.get(i, f"<t{i}>") for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([_TOKEN_CONTROL if i in special else _TOKEN_NORMAL for i in range(config.vocab_size)])
    for name, token in (("bos", config.bos_token_id), ("eos", config.eos_token_id)):
        if isinstance(token, int):
            getattr(writer, f"add_{name}_token_id")(token)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state and not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", _rotary_rows(state[p + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _rotary_rows(state[p + "self_attn.k_proj.weight"], kv_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


"""``eagle3`` checkpoints in the layouts vLLM and SGLang serve (docs/interop.md).

Both engines load EAGLE-3 drafters from a Hugging Face-style folder: ``config.json`` naming the
architecture ``LlamaForCausalLMEagle3`` and ``model.safetensors`` with the keys of their
``llama_eagle3.py`` (vLLM ``Eagle3LlamaForCausalLM.load_weights``, SGLang
``LlamaForCausalLMEagle3.load_weights``; sgl-project SpecForge writes the same keys):

=====================================================  ===========================  ============
key                                                    ours (``model.*``)            shape
=====================================================  ===========================  ============
``fc.weight``                                          ``fc.weight``                 [d, 3d]
``midlayer.input_layernorm.weight``                    ``layer.input_norm.weight``   [d]
``midlayer.hidden_norm.weight``                        ``layer.hidden_norm.weight``  [d]
``midlayer.self_attn.{q,k,v}_proj.weight``             ``layer.w{q,k,v}.weight``     [·, 2d]
``midlayer.self_attn.o_proj.weight``                   ``layer.wo.weight``           [d, H·hd]
``midlayer.post_attention_layernorm.weight``           ``layer.mlp_norm.weight``     [d]
``midlayer.mlp.gate_proj.weight`` / ``up_proj``        ``layer.w13.weight`` halves   [I, d]
``midlayer.mlp.down_proj.weight``                      ``layer.w2.weight``           [d, I]
``norm.weight``, ``lm_head.weight``                    the same                      [d], [N, d]
``d2t`` (int64 offsets), ``t2d`` (bool mask)           ``vocab.d2t``, ``vocab.t2d``  [N], [V]
=====================================================  ===========================  ============

The fused layers: SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as *outputs* of
those layers (it adds 1 to capture them); vLLM reads a top-level
``eagle_aux_hidden_state_layer_ids`` as the *inputs* of those layers, as is — so the vLLM export
writes our ids + 1 there and the SGLang one our ids.  Both hard-code three fused layers.  vLLM
refuses unknown keys and SGLang drops them silently, so an export writes exactly the keys above —
never the target's embedding — and checks every shape before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from specforge.interop import InteropError, check_shapes, drop_frozen, load_tensors, mismatch, read_config
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, save_eagle3

__all__ = ["EAGLE3_FORMATS", "Eagle3Format"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
# Serving key -> our state_dict key (gate/up are the two halves of our w13).
_SAME = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "layer.input_norm.weight",
    "midlayer.hidden_norm.weight": "layer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight": "layer.wq.weight",
    "midlayer.self_attn.k_proj.weight": "layer.wk.weight",
    "midlayer.self_attn.v_proj.weight": "layer.wv.weight",
    "midlayer.self_attn.o_proj.weight": "layer.wo.weight",
    "midlayer.post_attention_layernorm.weight": "layer.mlp_norm.weight",
    "midlayer.mlp.down_proj.weight": "layer.w2.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_GATE, _UP = "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"
_FROZEN = ("embed_tokens.weight", "model.embed_tokens.weight")  # a re-stored copy of the target's


def _expected(s: Eagle3Shape) -> dict[str, tuple[int, ...]]:
    d, hd, n = s.dim, s.head_dim, s.draft_vocab_size or s.vocab_size
    return {
        "fc.weight": (d, len(s.layers) * d), "midlayer.input_layernorm.weight": (d,),
        "midlayer.hidden_norm.weight": (d,), "midlayer.self_attn.q_proj.weight": (s.n_heads * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": (s.n_kv_heads * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": (s.n_kv_heads * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, s.n_heads * hd), "midlayer.post_attention_layernorm.weight": (d,),
        _GATE: (s.intermediate_size, d), _UP: (s.intermediate_size, d),
        "midlayer.mlp.down_proj.weight": (d, s.intermediate_size), "norm.weight": (d,), "lm_head.weight": (n, d),
        "d2t": (n,), "t2d": (s.vocab_size,),
    }


class Eagle3Format:
    """One serving engine's EAGLE-3 layout (see the module docstring)."""

    def __init__(self, name: str, engine: str, shift: int, full_vocab_maps: bool) -> None:
        self.name, self.engine, self._shift, self._full_maps = name, engine, shift, full_vocab_maps
        self.description = (f"the EAGLE-3 layout {engine} serves (LlamaForCausalLMEagle3: midlayer.* keys, "
                            "d2t/t2d maps)")

    # -- export ---------------------------------------------------------------------------------

    def export(self, source: Path, out: Path) -> list[str]:
        model, drafter = load_eagle3(source)
        s = model.shape
        notes = []
        if len(s.layers) != 3:
            raise InteropError(f"{source}: fuses {len(s.layers)} target layers {list(s.layers)}; {self.engine}'s "
                               "EAGLE-3 loader hard-codes three (fc takes 3·hidden inputs)")
        if s.rope_theta is None:
            raise InteropError(f"{source}: the checkpoint does not record its target's RoPE base (trained before "
                               "specforge stored it); train or re-save it with this version")
        state = model.state_dict()
        tensors = {key: state[ours] for key, ours in _SAME.items()}
        tensors[_GATE], tensors[_UP] = state["layer.w13.weight"].chunk(2, dim=0)
        vocab = model.vocab or DraftVocab(torch.arange(s.vocab_size), s.vocab_size)
        expected = _expected(s)
        if model.vocab is not None or self._full_maps:
            tensors["d2t"], tensors["t2d"] = vocab.d2t, vocab.t2d
            if model.vocab is None:
                notes.append("no draft vocabulary: d2t is all zeros and t2d all true (the whole target vocabulary)")
        else:  # vLLM builds no d2t parameter for the whole vocabulary, and refuses a tensor it has no slot for
            del expected["d2t"], expected["t2d"]
        check_shapes(tensors, expected, source)
        config = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": s.dim,
            "intermediate_size": s.intermediate_size, "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "num_hidden_layers": 1,
            "hidden_act": _ACTIVATIONS[s.activation], "rms_norm_eps": s.norm_eps, "vocab_size": s.vocab_size,
            "draft_vocab_size": vocab.size, "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_positions, "tie_word_embeddings": False, "attention_bias": False,
            "target_hidden_size": s.dim, "torch_dtype": str(state["fc.weight"].dtype).removeprefix("torch."),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s.layers), "use_aux_hidden_state": True},
            "specforge": {"method": "eagle3", "target": json.loads((source / "config.json").read_text()).get("target"),
                          "n_target_layers": s.n_target_layers, "drafter": drafter},
        }
        if self._shift:  # vLLM: the inputs of layers i + 1 = the outputs of layers i
            config["eagle_aux_hidden_state_layer_ids"] = [i + self._shift for i in s.layers]
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return notes

    # -- import ---------------------------------------------------------------------------------

    def detect(self, directory: Path) -> bool:
        config = read_config(directory)
        if not config or ARCHITECTURE not in (config.get("architectures") or []):
            return False
        top = "eagle_aux_hidden_state_layer_ids" in config
        return top if self._shift else not top  # vLLM's layout carries the top-level ids, SGLang's not

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]:
        config = read_config(directory) or {}
        weights, tensors = load_tensors(directory)
        notes = []
        if self._shift:
            layers = [int(i) - self._shift for i in config["eagle_aux_hidden_state_layer_ids"]]
        else:
            layers = [int(i) for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise InteropError(f"{directory / 'config.json'}: num_hidden_layers={config['num_hidden_layers']}; the "
                               "eagle3 drafter has one layer")
        prefixed = {k.removeprefix("model."): v for k, v in tensors.items()}
        prefixed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                    for k, v in prefixed.items()}
        for frozen in _FROZEN:
            key = frozen.removeprefix("model.")
            if key in prefixed:
                notes.append(drop_frozen(prefixed.pop(key), None if target is None else target.runtime.embed, key,
                                         "embedding", weights))
        try:
            d2t, t2d = prefixed.pop("d2t", None), prefixed.pop("t2d", None)
            n = int(config.get("draft_vocab_size") or config["vocab_size"])
            v = int(config["vocab_size"])
            if d2t is None:
                d2t = torch.zeros(n, dtype=torch.long)
            if t2d is None:
                t2d = torch.zeros(v, dtype=torch.bool)
                t2d[torch.arange(n) + d2t.long()] = True
            shape = Eagle3Shape(
                vocab_size=v, dim=int(config["hidden_size"]), n_heads=int(config["num_attention_heads"]),
                n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
                intermediate_size=int(config["intermediate_size"]), n_target_layers=max(layers) + 4 if layers else 1,
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                activation={v_: k for k, v_ in _ACTIVATIONS.items()}.get(config.get("hidden_act", "silu"), "silu"),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                max_positions=int(config.get("max_position_embeddings", 8192)), layers=tuple(layers),
                draft_vocab_size=n if n != v else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise InteropError(f"{directory / 'config.json'}: not a usable EAGLE-3 config ({exc})") from None
        target_layers = (config.get("specforge") or {}).get("n_target_layers")
        if target_layers:
            shape = shape.model_copy(update={"n_target_layers": int(target_layers)})
        elif target is None:
            notes.append(f"the target's depth is not recorded: taken as {shape.n_target_layers} (EAGLE-3's deepest "
                         "fused layer is L − 4); import with --target to check it")
        if target is not None:
            a = target.args
            wrong = mismatch({"vocab_size": (shape.vocab_size, a.vocab_size), "dim": (shape.dim, a.dim)})
            if wrong or max(layers, default=0) >= a.n_layers:
                raise InteropError(f"{directory}: made for another target — "
                                   + (wrong or f"fused layers {layers} beyond its {a.n_layers} layers"))
            shape = shape.model_copy(update={"n_target_layers": a.n_layers})
        check_shapes({**prefixed, "d2t": d2t, "t2d": t2d}, _expected(shape), weights)
        unknown = sorted(set(prefixed) - set(_SAME) - {_GATE, _UP})
        if unknown:
            raise InteropError(f"{weights}: tensors the EAGLE-3 layer does not have: {', '.join(unknown[:5])}")
        vocab = DraftVocab.from_maps(d2t, t2d) if shape.draft_vocab_size is not None else None
        model = Eagle3Model(shape, vocab=vocab)
        state = {ours: prefixed[key] for key, ours in _SAME.items()}
        state["layer.w13.weight"] = torch.cat([prefixed[_GATE], prefixed[_UP]], 0)
        dtype = state["fc.weight"].dtype
        model.to(dtype).load_state_dict(state)
        save_eagle3(out, model, {"kind": "eagle3", "imported_from": str(directory), "format": self.name},
                    target=(config.get("specforge") or {}).get("target"))
        return notes


# vLLM's Eagle3LlamaForCausalLM has a d2t parameter only for a draft vocabulary smaller than the
# target's (loading one otherwise fails: "no module or parameter named 'draft_id_to_target_id'");
# SGLang reads identity maps as the whole vocabulary.
EAGLE3_FORMATS = (Eagle3Format("vllm", "vLLM", 1, full_vocab_maps=False),
                  Eagle3Format("sglang", "SGLang", 0, full_vocab_maps=True))

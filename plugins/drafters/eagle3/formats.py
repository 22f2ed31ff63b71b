"""``eagle3`` checkpoints in the layouts vLLM and SGLang serve, and in DeepSpec's
(:class:`DeepSpecEagle3Format`; docs/interop.md).

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
never the target's embedding — and checks every shape before anything is written.  Their Llama
layer has no q/k norm, so a drafter trained with ``qk_norm`` goes to ``deepspec`` only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specforge.interop import (InteropError, check_shapes, drop_frozen, load_tensors, mismatch, read_config,
                               recorded_target, rope_theta, target_tensor)
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.checkpoints import TARGET_SHAPE
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, save_eagle3

__all__ = ["EAGLE3_FORMATS", "DeepSpecEagle3Format", "Eagle3Format"]

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
        if s.qk_norm:
            raise InteropError(f"{source}: the drafter RMS-normalises its queries and keys per head (qk_norm) "
                               f"and {self.engine}'s Llama EAGLE-3 layer has no q/k norm — export --to deepspec "
                               "keeps it, or train with drafter.qk_norm=false")
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


DEEPSPEC_ARCH = "Qwen3Eagle3Model"
# DeepSpec key -> ours (``model.*``); gate/up are the two halves of our w13, embed_tokens the
# target's own embedding (re-stored frozen).
_DS_SAME = {
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "layer.input_norm.weight",
    "layers.0.hidden_norm.weight": "layer.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight": "layer.wq.weight",
    "layers.0.self_attn.k_proj.weight": "layer.wk.weight",
    "layers.0.self_attn.v_proj.weight": "layer.wv.weight",
    "layers.0.self_attn.o_proj.weight": "layer.wo.weight",
    "layers.0.self_attn.q_norm.weight": "layer.q_norm.weight",
    "layers.0.self_attn.k_norm.weight": "layer.k_norm.weight",
    "layers.0.post_attention_layernorm.weight": "layer.mlp_norm.weight",
    "layers.0.mlp.down_proj.weight": "layer.w2.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_DS_GATE, _DS_UP, _DS_EMBED = "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "embed_tokens.weight"


def _deepspec_shapes(s: Eagle3Shape) -> dict[str, tuple[int, ...]]:
    d, hd, i = s.dim, s.head_dim, s.intermediate_size
    q, kv = s.n_heads * hd, s.n_kv_heads * hd
    return {
        _DS_EMBED: (s.vocab_size, d), "fc.weight": (d, len(s.layers) * d),
        "layers.0.input_layernorm.weight": (d,), "layers.0.hidden_norm.weight": (d,),
        "layers.0.self_attn.q_proj.weight": (q, 2 * d), "layers.0.self_attn.k_proj.weight": (kv, 2 * d),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * d), "layers.0.self_attn.o_proj.weight": (d, q),
        "layers.0.self_attn.q_norm.weight": (hd,), "layers.0.self_attn.k_norm.weight": (hd,),
        "layers.0.post_attention_layernorm.weight": (d,), _DS_GATE: (i, d), _DS_UP: (i, d),
        "layers.0.mlp.down_proj.weight": (d, i), "norm.weight": (d,), "lm_head.weight": (s.vocab_size, d),
    }


class DeepSpecEagle3Format:
    """DeepSpec's EAGLE-3 (``deepspec``): ``Qwen3Eagle3Model``, the folder its trainer's
    ``save_pretrained`` writes and its evaluator loads.

    **The same function as our eagle3 drafter with** ``qk_norm`` — compared point by point with
    deepseek-ai/DeepSpec @ afdfa7c (``deepspec/modeling/eagle3/{common,loss}.py``,
    ``qwen3/{config,modeling}.py``, ``trainer/eagle3_trainer.py``, ``eval/eagle3/evaluator.py``,
    ``eval/base_evaluator.py``):

    1. *Fusion.*  ``project_hidden_states`` is ``fc`` (``Linear(len(target_layer_ids)·d → d)``, no
       bias, no norm after it) over ``extract_eagle3_context_feature`` = the concatenation of
       ``hidden_states[i + 1]`` — the output of layer i — for ``target_layer_ids`` in their order:
       ours is ``fc`` over the outputs of ``layers`` in order.  DeepSpec's config builder asserts five
       strictly increasing ids (``validate_eagle3_target_layer_ids``); the model and the evaluator take
       any count (``fc`` is sized from the config), so another count is exported with a note.  Refused:
       one fused layer (``forward`` projects *any* hidden input of width len·d, so it would re-project
       the fed-back d-wide state every step), ids not increasing, and the target's last layer (its
       ``hidden_states[L]`` is final-normed; ``assert_no_final_target_layer``).
    2. *Layer input.*  ``Qwen3Eagle3DecoderLayer.forward``: residual = the hidden state;
       ``cat(input_layernorm(embeds), hidden_norm(hidden))`` — the embedding first, normed by
       ``input_layernorm``; q/k/v project the 2d concatenation, ``o_proj`` back to d, then
       ``post_attention_layernorm`` and ``Qwen3MLP`` (down(act(gate)·up)).  Ours: ``input_norm`` /
       ``hidden_norm`` in the same order, ``w13`` = gate then up; no biases (``attention_bias``
       false — an import with biases is refused).
    3. *q/k norm.*  ``Qwen3Eagle3Attention`` RMS-normalises each query and key head
       (``q_norm``/``k_norm``, ``Qwen3RMSNorm(head_dim)``, the config's ``rms_norm_eps``) *before*
       RoPE: our ``Eagle3Shape.qk_norm``.  An RMSNorm of weight 1 is not the identity, so a drafter
       without it is refused.
    4. *RoPE, positions, attention.*  ``Qwen3RotaryEmbedding`` of the config, a copy of the
       target's (``build_draft_config``): an export copies the target's ``config.json``.  Row t pairs
       g_t with token x_{t+1} at position t (``_init_context``: "the draft RoPE position stays at
       i"); TTT step k runs at t + k (``rope_cache_step_offset``) and sees step 0's rows ≤ t and its
       own earlier steps (``create_eagle3_attention_mask``); drafting extends the cache of committed
       rows and crops the chain after verification (``_propose``/``_update``).  Ours: the context
       rows ≤ a − 1, chain step j at a − 1 + (j − 1) attending to the context and its own chain —
       the same positions and pattern, and the first draft likewise comes from the row
       (x_0, g_{a−1}) at a − 1.
    5. *Feedback.*  The next step reads the layer output *before* the final norm (``forward``
       returns it; ``compute_logits`` = ``lm_head(norm(h))``; the TTT loop and ``_propose`` feed
       ``output.hidden_states``): ours feeds y back and takes logits of ``norm(y)``.
    6. *Heads and vocabulary.*  ``lm_head`` is ``[V, d]`` over the whole vocabulary (no d2t/t2d):
       a draft vocabulary is refused.  DeepSpec's trainer keeps it a frozen copy of the target's
       head (``initialize_embeddings_and_head(freeze=True)``); ours is trained from the same
       initial rows — either way a weight of the drafter, written and read as ours.
    7. *Embedding.*  ``embed_tokens`` is a frozen copy of the target's, read unscaled: an export
       writes the target's (from the target the checkpoint records), an import checks it against
       ``--target`` and drops it.  A target that scales its embeddings (Gemma, √d) is refused.
    8. *Depth.*  ``num_hidden_layers`` draft layers, which the evaluator requires to be 1: ours has
       one, an import of more is refused.  ``ttt_length`` (the evaluator's proposal length) is our
       γ; ``step_loss_decay`` is training-only and kept as recorded (0.8, ours, otherwise).

    Numerics only: ``Qwen3RMSNorm`` computes in float32 and casts back, ours in the model's dtype —
    identical in float32.
    """

    name = "deepspec"
    description = ("DeepSpec's Qwen3Eagle3Model (layers.0.* with q_norm/k_norm, fc over the fused layers, the "
                   "target's config and embed_tokens copy, lm_head over the whole vocabulary)")

    # -- export ---------------------------------------------------------------------------------

    def export(self, source: Path, out: Path) -> list[str]:
        model, drafter = load_eagle3(source)
        s, meta, layers = model.shape, read_config(source) or {}, list(model.shape.layers)
        checks = [
            (s.draft_vocab_size is not None,
             f"DeepSpec's Qwen3Eagle3Model drafts over the whole vocabulary (lm_head of {s.vocab_size} rows, no "
             f"d2t/t2d) and this drafter over a draft vocabulary of {s.draft_vocab_size} — export --to vllm or "
             "sglang keeps it, or train without drafter.draft_vocab"),
            (not s.qk_norm,
             "DeepSpec's Qwen3Eagle3Model RMS-normalises the layer's queries and keys per head (q_norm/k_norm) and "
             "this drafter has no qk-norm; an RMSNorm is not the identity, so it cannot be written exactly — train "
             "with drafter.qk_norm=true (the default on a Qwen3 target)"),
            (len(layers) == 1,
             f"it fuses one target layer ({layers[0]}); Qwen3Eagle3Model.forward projects every hidden input of "
             "width len(target_layer_ids)·hidden through fc, so with one it would re-project the fed-back hidden "
             "state at every step — train with several drafter.target_layers"),
            (layers != sorted(set(layers)),
             f"DeepSpec concatenates target_layer_ids in strictly increasing order and this drafter fuses {layers} "
             "— train with drafter.target_layers increasing"),
            (s.n_target_layers - 1 in layers,
             f"it fuses the target's last layer ({s.n_target_layers - 1}), which DeepSpec reads final-normed "
             f"(hidden_states[L]) — train with drafter.target_layers below {s.n_target_layers - 1}"),
        ]
        for failed, message in checks:
            if failed:
                raise InteropError(f"{source}: {message}")
        target_config, target_dir, args = recorded_target(meta.get("target"), s, TARGET_SHAPE, source)
        wrong = mismatch({"intermediate_size": (s.intermediate_size, args.intermediate_size),
                          "norm_eps": (s.norm_eps, args.norm_eps), "activation": (s.activation, args.activation)})
        if wrong:
            raise InteropError(f"{source}: its recorded target {meta.get('target')!r} is another model — {wrong}")
        if args.embed_scale != 1.0:
            raise InteropError(f"{source}: its target ({args.family}) scales its embeddings by {args.embed_scale:g} "
                               "and this drafter with it; DeepSpec's Qwen3Eagle3Model reads its embed_tokens "
                               "unscaled")
        dtype = load_file(str(source / "model.safetensors"))["model.fc.weight"].dtype  # as saved (load builds fp32)
        state = model.to(dtype).state_dict()
        tensors = {key: state[ours] for key, ours in _DS_SAME.items()}
        tensors[_DS_GATE], tensors[_DS_UP] = state["layer.w13.weight"].chunk(2, dim=0)
        tensors[_DS_EMBED] = target_tensor(target_dir, "model.embed_tokens.weight", "embed_tokens.weight").to(dtype)
        check_shapes(tensors, _deepspec_shapes(s), source)
        # The target's config.json (its RoPE, norms, sizes) with build_draft_config's fields.
        config = {k: v for k, v in target_config.items() if k not in ("architectures", "auto_map", "_name_or_path")}
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]  # the same base for readers on older transformers
        config.update(architectures=[DEEPSPEC_ARCH], num_target_layers=s.n_target_layers, num_hidden_layers=1,
                      draft_num_hidden_layers=1, layer_types=["full_attention"],
                      target_model_name_or_path=str(meta.get("target")), target_layer_ids=layers,
                      ttt_length=int(drafter.get("gamma") or 7), step_loss_decay=float(drafter.get("decay") or 0.8),
                      tie_word_embeddings=False, attention_bias=False, hidden_act=_ACTIVATIONS[s.activation])
        for key in [k for k in ("dtype", "torch_dtype") if k in target_config] or ["torch_dtype"]:
            config[key] = str(dtype).removeprefix("torch.")
        config["specforge"] = {"method": "eagle3", "target": meta.get("target"), "drafter": drafter}
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        notes = [f"the target's config and embedding: copied from the target the checkpoint records "
                 f"({meta.get('target')}); lm_head is the drafter's own"]
        if len(layers) != 5:
            notes.append(f"it fuses {len(layers)} target layers: DeepSpec's model and evaluator load it (fc over "
                         f"{len(layers)}·hidden), its trainer builds only five (validate_eagle3_target_layer_ids)")
        return notes

    # -- import ---------------------------------------------------------------------------------

    def detect(self, directory: Path) -> bool:
        return DEEPSPEC_ARCH in ((read_config(directory) or {}).get("architectures") or [])

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]:
        config, path = read_config(directory) or {}, directory / "config.json"
        where, tensors = load_tensors(directory)
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        notes: list[str] = []
        try:
            layers = [int(i) for i in config["target_layer_ids"]]
            depth = config.get("num_target_layers") or (target.args.n_layers if target is not None else None)
            draft_layers = int(config.get("num_hidden_layers", 1))
        except (KeyError, TypeError, ValueError) as exc:
            raise InteropError(f"{path}: not a usable DeepSpec Eagle3 config ({exc!r})") from None
        act = config.get("hidden_act", "silu")
        activation = {v: k for k, v in _ACTIVATIONS.items()}.get(act)
        checks = [
            (draft_layers != 1, f"{draft_layers} draft layers (num_hidden_layers), and specforge's eagle3 drafter "
                                "has one (as DeepSpec's evaluator requires)"),
            (len(layers) < 2, f"it fuses {len(layers)} target layer(s), and with one Qwen3Eagle3Model re-projects "
                              "the fed-back hidden state through fc at every step"),
            (layers != sorted(set(layers)) or min(layers, default=0) < 0,
             f"its target_layer_ids {layers} are not strictly increasing layer outputs"),
            (depth is None, "the target's depth (num_target_layers) is not recorded: import with --target"),
            (depth is not None and int(depth) - 1 in layers,
             f"it fuses the target's last layer ({depth and int(depth) - 1}), which DeepSpec reads final-normed"),
            (bool(config.get("attention_bias")), "attention biases, which specforge's eagle3 layer does not have"),
            (activation is None, f"a {act} MLP, which specforge's eagle3 layer does not have"),
        ]
        for failed, message in checks:
            if failed:
                raise InteropError(f"{path}: {message}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
        try:
            d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            shape = Eagle3Shape(
                vocab_size=int(config["vocab_size"]), dim=d, n_heads=heads,
                n_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or d // heads), intermediate_size=int(config["intermediate_size"]),
                n_target_layers=int(depth), norm_eps=float(config.get("rms_norm_eps", 1e-6)), activation=activation,
                rope_theta=None if scaled else rope_theta(config),
                max_positions=int(config.get("max_position_embeddings", 8192)), layers=tuple(layers), qk_norm=True)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise InteropError(f"{path}: not a usable DeepSpec Eagle3 config ({exc})") from None
        if target is not None:
            a = target.args
            wrong = mismatch({k: (getattr(shape, k), getattr(a, t)) for k, t in TARGET_SHAPE.items()})
            theirs, mine = rope_theta(target.hf_model.config.to_dict()), rope_theta(config)
            if not wrong and None not in (theirs, mine) and theirs != mine:
                wrong = f"RoPE base {mine} (target: {theirs})"
            if wrong:
                raise InteropError(f"{directory}: made for another target — {wrong}")
            if a.embed_scale != 1.0:
                raise InteropError(f"{directory}: the target ({a.family}) scales its embeddings by {a.embed_scale:g}, "
                                   "which DeepSpec's Qwen3Eagle3Model does not")
        expected = _deepspec_shapes(shape)
        check_shapes(tensors, expected, where)
        unknown = sorted(set(tensors) - set(expected) - {k for k in tensors if "rotary_emb." in k})
        if unknown:
            raise InteropError(f"{where}: tensors the EAGLE-3 layer does not have: {', '.join(unknown[:5])}")
        notes.append(drop_frozen(tensors[_DS_EMBED], None if target is None else target.runtime.embed, _DS_EMBED,
                                 "embedding", where))
        if target is None:
            notes.append("not checked against a target (its shape, RoPE base and embedding): import with --target")
        model = Eagle3Model(shape)
        state = {ours: tensors[key] for key, ours in _DS_SAME.items()}
        state["layer.w13.weight"] = torch.cat([tensors[_DS_GATE], tensors[_DS_UP]])
        model.to(tensors["fc.weight"].dtype).load_state_dict(state)
        drafter = {"kind": "eagle3", "imported_from": str(directory), "format": self.name}
        if config.get("ttt_length"):
            drafter["gamma"] = int(config["ttt_length"])
        if config.get("step_loss_decay"):
            drafter["decay"] = float(config["step_loss_decay"])
        save_eagle3(out, model, drafter, target=(config.get("specforge") or {}).get("target")
                    or getattr(target, "name", None) or config.get("target_model_name_or_path"))
        return notes


# vLLM's Eagle3LlamaForCausalLM has a d2t parameter only for a draft vocabulary smaller than the
# target's (loading one otherwise fails: "no module or parameter named 'draft_id_to_target_id'");
# SGLang reads identity maps as the whole vocabulary.
EAGLE3_FORMATS = (Eagle3Format("vllm", "vLLM", 1, full_vocab_maps=False),
                  Eagle3Format("sglang", "SGLang", 0, full_vocab_maps=True), DeepSpecEagle3Format())

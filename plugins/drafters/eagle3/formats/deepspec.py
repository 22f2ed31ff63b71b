"""``eagle3`` checkpoints in DeepSpec's layout (``deepspec``: its ``Qwen3Eagle3Model``;
docs/interop.md) — compared point by point in :class:`DeepSpecEagle3Format`'s docstring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge.toolkit.checkpoints import TARGET_SHAPE
from specforge.toolkit.formats import (InteropError, check_shapes, drop_frozen, load_tensors, mismatch, read_config,
                                       recorded_target, rope_theta, target_tensor)
from specforge_plugins.drafters.eagle3.formats.common import ACTIVATIONS, GATE_UP, layer_keys, stored_dtype
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, save_eagle3

__all__ = ["DEEPSPEC_ARCH", "DeepSpecEagle3Format"]

DEEPSPEC_ARCH = "Qwen3Eagle3Model"
# DeepSpec key -> ours (``model.*``): its one layer has q/k norms; gate/up are the two halves of
# our w13, embed_tokens the target's own embedding (re-stored frozen).
_DS_SAME = layer_keys("layers.0.", qk_norm=True)
_DS_GATE, _DS_UP = (f"layers.0.{key}" for key in GATE_UP)
_DS_EMBED = "embed_tokens.weight"


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
        dtype = stored_dtype(source)  # as saved (load_eagle3 builds float32)
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
                      tie_word_embeddings=False, attention_bias=False, hidden_act=ACTIVATIONS[s.activation])
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
        activation = {v: k for k, v in ACTIVATIONS.items()}.get(act)
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

"""``eagle3`` checkpoints in the layouts vLLM and SGLang serve, in the original EAGLE repository's
(:class:`EagleRepoFormat`) and in DeepSpec's (:class:`DeepSpecEagle3Format`; docs/interop.md).

Both engines load EAGLE-3 drafters from a Hugging Face-style folder: ``config.json`` naming the
architecture ``LlamaForCausalLMEagle3`` and ``model.safetensors`` with the keys of their
``llama_eagle3.py`` (vLLM ``Eagle3LlamaForCausalLM.load_weights``, SGLang
``LlamaForCausalLMEagle3.load_weights``; sgl-project SpecForge writes the same keys, and SafeAILab/EAGLE's
``cnets.Model`` — the reference they follow — has them under a ``LlamaForCausalLM`` config):

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
layer has no q/k norm, so a drafter trained with ``qk_norm`` goes to ``deepspec`` only.  EAGLE's
own folder records no fused layers: they follow from the target's depth (:func:`eagle_repo_layers`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge.interop import (InteropError, check_shapes, drop_frozen, load_tensors, mismatch, read_config,
                               recorded_target, rope_theta, target_tensor)
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.checkpoints import TARGET_SHAPE
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, rope_base, save_eagle3

__all__ = ["EAGLE3_FORMATS", "DeepSpecEagle3Format", "Eagle3Format", "EagleRepoFormat", "eagle_repo_layers"]

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
    """One serving engine's EAGLE-3 layout (see the module docstring).  The hooks
    (``_export_checks``, ``_config``, ``_fused``, ``_import_checks``, ``_head_dim``) are where
    :class:`EagleRepoFormat` — the same keys under another config — differs."""

    def __init__(self, name: str, engine: str, shift: int, full_vocab_maps: bool) -> None:
        self.name, self.engine, self._shift, self._full_maps = name, engine, shift, full_vocab_maps
        self.description = (f"the EAGLE-3 layout {engine} serves (LlamaForCausalLMEagle3: midlayer.* keys, "
                            "d2t/t2d maps)")

    # -- export ---------------------------------------------------------------------------------

    def _export_checks(self, s: Eagle3Shape) -> list[tuple[bool, str]]:
        """``(failed, why)`` for each thing the layout cannot state, checked in order."""
        return [(len(s.layers) != 3, f"fuses {len(s.layers)} target layers {list(s.layers)}; {self.engine}'s EAGLE-3 "
                                     "loader hard-codes three (fc takes 3·hidden inputs)"),
                *self._layer_checks(s)]

    def _layer_checks(self, s: Eagle3Shape) -> list[tuple[bool, str]]:
        """What every Llama EAGLE-3 layer (``midlayer``) lacks."""
        return [
            (s.qk_norm, f"the drafter RMS-normalises its queries and keys per head (qk_norm) and {self.engine}'s "
                        "Llama EAGLE-3 layer has no q/k norm — export --to deepspec keeps it, or train with "
                        "drafter.qk_norm=false"),
            (s.rope_theta is None, "the checkpoint does not record its target's RoPE base (trained before specforge "
                                   "stored it); train or re-save it with this version"),
        ]

    def _config(self, s: Eagle3Shape, draft_vocab_size: int, dtype: torch.dtype,
                provenance: dict[str, Any]) -> dict[str, Any]:
        """The layout's config.json."""
        config = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": s.dim,
            "intermediate_size": s.intermediate_size, "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "num_hidden_layers": 1,
            "hidden_act": _ACTIVATIONS[s.activation], "rms_norm_eps": s.norm_eps, "vocab_size": s.vocab_size,
            "draft_vocab_size": draft_vocab_size, "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_positions, "tie_word_embeddings": False, "attention_bias": False,
            "target_hidden_size": s.dim, "torch_dtype": str(dtype).removeprefix("torch."),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s.layers), "use_aux_hidden_state": True},
            "specforge": provenance,
        }
        if self._shift:  # vLLM: the inputs of layers i + 1 = the outputs of layers i
            config["eagle_aux_hidden_state_layer_ids"] = [i + self._shift for i in s.layers]
        return config

    def export(self, source: Path, out: Path) -> list[str]:
        model, drafter = load_eagle3(source)
        s = model.shape
        notes = []
        for failed, message in self._export_checks(s):
            if failed:
                raise InteropError(f"{source}: {message}")
        dtype = _stored_dtype(source)
        state = model.to(dtype).state_dict()  # in the dtype it was saved in (load_eagle3 builds float32)
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
        provenance = {"method": "eagle3", "target": json.loads((source / "config.json").read_text()).get("target"),
                      "n_target_layers": s.n_target_layers, "drafter": drafter}
        config = self._config(s, vocab.size, dtype, provenance)
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

    def _fused(self, config: dict[str, Any], path: Path, target: Any) -> tuple[list[int], int | None]:
        """The fused layers (0-based outputs) the folder names, and the target's depth when it
        follows from them (None: read from the recorded config or ``target`` afterwards)."""
        if self._shift:
            return [int(i) - self._shift for i in config["eagle_aux_hidden_state_layer_ids"]], None
        return [int(i) for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []], None

    def _import_checks(self, config: dict[str, Any], directory: Path, target: Any) -> list[str]:
        """Refusals beyond the shared ones (raise); returns notes.  sgl-project SpecForge's
        ``LlamaForCausalLMEagle3`` (``specforge/modeling/draft/llama3_eagle.py`` @ a6b6b023) has two
        options of its own, which it records in this layout's config: ``norm_output: false`` (logits
        of the layer output without the final norm) and ``fc_norm: true`` (an RMSNorm per fused
        state before ``fc``) — neither is our drafter's function."""
        path = directory / "config.json"
        if config.get("norm_output") is False:
            raise InteropError(f"{path}: norm_output: false — sgl-project SpecForge's drafter then takes logits of "
                               "the layer output without the final norm, and specforge's eagle3 drafter of norm(y)")
        if config.get("fc_norm"):
            raise InteropError(f"{path}: fc_norm: true — sgl-project SpecForge's drafter then RMS-normalises each "
                               "fused state before fc, which specforge's eagle3 drafter does not")
        return []

    def _head_dim(self, config: dict[str, Any]) -> int:
        return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]:
        config = read_config(directory) or {}
        weights, tensors = load_tensors(directory)
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise InteropError(f"{directory / 'config.json'}: num_hidden_layers={config['num_hidden_layers']}; the "
                               "eagle3 drafter has one layer")
        notes = self._import_checks(config, directory, target)
        layers, depth = self._fused(config, directory / "config.json", target)
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
                head_dim=self._head_dim(config), intermediate_size=int(config["intermediate_size"]),
                n_target_layers=depth or (max(layers) + 4 if layers else 1),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                activation={v_: k for k, v_ in _ACTIVATIONS.items()}.get(config.get("hidden_act", "silu"), "silu"),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                max_positions=int(config.get("max_position_embeddings", 8192)), layers=tuple(layers),
                draft_vocab_size=n if n != v else None)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
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
                    target=(config.get("specforge") or {}).get("target") or getattr(target, "name", None))
        return notes


def eagle_repo_layers(n_target_layers: int) -> tuple[int, ...] | None:
    """The target layers SafeAILab/EAGLE's EAGLE-3 fuses, as our 0-based layer outputs.

    Its target models (``eagle/model/modeling_llama_kv.py`` and ``modeling_qwen3_kv.py``,
    ``LlamaModel.forward``/``Qwen3Model.forward``; ``traineagle3/modeling_llama_kv.py`` likewise)
    append the hidden state *entering* decoder layer ``idx`` when ``idx == len(self.layers) - 3 or
    idx == len(self.layers) // 2 or idx == 2`` — each layer once, in increasing order — and
    ``utils.py`` concatenates them in that order: the outputs of layers 1, n//2 − 1 and n − 4, which
    is EAGLE-3's choice that :func:`eagle3_layers` (our default) makes too.  None where they are not
    the outputs of three distinct layers (a target of fewer than 7 layers: EAGLE's ``fc`` reads
    3·hidden inputs; with 3 layers the input of layer 0 is the embeddings, which we cannot tap)."""
    n = n_target_layers
    inputs = sorted({i for i in (2, n // 2, n - 3) if 0 <= i < n})
    return tuple(i - 1 for i in inputs) if len(inputs) == 3 and inputs[0] >= 1 else None


EAGLE_REPO_ARCH = "LlamaForCausalLM"


class EagleRepoFormat(Eagle3Format):
    """The original EAGLE repository's EAGLE-3 folder (``eagle``): what SafeAILab/EAGLE's
    ``EaModel.from_pretrained(use_eagle3=True, ea_model_path=…)`` loads and its ``traineagle3``
    writes — compared with SafeAILab/EAGLE @ cb7e0841 (``eagle/model/{ea_model,cnets,configs}.py``,
    ``modeling_{llama,qwen3}_kv.py``, ``utils.py``; ``eagle/traineagle3/{cnets,main,config.json}``).

    **The same keys as vLLM's and SGLang's layouts** (``cnets.Model``: ``midlayer.*``, ``fc``,
    ``norm``, ``lm_head`` ``[N, d]``, buffers ``d2t``/``t2d``; the reference they follow) **and the
    same function as our eagle3 drafter without** ``qk_norm``, point by point:

    1. *Fusion.*  ``fc`` (``Linear(3·d → d)``, no bias — ``bias`` in the config is ignored by the
       EAGLE-3 model) over the three captured states in increasing layer order, applied when the
       hidden input is wider than the embedding (``forward``: ``hidden_states.shape[-1] !=
       inputs_embeds.shape[-1]``), so never to the fed-back d-wide state.  The layers are not in the
       config: :func:`eagle_repo_layers` of the target's depth.
    2. *Layer.*  ``LlamaDecoderLayeremb``: residual = the hidden state; ``cat(input_layernorm(emb),
       hidden_norm(hidden))`` — embedding first; q/k/v over 2d, no bias, no q/k norm; ``o_proj``;
       ``post_attention_layernorm`` and ``LlamaMLP`` (down(act(gate)·up), ``hidden_act``).
       ``head_dim`` is ``hidden_size // num_attention_heads`` (a config ``head_dim`` is ignored), so a
       drafter whose heads are otherwise wide is refused.
    3. *RoPE, positions, attention.*  ``LlamaRotaryEmbedding`` of the config's ``rope_theta``
       (10000 when absent), unscaled unless ``rope_scaling`` (linear/dynamic); ours rotates with the
       target's RoPE, so an export writes the recorded θ and an import with ``--target`` checks it.
       ``topK_genrate``: row t = (token t + 1, hidden t) at position t, causal; draft step i at
       position T + i attending to the context and its ancestors (the tree mask) — ours.
    4. *Feedback, heads, vocabulary.*  The next step reads ``out_hidden`` before ``norm``; logits
       ``lm_head(norm(h))`` over N draft ids, target id = id + ``d2t[id]``; with
       ``vocab_size == draft_vocab_size`` the maps are deleted before loading (an export writes
       none; an import ignores them).
    5. *Embedding.*  ``embed_tokens`` is the target's, read unscaled from the base model unless the
       config has ``target_hidden_size`` (then from the folder); ``traineagle3/main.py`` saves
       without it (``exclude_frozen_parameters``).  An export writes none and no
       ``target_hidden_size``; an import checks a re-stored copy against ``--target`` and drops it,
       and refuses a target that scales its embeddings (Gemma; EAGLE's EAGLE-3 captures only from
       its Llama and Qwen3 models).

    ``EaModel`` loads with ``strict=False`` (a missing key silently stays random), so an export
    writes exactly these keys; it casts the drafter to the target's dtype.  Its trainer saves
    ``pytorch_model.bin`` (DeepSpeed's ``save_16bit_model``): a pickle, which specforge refuses —
    convert it to ``model.safetensors`` first.  Numerics only: ``LlamaRMSNorm`` computes in float32.
    """

    def __init__(self) -> None:
        super().__init__("eagle", "EAGLE", 0, full_vocab_maps=False)
        self.description = ("the original EAGLE repository's EAGLE-3 folder (SafeAILab/EAGLE EaModel: a "
                            "LlamaForCausalLM config, midlayer.* keys, fused layers hard-coded from the target's "
                            "depth)")

    def _export_checks(self, s: Eagle3Shape) -> list[tuple[bool, str]]:
        n, want = s.n_target_layers, eagle_repo_layers(s.n_target_layers)
        return [
            (want is None, f"its target has {n} layers, and EAGLE's hard-coded captures (the inputs of layers 2, "
                           f"n//2 and n − 3: {sorted({2, n // 2, n - 3})}) are not the outputs of three distinct "
                           "layers for it, while its fc reads 3·hidden inputs"),
            (want is not None and tuple(s.layers) != want,
             f"it fuses the target layers {list(s.layers)} and EAGLE hard-codes the outputs of layers "
             f"{list(want or ())} for a {n}-layer target (the inputs of its layers 2, n//2, n − 3), recording "
             "none in its config — train with the default drafter.target_layers, or export --to vllm or sglang, "
             "which record the fused layers"),
            (s.head_dim * s.n_heads != s.dim,
             f"its attention is {s.n_heads} heads × {s.head_dim} wide and its hidden size {s.dim}; EAGLE's layer "
             "derives head_dim = hidden_size / num_attention_heads"),
            *self._layer_checks(s),
        ]

    def _config(self, s: Eagle3Shape, draft_vocab_size: int, dtype: torch.dtype,
                provenance: dict[str, Any]) -> dict[str, Any]:
        """``traineagle3/config.json``'s fields (``EConfig``): no layer ids, no ``head_dim``, no
        ``target_hidden_size`` (EAGLE then reads the target's own embedding), ``draft_vocab_size``
        always (``cnets.Model`` sizes ``lm_head`` from it); ``rope_theta`` the target's."""
        return {
            "architectures": [EAGLE_REPO_ARCH], "model_type": "llama", "hidden_act": _ACTIVATIONS[s.activation],
            "hidden_size": s.dim, "intermediate_size": s.intermediate_size,
            "max_position_embeddings": s.max_positions, "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads, "num_hidden_layers": 1, "pretraining_tp": 1,
            "rms_norm_eps": s.norm_eps, "rope_scaling": None, "rope_theta": s.rope_theta,
            "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
            "vocab_size": s.vocab_size, "draft_vocab_size": draft_vocab_size, "specforge": provenance,
        }

    def detect(self, directory: Path) -> bool:
        """A one-layer ``LlamaForCausalLM`` config (not vLLM's/SGLang's ``LlamaForCausalLMEagle3``)
        over ``midlayer.*`` and ``fc.weight`` tensors — a Llama model's own folder has neither."""
        config = read_config(directory)
        if not config or EAGLE_REPO_ARCH not in (config.get("architectures") or []) \
                or config.get("num_hidden_layers") != 1:
            return False
        names = _tensor_names(directory)
        return "fc.weight" in names and any(k.startswith("midlayer.") for k in names)

    def _fused(self, config: dict[str, Any], path: Path, target: Any) -> tuple[list[int], int | None]:
        recorded = (config.get("specforge") or {}).get("n_target_layers")
        depth = int(recorded) if recorded else (None if target is None else target.args.n_layers)
        if depth is None:
            raise InteropError(f"{path}: EAGLE records no fused layers — it captures the inputs of the target's "
                               "layers 2, n//2 and n − 3 — and the target's depth n is not recorded: import with "
                               "--target")
        if target is not None and depth != target.args.n_layers:
            raise InteropError(f"{path.parent}: made for another target — n_target_layers {depth} "
                               f"(target: {target.args.n_layers})")
        layers = eagle_repo_layers(depth)
        if layers is None:
            raise InteropError(f"{path}: for a {depth}-layer target EAGLE's captures (the inputs of layers 2, n//2, "
                               f"n − 3: {sorted({2, depth // 2, depth - 3})}) are not the outputs of three distinct "
                               "layers, and its fc reads 3·hidden inputs")
        return list(layers), depth

    def _head_dim(self, config: dict[str, Any]) -> int:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])  # cnets.LlamaAttention

    def _import_checks(self, config: dict[str, Any], directory: Path, target: Any) -> list[str]:
        path, d, heads = directory / "config.json", config.get("hidden_size"), config.get("num_attention_heads")
        try:
            theta = float(config.get("rope_theta", 10000.0))  # LlamaRotaryEmbedding's default base
        except (TypeError, ValueError):
            raise InteropError(f"{path}: rope_theta {config.get('rope_theta')!r} is not a number") from None
        checks = [
            (isinstance(d, int) and isinstance(heads, int) and heads > 0 and d % heads != 0,
             f"hidden_size {d} is not a multiple of num_attention_heads {heads} (EAGLE's layer derives head_dim "
             "from them)"),
            (config.get("target_hidden_size") not in (None, d),
             f"target_hidden_size {config.get('target_hidden_size')} differs from hidden_size {d}: its fc reads a "
             "target of another width, and specforge's eagle3 drafter fuses states of its own width"),
            (config.get("rope_scaling") is not None,
             f"its own RoPE scaling {config.get('rope_scaling')}, and specforge's eagle3 drafter rotates with the "
             "target's RoPE"),
        ]
        for failed, message in checks:
            if failed:
                raise InteropError(f"{path}: {message}")
        if target is None:
            return ["not checked against a target (its RoPE base and embedding): import with --target"]
        theirs = rope_base(target.runtime, target.args.head_dim)
        if theirs is None or abs(theirs - theta) > 1e-5 * theta:
            raise InteropError(f"{directory}: made for another target — RoPE base {theta:g} "
                               f"(target: {'a scaled RoPE' if theirs is None else f'{theirs:g}'}); EAGLE rotates "
                               "with its config's rope_theta (10000 when absent), specforge's eagle3 drafter with "
                               "the target's RoPE")
        if target.args.embed_scale != 1.0:
            raise InteropError(f"{directory}: the target ({target.args.family}) scales its embeddings by "
                               f"{target.args.embed_scale:g}, which EAGLE's drafter does not")
        return []


def _stored_dtype(source: Path) -> torch.dtype:
    """The dtype an eagle3 checkpoint's weights were saved in (its ``fc`` weight alone is read)."""
    from safetensors import safe_open

    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.fc.weight").dtype


def _tensor_names(directory: Path) -> set[str]:
    """The tensor names of a folder's ``model.safetensors`` (or the shards its index lists),
    read from the headers; empty when there is none or it is unreadable."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    index = read_config(directory, "model.safetensors.index.json")
    if index is not None and not (directory / "model.safetensors").is_file():
        return set(index.get("weight_map") or {})
    try:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            return set(f.keys())
    except (OSError, SafetensorError, ValueError):
        return set()


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
        dtype = _stored_dtype(source)  # as saved (load_eagle3 builds float32)
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
                  Eagle3Format("sglang", "SGLang", 0, full_vocab_maps=True), DeepSpecEagle3Format(), EagleRepoFormat())

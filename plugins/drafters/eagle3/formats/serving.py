"""``eagle3`` checkpoints in the layouts vLLM and SGLang serve (``vllm``, ``sglang``; docs/interop.md).

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
own folder (:mod:`~specforge_plugins.drafters.eagle3.formats.eagle_repo`) has the same keys but records no
fused layers: they follow from the target's depth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge.toolkit.formats import InteropError, check_shapes, drop_frozen, load_tensors, mismatch, read_config
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.eagle3.formats.common import ACTIVATIONS, GATE_UP, layer_keys, stored_dtype
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, save_eagle3

__all__ = ["ARCHITECTURE", "Eagle3Format"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Serving key -> our state_dict key; gate/up are the two halves of our w13.
_SAME = layer_keys("midlayer.")
_GATE, _UP = (f"midlayer.{key}" for key in GATE_UP)
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
            "hidden_act": ACTIVATIONS[s.activation], "rms_norm_eps": s.norm_eps, "vocab_size": s.vocab_size,
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
        dtype = stored_dtype(source)
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
                activation={v_: k for k, v_ in ACTIVATIONS.items()}.get(config.get("hidden_act", "silu"), "silu"),
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

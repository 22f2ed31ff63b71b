"""``eagle3`` checkpoints in the original EAGLE repository's layout (``eagle``; docs/interop.md):
the serving layouts' keys (:mod:`~specforge_plugins.drafters.eagle3.formats.serving`) under a
``LlamaForCausalLM`` config that records no fused layers (:func:`eagle_repo_layers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specforge.toolkit.formats import InteropError, read_config
from specforge_plugins.drafters.eagle3.formats.common import ACTIVATIONS
from specforge_plugins.drafters.eagle3.formats.serving import Eagle3Format
from specforge_plugins.drafters.eagle3.model import Eagle3Shape, rope_base

__all__ = ["EAGLE_REPO_ARCH", "EagleRepoFormat", "eagle_repo_layers"]

EAGLE_REPO_ARCH = "LlamaForCausalLM"


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
            "architectures": [EAGLE_REPO_ARCH], "model_type": "llama", "hidden_act": ACTIVATIONS[s.activation],
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


def _tensor_names(directory: Path) -> set[str]:
    """The tensor names of a folder's ``model.safetensors`` (or the shards its index lists),
    read from the headers; empty when there is none or it is unreadable."""
    directory = Path(directory)
    index = read_config(directory, "model.safetensors.index.json")
    if index is not None and not (directory / "model.safetensors").is_file():
        return set(index.get("weight_map") or {})
    try:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            return set(f.keys())
    except (OSError, SafetensorError, ValueError):
        return set()

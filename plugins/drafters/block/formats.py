"""``dspark`` and ``dflash`` checkpoints in DeepSpec's layout and in the layouts vLLM serves
(docs/interop.md).

How our block drafter compares with DeepSpec's ``Qwen3DSparkModel`` (deepseek-ai/DeepSpec @ afdfa7c9,
``deepspec/modeling/dspark/{common,markov_head}.py``, ``qwen3/{config,modeling}.py``,
``eval/dspark/{evaluator,draft_ops}.py``) and vLLM's ``Qwen3DSparkForCausalLM`` /
``DFlashQwen3ForCausalLM`` (vllm-project/vllm: ``model_executor/models/qwen3_dspark.py`` @ 0302ff40
and 47bd6d7c, ``qwen3_dflash.py`` @ 036a00d1, ``v1/worker/gpu/spec_decode/{dflash,dspark}/speculator.py``
@ 00746147 / 02957b5a, ``dspark/utils.py`` @ 0308cbae, ``eagle/eagle3_utils.py`` @ 0cfdd2e1):

1. *Block layout.*  DeepSpec feeds ``[x_0, MASK × (block_size − 1)]`` at positions p … p+bs−1 and
   slot j predicts x_{j+1} (``create_noise_embed``; labels ``arange(1, block_size + 1)`` in
   ``forward``; ``build_dspark_proposal`` samples every slot): our ``dspark`` layout, γ = block_size.
   Its DFlash is the same model with ``markov_rank: 0`` (``config/dflash/*.py``), i.e. our ``dspark``
   without a correction head — *not* our ``dflash``, whose γ mask slots of ``[x_0, MASK × γ]``
   predict in place, so ``dflash`` has no DeepSpec layout.  vLLM's DSpark speculator drafts
   anchor-first by default (``sample_from_anchor``, ``sample_pos = query_pos + 1``); its DFlash
   speculator drafts ``1 + N`` slots and samples the mask slots at their own positions
   (``_prepare_dflash_inputs_kernel``): our ``dspark`` and ``dflash``.
2. *Context K/V, positions.*  All three project ``hidden_norm(fc(concat of tapped states))`` with
   each layer's own k/v projections (no input norm), k-normed and rotated at the context's
   positions, and prepend them to the block's (``Qwen3DSparkAttention.forward``;
   ``_project_context_kv``); queries come from block slots only; a block sees the context strictly
   before its anchor and itself bidirectionally (``create_dspark_attention_mask``; vLLM: context =
   the verified positions, the block at ``last_valid_pos + 1 …``, non-causal).  Slot j sits at
   anchor + j everywhere.  RoPE: ours is the target's (its ``inv_freq``); DeepSpec's config is a
   copy of the target's and vLLM's reads ``rope_parameters`` from the draft config — so an export
   copies the target's ``config.json``, RoPE included.
3. *Tapped layers.*  Ours are 0-based layer *outputs*; DeepSpec's ``target_layer_ids`` too
   (``hidden_states[i + 1]``, −1 = the embeddings, which we cannot tap); vLLM adds 1 to top-level
   ``target_layer_ids`` and ``dflash_config.target_layer_ids`` (it captures layer *inputs*) and
   reads ``eagle_aux_hidden_state_layer_ids`` as inputs, first.  Both concatenate in increasing
   order, and neither reads the last layer's raw output (DeepSpec's ``hidden_states[L]`` is
   final-normed: ``assert_no_final_target_layer``; vLLM never captures input L).
4. *MASK.*  DeepSpec and vLLM embed a vocabulary id, ``mask_token_id`` (DeepSpec from its own
   copy of the target's embedding).  A drafter of ours with a learned ``mask_embed`` cannot be
   DeepSpec's; vLLM's ``mask_embedding.pt`` is a pickle (never written or read here), but vLLM
   keeps a draft ``embed_tokens`` larger than the target's vocabulary (``uses_expanded_input_vocab``;
   ``load_dspark_model`` shares the target's only when ``vocab_size <= target``; DFlash's
   ``_should_share`` keeps an own copy unequal to the target's): the target's V rows plus the
   MASK vector as row V, ``mask_token_id = V``, ``draft_vocab_size`` V (or N).  No anchor is ever
   id V, so that is exact.
5. *Heads.*  Markov: ours B = W1[x_{k−1}] W2 with W1 [V, r], W2 [r, V]; theirs
   ``markov_w2(markov_w1[x])`` — ``markov_w1.weight`` = W1, ``markov_w2.weight`` = W2ᵀ [V or N, r].
   Gated: σ(Linear([h; e])) ⊙ e ↔ ``gate_proj``; rnn: ``[s; e; h] → (g, c, o)``,
   s' = σ(g)s + (1−σ(g))tanh(c), B = W2 tanh(o) ↔ ``joint_proj`` — the same formulas in the same
   order (``markov_head.py``).  vLLM has only the vanilla head (``DSparkMarkovHead``), none for
   DFlash.  Over a draft vocabulary ours has N + 1 W1 rows (one shared by every token outside) and
   W2 over N; vLLM's W1 covers the target's V (expanded from ours), W2 the N draft ids.
   Confidence: ``proj([h; markov_w1[x_{k−1}]])`` (``confidence_head_with_markov``) or ``proj(h)``,
   with bias — ours with ``embedding="head"`` (W1 tied), or an own table whose columns of ``proj``
   are all zero; an own table read by ``proj`` has no counterpart.  (Our c_k is clamped to
   [eps, 1 − eps]; theirs is the bare sigmoid: the runtime's choice, not a weight.)
6. *q/k norm.*  Qwen3 layers always RMS-normalise queries and keys per head; an RMSNorm of weight 1
   is not the identity, so a drafter without ``qk_norm`` (a Llama/SmolLM2 target's) is refused.
7. *Names.*  ``attn_norm``/``mlp_norm``/``ctx_norm`` = ``input_layernorm``/
   ``post_attention_layernorm``/``hidden_norm``; ``wkv`` = ``k_proj`` rows then ``v_proj`` rows;
   ``w13`` = ``gate_proj`` then ``up_proj``; no biases (``attention_bias: false``); SiLU MLP (vLLM's
   ``Qwen2MLP``); full, non-causal attention in every layer.

sgl-project SpecForge's ``DFlashDraftModel`` (``specforge/modeling/draft/dflash.py`` @ a6b6b023) is
vLLM's DFlash layout, written by its ``--to hf`` export (``save_pretrained``: ``architectures:
[DFlashDraftModel]``, ``auto_map``, a Qwen3 config with ``block_size``, ``num_target_layers`` and
``dflash_config.{mask_token_id, target_layer_ids}``; ``layers.*`` with q/k norm, ``fc``,
``hidden_norm``, ``norm``; no embedding or LM head), which ``scripts/gates/normalize_dflash_export.py``
leaves as it is but for dropping ``auto_map``.  Its ``spec_generate`` is our ``dflash``: the block
``[x_0, MASK × (block_size − 1)]`` at the anchor's positions, ``draft_hidden[:, -block_size + 1:]``
sampled in place (training: ``OnlineDFlashModel`` labels ``anchor + k``, slot 0 unweighted), context
``hidden_norm(fc(…))`` of ``hidden_states[i + 1]`` projected by each layer's k/v, k-normed with the
block's and rotated at the context's positions, seen strictly before the anchor
(``create_dflash_block_mask``), the block bidirectional; ``norm`` then the target's LM head.  The
``vllm`` import reads it; a Domino drafter (``dflash_config.projector_type: domino``, a GRU logits
head — normalised to the same architecture) is refused, as are SpecForge's sliding-window layers.

So an export writes the target's config.json plus the drafter's fields, the tensors of
:meth:`_Plan.shapes` and — for DeepSpec, whose evaluator loads the folder alone — the target's
embedding and LM head, read from the target the checkpoint records (``config.json``'s ``target``).
An import reads the union of the layouts, checks re-stored copies against ``--target`` and drops
them.  Anything not exact is refused with one sentence saying why and what would fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from specforge.toolkit.checkpoints import TARGET_SHAPE
from specforge.toolkit.confidence_head import DSparkConfidence, DSparkHeadConfig
from specforge.toolkit.formats import (InteropError, check_shapes, drop_frozen, load_tensors, mismatch, read_config,
                                       recorded_target, rope_theta, target_tensor)
from specforge.toolkit.heads import HEADS, HeadConfig
from specforge.vocab import DraftVocab, DraftVocabError
from specforge_plugins.drafters.block.checkpoint import load_drafter, save_drafter
from specforge_plugins.drafters.block.config import BlockDrafterConfig
from specforge_plugins.drafters.block.model import BlockBackbone

__all__ = ["DFLASH_FORMATS", "DSPARK_FORMATS", "BlockFormat"]

DSPARK_ARCH, DFLASH_ARCH = "Qwen3DSparkModel", "DFlashDraftModel"
NUM_ANCHORS = 512  # DeepSpec's training-only anchors per sequence: its model asserts the field exists
# Foreign key -> ours (``backbone.*``); per draft layer the k/v projections are the two halves of
# our wkv's output rows and gate/up those of our w13.
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "ctx_norm.weight", "norm.weight": "norm.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "wq.weight",
          "self_attn.o_proj.weight": "wo.weight", "self_attn.q_norm.weight": "q_norm.weight",
          "self_attn.k_norm.weight": "k_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
          "mlp.down_proj.weight": "w2.weight"}
_HALVES = {"wkv.weight": ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
           "w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
# Our correction heads: DeepSpec's markov_head_type, and the extra linear layer (ours, theirs).
_HEADS = {"markov": ("vanilla", None), "gated": ("gated", ("gate", "gate_proj")),
          "rnn": ("rnn", ("cell", "joint_proj"))}
_W1, _W2, _PROJ = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj"


@dataclass(frozen=True)
class _Plan:
    """What a checkpoint holds in the foreign layout, and so every tensor's shape."""

    c: BlockDrafterConfig
    v_in: int  # rows of embed_tokens and markov_w1: V, or V + 1 with the learned MASK vector as row V
    head: str | None  # markov / gated / rnn
    rank: int
    conf: bool | None  # the confidence head reads [h; W1[x]] (True) or h (False); None: no head
    embed: bool  # embed_tokens stored
    lm_head: bool  # lm_head stored

    @property
    def n(self) -> int:
        return self.c.draft_vocab_size or self.c.vocab_size

    def shapes(self) -> dict[str, tuple[int, ...]]:
        c, d, r = self.c, self.c.dim, self.rank
        q, kv, i = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate_size
        layer = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,),
                 "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (i, d),
                 "mlp.up_proj.weight": (i, d), "mlp.down_proj.weight": (d, i)}
        out = {"fc.weight": (d, len(c.tap_layers) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
        out.update({f"layers.{n}.{k}": s for n in range(c.draft_layers) for k, s in layer.items()})
        if self.embed:
            out["embed_tokens.weight"] = (self.v_in, d)
        if self.lm_head:
            out["lm_head.weight"] = (self.n, d)
        if c.draft_vocab_size is not None:
            out["d2t"] = (self.n,)
        if self.head is not None:
            out[_W1], out[_W2] = (self.v_in, r), (self.n, r)
            if self.head != "markov":
                extra = f"markov_head.{_HEADS[self.head][1][1]}"
                rows, fan = (r, d + r) if self.head == "gated" else (3 * r, 2 * r + d)
                out[extra + ".weight"], out[extra + ".bias"] = (rows, fan), (rows,)
        if self.conf is not None:
            out[_PROJ + ".weight"], out[_PROJ + ".bias"] = (1, d + (r if self.conf else 0)), (1,)
        return out


class BlockFormat:
    """DeepSpec's (``deepspec``) or vLLM's (``vllm``) layout of ``dspark`` or ``dflash`` checkpoints."""

    def __init__(self, name: str, method: str) -> None:
        self.name, self.method = name, method
        self.arch = DFLASH_ARCH if method == "dflash" else DSPARK_ARCH
        self.title = {("deepspec", "dspark"): "DeepSpec's Qwen3DSparkModel",
                      ("vllm", "dspark"): "vLLM's Qwen3DSparkForCausalLM",
                      ("vllm", "dflash"): "vLLM's DFlashQwen3ForCausalLM"}[name, method]
        self.description = (f"{self.title} ({self.arch}: layers.*, fc, hidden_norm"
                            + (", markov_head, confidence_head" if method == "dspark" else "")
                            + (", the target's embed_tokens/lm_head copies)" if name == "deepspec" else ")"))

    # -- export ---------------------------------------------------------------------------------

    def export(self, source: Path, out: Path) -> list[str]:
        config, tensors, notes = self.layout(source)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return notes

    def layout(self, source: Path, title: str | None = None) -> tuple[dict[str, Any], dict[str, Tensor], list[str]]:
        """``(config.json, tensors, notes)`` of the checkpoint ``source`` in this layout, every tensor
        checked against the shape the config implies; nothing is written (the refusals first, naming
        ``title``: this layout's, or that of a format built on it — llama.cpp's GGUF)."""
        backbone, head, conf, drafter = load_drafter(source)
        stored = load_file(str(source / "model.safetensors"))
        for prefix, module in (("backbone", backbone), ("head", head), ("confidence", conf)):
            if module is not None:  # in the dtype it was saved in (load_drafter builds float32 modules)
                module.to(next(v.dtype for k, v in stored.items()
                               if k.startswith(prefix + ".") and v.is_floating_point()))
        c, vocab, meta = backbone.config, backbone.vocab, read_config(source) or {}
        kind = None if head is None else next((k for k, cls in HEADS.items() if type(head) is cls), "?")
        self._refuse_export(c, head, kind, conf, source, title or self.title)
        deepspec, learned = self.name == "deepspec", c.mask_token_id is None
        with_markov = None if conf is None else conf.config.embedding == "head"
        zero_head = head is None and self.method == "dspark" and not deepspec  # vLLM's DSpark always has one
        plan = _Plan(c, v_in=c.vocab_size + (learned and not deepspec), head="markov" if zero_head else kind,
                     rank=1 if zero_head else (0 if head is None else head.config.rank), conf=with_markov,
                     embed=deepspec or learned, lm_head=deepspec or vocab is not None)
        target_config, target_dir, args = recorded_target(meta.get("target"), c, TARGET_SHAPE, source)
        if args.embed_scale != 1.0:  # ours multiplies the embedding by it, DeepSpec's and vLLM's Qwen3 do not
            raise InteropError(f"{source}: its target ({args.family}) scales its embeddings by {args.embed_scale:g} "
                               f"and this drafter with it; the Qwen3 layouts read embed_tokens unscaled")
        dtype = backbone.fc.weight.dtype
        state = backbone.state_dict()
        tensors = {key: state[ours] for key, ours in _TOP.items()}
        for n in range(c.draft_layers):
            tensors.update({f"layers.{n}.{key}": state[f"layers.{n}.{ours}"] for key, ours in _LAYER.items()})
            for ours, (a, b) in _HALVES.items():
                tensors[f"layers.{n}.{a}"], tensors[f"layers.{n}.{b}"] = state[f"layers.{n}.{ours}"].chunk(2, dim=0)
        rows = None if vocab is None else vocab.token_rows()
        if head is not None:
            hs = head.state_dict()
            w1 = hs["w1"] if rows is None else hs["w1"][rows]  # vLLM's W1 covers every target id
            tensors[_W1] = torch.cat([w1, w1.new_zeros(plan.v_in - len(w1), plan.rank)])  # row V: never a token
            tensors[_W2] = hs["w2"].t()
            if kind != "markov":
                ours, theirs = _HEADS[kind][1]
                tensors.update({f"markov_head.{theirs}.{p}": hs[f"{ours}.{p}"] for p in ("weight", "bias")})
        elif zero_head:  # bias W1[x] W2 = 0: the base logits unchanged, as ours without a head
            tensors[_W1], tensors[_W2] = (torch.zeros(rows, 1, dtype=dtype) for rows in (plan.v_in, plan.n))
        if conf is not None:
            cs = conf.state_dict()
            tensors[_PROJ + ".weight"] = cs["proj.weight"] if with_markov else cs["proj.weight"][:, :c.dim]
            tensors[_PROJ + ".bias"] = cs["proj.bias"]
        if plan.embed:
            embed = target_tensor(target_dir, "model.embed_tokens.weight", "embed_tokens.weight").to(dtype)
            tensors["embed_tokens.weight"] = (torch.cat([embed, backbone.mask_embed.detach()[None]]) if learned
                                              else embed)
        if plan.lm_head:
            lm_head = target_tensor(target_dir, "lm_head.weight", "model.embed_tokens.weight",
                                     "embed_tokens.weight")  # a tied head is the embedding
            tensors["lm_head.weight"] = (lm_head if vocab is None else lm_head[vocab.ids]).to(dtype)
        if vocab is not None:
            tensors["d2t"], tensors["t2d"] = vocab.d2t, vocab.t2d
        check_shapes(tensors, plan.shapes(), source)
        config = self._config(target_config, plan, dtype, learned, with_markov, kind)
        config["specforge"] = {"method": meta.get("method"), "target": meta.get("target"),
                               "vocab_size": c.vocab_size, "drafter": drafter}
        copied = ", ".join(["config"] + ["embedding"] * plan.embed + ["LM head"] * plan.lm_head)
        notes = [f"the target's {copied}: copied from the target the checkpoint records ({meta.get('target')})"]
        if zero_head:
            notes.append("no correction head: vLLM's DSpark model always has a Markov head, written with rank 1 and "
                         "zero weights (a zero bias)")
        if learned and not deepspec:
            notes.append(f"the learned MASK vector is embed_tokens row {c.vocab_size} (mask_token_id "
                         f"{c.vocab_size}): the draft's input vocabulary is the target's plus that row")
        return config, tensors, notes

    def _refuse_export(self, c: BlockDrafterConfig, head: Any, kind: str | None, conf: Any, source: Path,
                       layout: str) -> None:
        """One sentence for the first thing the layout cannot state exactly (the module docstring)."""
        taps = list(c.tap_layers)
        checks = [
            (not c.qk_norm, f"{layout} RMS-normalises every draft layer's queries and keys per head (Qwen3's q_norm/"
                            "k_norm) and this drafter has no qk-norm (trained with drafter.qk_norm=false, or before "
                            "it was the default); an RMSNorm is not the identity, so it cannot be written exactly — "
                            "retrain with drafter.qk_norm=true (the default)"),
            (c.activation != "silu", f"{layout}'s MLP is SiLU-gated and this drafter's is {c.activation}"),
            (taps != sorted(set(taps)), f"{layout} concatenates the tapped layers in increasing order and this "
                                        f"drafter taps {taps} — train with drafter.target_layers increasing"),
            (c.n_target_layers - 1 in taps,
             f"it taps the target's last layer ({c.n_target_layers - 1}), whose raw output neither DeepSpec (it "
             "reads the final-normed hidden_states[L]) nor vLLM (it captures layer inputs) provides — train with "
             f"drafter.target_layers below {c.n_target_layers - 1}"),
            (self.name == "deepspec" and c.draft_vocab_size is not None,
             f"{layout} drafts over the whole vocabulary (lm_head and Markov tables of {c.vocab_size} rows) and "
             f"this drafter over a draft vocabulary of {c.draft_vocab_size} — export --to vllm keeps it, or train "
             "without drafter.draft_vocab"),
            (self.name == "deepspec" and c.mask_token_id is None,
             f"{layout} embeds MASK slots as a vocabulary id (mask_token_id) of its copy of the target's embedding "
             "and this drafter learned its own MASK vector, which no id carries — export --to vllm keeps it as an "
             "extra embedding row"),
            (kind == "?", f"its correction head {type(head).__name__} is none of markov, gated, rnn"),
            (self.name != "deepspec" and self.method == "dspark" and kind in ("gated", "rnn"),
             f"{layout} has only the vanilla Markov head and this drafter's correction head is {kind} — export --to "
             "deepspec keeps it, or train with drafter.head.name=markov"),
            (self.method == "dflash" and head is not None,
             f"{layout} has no correction head and this drafter has a {kind} one — train with "
             "drafter.head.name=none"),
            (self.method == "dflash" and conf is not None,
             f"{layout} has no confidence head and this drafter has one — train with drafter.confidence.name=none"),
            (conf is not None and conf.config.embedding == "own" and bool(conf.proj.weight[:, c.dim:].any()),
             f"{layout}'s confidence head reads [h_k; markov_w1[x_k-1]] or h_k alone and this drafter's reads a "
             "token table of its own — train with drafter.confidence.embedding=head (the correction head's W1, "
             "paper eq. 7)"),
        ]
        for failed, message in checks:
            if failed:
                raise InteropError(f"{source}: {message}")

    def _config(self, target: dict[str, Any], plan: _Plan, dtype: torch.dtype, learned: bool,
                with_markov: bool | None, kind: str | None) -> dict[str, Any]:
        """The target's config.json (its RoPE, norms, sizes) with the drafter's fields, as
        DeepSpec's ``build_draft_config`` deep-copies it."""
        c = plan.c
        config = {k: v for k, v in target.items() if k not in ("architectures", "auto_map", "_name_or_path")}
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]  # the same base for readers on older transformers
        mask = c.vocab_size if learned else c.mask_token_id
        config.update(architectures=[self.arch], num_hidden_layers=c.draft_layers, num_target_layers=c.n_target_layers,
                      layer_types=["full_attention"] * c.draft_layers, use_sliding_window=False,
                      tie_word_embeddings=False, attention_bias=False, vocab_size=plan.v_in)
        for key in [k for k in ("dtype", "torch_dtype") if k in target] or ["torch_dtype"]:  # as the target names it
            config[key] = str(dtype).removeprefix("torch.")
        if self.method == "dflash":  # vLLM: dflash_config's ids + 1 are the captured layer inputs
            config.update(block_size=c.gamma + 1, draft_vocab_size=plan.n,
                          dflash_config={"mask_token_id": mask, "target_layer_ids": list(c.tap_layers)})
            return config
        config.update(block_size=c.gamma, mask_token_id=mask, target_layer_ids=list(c.tap_layers),
                      markov_rank=plan.rank, enable_confidence_head=plan.conf is not None)
        if plan.head is not None:
            config["markov_head_type"] = _HEADS[plan.head][0]
        if plan.conf is not None:
            config["confidence_head_with_markov"] = with_markov
        if self.name == "deepspec":
            config["num_anchors"] = NUM_ANCHORS
        else:
            config.update(draft_vocab_size=plan.n, sample_from_anchor=True)
        return config

    # -- import ---------------------------------------------------------------------------------

    def detect(self, directory: Path) -> bool:
        config = read_config(directory) or {}
        if self.arch not in (config.get("architectures") or []):
            return False
        return self.method == "dflash" or ("num_anchors" in config) == (self.name == "deepspec")

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]:
        config, path = read_config(directory) or {}, directory / "config.json"
        where, tensors = load_tensors(directory)
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        extra, sub = config.get("specforge") or {}, config.get("dflash_config") or {}
        notes: list[str] = []
        try:
            d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            v_in = int(config["vocab_size"])
            n = int(config.get("draft_vocab_size") or v_in)
            mask = sub.get("mask_token_id", config.get("mask_token_id"))
            r = 0 if self.method == "dflash" else int(config.get("markov_rank") or 0)
            depth = config.get("num_target_layers") or (target.args.n_layers if target is not None else None)
            shape = {"dim": d, "n_heads": heads, "n_kv_heads": int(config.get("num_key_value_heads") or heads),
                     "head_dim": int(config.get("head_dim") or d // heads), "n_target_layers": depth}
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise InteropError(f"{path}: not a usable {self.title} config ({exc!r})") from None
        taps = _tapped(config)
        self._refuse_import(config, sub, taps, mask, r, depth, path)
        mask, t2d = int(mask), tensors.pop("t2d", None)
        if target is None:  # the target's V: its t2d, recorded by our export, or the draft's output (an expanded input)
            v = int(t2d.numel() if t2d is not None else extra.get("vocab_size") or
                    (n if n < v_in and "d2t" not in tensors else v_in))
        else:
            v, a = target.args.vocab_size, target.args
            expanded = self.name == "vllm" and "embed_tokens.weight" in tensors  # vLLM: input rows past V
            vocab_ok = n <= v and (v_in == v or (v_in > v and expanded))
            wrong = mismatch({"vocab_size": (v if vocab_ok else v_in, v),
                              **{k: (shape[k], getattr(a, t)) for k, t in TARGET_SHAPE.items() if k in shape}})
            theirs, mine = rope_theta(target.hf_model.config.to_dict()), rope_theta(config)
            if not wrong and None not in (theirs, mine) and theirs != mine:
                wrong = f"RoPE base {mine} (target: {theirs})"
            if wrong:
                raise InteropError(f"{directory}: made for another target — {wrong}")
        learned = mask >= v  # past the target's vocabulary: the learned MASK vector (module docstring, 4.)
        if learned and ("embed_tokens.weight" not in tensors or mask >= v_in):
            raise InteropError(f"{path}: mask_token_id {mask} is past the target's {v} tokens and there is no "
                               "embed_tokens row for it")
        kind = {t: k for k, (t, _) in _HEADS.items()}.get(str(config.get("markov_head_type", "vanilla")).lower())
        w = tensors.get(_PROJ + ".weight")
        with_markov = None if w is None else bool(config.get("confidence_head_with_markov", w.shape[-1] != d))
        if with_markov and not r:
            raise InteropError(f"{path}: the confidence head reads markov_w1 and there is no Markov head "
                               "(markov_rank)")
        gamma = config.get("block_size")
        try:
            c = BlockDrafterConfig(
                vocab_size=v, dim=d, n_heads=heads, n_kv_heads=shape["n_kv_heads"], head_dim=shape["head_dim"],
                intermediate_size=int(config["intermediate_size"]), n_target_layers=int(depth),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), qk_norm=True,
                rope_theta=rope_theta(config) or 10000.0, draft_layers=int(config["num_hidden_layers"]),
                target_layers=tuple(taps), predict_anchor=self.method == "dspark",
                gamma=(int(gamma) - (self.method == "dflash")) if gamma else (16 if self.method == "dflash" else 7),
                mask_token_id=None if learned else mask, draft_vocab_size=n if n < v else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise InteropError(f"{path}: not a usable {self.title} config ({exc})") from None
        plan = _Plan(c, v_in=v_in, head=kind if r else None, rank=r, conf=with_markov,
                     embed=self.name == "deepspec" or "embed_tokens.weight" in tensors,
                     lm_head=self.name == "deepspec" or "lm_head.weight" in tensors)
        check_shapes(tensors, plan.shapes(), where)
        ignored = sorted(k for k in tensors if "rotary_emb." in k or "mask_embedding" in k)  # vLLM skips these too
        unknown = sorted(set(tensors) - set(plan.shapes()) - set(ignored))
        if unknown:
            raise InteropError(f"{where}: tensors {self.title} does not have: {', '.join(unknown[:5])}")
        vocab = None
        if c.draft_vocab_size is not None:
            d2t = tensors["d2t"].long()
            try:
                vocab = DraftVocab.from_maps(d2t, t2d) if t2d is not None else DraftVocab(torch.arange(n) + d2t, v)
            except DraftVocabError as exc:
                raise InteropError(f"{where}: its d2t/t2d maps are unusable ({exc})") from None
        embed_ref = None if target is None else target.runtime.embed
        head_ref = None if target is None else (target.runtime.lm_head if vocab is None
                                                else target.runtime.lm_head[vocab.ids])
        mask_vector = tensors["embed_tokens.weight"][mask] if learned else None
        for key, what, ref, rows in (("embed_tokens.weight", "embedding", embed_ref, v),
                                     ("lm_head.weight", "LM head", head_ref, plan.n)):
            if key in tensors:  # the embedding's rows past V are no token's (the MASK vector's)
                notes.append(drop_frozen(tensors[key][:rows], ref, key, what, where))
        if learned:
            notes.append(f"embed_tokens row {mask} (mask_token_id) is the drafter's learned MASK vector")
        if target is None:
            notes.append("not checked against a target (its embedding, LM head, shape and RoPE): import with --target")

        backbone = BlockBackbone(c, vocab=vocab)
        state = {ours: tensors[key] for key, ours in _TOP.items()}
        for i in range(c.draft_layers):
            state.update({f"layers.{i}.{ours}": tensors[f"layers.{i}.{key}"] for key, ours in _LAYER.items()})
            state.update({f"layers.{i}.{ours}": torch.cat([tensors[f"layers.{i}.{a}"],
                                                            tensors[f"layers.{i}.{b}"]])
                          for ours, (a, b) in _HALVES.items()})
        if learned:
            state["mask_embed"] = mask_vector
        backbone.to(tensors["fc.weight"].dtype).load_state_dict(state)
        head = self._head(tensors, plan, vocab, where, notes)
        confidence = self._confidence(tensors, plan, vocab, head)
        save_drafter(out, backbone, head, confidence, {"kind": self.method, "imported_from": str(directory),
                                                       "format": self.name},
                     method=self.method, target=extra.get("target") or getattr(target, "name", None))
        return notes

    def _refuse_import(self, config: dict[str, Any], sub: dict[str, Any], taps: list[int] | None, mask: Any,
                       r: int, depth: Any, path: Path) -> None:
        layers = config.get("layer_types") or []
        checks = [
            (self.method == "dflash" and sub.get("projector_type") not in (None, "dflash"),
             f"dflash_config.projector_type {sub.get('projector_type')!r}: sgl-project SpecForge's "
             f"{str(sub.get('projector_type')).capitalize()} drafter, a DFlash backbone with a logits head of its own "
             "(Domino: a GRU over the drafted prefix)"),
            (taps is None, "no tapped target layers (target_layer_ids)"),
            (taps is not None and -1 in taps, "it taps the target's embeddings (target layer -1), which specforge's "
                                              "drafters cannot read"),
            (taps is not None and taps != sorted(set(taps)), f"its tapped layers {taps} are not increasing"),
            (taps is not None and depth is not None and int(depth) - 1 in taps,
             f"it taps the target's last layer ({int(depth) - 1}), which the layout reads final-normed"),
            (mask is None, "no mask_token_id"),
            (depth is None, "the target's depth (num_target_layers) is not recorded: import with --target"),
            (any(t != "full_attention" for t in layers) or sub.get("use_swa"), "sliding-window draft layers"),
            (bool(config.get("is_causal") or sub.get("causal")), "causal draft attention (ours is bidirectional "
                                                                  "inside a block)"),
            (bool(config.get("attention_bias")), "attention biases"),
            (bool(sub.get("attention_sink_bias") or config.get("add_swa_attention_sink_bias")), "attention sinks"),
            (config.get("hidden_act", "silu") != "silu", f"a {config.get('hidden_act')} MLP (ours is SiLU-gated)"),
            (config.get("target_hidden_size") not in (None, config.get("hidden_size")),
             "a target hidden size other than the draft's"),
            (self.method == "dspark" and config.get("sample_from_anchor") is False,
             "the 1 + N block with a Markov head (sample_from_anchor: false)"),
            (r > 0 and str(config.get("markov_head_type", "vanilla")).lower() not in [t for t, _ in _HEADS.values()],
             f"an unknown markov_head_type {config.get('markov_head_type')!r}"),
        ]
        for failed, message in checks:
            if failed:
                raise InteropError(f"{path}: {message}; specforge's {self.method} drafter cannot compute it exactly")

    def _head(self, tensors: dict[str, Tensor], plan: _Plan, vocab: DraftVocab | None, where: Path,
              notes: list[str]) -> Any:
        """Our correction head of the Markov tensors (none for an all-zero W2: a zero bias)."""
        if plan.head is None:
            return None
        w1, w2 = tensors[_W1][:plan.c.vocab_size], tensors[_W2]
        if not w2.any() and not plan.conf:
            notes.append("an all-zero markov_w2 (a zero bias): imported without a correction head")
            return None
        state = {"w2": w2.t()}
        if vocab is not None:  # ours: a row per draft id, one shared by every other token
            rows = vocab.token_rows()
            outside = w1[rows == vocab.size]
            if not (outside == outside[:1]).all():
                raise InteropError(f"{where}: its markov_w1 gives tokens outside the draft vocabulary rows of their "
                                   "own; specforge's head over a draft vocabulary shares one among them, so it "
                                   "cannot be imported exactly")
            state["token_rows"], w1 = rows, torch.cat([w1[vocab.ids], outside[:1]])
        state["w1"] = w1
        if plan.head != "markov":
            ours, theirs = _HEADS[plan.head][1]
            state.update({f"{ours}.{p}": tensors[f"markov_head.{theirs}.{p}"] for p in ("weight", "bias")})
        head = HEADS[plan.head](HeadConfig(rank=plan.rank, vocab_size=plan.c.vocab_size, dim=plan.c.dim))
        if vocab is not None:
            head.restrict(state["token_rows"])
        head.to(w1.dtype).load_state_dict(state)
        return head

    def _confidence(self, tensors: dict[str, Tensor], plan: _Plan, vocab: DraftVocab | None, head: Any) -> Any:
        """Ours of ``confidence_head.proj``: tied to W1, or (reading h alone) an own rank-1 table that
        ``proj`` gives zero weight."""
        if plan.conf is None:
            return None
        weight, bias = tensors[_PROJ + ".weight"], tensors[_PROJ + ".bias"]
        conf = DSparkConfidence(DSparkHeadConfig(rank=plan.rank if plan.conf else 1, vocab_size=plan.c.vocab_size,
                                                 dim=plan.c.dim, embedding="head" if plan.conf else "own"))
        if vocab is not None:
            conf.restrict(vocab.token_rows())
        state = {k: v for k, v in conf.state_dict().items() if k == "token_rows"}
        state.update({"proj.weight": weight, "proj.bias": bias})
        if not plan.conf:
            state["proj.weight"] = torch.cat([weight, weight.new_zeros(1, 1)], dim=1)
            state["embed"] = torch.zeros_like(conf.embed)
        conf.to(weight.dtype).load_state_dict(state)
        if plan.conf:
            conf.tie(head)
        return conf


def _tapped(config: dict[str, Any]) -> list[int] | None:
    """The tapped layers as 0-based outputs, read in vLLM's order (``get_eagle3_aux_layers_from_config``):
    ``eagle_aux_hidden_state_layer_ids`` are layer inputs, the others outputs."""
    inputs = config.get("eagle_aux_hidden_state_layer_ids")
    if inputs:
        return [int(i) - 1 for i in inputs]
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") or config.get("target_layer_ids")
    return [int(i) for i in ids] if ids else None


# llama.cpp converts vLLM's layout (plugins/drafters/block/llamacpp.py); imported here, below the
# class it builds on, so that the drafters' registration keeps reading its formats from this module.
from specforge_plugins.drafters.block.llamacpp import LlamaCppFormat  # noqa: E402

DSPARK_FORMATS = (BlockFormat("deepspec", "dspark"), BlockFormat("vllm", "dspark"),
                  LlamaCppFormat(BlockFormat("vllm", "dspark")))
DFLASH_FORMATS = (BlockFormat("vllm", "dflash"), LlamaCppFormat(BlockFormat("vllm", "dflash")))

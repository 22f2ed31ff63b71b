"""The engine-facing parallel block drafter of ``dspark`` and ``dflash`` (docs/design/drafters.md).

One round for R requests:

1. *Context.*  The engine hands over the target's tapped hidden states of the positions each
   request committed since its last draft (``DraftContext.features``).  Their fused context K/V
   is computed once, in one pass for the whole batch, and appended to the request's
   :class:`~specforge.toolkit.context_cache.ContextCache`.
2. *Parallel stage.*  One backbone pass over every request's block ``[x_0, MASK × (γ−1)]``
   (DFlash: ``[x_0, MASK × γ]``) gives hidden states h_k and base logits U_k.
3. *Sequential stage.*  Left to right, the pipeline's correction head (``ctx.correction_head``,
   the engine's) biases U_k given x_{k−1}
   (x_0 = the anchor) and h_k; x_k is drawn from ``p_k = warp(U_k + B_k, the request's
   sampling)`` with a uniform from the request's own generator, and p_k is reported as the law
   of x_k (T = 0: the one-hot arg-max), which is what keeps the verifier exact.

Weights come from a checkpoint directory (:func:`~specforge_plugins.drafters.block.checkpoint.
load_drafter`) or a seeded random initialisation (tests, conformance).  The embedding and LM
head are always the bound target's.  The layout — which slot predicts x_1 — and the defaults are
the subclass's (:mod:`~specforge_plugins.drafters.dspark`, :mod:`~specforge_plugins.drafters.dflash`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from specforge.components import ComponentWeights, DraftBlock, DraftContext
from specforge.toolkit.checkpoints import TARGET_SHAPE, check_fits
from specforge.toolkit.context_cache import ContextCache
from specforge.toolkit.drafting import empty_block, open_round
from specforge.toolkit.layers import SharedWeights
from specforge.toolkit.sequential import sequential_stage
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.block.checkpoint import load_drafter
from specforge_plugins.drafters.block.config import BlockDrafterConfig
from specforge_plugins.drafters.block.model import BlockBackbone
from specforge_plugins.drafters.block.replay import replay_rounds

__all__ = ["BlockConfig", "BlockDrafter"]


class BlockConfig(BaseModel):
    """Parameters of a block drafter (``dspark``, ``dflash``)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(None, description="drafter checkpoint directory (save_drafter); None: random init")
    gamma: int | None = Field(None, ge=1, description="draft positions per block; None: the checkpoint's (else 7)")
    layers: int | None = Field(None, ge=1,
                               description="draft layers of a random init (None: 5); a checkpoint fixes them")
    target_layers: tuple[int, ...] | None = Field(
        None, description="tapped target layers of a random init; None: 5 spread from 1 to L-3 of the bound target")
    seed: int = Field(0, description="seed of the random initialisation")
    qk_norm: bool | None = Field(
        None, description="q/k norm in the draft layers of a random init (None: on, the peers' layout); a "
                          "checkpoint records its own")
    dtype: Literal["float32", "target"] = Field(
        "target", description="'target': run the backbone in the target's dtype (bf16 on the embedded default), "
                              "its projections packed as the target's are; float32: as trained")
    draft_vocab: int | None = Field(
        None, ge=1, description="a random init over a draft vocabulary of this many target ids (a seeded "
                                "random set; tests and conformance); a checkpoint brings its own")
    candidates: int | None = Field(
        None, ge=1, description="sequential stage on the top-K tokens of the base logits U_k only: the "
                                "correction head reads K columns of W2 instead of V, and q_k is the exact "
                                "law on those K tokens (zero elsewhere); None: the full vocabulary")

    @model_validator(mode="after")
    def _one_source(self):
        if self.checkpoint is not None and (self.layers is not None or self.target_layers is not None
                                            or self.draft_vocab is not None or self.qk_norm is not None):
            raise ValueError("layers, target_layers, draft_vocab and qk_norm come from the checkpoint; set them only "
                             "for a random init")
        return self


class BlockDrafter:
    """The engine-facing block drafter; the layout (DSpark or DFlash) is a class attribute."""

    predict_anchor = True  # DSpark: the anchor slot is the first prediction
    default_gamma = 7
    default_layers = 5

    def __init__(self, config: BlockConfig | None = None) -> None:
        self.config = config or BlockConfig()
        self._loaded: tuple[BlockBackbone, nn.Module | None, nn.Module | None] | None = None
        if self.config.checkpoint is not None:
            backbone, head, confidence, _ = load_drafter(self.config.checkpoint)
            if backbone.config.predict_anchor != self.predict_anchor:
                raise ValueError(f"{self.config.checkpoint}: a {_layout(backbone.config.predict_anchor)} checkpoint; "
                                 f"this drafter has the {_layout(self.predict_anchor)} layout")
            self._loaded = (backbone, head, confidence)
            self.gamma = self.config.gamma or backbone.config.gamma
        else:
            self.gamma = self.config.gamma or self.default_gamma
        self.backbone: BlockBackbone | None = None
        self.feature_layers: tuple[int, ...] = ()  # fixed at bind(), from the target's depth
        self._contexts: ContextCache | None = None
        # Wall time of the sequential stage's correction-head calls, for latency breakdowns
        # (the paper reports the Markov head at 0.2–1.3 % of a round), and of each part of a
        # draft (`specforge bench round` reads them).
        self.head_seconds = 0.0
        self.part_seconds: dict[str, float] = dict.fromkeys(("ingest", "backbone", "lm_head", "sequential"), 0.0)

    # -- set-up ----------------------------------------------------------------------------------

    def taps_for(self, args: Any) -> tuple[int, ...]:
        """The layers :meth:`bind` taps: the checkpoint's, else those its random config picks."""
        config = self._loaded[0].config if self._loaded is not None else self._random_config(args)
        return tuple(config.tap_layers)

    def bind(self, target: Any) -> None:
        """Share the target's embedding and LM head and fix the tapped layers within its depth."""
        args, runtime = target.args, target.runtime
        if self._loaded is not None:
            backbone = self._loaded[0]
            check_fits(backbone.config, args, self.config.checkpoint, TARGET_SHAPE)
            if backbone.config.gamma != self.gamma:  # a shorter or longer block than trained
                backbone.config = backbone.config.model_copy(update={"gamma": self.gamma})
        else:
            config = self._random_config(args)
            backbone = BlockBackbone(config, seed=self.config.seed, vocab=self._random_vocab(args.vocab_size))
        if self.config.dtype == "target":
            backbone = backbone.to(runtime.dtype).pack()
        else:  # as trained, whatever dtype the checkpoint stored
            backbone = backbone.float()
        self.backbone = backbone.eval().bind(SharedWeights.from_target(runtime))
        c = backbone.config
        self.feature_layers = c.tap_layers
        self._contexts = ContextCache(c.draft_layers, c.n_kv_heads, c.head_dim, backbone.dtype)

    def _random_vocab(self, vocab_size: int) -> DraftVocab | None:
        n = self.config.draft_vocab
        return None if n is None else DraftVocab.random(n, vocab_size, self.config.seed)

    def _random_config(self, args: Any) -> BlockDrafterConfig:
        layers = self.config.target_layers
        bad = [i for i in layers or () if not 0 <= i < args.n_layers]
        if bad:
            raise ValueError(f"target_layers: layer {bad[0]} is outside the target's {args.n_layers} layers "
                             f"(0..{args.n_layers - 1})")
        return BlockDrafterConfig.from_model_args(
            args, draft_layers=self.config.layers or self.default_layers, target_layers=layers,
            gamma=self.gamma, predict_anchor=self.predict_anchor, draft_vocab_size=self.config.draft_vocab,
            qk_norm=self.config.qk_norm is not False)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        """The tokens this drafter can propose (None: all of the target's); evaluation reports
        how much of what the target writes lies inside."""
        return None if self.backbone is None else self.backbone.vocab

    def companion_weights(self) -> dict[str, ComponentWeights]:
        """The checkpoint's trained correction head and confidence head, for the engine to load
        into the pipeline's components of those slots (the lifecycle of specforge.components)."""
        if self._loaded is None:
            return {}
        _, head, confidence = self._loaded
        where = str(self.config.checkpoint)
        return {slot: ComponentWeights(type(m), m.state_dict(), where)
                for slot, m in (("correction_head", head), ("confidence", confidence)) if m is not None}

    def replay(self, features: list[Any], target: Any) -> dict[str, Any]:
        """The greedy rounds this checkpoint would run over ``features``' text, on the training path
        (:func:`~specforge_plugins.drafters.block.replay.replay_rounds`, the ``Replays`` protocol)."""
        if self.backbone is None or self._loaded is None:
            raise ValueError("replay needs a drafter loaded from a checkpoint and bound to its target")
        head = self._loaded[1]
        if head is not None:
            head.bind(target)
        return {"checkpoint": str(self.config.checkpoint), **replay_rounds(self.backbone, head, features)}

    # -- one round -------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.backbone is None or self._contexts is None:
            raise RuntimeError("bind() the drafter to a target first")
        clock = time.perf_counter()
        self._ingest(ctx)
        clock = self._lap("ingest", clock)
        u, lengths, g = open_round(ctx, self.gamma)
        if g == 0:
            return empty_block(ctx)
        hidden = self._parallel(ctx)  # [R, γ, d]: the whole block, as trained (it is bidirectional)
        hidden = hidden[:, :g]
        clock = self._lap("backbone", clock)
        base = self.backbone.logits(hidden)  # only the slots worth drafting go through the LM head
        clock = self._lap("lm_head", clock)
        tokens, logits, probs = self._sequential(ctx, base, hidden, u)
        self._lap("sequential", clock)
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, logits=logits, hidden=hidden,
                          anchor=ctx.anchor)

    def _lap(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.part_seconds[part] += now - since
        return now

    def _sequential(self, ctx: DraftContext, base: Tensor, hidden: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tokens, logits, probs, seconds = sequential_stage(ctx, base, hidden, u, self.backbone.vocab,
                                                          self.config.candidates, self.backbone.config.vocab_size)
        self.head_seconds += seconds
        return tokens, logits, probs

    # -- the draft context: appended every round, freed when a request ends ---------------------

    def release(self, request_id: int) -> None:
        if self._contexts is not None:
            self._contexts.release(request_id)

    def _ingest(self, ctx: DraftContext) -> None:
        """Append the newly committed positions' context K/V, for all requests in one pass."""
        f = ctx.features
        if f is None:
            raise RuntimeError(f"{type(self).__name__} needs target features: the engine must tap "
                               f"feature_layers {self.feature_layers}")
        if tuple(f.layers) != tuple(self.feature_layers):
            raise RuntimeError(f"features of target layers {f.layers}; the drafter needs {self.feature_layers}")
        if f.states.shape[0] == 0:
            return
        kv = self.backbone.context_kv(f.states.flatten(1)[None], f.positions[None])
        counts = f.cu_seqlens[1:] - f.cu_seqlens[:-1]
        starts = f.positions[f.cu_seqlens[:-1].clamp(max=len(f.positions) - 1)]  # where each run begins
        self._contexts.extend_many(ctx.request_ids, starts, counts, [(k[0], v[0]) for k, v in kv])

    def _parallel(self, ctx: DraftContext) -> Tensor:
        anchor_pos = torch.tensor([len(h) - 1 for h in ctx.histories], dtype=torch.long)
        for rid, pos in zip(ctx.request_ids, anchor_pos.tolist()):
            held = self._contexts.length(rid)
            if held != pos:  # the context must be exactly the committed tokens before x_0
                raise RuntimeError(f"request {rid}: the draft context holds {held} positions, "
                                   f"the anchor is at position {pos}")
        kv, positions, valid = self._contexts.gather(ctx.request_ids)
        block = self.backbone.make_block(ctx.anchor)
        return self.backbone.draft(block, anchor_pos, kv, positions, valid)


def _layout(predict_anchor: bool) -> str:
    return "DSpark" if predict_anchor else "DFlash"

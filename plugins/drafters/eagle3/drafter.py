"""``eagle3``: EAGLE-3's one-layer autoregressive drafter as a chain of γ steps per round.

One round for R requests:

1. *Context.*  The engine hands over the three fused layers' outputs at the positions each request
   committed since its previous draft (ending just before the anchor x_0).  For each such row t
   the drafter appends the layer's K/V of (x_{t+1}, g_t) to the request's draft KV cache
   (:class:`~specforge.toolkit.context_cache.ContextCache`) — x_{t+1} is known, it was
   committed — and keeps g of the last row.
2. *Chain.*  Step 1 reads (x_0, g_{a−1}) and predicts x_1; step k reads (x_{k−1}, y_{k−1}), its
   own previous output, and attends to the cache and to the chain so far
   (:meth:`~specforge_plugins.drafters.eagle3.model.Eagle3Model.chain`).  Each x_k is drawn from
   the warped draft law with the request's own uniform and that law is reported as q_k (zero
   outside a draft vocabulary); the chain's K/V are dropped after the round.

With ``tree`` set, step 2 grows EAGLE-2's dynamic tree instead (top-k expansion by path
log-probability, the best ``nodes`` kept: :mod:`~specforge_plugins.drafters.eagle3.tree`); its
nodes are deterministic given the round's inputs, so q is one-hot and the ``tree`` walk of any
shipped verifier keeps the target's law.

Eagle3 runs no correction head (it is sequential by itself), so it combines with ``none`` only;
its ``hidden`` (final-normed y_k) feeds confidence estimators such as ``dspark-head``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from specforge.components import DraftBlock, DraftContext
from specforge.sampling import sample_with_uniform, warp
from specforge.toolkit.checkpoints import TARGET_SHAPE, check_fits
from specforge.toolkit.context_cache import ContextCache
from specforge.toolkit.drafting import LastRows, empty_block, open_round
from specforge.toolkit.layers import SharedWeights
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3
from specforge_plugins.drafters.eagle3.replay import replay_chain
from specforge_plugins.drafters.eagle3.tree import DynamicTree, grow_tree

__all__ = ["Eagle3Config", "Eagle3Drafter"]


class Eagle3Config(BaseModel):
    """Parameters of the ``eagle3`` drafter."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(None, description="eagle3 checkpoint directory; None: random init")
    gamma: int = Field(7, ge=1, description="draft steps per round")
    target_layers: tuple[int, ...] | None = Field(
        None, description="fused target layers of a random init; None: EAGLE-3's 1, L/2-1, L-4")
    seed: int = Field(0, description="seed of the random initialisation")
    draft_vocab: int | None = Field(None, ge=1, description="random init over a seeded random draft vocabulary "
                                                            "of this many target ids (tests, conformance)")
    dtype: Literal["float32", "target"] = Field("float32", description="run the model in float32 or the target's dtype")
    tree: DynamicTree | None = Field(None, description="EAGLE-2's dynamic tree of depth gamma (topk, nodes); "
                                                       "None: a chain")

    @model_validator(mode="after")
    def _one_source(self) -> Eagle3Config:
        if self.checkpoint is not None and (self.target_layers is not None or self.draft_vocab is not None):
            raise ValueError("target_layers and draft_vocab come from the checkpoint; set them only for a random init")
        return self


class Eagle3Drafter:
    """The engine-facing EAGLE-3 drafter (see the module docstring)."""

    def __init__(self, config: Eagle3Config | None = None) -> None:
        self.config = config or Eagle3Config()
        self.gamma = self.config.gamma
        self._loaded = load_eagle3(self.config.checkpoint)[0] if self.config.checkpoint is not None else None
        self.model: Eagle3Model | None = None
        self.feature_layers: tuple[int, ...] = ()
        self._cache: ContextCache | None = None
        self._last = LastRows()  # g of the row just before each request's anchor

    def taps_for(self, args: Any) -> tuple[int, ...]:
        """The layers :meth:`bind` taps: the checkpoint's, else EAGLE-3's three for this depth."""
        if self._loaded is not None:
            return tuple(self._loaded.shape.layers)
        return tuple(Eagle3Shape.from_model_args(args, layers=self.config.target_layers).layers)

    def bind(self, target: Any) -> None:
        args, runtime = target.args, target.runtime
        c = self.config
        if self._loaded is not None:
            model = self._loaded
            check_fits(model.shape, args, c.checkpoint, TARGET_SHAPE)
        else:
            vocab = None if c.draft_vocab is None else DraftVocab.random(c.draft_vocab, args.vocab_size, c.seed)
            shape = Eagle3Shape.from_model_args(args, runtime, layers=c.target_layers, draft_vocab_size=c.draft_vocab)
            model = Eagle3Model(shape, seed=c.seed, vocab=vocab)
        if c.dtype == "target":
            model = model.to(runtime.dtype)
        self.model = model.eval().bind(SharedWeights.from_target(runtime))
        s = model.shape
        self.feature_layers = s.layers
        self._cache = ContextCache(1, s.n_kv_heads, s.head_dim, model.dtype)

    def replay(self, features: list[Any], target: Any) -> dict[str, Any]:
        """The greedy rounds this checkpoint would run over ``features``' text, on the training path
        (:func:`~specforge_plugins.drafters.eagle3.replay.replay_chain`, the ``Replays`` protocol)."""
        if self.model is None or self._loaded is None:
            raise ValueError("replay needs a drafter loaded from a checkpoint and bound to its target")
        return {"checkpoint": str(self.config.checkpoint), **replay_chain(self.model, features, self.gamma)}

    @property
    def draft_vocab(self) -> DraftVocab | None:
        return None if self.model is None else self.model.vocab

    def release(self, request_id: int) -> None:
        self._last.release(request_id)
        if self._cache is not None:
            self._cache.release(request_id)

    @torch.inference_mode()
    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.model is None or self._cache is None:
            raise RuntimeError("bind() the drafter to a target first")
        self._ingest(ctx)
        u, lengths, g = open_round(ctx, self.gamma, self._last.ready(ctx.request_ids))
        if g == 0:
            return empty_block(ctx)
        r, anchor = len(ctx), ctx.anchor
        model, vocab = self.model, self.model.vocab
        for rid, h, n in zip(ctx.request_ids, ctx.histories, lengths.tolist()):
            held = self._cache.length(rid)
            if n and held != len(h) - 1:  # the context must be exactly the committed tokens before x_0
                raise RuntimeError(f"request {rid}: the draft context holds {held} positions, the anchor is at "
                                   f"position {len(h) - 1}")
        ((ctx_k, ctx_v),), _, valid = self._cache.gather(ctx.request_ids)
        valid[lengths == 0, 0] = True  # a request that drafts nothing reads a zero row, not an empty softmax
        g0 = self._last.gather(ctx.request_ids, (model.shape.dim,), model.dtype)
        pos0 = torch.tensor([len(h) - 2 for h in ctx.histories], dtype=torch.long).clamp_min(0)
        if self.config.tree is not None:
            return self._draft_tree(ctx, g0, pos0, ctx_k, ctx_v, valid, lengths, g)
        tokens = torch.zeros(r, g, dtype=torch.long)
        laws: list[Tensor] = []

        def draw(j: int, logits: Tensor) -> Tensor:
            law = warp(logits, ctx.sampling)  # the exact law x_{j+1} is drawn from, over the draft ids
            pick = sample_with_uniform(law, u[:, j])
            tokens[:, j] = pick if vocab is None else vocab.ids[pick]
            laws.append(law)
            return model.embed(tokens[:, j])

        y, logits = model.chain(model.embed(anchor), g0, pos0, ctx_k, ctx_v, valid, g, draw)
        draw(g - 1, logits[:, -1])  # the last step's token (``chain`` asks only for inputs it feeds back)
        law = torch.stack(laws, 1)
        probs = law if vocab is None else vocab.spread(law, 0.0)
        full = logits if vocab is None else vocab.spread(logits, float("-inf"))
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, logits=full, hidden=model.norm(y).float(),
                          anchor=anchor)

    def _draft_tree(self, ctx: DraftContext, g0: Tensor, pos0: Tensor, ctx_k: Tensor, ctx_v: Tensor, valid: Tensor,
                    lengths: Tensor, depth: int) -> DraftBlock:
        """EAGLE-2's dynamic tree of ``depth`` ≤ γ levels; a request keeps the nodes no deeper than its
        chain length in ``lengths`` (its ``max_tokens`` capped by γ; 0: none) — a prefix, as the tree
        is breadth first."""
        model, vocab, tree = self.model, self.model.vocab, self.config.tree
        grown = grow_tree(model, model.embed(ctx.anchor), g0, pos0, ctx_k, ctx_v, valid, depth, tree.topk,
                          tree.nodes, (lambda ids: ids) if vocab is None else vocab.to_target)
        tokens = grown.tokens if vocab is None else vocab.to_target(grown.tokens)
        logits = grown.logits if vocab is None else vocab.spread(grown.logits, float("-inf"))
        lengths = (grown.depth <= lengths[:, None]).sum(1)
        return DraftBlock(tokens=tokens, lengths=lengths, logits=logits, hidden=model.norm(grown.hidden).float(),
                          anchor=ctx.anchor, parents=grown.parents)

    def _ingest(self, ctx: DraftContext) -> None:
        """Append the K/V of each newly committed row (with the token that followed it)."""
        f = ctx.features
        if f is None or tuple(f.layers) != tuple(self.feature_layers):
            raise RuntimeError(f"eagle3 needs the target's layers {self.feature_layers} through DraftContext.features")
        n = f.states.shape[0]
        if n == 0:
            return
        counts = f.cu_seqlens[1:] - f.cu_seqlens[:-1]
        owner = torch.repeat_interleave(torch.arange(len(ctx)), counts)
        following = torch.tensor([int(ctx.histories[o][p + 1]) for o, p in zip(owner.tolist(), f.positions.tolist())],
                                 dtype=torch.long)
        k, v, g = self.model.context_kv(f.states.flatten(1), following, f.positions)
        starts = f.positions[f.cu_seqlens[:-1].clamp(max=n - 1)]
        self._cache.extend_many(ctx.request_ids, starts, counts, [(k, v)])
        self._last.update(ctx.request_ids, f.cu_seqlens, g)

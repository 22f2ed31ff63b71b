"""``medusa``: K heads on the target's last hidden state draft a chain of K tokens per round.

One round for R requests:

1. the engine hands over the target's last-layer output at the positions each request committed
   since its previous draft; the drafter keeps only the newest row per request (position t, just
   before the anchor x_0 at t + 1);
2. the K heads give base logits U_1 … U_K in one pass (:class:`MedusaHeads`);
3. the sequential stage shared with DSpark (:func:`~specforge.toolkit.sequential.sequential_stage`)
   draws x_1 … x_K left to right through the pipeline's correction head —
   ``none`` is plain Medusa (each x_k from its own head's law); ``markov`` makes it sequential —
   and reports each law exactly as sampled.

A request with no committed row yet (a one-token prompt) drafts nothing that round.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from specforge.components import DraftBlock, DraftContext
from specforge.toolkit.checkpoints import check_fits
from specforge.toolkit.drafting import LastRows, empty_block, open_round
from specforge.toolkit.sequential import sequential_stage
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.medusa.model import MedusaHeads, MedusaShape, load_medusa

__all__ = ["MedusaConfig", "MedusaDrafter"]


class MedusaConfig(BaseModel):
    """Parameters of the ``medusa`` drafter."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(None, description="medusa checkpoint directory; None: random init")
    gamma: int | None = Field(None, ge=1, description="heads used per round (≤ the checkpoint's); None: all")
    heads: int | None = Field(None, ge=1, description="K of a random init (None: gamma, else 5)")
    res_layers: int = Field(1, ge=1, description="residual blocks per head of a random init")
    output: Literal["own", "shared"] = Field("own", description="random init: own output layers or the target's LM head")
    seed: int = Field(0, description="seed of the random initialisation")
    draft_vocab: int | None = Field(None, ge=1, description="random init over a seeded random draft vocabulary "
                                                            "of this many target ids (tests, conformance)")
    candidates: int | None = Field(None, ge=1, description="sequential stage on the top-K tokens of each U_k only")
    dtype: Literal["float32", "target"] = Field("float32", description="run the heads in float32 or the target's dtype")
    tree: list[list[int]] | None = Field(
        None, description="a static candidate tree (Medusa's choices): each path lists, per depth k, which of head "
                          "k's top tokens to take, e.g. [[0], [1], [0, 0]]; every prefix of a path is a path too; "
                          "paths deeper than gamma are cut. None: a chain (one sampled token per head)")

    @model_validator(mode="after")
    def _one_source(self) -> MedusaConfig:
        if self.checkpoint is not None and (self.heads is not None or self.draft_vocab is not None):
            raise ValueError("heads and draft_vocab come from the checkpoint; set them only for a random init")
        if self.tree is not None:
            paths = {tuple(p) for p in self.tree}
            if not paths or any(not p or min(p) < 0 for p in paths):
                raise ValueError("tree: every path is a non-empty list of top-k indices (0 = the top token)")
            missing = sorted(p[:-1] for p in paths if len(p) > 1 and p[:-1] not in paths)
            if missing:
                raise ValueError(f"tree: the path {list(missing[0])} is missing (every prefix of a path must be one)")
            if len(paths) > 63:
                raise ValueError(f"tree: {len(paths)} nodes; at most 63")
        return self


class MedusaDrafter:
    """The engine-facing Medusa drafter (see the module docstring)."""

    def __init__(self, config: MedusaConfig | None = None) -> None:
        self.config = config or MedusaConfig()
        self._loaded: MedusaHeads | None = None
        if self.config.checkpoint is not None:
            self._loaded, _ = load_medusa(self.config.checkpoint)
            k = self._loaded.shape.heads
            if self.config.gamma is not None and self.config.gamma > k:
                raise ValueError(f"gamma={self.config.gamma}: the checkpoint has {k} heads")
            self.gamma = self.config.gamma or k
        else:
            self.gamma = self.config.gamma or self.config.heads or 5
            if self.config.heads is not None and self.gamma > self.config.heads:
                raise ValueError(f"gamma={self.gamma} is larger than heads={self.config.heads}")
        self.heads: MedusaHeads | None = None
        # A static tree, breadth first: per node its path, its parent's index (−1: x_0), its depth.
        self._tree = sorted({tuple(p) for p in self.config.tree}, key=lambda p: (len(p), p)) if self.config.tree else None

        self.feature_layers: tuple[int, ...] = ()
        self._last = LastRows()  # the last layer's output just before each request's anchor
        self.head_seconds = 0.0

    def taps_for(self, args: Any) -> tuple[int, ...]:
        """The last layer's output, what every head reads."""
        layers = self._loaded.shape.n_target_layers if self._loaded is not None else args.n_layers
        return (layers - 1,)

    def bind(self, target: Any) -> None:
        args, runtime = target.args, target.runtime
        if self._loaded is not None:
            heads = self._loaded
            check_fits(heads.shape, args, self.config.checkpoint,
                       {"vocab_size": "vocab_size", "dim": "dim", "n_target_layers": "n_layers"})
            init = False
        else:
            c = self.config
            vocab = None if c.draft_vocab is None else DraftVocab.random(c.draft_vocab, args.vocab_size, c.seed)
            shape = MedusaShape.from_model_args(args, heads=c.heads or self.gamma, res_layers=c.res_layers,
                                                output=c.output, draft_vocab_size=c.draft_vocab)
            heads, init = MedusaHeads(shape, seed=c.seed, vocab=vocab), True
        if self.config.dtype == "target":
            heads = heads.to(runtime.dtype)
        self.heads = heads.eval().bind(runtime.norm, runtime.lm_head, init_output=init)
        if init:  # zero-initialised blocks would make every head repeat the target's next-token law
            _perturb(self.heads, self.config.seed)
        self.feature_layers = (heads.shape.tap_layer,)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        return None if self.heads is None else self.heads.vocab

    def release(self, request_id: int) -> None:
        self._last.release(request_id)

    @torch.inference_mode()
    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.heads is None:
            raise RuntimeError("bind() the drafter to a target first")
        self._ingest(ctx)
        u, lengths, g = open_round(ctx, self.gamma, self._last.ready(ctx.request_ids))
        if g == 0:
            return empty_block(ctx)
        last = self._last.gather(ctx.request_ids, (self.heads.shape.dim,), torch.float32)
        hidden = self.heads.hidden(last)[:, :g]
        base = self.heads.logits(hidden)
        if self._tree is not None:
            return self._draft_tree(ctx, base, hidden, lengths)
        tokens, logits, probs, seconds = sequential_stage(ctx, base, hidden, u, self.heads.vocab,
                                                          self.config.candidates, self.heads.shape.vocab_size)
        self.head_seconds += seconds
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, logits=logits, hidden=hidden, anchor=ctx.anchor)

    def _draft_tree(self, ctx: DraftContext, base: Tensor, hidden: Tensor, lengths: Tensor) -> DraftBlock:
        """Medusa's candidate tree: node (c_1, …, c_k) takes the c_k-th top token of head k's
        logits (biased by the correction head given its parent's token, in a fresh state).  Each
        node is deterministic given the round's inputs, so q is one-hot (``probs=None``) and the
        verifier's walk zeroes a rejected sibling in the residual.  A request keeps the nodes no
        deeper than its chain length in ``lengths`` (0: none) — a prefix, as the nodes are breadth first."""
        r, g = base.shape[0], base.shape[1]
        nodes = [p for p in self._tree if len(p) <= g]
        index = {p: j for j, p in enumerate(nodes)}
        parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in nodes], dtype=torch.long)
        depth = torch.tensor([len(p) for p in nodes], dtype=torch.long)
        head, vocab, v = ctx.correction_head, self.heads.vocab, self.heads.shape.vocab_size
        tokens = torch.zeros(r, len(nodes), dtype=torch.long)
        logits = torch.full((r, len(nodes), v), float("-inf"), dtype=base.dtype)
        for j, path in enumerate(nodes):
            k = len(path) - 1  # head k drafts depth k + 1
            prev = ctx.anchor if k == 0 else tokens[:, index[path[:-1]]]
            step = base[:, k]
            if head is not None:
                step, _ = head.step(step, prev, hidden[:, k], head.init_state(r))
            pick = step.topk(path[-1] + 1, dim=-1).indices[:, -1]
            tokens[:, j] = pick if vocab is None else vocab.ids[pick]
            if vocab is None:
                logits[:, j] = step
            else:
                logits[:, j, vocab.ids] = step
        lengths = (depth[None, :] <= lengths[:, None]).sum(1)
        return DraftBlock(tokens=tokens, lengths=lengths, logits=logits, hidden=hidden[:, depth - 1],
                          anchor=ctx.anchor, parents=parents.expand(r, len(nodes)))

    def _ingest(self, ctx: DraftContext) -> None:
        f = ctx.features
        if f is None or tuple(f.layers) != self.feature_layers:
            raise RuntimeError(f"medusa needs the target's layer {self.feature_layers} output through "
                               "DraftContext.features")
        self._last.update(ctx.request_ids, f.cu_seqlens, f.states[:, 0])


def _perturb(heads: MedusaHeads, seed: int) -> None:
    """Random residual-block weights for a random init (tests, conformance)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for res in block:
                w = res.linear.weight
                w.copy_((torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5).to(w.dtype))

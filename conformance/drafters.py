"""The suite's probe drafter: correct (lossless) but deliberately bad at guessing.

``random`` proposes tokens from a random first-order Markov law: the law of slot k is a fixed
random distribution chosen by k and the previous token x_{k-1} (the anchor for k = 1).  That
makes it

* a real *sampling* drafter — it reports the law each token was drawn from, so verifiers take the
  q-path (rejection ratios, residuals) that a deterministic drafter like ``ngram`` never reaches;
* wrong often enough that rejections happen at every position, which exercises rollback, residual
  sampling and correction tokens;
* sequential: q_{k+1}, and so any confidence computed from it, depends on x_k — exactly the
  dependence that makes a retrospective scheduler lossy (paper Appendix A).

``shadow`` is its opposite: the target's own law, perturbed, so that long prefixes are accepted.
With ``spike`` > 0 each position k also puts that much mass on its own token s_k (a different one
per position): the draft laws are then peaked and differ strongly between positions, rejections
happen at every depth of a long accepted prefix, and a residual built from the wrong position's
law is far from the right one.  With ``tilt`` > 0 each token's logit is moved by a small fixed
random amount instead: p/q then lies close to 1 on both sides, where acceptance is neither certain
nor rare and a rule that is off just below 1 shows.

Registered by the conformance suite and by tests with ``host.add_plugin``, never through an entry
point.
"""

from __future__ import annotations

import torch
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from specforge import hookimpl
from specforge.components import DraftBlock, DraftContext
from specforge.sampling import sample_with_uniform

__all__ = ["SUITE_DRAFTERS", "RandomDrafter", "RandomDrafterConfig", "RandomTreeConfig", "RandomTreeDrafter", "ShadowDrafter",
           "ShadowDrafterConfig"]


#: the suite's own drafters: parts of its cases, never components under test
SUITE_DRAFTERS = frozenset({"random", "shadow", "random-tree"})


class RandomDrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gamma: int = Field(4, ge=1)
    sharpness: float = Field(2.0, gt=0, description="scale of the random logits (larger: more peaked)")
    seed: int = Field(1234, description="seed of the random law table")
    buckets: int = Field(64, ge=1, description="previous tokens share law rows modulo this (bounds memory "
                                                "for large vocabularies: the table is γ × buckets × V)")
    deterministic: bool = Field(
        False, description="true: report the proposals as one-hot q (a deterministic drafter, like ngram)"
    )


class RandomDrafter:
    """Draws x_k ~ softmax(table[k, x_{k-1} mod buckets]) — independent of the request's sampling
    settings, which is allowed: q only has to be the law the token was actually drawn from."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: RandomDrafterConfig | None = None) -> None:
        self.config = config or RandomDrafterConfig()
        self.gamma = self.config.gamma
        self.table: Tensor | None = None  # [gamma, buckets, V] logits

    def bind(self, target) -> None:
        v, c = target.vocab_size, self.config
        gen = torch.Generator().manual_seed(c.seed)
        self.table = torch.randn(self.gamma, min(c.buckets, v), v, generator=gen) * c.sharpness

    def release(self, request_id: int) -> None:
        pass

    def draw_law(self, logits: Tensor) -> Tensor:
        """The law the tokens are sampled from (controls override this)."""
        return torch.softmax(logits, -1)

    def reported_law(self, logits: Tensor) -> Tensor:
        """The law reported as q."""
        return torch.softmax(logits, -1)

    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.table is None:
            raise RuntimeError("bind() the drafter to a target first")
        r, g, v = len(ctx), self.gamma, self.table.shape[-1]
        u = (torch.stack([torch.rand(g, generator=gen, dtype=torch.float64) for gen in ctx.generators])
             if r else torch.empty(0, g, dtype=torch.float64))
        prev = ctx.anchor
        tokens = torch.empty(r, g, dtype=torch.long)
        logits = torch.empty(r, g, v)
        for k in range(g):
            logits[:, k] = self.table[k, prev % self.table.shape[1]]
            tokens[:, k] = sample_with_uniform(self.draw_law(logits[:, k]), u[:, k])
            prev = tokens[:, k]
        lengths = torch.minimum(torch.full((r,), g, dtype=torch.long), ctx.max_tokens)
        probs = None if self.config.deterministic else self.reported_law(logits)
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, logits=logits, anchor=ctx.anchor)


class ShadowDrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gamma: int = Field(3, ge=1)
    temperature: float = Field(1.5, gt=0, description="the target's logits are divided by this")
    noise: float = Field(0.05, ge=0, lt=1, description="weight of a uniform law mixed in (full support)")
    spike: float = Field(0.0, ge=0, lt=1, description="mass put on one token per position, a different "
                                                       "token at each position")
    tilt: float = Field(0.0, ge=0, description="each token's logit moved by tilt·g_k(x), g_k a fixed random "
                                               "table in [−1, 1] per position: p/q then lies within "
                                               "[e^(−2·tilt), e^(2·tilt)] (at temperature 1, no noise or spike)")
    seed: int = Field(0, description="seed of the spike tokens")

    @model_validator(mode="after")
    def _mass(self) -> ShadowDrafterConfig:
        if self.noise + self.spike >= 1:
            raise ValueError("noise + spike must stay below 1 (the target's own law keeps the rest)")
        return self


class ShadowDrafter:
    """Drafts from the target's own next-token law, deliberately perturbed: a temperature and
    a little uniform noise.  Close to p, so most drafts are accepted — the probe that exercises
    long accepted prefixes and bonus tokens, where ``random`` is rejected almost at once.

    Runs the Hugging Face model over each request's full history (no KV cache), remembering
    the next-token logits of every prefix it has seen: the suite's targets are tiny and its
    requests share a prompt, so a few thousand prefixes cover a whole case.  Far too slow for
    a real model.
    """

    MEMO = 1 << 17  # prefixes remembered (then forgotten all at once): ~70 MB at V = 128

    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: ShadowDrafterConfig | None = None) -> None:
        self.config = config or ShadowDrafterConfig()
        self.gamma = self.config.gamma
        self.model = None
        self._memo: dict[tuple[int, ...], Tensor] = {}

    def bind(self, target) -> None:
        self.model = target.hf_model
        self._memo = {}
        gen = torch.Generator().manual_seed(self.config.seed)
        v = target.vocab_size
        # s_k for k = 0..γ-1: distinct while γ ≤ V
        self.spikes = torch.randperm(v, generator=gen).repeat(self.gamma // v + 1)[: self.gamma]
        self.tilts = self.config.tilt * (2 * torch.rand(self.gamma, v, generator=gen) - 1)

    def law(self, logits: Tensor, k: int) -> Tensor:
        """q_k from the target's logits ``[R, V]`` at slot k."""
        c = self.config
        law = (1 - c.noise - c.spike) * torch.softmax(logits / c.temperature + self.tilts[k], -1) \
            + c.noise / logits.shape[-1]
        if c.spike:
            law[:, self.spikes[k]] += c.spike
        return law

    def release(self, request_id: int) -> None:
        pass

    @torch.inference_mode()
    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.model is None:
            raise RuntimeError("bind() the drafter to a target first")
        r, g, c = len(ctx), self.gamma, self.config
        u = (torch.stack([torch.rand(g, generator=gen, dtype=torch.float64) for gen in ctx.generators])
             if r else torch.empty(0, g, dtype=torch.float64))
        tokens = torch.empty(r, g, dtype=torch.long)
        out_logits = torch.empty(r, g, self.model.config.vocab_size)
        seqs = [tuple(h.tolist()) for h in ctx.histories]
        for k in range(g):
            step = self._next_logits(seqs)
            out_logits[:, k] = step
            x = sample_with_uniform(self.law(step, k), u[:, k])
            tokens[:, k] = x
            seqs = [s + (t,) for s, t in zip(seqs, x.tolist())]
        probs = torch.stack([self.law(out_logits[:, k], k) for k in range(g)], 1)
        lengths = torch.minimum(torch.full((r,), g, dtype=torch.long), ctx.max_tokens)
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, logits=out_logits / c.temperature + self.tilts,
                          anchor=ctx.anchor)

    def _next_logits(self, seqs: list[tuple[int, ...]]) -> Tensor:
        """``[len(seqs), V]`` float32 logits of the target after each sequence; the prefixes not
        seen before run in one forward per length."""
        memo = self._memo
        missing: dict[int, list[tuple[int, ...]]] = {}
        for s in dict.fromkeys(seqs):
            if s not in memo:
                missing.setdefault(len(s), []).append(s)
        if sum(map(len, missing.values())) + len(memo) > self.MEMO:
            memo.clear()
            missing = {}
            for s in dict.fromkeys(seqs):
                missing.setdefault(len(s), []).append(s)
        for group in missing.values():
            rows = self.model(input_ids=torch.tensor(group), use_cache=False).logits[:, -1].float()
            memo.update(zip(group, rows))
        if not seqs:
            return torch.empty(0, self.model.config.vocab_size)
        return torch.stack([memo[s] for s in seqs])


class RandomTreeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    branching: tuple[int, ...] = Field((3, 2), min_length=1, description="children of every node, per depth")
    children: Literal["iid", "distinct", "top"] = Field(
        "iid", description="how siblings are drawn: independently from their parent's law; without replacement "
                           "(q = the law given the siblings drawn before); or the top-k of that law (one-hot q)")
    source: Literal["table", "target"] = Field(
        "table", description="where a node's children's law comes from: a random table indexed by depth and the "
                             "parent's token, or the target's own law after the node's path (perturbed as "
                             "``shadow``'s: temperature and noise), close to p, so that siblings are often accepted")
    sharpness: float = Field(2.0, gt=0, description="scale of the random logits (source: table)")
    seed: int = Field(4321, description="seed of the random law table")
    buckets: int = Field(64, ge=1, description="previous tokens share law rows modulo this")
    temperature: float = Field(1.5, gt=0, description="the target's logits are divided by this (source: target)")
    noise: float = Field(0.05, ge=0, lt=1, description="weight of a uniform law mixed in (source: target)")

    @model_validator(mode="after")
    def _size(self) -> RandomTreeConfig:
        if tree_size(self.branching) > 63:
            raise ValueError(f"a tree of branching {list(self.branching)} has {tree_size(self.branching)} nodes; "
                             "at most 63")
        return self


def tree_size(branching: tuple[int, ...]) -> int:
    total, level = 0, 1
    for b in branching:
        level *= b
        total += level
    return total


class RandomTreeDrafter:
    """Drafts a token *tree* of a fixed shape (``branching``), nodes in breadth-first order: the
    children of a node with token t at depth d come from softmax(table[d, t mod buckets]), drawn
    as ``children`` says, each reporting the law it was actually drawn from.  The probe of the
    verifiers' tree walk: every sibling order, residual update and rejected subtree is met."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: RandomTreeConfig | None = None) -> None:
        self.config = config or RandomTreeConfig()
        c = self.config
        parents, depth, first = [], [], [-1]  # first: the nodes of the previous level
        for d, b in enumerate(c.branching):
            level = []
            for parent in first:
                for _ in range(b):
                    level.append(len(parents))
                    parents.append(parent)
                    depth.append(d)
            first = level
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.depth = torch.tensor(depth, dtype=torch.long)
        self.paths: dict[int, list[int]] = {-1: []}  # node -> the nodes from the anchor's child down to it
        for j, parent in enumerate(parents):
            self.paths[j] = [*self.paths[parent], j]
        self.gamma = len(parents)
        self.table: Tensor | None = None
        self.shadow: ShadowDrafter | None = None

    def bind(self, target) -> None:
        v, c = target.vocab_size, self.config
        gen = torch.Generator().manual_seed(c.seed)
        self.table = torch.randn(len(c.branching), min(c.buckets, v), v, generator=gen) * c.sharpness
        self.shadow = None
        if c.source == "target":
            self.shadow = ShadowDrafter(ShadowDrafterConfig(gamma=1, temperature=c.temperature, noise=c.noise))
            self.shadow.bind(target)

    @torch.inference_mode()
    def _row(self, ctx: DraftContext, histories: list[tuple[int, ...]], tokens: Tensor, parent: int) -> Tensor:
        """``[R, V]`` logits of the law of ``parent``'s children (−1: the anchor's)."""
        if self.shadow is None:
            prev = ctx.anchor if parent < 0 else tokens[:, parent]
            depth = 0 if parent < 0 else int(self.depth[parent]) + 1
            return self.table[depth, prev % self.table.shape[1]]
        path = tokens[:, self.paths[parent]].tolist()
        seqs = [h + tuple(p) for h, p in zip(histories, path)]
        return self.shadow.law(self.shadow._next_logits(seqs), 0).log()

    def release(self, request_id: int) -> None:
        pass

    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.table is None:
            raise RuntimeError("bind() the drafter to a target first")
        r, g, v = len(ctx), self.gamma, self.table.shape[-1]
        u = ctx.uniforms(g)
        tokens = torch.zeros(r, g, dtype=torch.long)
        probs = torch.zeros(r, g, v)
        logits = torch.zeros(r, g, v)
        taken: dict[int, Tensor] = {}  # parent node -> [R, V] siblings drawn so far
        rows: dict[int, Tensor] = {}  # parent node -> [R, V] its children's logits (siblings share them)
        histories = [tuple(h.tolist()) for h in ctx.histories] if self.shadow is not None else []
        for j in range(g):
            parent = int(self.parents[j])
            if parent not in rows:
                rows[parent] = self._row(ctx, histories, tokens, parent)
            row = rows[parent]  # [R, V]
            law = torch.softmax(row, -1)
            seen = taken.setdefault(parent, torch.zeros(r, v, dtype=torch.bool))
            if self.config.children == "distinct":
                law = torch.where(seen, 0.0, law)
                law = law / law.sum(-1, keepdim=True)
            if self.config.children == "top":
                x = torch.where(seen, float("-inf"), row).argmax(-1)
                law = torch.nn.functional.one_hot(x, v).to(law.dtype)
            else:
                x = sample_with_uniform(law, u[:, j])
            seen[torch.arange(r), x] = True
            tokens[:, j], probs[:, j], logits[:, j] = x, law, row
        # breadth-first order: the nodes no deeper than max_tokens are a prefix of it
        lengths = (self.depth[None, :] < ctx.max_tokens[:, None]).sum(1)
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, logits=logits, anchor=ctx.anchor,
                          parents=self.parents.expand(r, g))


@hookimpl
def specforge_register_drafters(register):
    register("random", RandomDrafter, config=RandomDrafterConfig, provides=("probs", "logits"),
             examples=({"gamma": 3}, {"gamma": 5, "sharpness": 1.0}, {"gamma": 2, "sharpness": 3.0}),
             description="TEST ONLY: random Markov proposals, so that rejections happen everywhere")
    register("shadow", ShadowDrafter, config=ShadowDrafterConfig, provides=("probs", "logits"),
             examples=({"gamma": 3}, {"gamma": 4, "temperature": 0.7, "noise": 0.1},
                       {"gamma": 3, "temperature": 1.0, "spike": 0.3}),
             description="TEST ONLY: the target's own law, perturbed, so that most drafts are accepted")
    register("random-tree", RandomTreeDrafter, config=RandomTreeConfig, provides=("probs", "logits"), trees=True,
             examples=({"branching": [3, 1]}, {"branching": [2, 2], "children": "distinct"},
                       {"branching": [3, 2], "children": "top"}),
             description="TEST ONLY: token trees of a fixed shape from a random table or the target's perturbed "
                         "law, siblings iid, distinct or top-k")

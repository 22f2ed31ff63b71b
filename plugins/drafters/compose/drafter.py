"""The ``compose`` drafter: registered drafters composed by name (docs/composition.md).

Two modes, one round each:

* **cascade** — the members draft in order, each for the requests no earlier member took: a
  request takes a member's proposal when the member's confidence in its first token reaches the
  member's ``threshold`` (no threshold: whenever it proposes anything); the last member takes
  every request left.  ``ngram`` then ``dspark`` costs no backbone pass on the rounds where the
  prompt already holds the continuation.
* **tree** — every member drafts for every request, and each member's chain becomes one branch of
  a token tree under the anchor, verified by the lossless tree walk.  Members draw their tokens
  independently of one another, so the law each node was drawn from, given its path and the
  siblings drawn before it, is simply its member's law at that slot — what the walk needs.  The
  nodes are ordered by depth, then by member, so a scheduler that verifies the first ℓ nodes
  keeps the shallow nodes of every branch.

Each slot reports the law it was actually drawn from: the member's ``probs``, or one-hot for a
deterministic member (``None`` only when every proposal of the round is one-hot).  Its confidence
is the member's own (``DraftBlock.confidence``): the estimator named in the member's config, or
the member's reported one.

**Members keep their own state.**  Every member reads the target features it asked for
(``feature_layers``; the composition taps their union) of every committed position: what arrives
for a request while a member does not draft for it waits in that member's backlog and is handed
over, in position order, the next time it does.  ``release`` releases a request in every member.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specforge.components import ComponentWeights, DraftBlock, DraftContext, TargetFeatures
from specforge.errors import ConfigError
from specforge.protocols import Binds, Learns, SharesHead, Taps, check_optional
from specforge.toolkit.companions import attach_companions, companions_of
from specforge_plugins.drafters.compose.config import MAX_TREE_NODES, ComposeConfig

__all__ = ["ComposeDrafter"]


class _Backlog:
    """Target features of committed positions a member has not drafted from yet, per request."""

    def __init__(self, columns: list[int], layers: tuple[int, ...]) -> None:
        self.columns = columns  # the member's layers among the composition's taps
        self.layers = layers
        self._held: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def add(self, request_ids: list[int], features: TargetFeatures) -> None:
        states = features.states[:, self.columns]
        for r, rid in enumerate(request_ids):
            lo, hi = int(features.cu_seqlens[r]), int(features.cu_seqlens[r + 1])
            if hi > lo:
                self._held.setdefault(rid, []).append((features.positions[lo:hi], states[lo:hi]))

    def take(self, request_ids: list[int], like: TargetFeatures) -> TargetFeatures:
        """Hand over (and forget) what the requests hold, as one :class:`TargetFeatures`."""
        positions, states = [], []
        for rid in request_ids:
            chunks = self._held.pop(rid, [])
            positions.append(torch.cat([p for p, _ in chunks]) if chunks else like.positions[:0])
            states.append(torch.cat([s for _, s in chunks]) if chunks else like.states[:0, self.columns])
        cu = torch.zeros(len(request_ids) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor([len(p) for p in positions], dtype=torch.long), 0)
        return TargetFeatures(self.layers, torch.cat(states), torch.cat(positions), cu)

    def release(self, request_id: int) -> None:
        self._held.pop(request_id, None)


@dataclass
class _Running:
    """A member at work: its drafter, its confidence estimator, its cascade threshold."""

    key: str  # its config key, for messages
    name: str
    drafter: Any
    estimator: Any
    threshold: float | None
    backlog: _Backlog | None = None
    layers: tuple[int, ...] = field(default=())


@dataclass
class _Drafted:
    """One member's proposals for some requests of the round (block row j ↔ composed row rows[j])."""

    member: int
    rows: list[int]
    block: DraftBlock
    confidence: Tensor  # [len(rows), G_m]
    lengths: Tensor  # [len(rows)] the slots taken into the composed block (0: not taken)


class ComposeDrafter:
    """Drafts with its members (see the module docstring)."""

    def __init__(self, config: ComposeConfig) -> None:
        self.config = config
        self.members = [_Running(key=f"drafter.members.{i}", name=m.drafter.name, drafter=m.drafter.create(),
                                 estimator=None if m.confidence is None else m.confidence.create(),
                                 threshold=m.threshold)
                        for i, m in enumerate(config.resolved())]
        self.gamma = max(int(m.drafter.gamma) for m in self.members)
        self.feature_layers: tuple[int, ...] = ()
        self._vocab_size: int | None = None
        self._shared = False

    # -- set-up ----------------------------------------------------------------------------------

    def taps_for(self, args: Any) -> tuple[int, ...]:
        """The union of the members' taps (a member that does not declare them adds none here;
        the engine then checks what it taps after binding)."""
        return tuple(sorted({int(i) for m in self.members if isinstance(m.drafter, Taps)
                             for i in m.drafter.taps_for(args)}))

    def bind(self, target: Any) -> None:
        """Bind every member and its estimator, give each estimator what the member's checkpoint
        trained for it, and tap the union of the members' layers."""
        self._vocab_size = int(target.vocab_size)
        for m in self.members:
            check_optional("drafter", m.drafter)
            if isinstance(m.drafter, Binds):
                m.drafter.bind(target)
            if m.estimator is not None:
                check_optional("confidence", m.estimator)
                if isinstance(m.estimator, Binds):
                    m.estimator.bind(target)
                confidence = {k: v for k, v in companions_of(m.drafter).items() if k == "confidence"}
                attach_companions(m.drafter, {"confidence": m.estimator}, confidence,
                                  where={"confidence": f"{m.key}.confidence"})
            m.layers = tuple(int(i) for i in (getattr(m.drafter, "feature_layers", ()) or ()))
        self.gamma = max(int(m.drafter.gamma) for m in self.members)
        self.feature_layers = tuple(sorted({i for m in self.members for i in m.layers}))
        for m in self.members:
            if m.layers:
                m.backlog = _Backlog([self.feature_layers.index(i) for i in m.layers], m.layers)
        vocabs = {id(v): v for v in (getattr(m.drafter, "draft_vocab", None) for m in self.members) if v is not None}
        if len(vocabs) > 1:
            raise ConfigError(["drafter.members: two members propose from different draft vocabularies; the "
                               "pipeline's one correction head and estimator cannot read both"])

    @property
    def draft_vocab(self) -> Any:
        """The draft vocabulary of the member that has one (the pipeline's heads are read by its
        draft ids); ``None`` when every member proposes from the whole vocabulary."""
        for m in self.members:
            vocab = getattr(m.drafter, "draft_vocab", None)
            if vocab is not None:
                return vocab
        return None

    def companion_weights(self) -> dict[str, ComponentWeights]:
        """The correction head a member's checkpoint trained, for the pipeline's slot (a member's
        confidence head went to that member's estimator at bind)."""
        out: dict[str, ComponentWeights] = {}
        owner = ""
        for m in self.members:
            weights = companions_of(m.drafter).get("correction_head")
            if weights is None:
                continue
            if out:
                raise ConfigError([f"{m.key}: its checkpoint trained a correction head, and so did {owner}'s; the "
                                   "pipeline has one correction head"])
            out["correction_head"], owner = weights, m.key
        return out

    def release(self, request_id: int) -> None:
        for m in self.members:
            m.drafter.release(request_id)
            if m.backlog is not None:
                m.backlog.release(request_id)

    def forget(self) -> None:
        """Every learning member forgets what it learned (:class:`specforge.protocols.Learns`)."""
        for m in self.members:
            if isinstance(m.drafter, Learns):
                m.drafter.forget()

    # -- one round -------------------------------------------------------------------------------

    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self._vocab_size is None:
            raise RuntimeError("bind() the drafter to a target first")
        if not self._shared:  # the pipeline's correction head is loaded by the first round
            for m in self.members:
                if isinstance(m.estimator, SharesHead):
                    m.estimator.share(ctx.correction_head)
            self._shared = True
        if self.feature_layers:
            if ctx.features is None:
                raise RuntimeError(f"compose needs target features of layers {self.feature_layers}")
            for m in self.members:
                if m.backlog is not None:
                    m.backlog.add(ctx.request_ids, ctx.features)
        drafted = self._cascade(ctx) if self.config.mode == "cascade" else self._tree(ctx)
        return self._assemble(ctx, drafted)

    def _run(self, i: int, ctx: DraftContext, rows: list[int]) -> tuple[DraftBlock, Tensor]:
        """Member ``i``'s block for the requests ``rows`` of the round, and its confidence."""
        m = self.members[i]
        ids = [ctx.request_ids[r] for r in rows]
        sub = DraftContext(request_ids=ids, histories=[ctx.histories[r] for r in rows],
                           max_tokens=ctx.max_tokens[rows], sampling=ctx.sampling.rows(rows),
                           generators=[ctx.generators[r] for r in rows],
                           features=None if m.backlog is None else m.backlog.take(ids, ctx.features),
                           correction_head=ctx.correction_head)
        block = m.drafter.draft(sub)
        g = block.tokens.shape[1]
        if g == 0:
            return block, torch.zeros(len(rows), 0)
        confidence = m.estimator.estimate(block) if m.estimator is not None else block.confidence
        if confidence is None:
            raise RuntimeError(f"{m.key}: drafter {m.name!r} reported no confidence this round; name an estimator "
                               f"for it ({m.key}.confidence)")
        return block, confidence[:, :g]

    def _cascade(self, ctx: DraftContext) -> list[_Drafted]:
        rows, out = list(range(len(ctx))), []
        for i, m in enumerate(self.members):
            if not rows:
                break
            block, confidence = self._run(i, ctx, rows)
            lengths = _lengths(block, rows)
            if i < len(self.members) - 1 and lengths.numel():
                first = confidence[:, 0] if confidence.shape[1] else torch.zeros(len(rows))
                clears = lengths > 0
                if m.threshold is not None:
                    clears &= first >= m.threshold
                lengths = torch.where(clears, lengths, 0)
            out.append(_Drafted(i, rows, block, confidence, lengths))
            taken = set(r for r, n in zip(rows, lengths.tolist()) if n > 0)
            rows = [r for r in rows if r not in taken]
        return out

    def _tree(self, ctx: DraftContext) -> list[_Drafted]:
        rows, out = list(range(len(ctx))), []
        for i, m in enumerate(self.members):
            block, confidence = self._run(i, ctx, rows)
            if block.parents is not None:
                raise RuntimeError(f"{m.key}: drafter {m.name!r} proposed a token tree; the branches of a composed "
                                   "tree are chains")
            out.append(_Drafted(i, rows, block, confidence, _lengths(block, rows)))
        return out

    def _assemble(self, ctx: DraftContext, drafted: list[_Drafted]) -> DraftBlock:
        """One block of R rows from the members' proposals (nodes by depth, then member)."""
        r_all = len(ctx)
        taken = torch.zeros(len(self.members), r_all, dtype=torch.long)  # L[m, r]: slots member m gives row r
        for d in drafted:
            taken[d.member, d.rows] = d.lengths
        depth = torch.arange(int(taken.max()) if taken.numel() else 0)
        # slot(m, r, k) = Σ_m' min(L[m', r], k) + Σ_{m' < m} [L[m', r] > k]: the node's place when
        # nodes are ordered by depth k, then by member (parents always come first).
        below = torch.minimum(taken[:, :, None], depth).sum(0)  # [R, K] nodes shallower than k
        deeper = (taken[:, :, None] > depth).long()  # [M, R, K]
        before = torch.cumsum(deeper, 0) - deeper  # members before m that reach depth k
        total = taken.sum(0)
        g = int(total.max()) if r_all else 0
        tree = self.config.mode == "tree" and bool(((taken > 0).sum(0) > 1).any())
        tree |= any(d.block.parents is not None for d in drafted)
        if g > MAX_TREE_NODES and tree:
            raise RuntimeError(f"the composed tree has {g} nodes; a token tree holds at most {MAX_TREE_NODES}")
        tokens = torch.zeros(r_all, g, dtype=torch.long)
        confidence = torch.full((r_all, g), 0.5)
        parents = torch.arange(g).expand(r_all, g) - 1 if tree else None
        parents = None if parents is None else parents.clone()
        sampled = any(d.block.probs is not None and bool((d.lengths > 0).any()) for d in drafted)
        probs = torch.zeros(r_all, g, self._vocab_size, dtype=_probs_dtype(drafted)) if sampled else None
        for d in drafted:
            if not d.lengths.numel() or int(d.lengths.max()) == 0:
                continue
            j, k = torch.nonzero(torch.arange(int(d.lengths.max())) < d.lengths[:, None], as_tuple=True)
            r = torch.tensor(d.rows, dtype=torch.long)[j]
            slot = below[r, k] + before[d.member, r, k]
            tokens[r, slot] = d.block.tokens[j, k].long()
            confidence[r, slot] = d.confidence[j, k].to(confidence.dtype)
            if parents is not None:
                if d.block.parents is not None:  # a member's own tree (cascade): its parents, in place
                    parents[r, slot] = d.block.parents[j, k].long()
                else:
                    up = below[r, (k - 1).clamp_min(0)] + before[d.member, r, (k - 1).clamp_min(0)]
                    parents[r, slot] = torch.where(k > 0, up, -1)
            if probs is not None:
                if d.block.probs is not None:
                    probs[r, slot] = d.block.probs[j, k].to(probs.dtype)
                else:  # a deterministic member: q is one-hot on its token
                    probs[r, slot, tokens[r, slot]] = 1.0
        return DraftBlock(tokens=tokens, lengths=total, probs=probs, anchor=ctx.anchor, parents=parents,
                          confidence=confidence)


def _lengths(block: DraftBlock, rows: list[int]) -> Tensor:
    """``[len(rows)]`` the member's real slots, within the width of its block."""
    if block.tokens.shape[1] == 0:
        return torch.zeros(len(rows), dtype=torch.long)
    return block.lengths.to(torch.long).clamp(0, block.tokens.shape[1])


def _probs_dtype(drafted: list[_Drafted]) -> torch.dtype:
    dtypes = [d.block.probs.dtype for d in drafted if d.block.probs is not None]
    return dtypes[0] if dtypes else torch.get_default_dtype()

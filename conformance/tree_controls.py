"""The suite's negative controls over token trees: the shipped tree walk
(:func:`~specforge.toolkit.trees.verify_tree`) with one ingredient broken each — registered with
the other controls (:mod:`specforge_conformance.controls`), which says what a control is for.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from specforge.components import VerifyOutput
from specforge.toolkit.trees import is_child, verify_tree
from specforge.toolkit.verification import prepare
from specforge_plugins.verifiers import RejectionConfig, RejectionVerifier

__all__ = ["TREE_CONTROLS", "TreeLateSiblingVerifier", "TreeLeakyResidualVerifier", "TreeRejectedSubtreeVerifier",
           "TreeSiblingEchoVerifier", "TreeStaleResidualVerifier", "TreeWalkControl", "sibling_index"]


class TreeWalkControl(RejectionVerifier):
    """The shipped tree walk (:func:`~specforge.toolkit.trees.verify_tree`) under the declared
    rule with one ingredient changed by a subclass — the residual it goes on with after a
    rejected sibling, the uniforms it is handed, or which nodes count as children of the current
    one; chains are verified correctly."""

    child_of = staticmethod(is_child)

    def walk_residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return self.residual(p, q, x)

    def walk_uniforms(self, uniforms: Tensor, parents: Tensor) -> Tensor:
        """The uniforms the walk is handed (``[R, G+1, 2]``, a copy) given the tree's ``parents``."""
        return uniforms

    def verify(self, target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, parents=None):
        if parents is None:
            return super().verify(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms)
        inputs = prepare(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms)
        parents = parents.to(torch.long)
        return verify_tree(self.accept_probability, self.walk_residual, self.target_probs(inputs, sampling),
                           inputs.tokens, inputs.probs, parents, inputs.lengths,
                           self.walk_uniforms(inputs.uniforms.clone(), parents), child_of=self.child_of)


class TreeStaleResidualVerifier(TreeWalkControl):
    """Tries every sibling against the node's fresh target law: the residual is never updated
    after a rejected sibling (and a node whose children were all rejected emits from p)."""

    control = ("tree-stale-residual", "tree walk without the residual update after a rejected sibling")

    def walk_residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return p


def _through_rejected(parent: Tensor, cur: Tensor, rejected: Tensor) -> Tensor:
    """A child of the current node, or of a node rejected on the way (its subtree leaks in)."""
    return (parent == cur) | rejected.gather(1, (parent + 1)[:, None])[:, 0]


class TreeRejectedSubtreeVerifier(TreeWalkControl):
    """After rejecting a child, still tries that child's own children as candidates, and reads
    the accepted path back from the deepest accepted node through its parents — so a rejected
    child comes back into the output with its accepted child."""

    control = ("tree-rejected-subtree", "tree walk that tries a rejected child's children")

    child_of = staticmethod(_through_rejected)

    def verify(self, target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, parents=None):
        out = super().verify(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, parents)
        if parents is None:
            return out
        path = torch.full_like(out.path, -1)
        counts = torch.zeros_like(out.num_accepted)
        for r, n in enumerate(out.num_accepted.tolist()):
            chain, node = [], int(out.path[r, n - 1]) if n else -1
            while node >= 0:
                chain.append(node)
                node = int(parents[r, node])
            path[r, :len(chain)] = torch.tensor(chain[::-1], dtype=torch.long)
            counts[r] = len(chain)
        return VerifyOutput(num_accepted=counts, next_token=out.next_token, path=path)


def sibling_index(parents: Tensor) -> Tensor:
    """``[R, G]`` how many earlier nodes share each node's parent (0: a first child)."""
    same = parents[:, :, None] == parents[:, None, :]  # [R, j, i]
    earlier = torch.ones(parents.shape[1], parents.shape[1], dtype=torch.bool).tril(-1)
    return (same & earlier).sum(-1)


class EchoConfig(RejectionConfig):
    every: int = Field(5, ge=1, description="the rows of the batch affected: every this many")


class TreeSiblingEchoVerifier(TreeWalkControl):
    """In every fifth row of the batch, each third sibling (index 2, 5, …) is decided with the
    uniform of the node before it (its elder sibling in breadth-first order): the randomness of
    one node leaks into another's decision, for some nodes only."""

    control = ("tree-sibling-echo", "in some rows, every third sibling decided with its elder's uniform")
    config_class = EchoConfig

    def __init__(self, config: EchoConfig | None = None) -> None:
        super().__init__(config or EchoConfig())

    def walk_uniforms(self, uniforms: Tensor, parents: Tensor) -> Tensor:
        sib = sibling_index(parents)
        rows = (torch.arange(parents.shape[0]) % self.config.every == 0)[:, None]
        echo = ((sib % 3 == 2) & rows).nonzero(as_tuple=True)
        uniforms[echo[0], echo[1], 0] = uniforms[echo[0], echo[1] - 1, 0]
        return uniforms


class LateSiblingConfig(RejectionConfig):
    boost: float = Field(1.15, gt=0, description="acceptance of the third and later siblings × this")


class TreeLateSiblingVerifier(TreeWalkControl):
    """The third and later siblings of a node are accepted with min(1, 1.15·a) — their uniform
    is scaled — while the first two follow the rule."""

    control = ("tree-late-sibling", "third and later siblings accepted with min(1, 1.15·a)")
    config_class = LateSiblingConfig

    def __init__(self, config: LateSiblingConfig | None = None) -> None:
        super().__init__(config or LateSiblingConfig())

    def walk_uniforms(self, uniforms: Tensor, parents: Tensor) -> Tensor:
        late = sibling_index(parents) >= 2
        uniforms[..., :-1, 0] = torch.where(late, uniforms[..., :-1, 0] / self.config.boost, uniforms[..., :-1, 0])
        return uniforms


class LeakyResidualConfig(RejectionConfig):
    leak: float = Field(0.05, ge=0, le=1, description="share of the pre-rejection law kept in the residual")


class TreeLeakyResidualVerifier(TreeWalkControl):
    """After a rejected sibling the walk goes on with (1 − ε)·residual + ε·(the law before it):
    a residual update that is only mostly made (``tree-stale-residual`` is ε = 1)."""

    control = ("tree-leaky-residual", "residual after a rejected sibling keeps 5 % of the law before")
    config_class = LeakyResidualConfig

    def __init__(self, config: LeakyResidualConfig | None = None) -> None:
        super().__init__(config or LeakyResidualConfig())

    def walk_residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return (1 - self.config.leak) * self.residual(p, q, x) + self.config.leak * p


# --- registration -----------------------------------------------------------------------------


TREE_CONTROLS = (TreeStaleResidualVerifier, TreeRejectedSubtreeVerifier, TreeSiblingEchoVerifier,
                 TreeLateSiblingVerifier, TreeLeakyResidualVerifier)

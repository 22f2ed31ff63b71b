"""Verifying a token *tree*: several candidates per node, recursive rejection (SpecInfer, EAGLE-2).

A tree draft lists its nodes in an order where every parent comes before its children:
``parents[r, j]`` is the node index of node j's parent (−1: a child of the anchor x_0), node j
holds token ``tokens[r, j]`` drawn from ``probs[r, j]`` — the law it was *actually* drawn from,
given its path and the siblings drawn before it — and row j + 1 of the target logits is the
target's law after node j's path (row 0: after x_0).

Starting at the anchor with p the warped target law there, the children of the current node are
tried in index order: child j is accepted with ``accept_probability(p, q_j, x_j)``, and then the
walk moves into it with p the target's law after it; if it is rejected, p becomes
``residual(p, q_j, x_j)`` and the next sibling is tried against that.  When no child is left the
emitted token is a sample of p.  For the rejection rule (accept min(1, p/q), residual
norm(max(p − q, 0))) each step is one speculative-sampling step of the current residual law
against an independent proposal, so the emitted path has exactly the target's law, whatever the
tree's shape and the per-node laws (docs/design/verification.md#multi-draft-trees).  On a chain
(``parents[j] = j − 1``) it is the chain rule itself, uniform for uniform.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specforge.components import VerifyOutput
from specforge.sampling import sample_with_uniform

__all__ = ["check_parents", "is_child", "verify_tree"]


def check_parents(parents: Tensor, lengths: Tensor) -> None:
    """Raise ``ValueError`` naming the first node whose parent is not an earlier node (or −1)."""
    r, g = parents.shape
    j = torch.arange(g)[None, :]
    bad = (j < lengths[:, None]) & ((parents < -1) | (parents >= j))
    if bool(bad.any()):
        i, k = (int(t) for t in bad.nonzero()[0])
        raise ValueError(f"request {i}, node {k}: parent {int(parents[i, k])} is not an earlier node or -1 "
                         "(parents must come before their children)")


def is_child(parent: Tensor, cur: Tensor, rejected: Tensor) -> Tensor:
    """Whether a node whose parent is ``parent [R]`` is a child of the walk's current node
    ``cur [R]`` (``rejected [R, G+1]``: the nodes rejected so far, shifted by one for the anchor,
    which a correct walk never reads; the conformance suite's controls do)."""
    return parent == cur


def verify_tree(accept_probability, residual, p: Tensor, tokens: Tensor, probs: Tensor | None, parents: Tensor,
                lengths: Tensor, uniforms: Tensor, child_of=is_child) -> VerifyOutput:
    """The walk of the module docstring, vectorised over requests, one step per node.

    ``p [R, G+1, V]`` warped target laws per row; ``tokens``/``parents [R, G]``; ``probs
    [R, G, V]`` or ``None`` (one-hot q); ``lengths [R]`` nodes to verify (a prefix of the order);
    ``uniforms [R, G+1, 2]``: ``[r, j, 0]`` decides node j, ``[r, row, 1]`` samples the token
    emitted after the node of that row.  Returns the accepted path (``path [R, G]`` node indices,
    −1 past ``num_accepted``) with the emitted token.
    """
    r, g = tokens.shape
    rows = torch.arange(r, device=p.device)
    cur = torch.full((r,), -1, dtype=torch.long, device=p.device)  # the node the walk stands on
    law = p[:, 0].clone()
    depth = torch.zeros(r, dtype=torch.long, device=p.device)
    path = torch.full((r, g), -1, dtype=torch.long, device=p.device)
    rejected = torch.zeros(r, g + 1, dtype=torch.bool, device=p.device)
    for j in range(g):
        child = (j < lengths) & child_of(parents[:, j], cur, rejected)
        if not bool(child.any()):
            continue
        x = tokens[:, j]
        q = None if probs is None else probs[:, j]
        accept = child & (uniforms[:, j, 0] < accept_probability(law, q, x))
        reject = child & ~accept
        if bool(reject.any()):
            law = torch.where(reject[:, None], residual(law, q, x), law)
            rejected[:, j + 1] = reject
        if bool(accept.any()):
            path[rows[accept], depth[accept]] = j
            depth = depth + accept.to(torch.long)
            cur = torch.where(accept, j, cur)
            law = torch.where(accept[:, None], p[:, j + 1], law)
    next_token = sample_with_uniform(law, uniforms[rows, cur + 1, 1])
    return VerifyOutput(num_accepted=depth, next_token=next_token, path=path)

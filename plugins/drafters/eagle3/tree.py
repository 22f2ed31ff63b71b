"""EAGLE-2's dynamic draft tree (Li et al., 2024) over the EAGLE-3 layer (docs/design/drafters.md#eagle3).

The tree grows one depth per pass of the layer, for every request of the round at once:

1. *Root.*  The first pass reads (x_0, g) as the chain's first step does; its top-k draft ids are
   the depth-1 nodes, each scored by its log-probability under the draft model.
2. *Expand.*  The k best nodes of the newest depth (the *frontier*) are fed back — each with the
   hidden state of the pass that proposed it, attending to the context and to the frontier nodes
   on its own path — and each proposes its top-k children, scored by the *path* log-probability
   (parent's score + the child's log-probability).  The k best of the k² children are the next
   frontier; all of them stay candidates.
3. *Rerank.*  The ``nodes`` best candidates by path score form the tree.  A child never scores
   above its parent, so the choice is closed under ancestors (ties broken towards the shallower
   node); the nodes are returned breadth first, parents before children.

Every choice is a deterministic function of the round's inputs, so each node's draft law is
one-hot and the tree verifier's walk (recursive rejection with the residual updated after each
rejected sibling) keeps the output law exactly the target's, whatever the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge_plugins.drafters.eagle3.model import Eagle3Model

__all__ = ["DraftTree", "DynamicTree", "grow_tree"]

# Path scores are sums of log-probabilities; a floor keeps an impossible token's score finite, so
# the tie-break below still orders a parent before its child.
_LOGP_FLOOR = -1e4


class DynamicTree(BaseModel):
    """``eagle3.tree``: EAGLE-2's dynamic tree instead of a chain (depth = ``gamma``)."""

    model_config = ConfigDict(extra="forbid")

    topk: int = Field(4, ge=1, le=16, description="children proposed per expanded node, and nodes expanded per depth")
    nodes: int = Field(16, ge=1, le=63, description="nodes kept: the best by path log-probability")


@dataclass(frozen=True)
class DraftTree:
    """A tree for B sequences, breadth first.

    ``tokens [B, M]`` draft ids, ``parents [B, M]`` (−1: a child of x_0), ``depth [B, M]``
    (1 for x_0's children), ``logits [B, M, N]`` the draft logits the node was chosen from,
    ``hidden [B, M, d]`` the layer output that proposed it.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    logits: Tensor
    hidden: Tensor


def grow_tree(model: Eagle3Model, emb0: Tensor, hidden0: Tensor, pos0: Tensor, ctx_k: Tensor, ctx_v: Tensor,
              ctx_ok: Tensor, depth: int, topk: int, nodes: int, to_target) -> DraftTree:
    """The dynamic tree of ``depth`` levels (see the module docstring).

    Inputs are the chain's (:meth:`Eagle3Model.chain`): x_0's embedding and g ``[B, d]`` at
    ``pos0 [B]``, the context keys/values ``[B, C, KV, hd]`` and ``ctx_ok [B, C]``.
    ``to_target`` maps draft ids to the target ids the embedding reads.
    """
    b = emb0.shape[0]
    batch = torch.arange(b)[:, None]
    y, logits, _, _ = model.step(emb0[:, None], hidden0[:, None].to(model.dtype), pos0[:, None], ctx_k, ctx_v,
                                 ctx_ok[:, None], None)
    k = min(topk, logits.shape[-1])
    eye = torch.eye(k, dtype=torch.bool).expand(b, k, k)
    # Every pass's output rows, so that a candidate can name the row that proposed it.
    outs_y, outs_logits = [y[:, 0]], [logits[:, 0]]
    score, tok = torch.log_softmax(logits[:, 0], -1).clamp_min(_LOGP_FLOOR).topk(k, dim=-1)  # [B, k]
    # Candidates: draft id, path score, depth, parent (candidate index; −1: x_0), proposing row.
    cand = {"tok": [tok], "score": [score.double()], "depth": [torch.ones(b, k, dtype=torch.long)],
            "parent": [torch.full((b, k), -1)], "src": [torch.zeros(b, k, dtype=torch.long)]}
    frontier = torch.arange(k).expand(b, k)  # candidate indices of the nodes expanded next
    reads = y[:, 0, None].expand(b, k, -1)  # the hidden state each frontier node reads
    keys, values = ctx_k, ctx_v  # the context, then every expanded node's K/V
    ancestors = torch.zeros(b, k, 0, dtype=torch.bool)  # per frontier node: the expanded nodes on its path
    n_cand = k
    for level in range(1, depth):
        emb = model.embed(to_target(torch.cat(cand["tok"], 1).gather(1, frontier)))
        mask = torch.cat([ctx_ok[:, None].expand(b, k, -1), ancestors], 2)
        y, logits, kk, vv = model.step(emb, reads, (pos0 + level)[:, None].expand(b, k), keys, values, mask, eye)
        keys, values = torch.cat([keys, kk], 1), torch.cat([values, vv], 1)
        src0 = len(outs_y)
        outs_y.extend(y.unbind(1))
        outs_logits.extend(logits.unbind(1))
        child_logp, child_tok = torch.log_softmax(logits, -1).clamp_min(_LOGP_FLOOR).topk(k, dim=-1)  # [B, k, k]
        parent_score = torch.cat(cand["score"], 1).gather(1, frontier)
        child_score = (parent_score[:, :, None] + child_logp.double()).flatten(1)  # [B, k·k], row-major
        cand["tok"].append(child_tok.flatten(1))
        cand["score"].append(child_score)
        cand["depth"].append(torch.full((b, k * k), level + 1, dtype=torch.long))
        cand["parent"].append(frontier.repeat_interleave(k, dim=1))
        cand["src"].append((src0 + torch.arange(k).repeat_interleave(k)).expand(b, k * k))
        if level + 1 == depth:
            break
        best = child_score.topk(k, dim=-1).indices  # [B, k] among the new children
        # A new frontier node's path: its parent's path and its parent (just expanded).
        ancestors = torch.cat([ancestors, eye], 2)[batch, best // k]
        frontier, reads = n_cand + best, y[batch, best // k]
        n_cand += k * k
    tok, score, d, parent, src = (torch.cat(cand[key], 1) for key in ("tok", "score", "depth", "parent", "src"))
    chosen, new_parent = _rerank(score, d, parent, nodes)
    rows = src.gather(1, chosen)
    return DraftTree(tokens=tok.gather(1, chosen), parents=new_parent, depth=d.gather(1, chosen),
                     logits=torch.stack(outs_logits, 1)[batch, rows], hidden=torch.stack(outs_y, 1)[batch, rows])


def _rerank(score: Tensor, depth: Tensor, parent: Tensor, nodes: int) -> tuple[Tensor, Tensor]:
    """The best ``nodes`` of ``[B, C]`` candidates, breadth first: (candidate indices ``[B, M]``,
    parents remapped to positions in that order)."""
    b, total = score.shape
    m = min(nodes, total)
    # The depth term breaks ties towards the shallower node, so the choice is closed under ancestors.
    key = score - 1e-6 * depth.double()
    chosen = key.topk(m, dim=-1).indices
    # Breadth first: by depth, then by score; a parent is shallower, so it comes first.
    chosen = chosen.gather(1, (depth.gather(1, chosen).double() * 1e9 - key.gather(1, chosen)).argsort(dim=-1))
    position = torch.full((b, total), -1, dtype=torch.long).scatter_(1, chosen, torch.arange(m).expand(b, m))
    par = parent.gather(1, chosen)
    new_parent = torch.where(par >= 0, position.gather(1, par.clamp_min(0)), -1)
    if ((par >= 0) & (new_parent < 0)).any() or (new_parent >= torch.arange(m)).any():
        raise RuntimeError("the dynamic tree's choice is not closed under ancestors")  # cannot happen: see above
    return chosen, new_parent

"""DSpark's training objective (paper §3.3 eq. 9–12; docs/training.md#how-training-works).

For each block b and draft position k (1-based in prose, 0-based in tensors)::

    w_k   = exp(−(k−1)/γ)
    c*_k  = 1 − ½‖p_d,k − p_t,k‖₁                       (detached: a label, eq. 8)
    L_ce  = Σ_k w_k · −log p_d,k(x*_k)                   (eq. 9)
    L_tv  = Σ_k w_k · ‖p_d,k − p_t,k‖₁                   (eq. 10)
    L_conf= Σ_k w_k · BCE(c_k, c*_k)                      (eq. 11)
    L     = 0.1·L_ce + 0.9·L_tv + 1.0·L_conf              (eq. 12)

The paper position-weights all three terms ("All three are position-weighted by w_k"), and so
do we.  Each term is summed over the supervised positions of a block and averaged over the blocks
that have at least one, so a term is "per block" as in the paper whatever the batch size.

Only the contiguous valid prefix of each block is supervised (docs/training.md): position k counts iff
positions 1..k are all inside the sequence and the loss mask.  Positions after a hole never count
— their label would be the continuation of a text that prefix-based verification never reaches.

The teacher p_t is the target's last hidden state through the frozen LM head, softmaxed in float32,
at the sampled positions only (:func:`teacher_probs`): only hidden states travel (paper §5.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specforge.toolkit.training import LossOutput, MetricNames

__all__ = ["CHAIN_METRICS", "DSparkLoss", "chain_loss", "dspark_loss", "position_weights", "teacher_probs", "valid_prefix"]


def position_weights(length: int, gamma: int | None = None, device: torch.device | str | None = None) -> Tensor:
    """``[length]`` float32 w_k = exp(−(k−1)/γ), k = 1..length (γ defaults to ``length``)."""
    gamma = gamma or length
    return torch.exp(-torch.arange(length, dtype=torch.float32, device=device) / gamma)


def teacher_probs(last_hidden: Tensor, lm_head: Tensor) -> Tensor:
    """``[..., d]`` final-normed target states at the sampled positions → p_t ``[..., V]``.

    The projection runs in the LM head's dtype (as the target's own logits are computed, see
    ``Transformer.project``); the softmax in float32.
    """
    return torch.softmax(F.linear(last_hidden.to(lm_head.dtype), lm_head).float(), dim=-1)


def valid_prefix(valid: Tensor) -> Tensor:
    """``[B, S]`` bool → the contiguous valid prefix of each row (a hole ends it)."""
    return torch.cumprod(valid.to(torch.int8), dim=-1).bool()


@dataclass(frozen=True)
class DSparkLoss:
    total: Tensor  # scalar, what to backpropagate
    ce: Tensor  # scalar, L_ce
    tv: Tensor  # scalar, L_tv (sum of L1 distances, ∈ [0, 2] per position)
    conf: Tensor  # scalar, L_conf (0 when no confidence logits were given)
    c_star: Tensor  # [B, S] per-step acceptance labels (0 outside the supervised prefix)
    mask: Tensor  # [B, S] the supervised positions
    accept_rate: Tensor  # [S] mean c*_k over blocks supervised at k: accept_rate@k
    tau: Tensor  # scalar, mean over blocks of 1 + Σ_k Π_{i≤k} c*_i (bonus token included)

    def metrics(self) -> dict[str, float]:
        """Flat floats for logging: each term, τ̂ and accept_rate@k (k 1-based)."""
        out = {"loss": self.total.item(), "ce": self.ce.item(), "tv": self.tv.item(),
               "conf": self.conf.item(), "tau": self.tau.item()}
        out.update({f"accept_rate@{k + 1}": v for k, v in enumerate(self.accept_rate.tolist())})
        return out


def dspark_loss(
    draft_logits: Tensor,
    labels: Tensor,
    target_probs: Tensor,
    valid: Tensor,
    conf_logits: Tensor | None = None,
    gamma: int | None = None,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    conf_weight: float = 1.0,
    outside: Tensor | None = None,
) -> DSparkLoss:
    """The DSpark objective on B blocks of S draft positions.

    Args:
        draft_logits: ``[B, S, V]`` corrected draft logits (base U + correction bias, teacher-forced).
        labels: ``[B, S]`` ground-truth x*_k (any value where not valid, e.g. −100).
        target_probs: ``[B, S, V]`` p_t from :func:`teacher_probs`.
        valid: ``[B, S]`` inside the sequence and the loss mask; reduced to its valid prefix.
        conf_logits: ``[B, S]`` pre-sigmoid confidence c_k, or None (no L_conf).
        gamma: γ of w_k (default S).
        outside: ``[B, S]`` the target's probability mass outside a draft vocabulary, when the
            draft logits cover only its N tokens (``target_probs`` then holds p_t on those N,
            and ``labels`` are draft ids, negative for a token outside): the draft law puts no
            mass there, so that mass counts fully in ‖p_d − p_t‖₁, and such a label gets no CE.
    """
    b, s, _ = draft_logits.shape
    mask = valid_prefix(valid)
    w = position_weights(s, gamma, draft_logits.device) * mask  # [B, S], 0 off the prefix
    blocks = mask[:, 0].sum().clamp_min(1)  # a block is supervised iff its first position is
    zero = torch.zeros((), device=draft_logits.device)

    # Positions past the prefix may hold garbage (inf/NaN padding): replace them *before* any
    # arithmetic, since a NaN anywhere in a softmax's backward poisons the gradient even when the
    # result is masked out afterwards.
    keep = mask[..., None]
    logp = torch.log_softmax(torch.where(keep, draft_logits.float(), zero), dim=-1)
    p_t = torch.where(keep, target_probs.float(), zero)
    labelled = mask & (labels >= 0)  # a label outside the draft vocabulary has no CE term
    nll = -logp.gather(-1, torch.where(labelled, labels, 0)[..., None]).squeeze(-1)
    ce = (w * torch.where(labelled, nll, zero)).sum() / blocks

    l1 = (logp.exp() - p_t).abs().sum(-1)
    if outside is not None:
        l1 = l1 + outside.float()
    l1 = torch.where(mask, l1, zero)
    tv = (w * l1).sum() / blocks

    c_star = torch.where(mask, (1 - 0.5 * l1.detach()).clamp(0, 1), zero)
    if conf_logits is None:
        conf = zero
    else:
        bce = F.binary_cross_entropy_with_logits(torch.where(mask, conf_logits.float(), zero), c_star,
                                                 reduction="none")
        conf = (w * bce).sum() / blocks

    total = ce_weight * ce + tv_weight * tv + conf_weight * conf
    with torch.no_grad():
        accept_rate = c_star.sum(0) / mask.sum(0).float()  # NaN where no block reaches k
        # Π_{i≤k} c*_i with c* = 0 off the prefix: a short block contributes only what it shows.
        survive = torch.cumprod(c_star, dim=-1).sum(-1)
        tau = torch.where(mask[:, 0], 1 + survive, zero).sum() / blocks
    return DSparkLoss(total=total, ce=ce, tv=tv, conf=conf, c_star=c_star, mask=mask,
                      accept_rate=accept_rate, tau=tau)


#: The metrics :func:`chain_loss` fills: a method that returns it declares them as its ``metrics``.
CHAIN_METRICS = MetricNames(means=("ce", "tau"), sums=("supervised",), positions=("top1",))


def chain_loss(ce: Tensor, logits: Tensor, labels: Tensor, valid: Tensor, weights: Tensor) -> LossOutput:
    """The loss of a chain drafter scored slot by slot (Medusa's heads, EAGLE-3's TTT steps).

    ``ce [B, k]`` per-slot losses, ``logits [B, k, N]``, ``labels [B, k]`` (in the logits' ids;
    anything where not ``valid``), ``valid [B, k]``, slot weights ``weights [k]``.  Total:
    Σ_k weights_k·ce_k averaged over the blocks whose first slot is supervised; metrics: ``ce`` (the mean per-slot loss), ``tau`` (the
    greedy chain's expected accepted length on the batch, 1 + Σ_k Π_{j≤k} [arg-max_j = label_j])
    and ``top1`` per slot.
    """
    mask = valid.to(logits.dtype)
    counted = valid[:, 0]
    blocks = counted.sum()
    hits = (logits.argmax(-1) == labels) & valid
    tau = 1 + torch.cumprod(hits.to(logits.dtype), 1).sum(1)
    return LossOutput(
        total=(ce * mask * weights).sum() / blocks.clamp_min(1), blocks=blocks,
        means={"ce": (ce * mask).sum() / mask.sum().clamp_min(1),
               "tau": (tau * counted).sum() / counted.sum().clamp_min(1)},
        sums={"supervised": mask.sum()},
        positions={"top1": (hits.sum(0).to(logits.dtype), mask.sum(0))})

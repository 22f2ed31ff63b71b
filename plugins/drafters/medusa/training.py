"""Medusa-1 training through the training contract: the heads only, L = Σ_k λ_k · CE_k.

For a block whose anchor sits at position a, the heads read the target's last-layer output at
a − 1 (the position whose next token is the anchor) and head k is labelled with the token at
a + k — the block's slot k − 1 (:class:`~specforge.toolkit.training.TrainBatch`).  λ_k = decay^k
(Medusa's 0.8).  The target's answers are the labels (hard CE, as Medusa-1), so no teacher law
is computed.  ``tau`` is the greedy chain's expected accepted length on the batch,
1 + Σ_k Π_{j≤k} [head j's arg-max is the label].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge.toolkit.losses import CHAIN_METRICS, chain_loss
from specforge.toolkit.training import BatchModule, DataNeeds, LossOutput, TrainBatch
from specforge.toolkit.vocab_training import VocabTraining, check_resumable
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.medusa.model import MedusaHeads, MedusaShape, load_medusa, save_medusa

__all__ = ["MedusaTrainConfig", "MedusaTraining"]

class MedusaTrainConfig(BaseModel):
    """The ``drafter.*`` keys of a training config for ``medusa``."""

    model_config = ConfigDict(extra="forbid")

    heads: int = Field(5, ge=1, description="K: heads (draft positions per round)")
    res_layers: int = Field(1, ge=1, description="residual blocks per head")
    output: Literal["own", "shared"] = Field("own", description="own output layer per head (initialised from the "
                                                                "target's LM head) or the target's, frozen")
    decay: float = Field(0.8, gt=0, le=1, description="λ_k = decay^k")
    seed: int = Field(0, description="seed of the initialisation")
    draft_vocab: int | None = Field(None, ge=1, description="N: output layers over the N most frequent tokens of "
                                                            "the training answers; None: the whole vocabulary")


class _Module(BatchModule):
    """The heads over the tapped last layer just before each anchor (what the trainer wraps)."""

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.heads = heads

    def run(self, batch: TrainBatch) -> Tensor:
        return self.heads(batch.before_anchor())


class MedusaTraining(VocabTraining):
    """One Medusa-1 training run (see the module docstring)."""

    method = "medusa"
    config = MedusaTrainConfig
    metrics = CHAIN_METRICS

    def _build(self, vocab: DraftVocab | None) -> _Module:
        c, rt = self.settings, self.target.runtime
        shape = MedusaShape.from_model_args(self.target.args, heads=c.heads, res_layers=c.res_layers,
                                            output=c.output, draft_vocab_size=None if vocab is None else vocab.size)
        heads = MedusaHeads(shape, seed=c.seed, vocab=vocab)
        heads.bind(rt.norm.detach().float().to(self.device), rt.lm_head.detach().float().to(self.device),
                   init_output=True)
        return _Module(heads).to(self.device)

    def needs(self) -> DataNeeds:
        return DataNeeds(layers=(self.target.args.n_layers - 1,), block=self.settings.heads, mask_token_id=0,
                         teacher=False, token_counts=self.settings.draft_vocab is not None)

    def loss(self, outputs: Tensor, batch: TrainBatch) -> LossOutput:
        logits = outputs.float()  # [B, K, N]
        labels, valid = self.in_draft_vocab(batch.labels, batch.valid & (batch.anchor_pos > 0)[:, None])
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none").view_as(labels)
        k = logits.shape[1]  # λ_k = decay^k, k = 1 … K (Medusa's 0.8^k)
        weights = self.settings.decay ** torch.arange(1, k + 1, dtype=logits.dtype, device=logits.device)
        return chain_loss(ce, logits, labels, valid, weights)

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        save_medusa(directory, self.module.heads, {"kind": "medusa", **provenance, **self.vocab_record()},
                    target=self.target_name)

    def load(self, directory: Path) -> None:
        heads, _ = load_medusa(directory)
        check_resumable(directory, heads, self.module.heads)
        self.module.heads.load_state_dict(heads.state_dict())

"""Medusa-1 training through the training contract: the heads only, L = Σ_k λ_k · CE_k.

For a block whose anchor sits at position a, the heads read the target's last-layer output at
a − 1 (the position whose next token is the anchor) and head k is labelled with the token at
a + k — the block's slot k − 1 (:class:`~specforge.training.contract.TrainBatch`).  λ_k = decay^k
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
from torch import Tensor, nn

from specforge.training.contract import DataNeeds, DataSummary, LossOutput, MetricNames, TrainBatch
from specforge.training.losses import chain_loss
from specforge.vocab import DraftVocab, DraftVocabError
from specforge_plugins.drafters.checkpoints import DrafterCheckpointError
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


class _Module(nn.Module):
    """The heads with the batch plumbing: what the trainer wraps (in DDP under torchrun)."""

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, batch: TrainBatch | None) -> Tensor:
        if batch is None:  # a rank with no blocks still joins the gradient all-reduce
            return sum(p.sum() for p in self.parameters()) * 0.0
        before = (batch.anchor_pos - 1).clamp_min(0)
        last = batch.ctx[batch.ctx_index, before]  # [B, d]: the tapped last layer, one tap
        return self.heads(last)


class MedusaTraining:
    """One Medusa-1 training run (see the module docstring)."""

    method = "medusa"
    config = MedusaTrainConfig
    metrics = MetricNames(means=("ce", "tau"), sums=("supervised",), positions=("top1",))

    def __init__(self, config: MedusaTrainConfig, target: Any, device: torch.device | str = "cpu") -> None:
        self.settings, self.target, self.device = config, target, device
        self.target_name = str(target.name)
        if config.draft_vocab is not None and config.draft_vocab >= target.args.vocab_size:
            raise DraftVocabError(f"drafter.draft_vocab: {config.draft_vocab} is not smaller than the target's "
                                  f"{target.args.vocab_size} tokens (leave it unset for the whole vocabulary)")
        self.vocab: DraftVocab | None = None
        self.coverage: float | None = None
        self._module: _Module | None = None if config.draft_vocab is not None else self._build(None)

    def _build(self, vocab: DraftVocab | None) -> _Module:
        c, rt = self.settings, self.target.runtime
        shape = MedusaShape.from_model_args(self.target.args, heads=c.heads, res_layers=c.res_layers,
                                            output=c.output, draft_vocab_size=None if vocab is None else vocab.size)
        heads = MedusaHeads(shape, seed=c.seed, vocab=vocab)
        heads.bind(rt.norm.detach().float().to(self.device), rt.lm_head.detach().float().to(self.device),
                   init_output=True)
        return _Module(heads).to(self.device)

    @property
    def module(self) -> _Module:
        if self._module is None:
            raise RuntimeError("prepare() the method with the data's token counts first (draft_vocab is set)")
        return self._module

    def needs(self) -> DataNeeds:
        return DataNeeds(layers=(self.target.args.n_layers - 1,), block=self.settings.heads, mask_token_id=0,
                         teacher=False, token_counts=self.settings.draft_vocab is not None)

    def prepare(self, summary: DataSummary) -> None:
        if self.settings.draft_vocab is None or self._module is not None:
            return
        self.vocab, self.coverage = DraftVocab.from_data(summary.token_counts, self.settings.draft_vocab)
        self._module = self._build(self.vocab)

    def loss(self, outputs: Tensor, batch: TrainBatch) -> LossOutput:
        logits = outputs.float()  # [B, K, N]
        labels, valid = batch.labels, batch.valid & (batch.anchor_pos > 0)[:, None]
        if self.vocab is not None:  # a label outside the draft vocabulary cannot be predicted: unsupervised
            inside = self.vocab.t2d.to(labels.device)[labels.clamp_min(0)]
            labels = self.vocab.to_draft(labels.clamp_min(0)).masked_fill(~inside, 0)
            valid = valid & inside
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none").view_as(labels)
        k = logits.shape[1]  # λ_k = decay^k, k = 1 … K (Medusa's 0.8^k)
        weights = self.settings.decay ** torch.arange(1, k + 1, dtype=logits.dtype, device=logits.device)
        return chain_loss(ce, logits, labels, valid, weights)

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        extra = {} if self.vocab is None else {"draft_vocab": self.vocab.size, "train_coverage": self.coverage}
        save_medusa(directory, self.module.heads, {"kind": "medusa", **provenance, **extra}, target=self.target_name)

    def load(self, directory: Path) -> None:
        heads, _ = load_medusa(directory)
        mine = self.module.heads
        if heads.shape != mine.shape or (heads.vocab is None) != (mine.vocab is None) or (
                heads.vocab is not None and not torch.equal(heads.vocab.ids, mine.vocab.ids)):
            raise DrafterCheckpointError(f"{directory}: its heads ({heads.shape}) differ from this run's "
                                         f"({mine.shape}); resume with the same config and data")
        mine.load_state_dict(heads.state_dict())

    def pipeline(self, directory: Path) -> dict[str, Any]:
        return {"drafter": {"name": self.method, "checkpoint": str(directory)},
                "correction_head": {"name": "none"}, "confidence": {"name": "constant"}}

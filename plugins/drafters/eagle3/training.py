"""EAGLE-3 training through the training contract: training-time test (TTT) over γ steps.

For a block whose anchor sits at position a, every context row t of its sequence carries the K/V
of (x_{t+1}, g_t) — the true next token and the fused target features — and the chain of
:meth:`~specforge_plugins.drafters.eagle3.model.Eagle3Model.chain` runs γ steps from row a − 1:
step 1 reads (x_a, g_{a−1}) and predicts x_{a+1}; step k reads the true token x_{a+k−1} with the
model's *own* output of step k − 1 — exactly what it will see when drafting after an accepted
prefix.  Loss: Σ_k 0.8^(k−1) · soft cross-entropy against the target's law p_t at slot k (on the
draft vocabulary's tokens when there is one, where the target token lies inside).  ``tau`` is the
greedy chain's expected accepted length, 1 + Σ_k Π_{j≤k} [arg-max_j = label_j].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge.toolkit.layers import SharedWeights
from specforge.toolkit.losses import CHAIN_METRICS, chain_loss
from specforge.toolkit.training import BatchModule, DataNeeds, LossOutput, TrainBatch
from specforge.toolkit.vocab_training import VocabTraining, check_resumable
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, save_eagle3

__all__ = ["Eagle3TrainConfig", "Eagle3Training"]


class Eagle3TrainConfig(BaseModel):
    """The ``drafter.*`` keys of a training config for ``eagle3``."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(7, ge=1, description="training-time test steps (the drafted chain's length)")
    decay: float = Field(0.8, gt=0, le=1, description="step k's loss weight: decay^(k-1)")
    target_layers: list[int] | None = Field(None, description="fused target layers; None: EAGLE-3's 1, L/2-1, L-4")
    seed: int = Field(0, description="seed of the initialisation")
    draft_vocab: int | None = Field(None, ge=1, description="N: the drafter's LM head over the N most frequent tokens "
                                                            "of the training answers; None: the whole vocabulary")
    qk_norm: bool | None = Field(
        None, description="per-head RMSNorm of queries and keys in the draft layer; None: as the target's layers "
                          "(True is what DeepSpec's Qwen3Eagle3Model holds: export --to deepspec needs it)")


class _Module(BatchModule):
    """The model with the batch plumbing: what the trainer wraps (in DDP under torchrun)."""

    def __init__(self, model: Eagle3Model, steps: int) -> None:
        super().__init__()
        self.model, self.steps = model, steps

    def run(self, batch: TrainBatch) -> Tensor:
        m = self.model
        if batch.ctx_ids is None:
            raise ValueError("eagle3 needs TrainBatch.ctx_ids (the tokens of the context rows)")
        ids, ctx = batch.ctx_ids, batch.ctx
        s, t = ids.shape
        following = torch.cat([ids[:, 1:], ids.new_zeros(s, 1)], 1)  # x_{t+1} of every row
        positions = torch.arange(t, device=ids.device).expand(s, t)
        k, v, g = m.context_kv(ctx, following, positions)
        seq, a = batch.ctx_index, batch.anchor_pos
        row = (a - 1).clamp_min(0)
        # A block sees the rows strictly before its anchor; row a − 1 is its first step's own key.
        ctx_ok = (positions[seq] <= row[:, None]) & batch.ctx_valid[seq]
        labels = batch.labels

        def teacher(j: int, _logits: Tensor) -> Tensor:
            return m.embed(labels[:, j].clamp_min(0))

        _, logits = m.chain(m.embed(batch.anchor_ids), g[seq, row], row, k[seq], v[seq], ctx_ok,
                            min(self.steps, labels.shape[1]), teacher)
        return logits


class Eagle3Training(VocabTraining):
    """One EAGLE-3 training run (see the module docstring)."""

    method = "eagle3"
    config = Eagle3TrainConfig
    metrics = CHAIN_METRICS

    def __init__(self, config: Eagle3TrainConfig, target: Any, device: torch.device | str = "cpu") -> None:
        super().__init__(config, target, device)
        self.shape = self._shape(None)

    def _shape(self, vocab: DraftVocab | None) -> Eagle3Shape:
        c, args = self.settings, self.target.args
        return Eagle3Shape.from_model_args(args, self.target.runtime,
                                           layers=tuple(c.target_layers) if c.target_layers else None,
                                           draft_vocab_size=None if vocab is None else vocab.size,
                                           qk_norm=args.qk_norm if c.qk_norm is None else c.qk_norm)

    def _build(self, vocab: DraftVocab | None) -> _Module:
        model = Eagle3Model(self._shape(vocab), seed=self.settings.seed, vocab=vocab)
        model.bind(SharedWeights.from_target(self.target.runtime, self.device), init_head=True)
        return _Module(model, self.settings.steps).to(self.device)

    def needs(self) -> DataNeeds:
        return DataNeeds(layers=self.shape.layers, block=self.settings.steps, mask_token_id=0,
                         token_counts=self.settings.draft_vocab is not None)

    def loss(self, outputs: Tensor, batch: TrainBatch) -> LossOutput:
        logits = outputs.float()  # [B, k, N]
        k = logits.shape[1]
        p_t = batch.p_t[:, :k]
        if self.vocab is not None:  # EAGLE-3: supervise where the target's token can be drafted
            p_t = p_t[..., self.vocab.ids.to(p_t.device)]
        labels, valid = self.in_draft_vocab(batch.labels[:, :k], batch.valid[:, :k] & (batch.anchor_pos > 0)[:, None])
        ce = -(p_t * torch.log_softmax(logits, -1)).sum(-1)
        weights = self.settings.decay ** torch.arange(k, dtype=logits.dtype, device=logits.device)  # 0.8^(k−1)
        return chain_loss(ce, logits, labels, valid, weights)

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        save_eagle3(directory, self.module.model, {"kind": "eagle3", "gamma": self.settings.steps, **provenance,
                                                   **self.vocab_record()}, target=self.target_name)

    def load(self, directory: Path) -> None:
        model, _ = load_eagle3(directory)
        check_resumable(directory, model, self.module.model)
        self.module.model.load_state_dict(model.state_dict())

    def drafter_section(self, directory: Path) -> dict[str, Any]:
        return {**super().drafter_section(directory), "gamma": self.settings.steps}

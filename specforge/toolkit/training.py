"""The training contract: what a drafter plug-in provides so that ``specforge train`` can train it.

It sits in the plug-in authors' toolkit, below the trainer (:mod:`specforge.training`), which
imports it: a method and the trainer meet here, and neither imports the other.

A drafter is trainable when its registration names a *training method*::

    @hookimpl
    def specforge_register_drafters(register):
        register("my-drafter", MyDrafter, config=MyDrafterConfig, training=MyTraining, ...)

``MyTraining`` is a class with a pydantic ``config`` model (the ``drafter.*`` keys of a training
config, besides ``name``) whose constructor takes ``(config, target, device)`` and returns an object with
the methods of :class:`DraftTraining`.  The trainer owns everything that is the same for every
method — data, regeneration, the feature cache, anchors, batching, the teacher law, the
optimizer and its schedule, ``torchrun``, checkpoints, resuming, metrics and export — and sees a
method only through this contract.  See the "Training" page of the docs, "Training your own
drafter".

One step, as the trainer runs it:

1. the method's :class:`DataNeeds` say which target layers to tap (the feature cache stores
   them), how many draft slots follow each anchor and how the block's input ids are laid out;
   once the data exists, ``prepare`` gets a :class:`DataSummary` (token frequencies, if asked);
2. the trainer samples anchors, packs their blocks and computes the teacher law p_t (the target's
   own next-token law at every supervised slot), giving a :class:`TrainBatch`;
3. ``module(batch)`` runs the method's trainable :class:`torch.nn.Module` (wrapped in
   DistributedDataParallel under ``torchrun``) and ``loss(outputs, batch)`` turns its outputs
   into a :class:`LossOutput`; the trainer backpropagates, clips, steps and logs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel
from torch import Tensor, nn

__all__ = ["BatchModule", "DataNeeds", "DataSummary", "DraftTraining", "LossOutput", "MetricNames", "TrainBatch",
           "TrainingMethod", "empty_loss"]


@dataclass(frozen=True)
class DataNeeds:
    """What a method asks of the data pipeline.

    Attributes:
        layers: target layers (0-based) whose outputs the method reads; the feature cache taps
            them, and :attr:`TrainBatch.ctx` holds them concatenated per position.
        block: draft slots supervised after each anchor (γ): slot j is labelled with the token
            at ``anchor + 1 + j``.
        input_len: input slots per block in :attr:`TrainBatch.block_ids` (γ when the anchor slot
            is the first prediction, as in DSpark; γ + 1 when the γ slots after it are, as in DFlash).
        mask_token_id: the input id of every slot but the anchor.
        teacher: the method's loss reads p_t (:attr:`TrainBatch.p_t`); computing it costs a
            projection through the target's LM head per supervised slot, so say no if unused.
        token_counts: the method's ``prepare`` needs :attr:`DataSummary.token_counts` (e.g. to
            choose a draft vocabulary); counting costs one pass over the training data.
    """

    layers: tuple[int, ...]
    block: int
    mask_token_id: int
    input_len: int | None = None
    teacher: bool = True
    token_counts: bool = False

    @property
    def slots(self) -> int:
        return self.block if self.input_len is None else self.input_len


@dataclass(frozen=True)
class DataSummary:
    """What the trainer tells a method's ``prepare`` about the training data (held-out sequences
    excluded).

    Attributes:
        sequences: training sequences.
        token_counts: ``[V]`` int64 occurrences of each token among the supervised (loss-mask)
            tokens — the target's own answers when the data was regenerated — or ``None`` when the
            method's needs did not ask for them.
    """

    sequences: int
    token_counts: Tensor | None = None


@dataclass(frozen=True)
class MetricNames:
    """The names a method's :class:`LossOutput` fills, declared up front so a rank with no data in
    a step still takes part in the metric all-reduce."""

    means: tuple[str, ...] = ()  # averaged over blocks ("ce", "tau", …)
    sums: tuple[str, ...] = ()  # summed over the global batch ("supervised", …)
    positions: tuple[str, ...] = ()  # per draft slot, logged as name@1 … name@γ ("accept_rate", …)


@dataclass(frozen=True)
class TrainBatch:
    """One rank's share of a step: B blocks of ``block`` slots over S sequences' features.

    Attributes:
        block_ids: ``[B, input_len]`` the block's input ids: the anchor, then mask ids.
        anchor_pos: ``[B]`` the anchor's position inside its sequence.
        anchor_ids: ``[B]`` the anchor token.
        labels: ``[B, γ]`` the token each slot must predict (any value where not ``valid``).
        prev_ids: ``[B, γ]`` the token before each label (x_{k−1}; x_0 is the anchor).
        valid: ``[B, γ]`` the slot's label lies inside the sequence and its loss mask.
        ctx: ``[S, T, m·d]`` the tapped layers' outputs of the S sequences, concatenated per
            position, zero-padded to the longest (T).
        ctx_valid: ``[S, T]`` False on padding.
        ctx_index: ``[B]`` the sequence of each block.
        p_t: ``[B, γ, V]`` float32, the target's law of each slot's token given the true prefix
            (zero where not ``valid``); ``None`` when the method's needs say ``teacher=False``.
        ctx_ids: ``[S, T]`` the token at each context position (0 on padding), for methods whose
            context rows read the token that follows them (EAGLE-3's (x_{t+1}, g_t) pairs).
    """

    block_ids: Tensor
    anchor_pos: Tensor
    anchor_ids: Tensor
    labels: Tensor
    prev_ids: Tensor
    valid: Tensor
    ctx: Tensor
    ctx_valid: Tensor
    ctx_index: Tensor
    p_t: Tensor | None = None
    ctx_ids: Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.shape[0])

    def before_anchor(self) -> Tensor:
        """``[B, m·d]`` each block's context row just before its anchor — the position whose next
        token is the anchor, what a drafter reading the target's state there sees when drafting
        (row 0 for an anchor at position 0, which has none: mask such blocks out of the loss)."""
        return self.ctx[self.ctx_index, (self.anchor_pos - 1).clamp_min(0)]


@dataclass(frozen=True)
class LossOutput:
    """A method's loss on one rank's batch.

    Attributes:
        total: the scalar to backpropagate, a mean over ``blocks``.
        blocks: how many blocks that mean is over (a 0-d tensor); the trainer rescales so that the
            gradient is the mean over every rank's blocks.
        means: per-block means to log (each weighted by ``blocks`` across ranks).
        sums: totals to log (summed across ranks).
        positions: per-slot ``(sum, count)`` pairs of ``[γ]`` tensors; logged as sum / count.
    """

    total: Tensor
    blocks: Tensor
    means: dict[str, Tensor] = field(default_factory=dict)
    sums: dict[str, Tensor] = field(default_factory=dict)
    positions: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


@runtime_checkable
class DraftTraining(Protocol):
    """One training run of a method, built as ``training(config, target, device)``.

    ``config`` is the method's validated ``config`` model; ``target`` the loaded
    :class:`~specforge.runtime.TargetModel` (its ``args``, ``runtime.embed``/``lm_head``, ``name``).
    """

    #: the method's name, written into every checkpoint it saves
    method: str
    #: the trainable parameters; ``module(batch)`` gives what :meth:`loss` reads (``batch`` may be
    #: ``None`` on a rank with no data this step: return something that touches every parameter,
    #: as a :class:`BatchModule` does)
    module: nn.Module
    metrics: MetricNames

    def needs(self) -> DataNeeds:
        """The data this method trains on."""
        ...

    def prepare(self, summary: DataSummary) -> None:
        """Called once when the data is ready, before :attr:`module` is read: build what depends
        on the data here (a draft vocabulary).  A method may leave it empty."""
        ...

    def loss(self, outputs: Any, batch: TrainBatch) -> LossOutput:
        """The loss of ``module(batch)``'s ``outputs``."""
        ...

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        """Write the trained drafter (safetensors + a JSON config naming ``method`` and the target,
        plus ``provenance``: steps, training config) so that the drafter plug-in can load it."""
        ...

    def load(self, directory: Path) -> None:
        """Load weights written by :meth:`save` into :attr:`module` (resuming a run)."""
        ...

    def pipeline(self, directory: Path) -> dict[str, Any]:
        """The pipeline sections (``drafter``, and ``correction_head``/``confidence`` when the
        method trains them) that serve the drafter saved in ``directory``."""
        ...


class TrainingMethod(Protocol):
    """What a drafter registers as ``training=``: a class with a ``config`` model."""

    config: type[BaseModel]

    def __call__(self, config: BaseModel, target: Any) -> DraftTraining: ...


class BatchModule(nn.Module, ABC):
    """A method's trainable :attr:`DraftTraining.module`: subclasses implement :meth:`run` on one
    rank's :class:`TrainBatch`.

    Under ``torchrun`` a rank whose sequences gave no block this step is called with ``None``; it
    must still take part in DistributedDataParallel's gradient all-reduce, or the other ranks wait
    for it forever, so it returns a zero that touches every parameter.
    """

    def forward(self, batch: TrainBatch | None) -> Any:
        if batch is None:
            return sum(p.sum() for p in self.parameters()) * 0.0
        return self.run(batch)

    @abstractmethod
    def run(self, batch: TrainBatch) -> Any:
        """What :meth:`DraftTraining.loss` reads, computed on ``batch``."""


def empty_loss(metrics: MetricNames, block: int, device: torch.device) -> LossOutput:
    """The :class:`LossOutput` of a rank that had no block this step (all zeros)."""
    zero = torch.zeros((), device=device)
    pos = torch.zeros(block, device=device)
    return LossOutput(total=zero, blocks=zero, means=dict.fromkeys(metrics.means, zero),
                      sums=dict.fromkeys(metrics.sums, zero),
                      positions={name: (pos, pos) for name in metrics.positions})

"""What every training method whose drafter may propose from a draft vocabulary shares (FR-Spec;
EAGLE-3's ``d2t``/``t2d`` maps, :mod:`specforge.vocab`).

Without ``draft_vocab`` in its config the method's module depends on nothing but the target, so it
is built at once.  With ``draft_vocab = N`` nothing can be built before the data is counted: the
method's needs ask the trainer for the supervised tokens' counts, ``prepare`` makes the N most
frequent the draft vocabulary and builds the module over it.  A saved drafter records the
vocabulary's size and its coverage of the training answers; resuming refuses a checkpoint over
other tokens, since its rows would mean other tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specforge.toolkit.checkpoints import DrafterCheckpointError
from specforge.toolkit.training import DataSummary
from specforge.vocab import DraftVocab, DraftVocabError

__all__ = ["VocabTraining", "check_resumable", "same_vocab"]


def same_vocab(a: DraftVocab | None, b: DraftVocab | None) -> bool:
    """Whether two draft vocabularies (``None``: the whole vocabulary) hold the same tokens."""
    return (a is None) == (b is None) and (a is None or torch.equal(a.ids, b.ids))


def check_resumable(directory: str | Path, loaded: nn.Module, mine: nn.Module) -> None:
    """Refuse to resume ``mine`` from ``loaded`` (read from ``directory``) — networks with a
    ``shape`` and a ``vocab`` — when they differ in either."""
    if loaded.shape != mine.shape or not same_vocab(loaded.vocab, mine.vocab):
        raise DrafterCheckpointError(f"{directory}: the checkpoint ({loaded.shape}) differs from this run "
                                     f"({mine.shape}) in shape or draft vocabulary; resume with the same config "
                                     "and data")


class VocabTraining(ABC):
    """The base of a training method (:class:`~specforge.toolkit.training.DraftTraining`) whose
    ``config`` has a ``draft_vocab`` field (N, or ``None`` for the target's whole vocabulary).

    A subclass sets ``method`` and ``config`` and implements ``_build(vocab)`` (its module over
    ``vocab``), ``needs`` (asking for ``token_counts`` when ``draft_vocab`` is set), ``loss``,
    ``save`` and ``load``.  :meth:`pipeline` serves the drafter alone; a method that trains
    pipeline components with it says so in its own.
    """

    method: str

    def __init__(self, config: Any, target: Any, device: torch.device | str = "cpu") -> None:
        self.settings, self.target, self.device = config, target, device
        self.target_name = str(target.name)
        n = config.draft_vocab
        if n is not None and n >= target.args.vocab_size:
            raise DraftVocabError(f"drafter.draft_vocab: {n} is not smaller than the target's "
                                  f"{target.args.vocab_size} tokens (leave it unset for the whole vocabulary)")
        self.vocab: DraftVocab | None = None
        self.coverage: float | None = None
        self._module: nn.Module | None = None if n is not None else self._build(None)

    @abstractmethod
    def _build(self, vocab: DraftVocab | None) -> nn.Module:
        """The method's trainable module over ``vocab`` (``None``: the whole vocabulary)."""

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError("prepare() the method with the data's token counts first (draft_vocab is set)")
        return self._module

    def prepare(self, summary: DataSummary) -> None:
        """With ``draft_vocab``: the N most frequent supervised tokens of the data become the
        draft vocabulary, and the module is built over them."""
        if self.settings.draft_vocab is None or self._module is not None:
            return
        self.vocab, self.coverage = DraftVocab.from_data(summary.token_counts, self.settings.draft_vocab)
        self._module = self._build(self.vocab)

    def in_draft_vocab(self, labels: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """``labels`` (target ids) as draft ids, −1 for a token outside the draft vocabulary, and
        ``valid`` without those slots: a token the drafter cannot propose is not supervised.
        Without a draft vocabulary both come back unchanged."""
        if self.vocab is None:
            return labels, valid
        inside = self.vocab.t2d.to(labels.device)[labels.clamp_min(0)]
        return self.vocab.to_draft(labels.clamp_min(0)).masked_fill(~inside, -1), valid & inside

    def vocab_record(self) -> dict[str, Any]:
        """What a saved drafter's config records about its draft vocabulary (nothing without one)."""
        return {} if self.vocab is None else {"draft_vocab": self.vocab.size, "train_coverage": self.coverage}

    def drafter_section(self, directory: Path) -> dict[str, Any]:
        """The pipeline's ``drafter`` section that serves the drafter saved in ``directory``."""
        return {"name": self.method, "checkpoint": str(directory)}

    def pipeline(self, directory: Path) -> dict[str, Any]:
        return {"drafter": self.drafter_section(directory), "correction_head": {"name": "none"},
                "confidence": {"name": "constant"}}

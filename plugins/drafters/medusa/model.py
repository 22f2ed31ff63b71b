"""Medusa heads (Cai et al., 2024; docs/design/drafters.md#medusa) and their checkpoint.

Head k (k = 1 … K) reads the target's last hidden state h_t — the final-normed output of its last
layer at the last committed position t — and predicts the token at t + k + 1:

    U_k = W_k · ResBlock_k^n(h_t),    ResBlock(x) = x + SiLU(W x + b),  W, b zero-initialised,

each head with its own residual blocks (distinct modules) and its own output layer W_k,
initialised from the target's LM head (so an untrained head predicts the target's next token).
With the anchor x_0 at t + 1, head k drafts x_k.  ``output="shared"`` uses the target's frozen
LM head for every head instead (K × fewer parameters, less accurate).

With a draft vocabulary the output layers cover its N tokens only (EAGLE-3's d2t/t2d maps,
:class:`specforge.vocab.DraftVocab`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from specforge.toolkit.checkpoints import (
    DrafterCheckpointError,
    read_checkpoint,
    read_vocab,
    vocab_tensors,
    write_checkpoint,
)
from specforge.toolkit.drafting import check_draft_vocab_size
from specforge.vocab import DraftVocab

__all__ = ["FORMAT", "VERSION", "MedusaHeads", "MedusaShape", "load_medusa", "save_medusa"]

FORMAT, VERSION = "specforge-medusa", 1


class MedusaShape(BaseModel):
    """Everything needed to rebuild the heads (stored in the checkpoint's config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(ge=1, description="the target's vocabulary")
    dim: int = Field(ge=1, description="the target's hidden size")
    n_target_layers: int = Field(ge=1, description="the target's depth (its last layer is tapped)")
    norm_eps: float = 1e-6
    heads: int = Field(5, ge=1, description="K: draft positions per round")
    res_layers: int = Field(1, ge=1, description="residual blocks per head")
    output: Literal["own", "shared"] = Field("own", description="each head's own output layer, or the target's LM head")
    draft_vocab_size: int | None = Field(None, ge=1, description="N: output layers over a draft vocabulary")

    @model_validator(mode="after")
    def _check(self) -> MedusaShape:
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        return self

    @classmethod
    def from_model_args(cls, args: Any, **overrides: Any) -> MedusaShape:
        return cls(vocab_size=args.vocab_size, dim=args.dim, n_target_layers=args.n_layers,
                   norm_eps=args.norm_eps, **overrides)

    @property
    def tap_layer(self) -> int:
        return self.n_target_layers - 1


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: a new block starts as the identity (Medusa
    zeroes W only; a zero b as well makes an untrained head exactly the target's LM head)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads over the target's final-normed last hidden state; see the module docstring.

    The target's final norm weight and LM head are held by reference (``bind``), never as
    parameters: they are neither trained nor saved.
    """

    def __init__(self, shape: MedusaShape, seed: int = 0, vocab: DraftVocab | None = None) -> None:
        super().__init__()
        if (vocab is None) != (shape.draft_vocab_size is None) or (vocab is not None and vocab.size != shape.draft_vocab_size):
            raise ValueError("the draft vocabulary must match draft_vocab_size")
        self.shape, self.vocab = shape, vocab
        out = shape.draft_vocab_size or shape.vocab_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(shape.dim) for _ in range(shape.res_layers)))
                                        for _ in range(shape.heads))
            self.out = (nn.ModuleList(nn.Linear(shape.dim, out, bias=False) for _ in range(shape.heads))
                        if shape.output == "own" else None)
        self._norm: Tensor | None = None
        self._lm_head: Tensor | None = None

    def bind(self, norm: Tensor, lm_head: Tensor, init_output: bool = False) -> MedusaHeads:
        """Read the target's final-norm weight ``[d]`` and LM head ``[V, d]`` (by reference);
        ``init_output`` copies the LM head's rows into every own output layer (a new run)."""
        if lm_head.shape != (self.shape.vocab_size, self.shape.dim):
            raise ValueError(f"the target's LM head is {tuple(lm_head.shape)}; the heads were built for "
                             f"({self.shape.vocab_size}, {self.shape.dim})")
        # detached: a target's Parameter assigned here would become one of the heads' own
        # (trained, saved); a detached view shares its storage, nothing is copied.
        self._norm, self._lm_head = norm.detach(), lm_head.detach()
        if init_output and self.out is not None:
            rows = self._rows(lm_head)
            with torch.no_grad():
                for layer in self.out:
                    layer.weight.copy_(rows.to(layer.weight.dtype))
        return self

    def _rows(self, lm_head: Tensor) -> Tensor:
        return lm_head if self.vocab is None else lm_head[self.vocab.ids.to(lm_head.device)]

    def hidden(self, last: Tensor) -> Tensor:
        """``[B, d]`` output of the target's last layer (before its final norm) → ``[B, K, d]``,
        each head's residual-block output."""
        if self._norm is None:
            raise RuntimeError("bind() the heads to the target first")
        h = F.rms_norm(last.to(self.dtype), (last.shape[-1],), self._norm.to(self.dtype), self.shape.norm_eps)
        return torch.stack([block(h) for block in self.blocks], 1)

    def logits(self, hidden: Tensor) -> Tensor:
        """``[B, k, d]`` (the first k ≤ K heads) → ``[B, k, N]`` base logits over the draft
        vocabulary (N = V without one)."""
        if self.out is not None:
            return torch.stack([self.out[k](hidden[:, k]) for k in range(hidden.shape[1])], 1)
        return hidden @ self._rows(self._lm_head).to(hidden.dtype).T

    def forward(self, last: Tensor) -> Tensor:
        return self.logits(self.hidden(last))

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0][0].linear.weight.dtype


def save_medusa(directory: str | Path, heads: MedusaHeads, config: dict[str, Any] | None = None, *,
                target: str | None = None) -> Path:
    """Write ``heads`` (+ free-form drafter ``config``: provenance) as a ``medusa`` checkpoint."""
    meta = {"format": FORMAT, "version": VERSION, "method": "medusa", "target": target,
            "medusa": heads.shape.model_dump(mode="json"), "drafter": config or {}}
    tensors = {f"heads.{k}": v for k, v in heads.state_dict().items()}
    tensors.update(vocab_tensors(heads.vocab))
    return write_checkpoint(directory, meta, tensors)


def load_medusa(directory: str | Path) -> tuple[MedusaHeads, dict[str, Any]]:
    """Read a checkpoint written by :func:`save_medusa`: ``(heads, drafter config)``; the heads
    still need ``bind`` to the target."""
    meta, tensors = read_checkpoint(directory, FORMAT, VERSION, "medusa")
    vocab = read_vocab(tensors, directory)
    try:
        heads = MedusaHeads(MedusaShape.model_validate(meta["medusa"]), vocab=vocab)
        heads.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("heads.")})
    except (KeyError, ValueError, RuntimeError) as exc:  # strict load: a missing or extra tensor
        raise DrafterCheckpointError(f"{directory}: not a usable medusa checkpoint ({exc})") from None
    return heads, meta.get("drafter", {})

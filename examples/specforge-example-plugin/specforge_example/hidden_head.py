"""A third-party *trainable* drafter: one linear layer over the target's last hidden state.

``hidden-head`` drafts one token per round.  The target's last layer has already seen every
committed token before the anchor x_0; its output at the position just before x_0 (h) together
with x_0's embedding (e) is all the drafter reads::

    q(x_1) = warp( LM_head( RMSNorm( W · [h ; e] ) ) )

W (2d → d) and the norm's weight are the only parameters; the embedding, the final norm's scale
and the LM head are the target's, frozen.  It is the smallest drafter that shows every part of
specforge's plug-in contract for drafters: drafting with the law it samples from (the engine
side), and training through ``specforge train`` (the ``training=`` registration: the module, the
loss over a packed batch, what it needs from the data pipeline and its checkpoint format).

It imports from specforge only the contracts and the plug-in authors' toolkit
(:mod:`specforge.toolkit`): the training contract, and the checkpoint directory every shipped
drafter uses — ``config.json`` (format, method, target, shape, the weights' sha256) and
``model.safetensors`` (W and the norm), checked on every load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from specforge.components import DraftBlock, DraftContext
from specforge.sampling import sample_with_uniform, warp
from specforge.toolkit.checkpoints import DrafterCheckpointError, read_checkpoint, write_checkpoint
from specforge.toolkit.drafting import LastRows, empty_block, open_round
from specforge.toolkit.training import BatchModule, DataNeeds, LossOutput, MetricNames, TrainBatch

METHOD = "hidden-head"
VERSION = 1  # of the checkpoint's layout: a loader refuses any other


class HiddenHead(nn.Module):
    """``[N, d]`` last-layer states and ``[N]`` anchor ids → ``[N, V]`` logits of the next token."""

    def __init__(self, dim: int, eps: float, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter(torch.randn(dim, 2 * dim, generator=gen) * (2 * dim) ** -0.5)
        self.norm = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.frozen: dict[str, Tensor] = {}  # the target's embedding, final norm and LM head

    def bind(self, target: Any) -> HiddenHead:
        rt = target.runtime
        self.frozen = {"embed": rt.embed.detach(), "final_norm": rt.norm.detach(), "lm_head": rt.lm_head.detach()}
        return self

    def forward(self, hidden: Tensor, anchor: Tensor) -> Tensor:
        f = self.frozen
        h = F.rms_norm(hidden.float(), (hidden.shape[-1],), f["final_norm"].float(), self.eps)
        e = F.embedding(anchor, f["embed"]).float()
        z = torch.cat([h, e], dim=-1) @ self.proj.t()
        z = F.rms_norm(z, (z.shape[-1],), self.norm, self.eps)
        return z @ f["lm_head"].float().t()


def _last_layer(target: Any) -> int:
    return int(target.args.n_layers) - 1


# -- the engine side -----------------------------------------------------------------------------


class HiddenHeadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str | None = Field(None, description="directory written by `specforge train`; None: random init")
    seed: int = Field(0, description="seed of the random initialisation")


class HiddenHeadDrafter:
    """Drafts x_1 from the last committed position's last-layer state and the anchor."""

    gamma = 1

    def __init__(self, config: HiddenHeadConfig | None = None) -> None:
        self.config = config or HiddenHeadConfig()
        self.feature_layers: tuple[int, ...] = ()
        self.head: HiddenHead | None = None
        self._last = LastRows()  # each request's newest last-layer state

    def bind(self, target: Any) -> None:
        layer = _last_layer(target)
        self.feature_layers = (layer,)
        self.head = HiddenHead(target.args.dim, target.args.norm_eps, self.config.seed).bind(target)
        if self.config.checkpoint is not None:
            load_checkpoint(self.head, Path(self.config.checkpoint), target)
        self.head.eval()

    @torch.inference_mode()
    def draft(self, ctx: DraftContext) -> DraftBlock:
        if self.head is None:
            raise RuntimeError("bind() the drafter to a target first")
        f = ctx.features
        if f is not None:
            self._last.update(ctx.request_ids, f.cu_seqlens, f.states[:, 0])
        # One uniform per request and round, from its own generator; one token unless max_tokens is 0.
        u, lengths, g = open_round(ctx, self.gamma)
        if g == 0:
            return empty_block(ctx)
        hidden = self._last.gather(ctx.request_ids, (self.head.proj.shape[0],), torch.float32)
        logits = self.head(hidden, ctx.anchor)
        probs = warp(logits, ctx.sampling)  # the exact law the token is drawn from
        tokens = sample_with_uniform(probs, u[:, 0])
        return DraftBlock(tokens=tokens[:, None], lengths=lengths, probs=probs[:, None], logits=logits[:, None],
                          anchor=ctx.anchor)

    def release(self, request_id: int) -> None:
        self._last.release(request_id)


# -- the training side ---------------------------------------------------------------------------


class HiddenHeadTrainConfig(BaseModel):
    """The ``drafter.*`` keys of ``specforge train`` for ``hidden-head``."""

    model_config = ConfigDict(extra="forbid")
    seed: int = Field(0, description="seed of the initialisation")
    distill: float = Field(1.0, ge=0, le=1, description="weight of the soft CE against the target's law "
                                                        "(the rest: CE against the data's token)")


class _Module(BatchModule):
    """The trainable part, called on a whole :class:`TrainBatch` (``BatchModule`` answers for a
    rank that drew no block this step, so DDP can wrap it)."""

    def __init__(self, head: HiddenHead) -> None:
        super().__init__()
        self.head = head

    def run(self, batch: TrainBatch) -> Tensor:
        # The state at the position before each anchor; an anchor at position 0 has none (zeros).
        hidden = batch.before_anchor()
        hidden = torch.where((batch.anchor_pos > 0)[:, None], hidden, torch.zeros_like(hidden))
        return self.head(hidden, batch.anchor_ids)


class HiddenHeadTraining:
    """``specforge train drafter.name=hidden-head``: soft cross-entropy against the target's law."""

    method = METHOD
    config = HiddenHeadTrainConfig
    metrics = MetricNames(means=("ce", "tau"), positions=("accept_rate",))

    def __init__(self, config: HiddenHeadTrainConfig, target: Any, device: Any = "cpu") -> None:
        self.settings = config
        self.target = target
        self.head = HiddenHead(target.args.dim, target.args.norm_eps, config.seed).bind(target)
        self.module = _Module(self.head).to(device)

    def needs(self) -> DataNeeds:
        return DataNeeds(layers=(_last_layer(self.target),), block=1, mask_token_id=0, teacher=True)

    def loss(self, outputs: Tensor, batch: TrainBatch) -> LossOutput:
        valid = batch.valid[:, 0]
        blocks = valid.sum()
        logp = torch.log_softmax(outputs.float(), dim=-1)[valid]
        p_t = batch.p_t[:, 0][valid]
        hard = -logp.gather(-1, batch.labels[:, 0][valid][:, None]).squeeze(-1)
        soft = -(p_t * logp).sum(-1)
        w = self.settings.distill
        n = blocks.clamp_min(1)
        ce = ((1 - w) * hard + w * soft).sum() / n
        # What verification would accept: 1 − TV(q, p) per block (paper eq. 8).
        accept = (1 - 0.5 * (logp.exp() - p_t).abs().sum(-1)).detach()
        return LossOutput(total=ce, blocks=blocks, means={"ce": ce.detach(), "tau": 1 + accept.sum() / n},
                          positions={"accept_rate": (accept.sum()[None], blocks.float()[None])})

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        meta = {"format": METHOD, "version": VERSION, "method": METHOD, "target": str(self.target.name),
                "dim": int(self.target.args.dim), "vocab_size": int(self.target.args.vocab_size),
                "layer": _last_layer(self.target), **provenance}
        write_checkpoint(directory, meta, {"proj": self.head.proj, "norm": self.head.norm})

    def load(self, directory: Path) -> None:
        load_checkpoint(self.head, directory, self.target)

    def pipeline(self, directory: Path) -> dict[str, Any]:
        return {"drafter": {"name": METHOD, "checkpoint": str(directory)}}


def load_checkpoint(head: HiddenHead, directory: Path, target: Any) -> None:
    """Weights of a ``hidden-head`` checkpoint, refused when damaged (the toolkit checks the
    weights' hash), written by another method, or for another shape."""
    meta, tensors = read_checkpoint(directory, METHOD, VERSION, METHOD)
    if meta.get("dim") != target.args.dim or meta.get("vocab_size") != target.args.vocab_size:
        raise DrafterCheckpointError(f"{directory}: trained for a target with dim={meta.get('dim')}, "
                                     f"vocab_size={meta.get('vocab_size')}; this one has dim={target.args.dim}, "
                                     f"vocab_size={target.args.vocab_size}")
    with torch.no_grad():
        head.proj.copy_(tensors["proj"])
        head.norm.copy_(tensors["norm"])

"""The layers a drafter network over the target's features is built from, in the target's conventions
(docs/design/drafters.md): its RMSNorm, its rotate-half RoPE, grouped-query attention over an
explicit mask, its gated MLP, and the target's frozen tensors the drafter reads by reference.

A draft layer copies the *shape* of a target layer, so these follow the runtime's formulas
exactly; they are plain modules and functions (no packing, no compile op), trainable as written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specforge.toolkit.drafting import TargetShape

__all__ = ["DraftLayerBase", "DraftNetwork", "RMSNorm", "SharedWeights", "attend", "gated_mlp", "rope", "rotate"]


@dataclass(frozen=True)
class SharedWeights:
    """The target's frozen tensors the drafter reads (by reference, never copied)."""

    embed: Tensor  # [V, d]
    lm_head: Tensor  # [V, d]
    embed_scale: float = 1.0  # Gemma scales embeddings by sqrt(d)
    inv_freq: Tensor | None = None  # the target's RoPE frequencies (its RoPE variant), if shared
    rope_scaling: float = 1.0
    # The target's own LM-head projection (pre-packed on CPU), used when no gradient is needed;
    # training goes through F.linear on ``lm_head`` so autograd can see it.
    project: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def from_target(cls, runtime: nn.Module, device: torch.device | str | None = None) -> SharedWeights:
        """From a target's ``runtime`` (its embedding, LM head, RoPE and packed LM-head projection).

        With a ``device`` other than the CPU (training on an accelerator) the tensors are copies on
        it, without the packed projection, which is a CPU layout.
        """
        shared = cls(embed=runtime.embed, lm_head=runtime.lm_head, embed_scale=runtime.args.embed_scale,
                     inv_freq=runtime.inv_freq, rope_scaling=runtime.rope_scaling,
                     project=getattr(runtime, "head_projection", None))
        if device is None or torch.device(device).type == "cpu":
            return shared
        return cls(runtime.embed.to(device), runtime.lm_head.to(device), shared.embed_scale,
                   None if runtime.inv_freq is None else runtime.inv_freq.to(device), shared.rope_scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``[B, T]`` positions → cos, sin ``[B, T, 1, head_dim]`` (rotate-half layout, as the target)."""
    freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[..., None, :], (emb.sin() * scaling).to(dtype)[..., None, :]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention: ``q [B, T, H, hd]`` over ``k``/``v`` ``[B, S, KV, hd]`` with a
    boolean ``mask [B, T, S]`` (True = attend) → ``[B, T, H·hd]``."""
    b, t, h, hd = q.shape
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    rep = h // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=hd ** -0.5)
    return o.transpose(1, 2).reshape(b, t, h * hd)


def gated_mlp(x: Tensor, w13: nn.Module, w2: nn.Module, activation: str) -> Tensor:
    """The target-shaped MLP: ``w2(act(gate) ⊙ up)`` with ``(gate, up) = w13(x)``."""
    gate, up = w13(x).chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return w2(act * up)


class DraftLayerBase(nn.Module):
    """What every draft decoder layer of the target's shape ends with, in the target's names (so
    weights map one to one onto a serving stack's): the attention's output projection ``wo``, the
    optional per-head ``q_norm``/``k_norm`` and the pre-norm gated MLP (``mlp_norm``, ``w13``, ``w2``).

    A subclass creates its input norms and q/k/v projections, then calls :meth:`add_output`: a
    seeded initialisation follows the order the parameters are created in.
    """

    def add_output(self, shape: TargetShape, qk_norm: bool) -> None:
        d, hd, eps = shape.dim, shape.head_dim, shape.norm_eps
        self.wo = nn.Linear(shape.n_heads * hd, d, bias=False)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
        self.mlp_norm = RMSNorm(d, eps)
        self.w13 = nn.Linear(d, 2 * shape.intermediate_size, bias=False)
        self.w2 = nn.Linear(shape.intermediate_size, d, bias=False)
        self.activation = shape.activation

    @torch.no_grad()
    def copy_output_from(self, target_layer: nn.Module) -> None:
        """Take the output half of a target layer (``wo``, ``q_norm``/``k_norm``, ``mlp_norm``,
        ``w13``, ``w2``) as this layer's starting weights: a draft layer of the target's shape can
        start from what the target already computes instead of from noise (the recipe study in
        docs/shipped-drafter.md measures whether that pays).  ``target_layer`` is a layer of the
        runtime's :class:`~specforge.runtime.torch.model.Transformer`, whose tensors are read, not shared.
        q/k norms a target's layers lack (Llama, SmolLM2) stay where they are (a fresh layer's: one)."""
        pairs = [(self.wo.weight, target_layer.wo), (self.mlp_norm.weight, target_layer.mlp_norm),
                 (self.w13.weight, target_layer.w13), (self.w2.weight, target_layer.w2)]
        if hasattr(self, "q_norm") and hasattr(target_layer, "q_norm"):
            pairs += [(self.q_norm.weight, target_layer.q_norm), (self.k_norm.weight, target_layer.k_norm)]
        for mine, theirs in pairs:
            if mine.shape != theirs.shape:
                raise ValueError(f"a target layer's tensor of shape {tuple(theirs.shape)} cannot start a draft "
                                 f"layer's of shape {tuple(mine.shape)}")
            mine.copy_(theirs.detach().to(mine.dtype))

    def finish(self, residual: Tensor, attended: Tensor) -> Tensor:
        """``residual + wo(attended)``, then the MLP block: the layer's output."""
        x = residual + self.wo(attended)
        return x + gated_mlp(self.mlp_norm(x), self.w13, self.w2, self.activation)


class DraftNetwork(nn.Module):
    """What a drafter network over fused target features shares: it embeds tokens with the
    target's frozen embedding and rotates with the target's RoPE, both read through the bound
    :class:`SharedWeights` (never parameters: neither trained nor saved).

    A subclass fuses the tapped layers through its ``fc`` layer, whose dtype is the network's, and
    calls :meth:`own_rope` in its constructor: those frequencies serve until a target is bound.
    """

    shared: SharedWeights | None

    def own_rope(self, head_dim: int, theta: float) -> None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def bound(self) -> SharedWeights:
        """The bound target's tensors (an error before ``bind``)."""
        if self.shared is None:
            raise RuntimeError(f"bind() the {type(self).__name__} to the target's SharedWeights first")
        return self.shared

    def embed(self, ids: Tensor) -> Tensor:
        """``[...]`` token ids → ``[..., d]`` in the network's dtype (a negative id reads row 0)."""
        sh = self.bound()
        x = F.embedding(ids.clamp_min(0), sh.embed).to(self.dtype)
        return x * sh.embed_scale if sh.embed_scale != 1.0 else x

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        sh = self.shared
        if sh is not None and sh.inv_freq is not None:
            return rope(positions, sh.inv_freq, sh.rope_scaling, self.dtype)
        return rope(positions, self.inv_freq, 1.0, self.dtype)

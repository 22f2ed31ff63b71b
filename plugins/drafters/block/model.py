"""The parallel block-drafter backbone of DSpark and DFlash (paper §2.2, §3.1; docs/design/drafters.md).

One forward pass drafts a whole block.  Target features of m tapped layers are fused into a
context ``ctx = RMSNorm(W_c [H(l1);…;H(lm)])``; every draft layer prepends its own K/V
projections of ``ctx`` to the block's keys/values, while queries come from the block tokens only.
A block attends bidirectionally inside itself and to every context position strictly before its
anchor (the anchor itself has no target features yet: the target has not consumed it).

The embedding and LM head are the target's, frozen and *shared* (held by reference in
:class:`SharedWeights`, never registered as parameters, so they are neither trained nor saved).
Attention is plain SDPA with an explicit boolean mask: small blocks, no flex_attention needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specforge.vocab import DraftVocab
from specforge_plugins.drafters.block.config import BlockDrafterConfig

__all__ = ["MASK", "BlockBackbone", "DraftLayer", "SharedWeights", "attend", "block_attention_mask", "gated_mlp"]

#: Sentinel id of a MASK slot when the mask embedding is learned (``mask_token_id=None``).
MASK = -1


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
    def from_target(cls, target: nn.Module) -> SharedWeights:
        """From a :class:`specforge.target.model.Transformer`."""
        return cls(embed=target.embed, lm_head=target.lm_head, embed_scale=target.args.embed_scale,
                   inv_freq=target.inv_freq, rope_scaling=target.rope_scaling,
                   project=getattr(target, "head_projection", None))


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


def block_attention_mask(anchor_pos: Tensor, block_len: int, ctx_positions: Tensor,
                         ctx_valid: Tensor | None = None) -> Tensor:
    """``[B, S, C+S]`` boolean mask (True = attend) over ``[context ; block]`` keys.

    Context key c is visible to every slot of block b iff it is valid and its position is
    strictly before the anchor's; block keys are all visible (bidirectional inside the block).
    """
    ctx_ok = ctx_positions < anchor_pos[:, None]
    if ctx_valid is not None:
        ctx_ok = ctx_ok & ctx_valid
    b, c = ctx_ok.shape
    inside = torch.ones(b, block_len, block_len, dtype=torch.bool, device=ctx_ok.device)
    return torch.cat([ctx_ok[:, None, :].expand(b, block_len, c), inside], dim=-1)


class DraftLayer(nn.Module):
    """A pre-norm decoder layer of the target's shape whose keys/values start with the context."""

    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.c = c
        d, hd = c.dim, c.head_dim
        self.attn_norm = RMSNorm(d, c.norm_eps)
        self.wq = nn.Linear(d, c.n_heads * hd, bias=False)
        self.wkv = nn.Linear(d, 2 * c.n_kv_heads * hd, bias=False)  # shared by context and block
        self.wo = nn.Linear(c.n_heads * hd, d, bias=False)
        if c.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, c.norm_eps), RMSNorm(hd, c.norm_eps)
        self.mlp_norm = RMSNorm(d, c.norm_eps)
        self.w13 = nn.Linear(d, 2 * c.intermediate_size, bias=False)
        self.w2 = nn.Linear(c.intermediate_size, d, bias=False)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, T, d]`` → rotated K and V ``[B, T, KV, hd]``; used for the context *and* the block,
        so a draft KV cache can hold the context part across rounds."""
        b, t, _ = x.shape
        k, v = self.wkv(x).view(b, t, 2, self.c.n_kv_heads, self.c.head_dim).unbind(2)
        if self.c.qk_norm:
            k = self.k_norm(k)
        return rotate(k, cos, sin), v

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        c = self.c
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, c.n_heads, c.head_dim)
        if c.qk_norm:
            q = self.q_norm(q)
        q = rotate(q, cos, sin)
        k_blk, v_blk = self.kv(h, cos, sin)
        # K = [W_K ctx ; W_K h_blk], V likewise (paper eq. 3); heads first for SDPA.
        o = attend(q, torch.cat([ctx_k, k_blk], dim=1), torch.cat([ctx_v, v_blk], dim=1), mask)
        x = x + self.wo(o)
        return x + gated_mlp(self.mlp_norm(x), self.w13, self.w2, c.activation)


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


class PackedLinear(nn.Module):
    """An inference-only stand-in for a bias-free ``nn.Linear`` whose weight runs through the
    target's :class:`~specforge.target.model.Projection` (oneDNN's blocked layout for bf16/fp16
    on CPU, ``F.linear`` elsewhere): the drafter's small matmuls, like the target's, are faster
    packed than re-packed on every call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from specforge.target.model import Projection

        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.projection = Projection(self.weight.data, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return self.projection(x.to(self.weight.dtype))


class BlockBackbone(nn.Module):
    """Feature fusion + draft layers + final norm; logits through the shared LM head."""

    def __init__(self, config: BlockDrafterConfig, shared: SharedWeights | None = None, seed: int = 0,
                 vocab: DraftVocab | None = None) -> None:
        super().__init__()
        c = self.config = config
        if (vocab is None) != (c.draft_vocab_size is None) or (vocab is not None and vocab.size != c.draft_vocab_size):
            raise ValueError(f"draft_vocab_size={c.draft_vocab_size} needs a draft vocabulary of that size "
                             f"(got {None if vocab is None else vocab.size})")
        if vocab is not None:
            vocab.check_target(c.vocab_size, "block drafter")
        self.vocab = vocab
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # seeded init without touching the caller's RNG stream
            self.fc = nn.Linear(len(c.tap_layers) * c.dim, c.dim, bias=False)  # W_c, no bias
            self.ctx_norm = RMSNorm(c.dim, c.norm_eps)
            self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.draft_layers))
            self.norm = RMSNorm(c.dim, c.norm_eps)
            # Learned MASK vector unless a vocabulary id is designated: the shared embedding is
            # frozen, so a learned vector is the only trainable way to give MASK its own meaning.
            self.mask_embed = nn.Parameter(0.02 * torch.randn(c.dim)) if c.mask_token_id is None else None
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # A plain dataclass: the target's tensors never become parameters.
        self.shared = None if shared is None else self._restricted(shared)

    def bind(self, shared: SharedWeights) -> BlockBackbone:
        self.shared = self._restricted(shared)
        return self

    def _restricted(self, shared: SharedWeights) -> SharedWeights:
        """With a draft vocabulary the base logits come from the LM head's rows of its N tokens
        only (a frozen copy, packed like the target's own head when that one is)."""
        if self.vocab is None:
            return shared
        from specforge.target.model import Projection

        head = shared.lm_head.detach()[self.vocab.ids.to(shared.lm_head.device)].contiguous()
        return replace(shared, lm_head=head, project=Projection(head) if shared.project is not None else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def pack(self) -> BlockBackbone:
        """For inference: every linear layer through a :class:`PackedLinear` (no training after)."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child))
        return self

    def _shared(self) -> SharedWeights:
        if self.shared is None:
            raise RuntimeError("bind() the backbone to the target's SharedWeights first")
        return self.shared

    def make_block(self, anchor: Tensor) -> Tensor:
        """``[B]`` anchors → ``[B, S]`` input ids ``[anchor, MASK, …]`` (S = γ or γ+1)."""
        c = self.config
        fill = MASK if c.mask_token_id is None else c.mask_token_id
        ids = torch.full((anchor.shape[0], c.block_len), fill, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        return ids

    def embed(self, ids: Tensor) -> Tensor:
        sh = self._shared()
        x = F.embedding(ids.clamp_min(0), sh.embed).to(self.dtype)
        if sh.embed_scale != 1.0:
            x = x * sh.embed_scale
        if self.mask_embed is not None:
            x = torch.where((ids == MASK)[..., None], self.mask_embed.to(x.dtype), x)
        return x

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        sh = self.shared
        if sh is not None and sh.inv_freq is not None:
            return rope(positions, sh.inv_freq, sh.rope_scaling, self.dtype)
        return rope(positions, self.inv_freq, 1.0, self.dtype)

    def fuse(self, features: Tensor) -> Tensor:
        """``[N, C, m·d]`` concatenated tapped target states → ``ctx [N, C, d]``."""
        return self.ctx_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context K/V ``[N, C, KV, hd]`` of ``features`` at ``positions [N, C]``."""
        ctx = self.fuse(features)
        cos, sin = self.rope(positions)
        return [layer.kv(ctx, cos, sin) for layer in self.layers]

    def logits(self, hidden: Tensor) -> Tensor:
        """Base logits U through the frozen shared LM head, float32 (as the target's)."""
        shared = self._shared()
        head = shared.lm_head
        if shared.project is not None and not torch.is_grad_enabled():
            return shared.project(hidden.to(head.dtype)).float()
        return F.linear(hidden.to(head.dtype), head).float()

    def forward(self, block_ids: Tensor, ctx_features: Tensor, anchor_pos: Tensor,
                ctx_positions: Tensor | None = None, ctx_valid: Tensor | None = None,
                ctx_index: Tensor | None = None, with_logits: bool = True) -> tuple[Tensor, Tensor | None]:
        """Draft B blocks in one pass.

        Args:
            block_ids: ``[B, S]`` from :meth:`make_block` (or teacher-built: same layout).
            ctx_features: ``[N, C, m·d]`` tapped target states of N sequences (N = B unless
                ``ctx_index`` maps blocks to sequences, so many anchors share one fusion).
            anchor_pos: ``[B]`` absolute position of each block's anchor; slot j sits at
                ``anchor_pos + j``.
            ctx_positions: ``[N, C]`` absolute positions of the context tokens (default 0..C−1).
            ctx_valid: ``[N, C]`` False for padding.
            ctx_index: ``[B]`` sequence of each block, or None (block b uses sequence b).

        Returns:
            ``hidden [B, P, d]`` (final-normed) and base logits ``U [B, P, V]`` (float32) of the
            P = S − first_prediction prediction slots: output p predicts x_{p+1}.
        """
        n, c_len, _ = ctx_features.shape
        if ctx_positions is None:
            ctx_positions = torch.arange(c_len, device=ctx_features.device).expand(n, c_len)
        kv = self.context_kv(ctx_features, ctx_positions)
        hidden = self.draft(block_ids, anchor_pos, kv, ctx_positions, ctx_valid, ctx_index)
        return hidden, (self.logits(hidden) if with_logits else None)

    def draft(self, block_ids: Tensor, anchor_pos: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
              ctx_positions: Tensor, ctx_valid: Tensor | None = None,
              ctx_index: Tensor | None = None) -> Tensor:
        """The block pass given precomputed context K/V (what a draft KV cache would hold)."""
        b, s = block_ids.shape
        if ctx_index is not None:
            ctx_positions = ctx_positions[ctx_index]
            ctx_valid = None if ctx_valid is None else ctx_valid[ctx_index]
            ctx_kv = [(k[ctx_index], v[ctx_index]) for k, v in ctx_kv]
        mask = block_attention_mask(anchor_pos, s, ctx_positions, ctx_valid)
        cos, sin = self.rope(anchor_pos[:, None] + torch.arange(s, device=block_ids.device))
        x = self.embed(block_ids)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x[:, self.config.first_prediction:])

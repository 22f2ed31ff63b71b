"""The parallel block-drafter backbone of DSpark and DFlash (paper §2.2, §3.1; docs/design/drafters.md).

One forward pass drafts a whole block.  Target features of m tapped layers are fused into a
context ``ctx = RMSNorm(W_c [H(l1);…;H(lm)])``; every draft layer prepends its own K/V
projections of ``ctx`` to the block's keys/values, while queries come from the block tokens only.
A block attends bidirectionally inside itself and to every context position strictly before its
anchor (the anchor itself has no target features yet: the target has not consumed it).

The embedding and LM head are the target's, frozen and *shared* (held by reference in
:class:`~specforge.toolkit.layers.SharedWeights`, never registered as parameters, so they are
neither trained nor saved).
Attention is plain SDPA with an explicit boolean mask: small blocks, no flex_attention needed.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specforge.toolkit.layers import DraftLayerBase, DraftNetwork, RMSNorm, SharedWeights, attend, rotate
from specforge.toolkit.projection import Projection
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.block.config import BlockDrafterConfig

__all__ = ["MASK", "BlockBackbone", "DraftLayer", "PackedLinear", "block_attention_mask"]

#: Sentinel id of a MASK slot when the mask embedding is learned (``mask_token_id=None``).
MASK = -1


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


class DraftLayer(DraftLayerBase):
    """A pre-norm decoder layer of the target's shape whose keys/values start with the context."""

    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.c = c
        d, hd = c.dim, c.head_dim
        self.attn_norm = RMSNorm(d, c.norm_eps)
        self.wq = nn.Linear(d, c.n_heads * hd, bias=False)
        self.wkv = nn.Linear(d, 2 * c.n_kv_heads * hd, bias=False)  # shared by context and block
        self.add_output(c, c.qk_norm)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, T, d]`` → rotated K and V ``[B, T, KV, hd]``; used for the context *and* the block,
        so a draft KV cache can hold the context part across rounds."""
        b, t, _ = x.shape
        k, v = self.wkv(x).view(b, t, 2, self.c.n_kv_heads, self.c.head_dim).unbind(2)
        if self.c.qk_norm:
            k = self.k_norm(k)
        return rotate(k, cos, sin), v

    @torch.no_grad()
    def copy_from(self, target_layer: nn.Module) -> None:
        """Start from a target layer's weights: its input norm, its fused q/k/v projection split
        into ``wq`` and ``wkv`` (a q/k/v bias, which draft layers do not have, is left out) and
        its output half (:meth:`~specforge.toolkit.layers.DraftLayerBase.copy_output_from`); q/k
        norms the target's layers lack (Llama, SmolLM2) stay at one."""
        q_size = self.wq.weight.shape[0]
        wqkv = target_layer.wqkv.detach()
        if wqkv.shape[0] != q_size + self.wkv.weight.shape[0]:
            raise ValueError(f"a target layer with q/k/v rows {wqkv.shape[0]} cannot start a draft layer with "
                             f"{q_size + self.wkv.weight.shape[0]}")
        self.attn_norm.weight.copy_(target_layer.attn_norm.detach().float())
        self.wq.weight.copy_(wqkv[:q_size].float())
        self.wkv.weight.copy_(wqkv[q_size:].float())
        self.copy_output_from(target_layer)

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
        return self.finish(x, o)


class PackedLinear(nn.Module):
    """An inference-only stand-in for a bias-free ``nn.Linear`` whose weight runs through a
    :class:`~specforge.toolkit.projection.Projection` (oneDNN's blocked layout for bf16/fp16
    on CPU, ``F.linear`` elsewhere): the drafter's small matmuls, like the target's, are faster
    packed than re-packed on every call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.projection = Projection(self.weight.data, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return self.projection(x.to(self.weight.dtype))


class BlockBackbone(DraftNetwork):
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
        self.own_rope(c.head_dim, c.rope_theta)
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
        head = shared.lm_head.detach()[self.vocab.ids.to(shared.lm_head.device)].contiguous()
        return replace(shared, lm_head=head, project=Projection(head) if shared.project is not None else None)

    def pack(self) -> BlockBackbone:
        """For inference: every linear layer through a :class:`PackedLinear` (no training after)."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child))
        return self

    def make_block(self, anchor: Tensor) -> Tensor:
        """``[B]`` anchors → ``[B, S]`` input ids ``[anchor, MASK, …]`` (S = γ or γ+1)."""
        c = self.config
        fill = MASK if c.mask_token_id is None else c.mask_token_id
        ids = torch.full((anchor.shape[0], c.block_len), fill, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        return ids

    def embed(self, ids: Tensor) -> Tensor:
        x = super().embed(ids)
        if self.mask_embed is not None:
            x = torch.where((ids == MASK)[..., None], self.mask_embed.to(x.dtype), x)
        return x

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
        shared = self.bound()
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

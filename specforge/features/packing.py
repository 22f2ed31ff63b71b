"""Anchor packing: many draft blocks of a batch in one dense token dimension (docs/training.md).

Training a block drafter samples *anchors* — positions a of a sequence — and builds one block per
anchor: DSpark's input is ``[x_a, MASK × (γ−1)]`` at positions a … a+γ−1, and slot j predicts token
a+1+j (the anchor slot is the first prediction; ``label_shift`` = 1).  All blocks of a batch are
laid end to end in one "packed" dimension of ``Tb`` tokens, without padding; the target features
of the batch's sequences lie end to end in a context dimension of ``Tc`` rows.

Attention rule (the drafter's, docs/design/drafters.md): a block token sees the context of its own
sequence strictly before its anchor (the anchor's own target features do not exist yet when it is
drafted) and every token of its own block (bidirectional).  Both sets are contiguous, so the exact
token-level format is four integers per packed token::

    context rows  ctx_start[t] <= c < ctx_end[t]     (c indexes the Tc context rows)
    block rows    blk_start[t] <= k < blk_end[t]     (k indexes the Tb packed rows)

:meth:`PackedBlocks.dense_mask` materialises it as a boolean ``[Tb, Tc + Tb]`` mask whose columns
are the context rows, then the packed block rows — the order of ``K = [W_K ctx ; W_K h_blk]``.
:func:`flex_block_mask` turns the same ranges into a flex_attention ``BlockMask`` where available.

Supervision: slot j is valid iff every slot up to j predicts a token inside the sequence and inside
the loss mask (the *contiguous valid prefix*); labels elsewhere are ``ignore_index``.  Anchors are
drawn among positions a with ``loss_mask[a] = loss_mask[a+1] = 1`` and a+1 inside the sequence,
so every block has at least one valid slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specforge.features.compute import as_pair

__all__ = ["PackedBlocks", "anchor_candidates", "flex_block_mask", "pack_blocks", "sample_anchors"]


@dataclass(frozen=True)
class PackedBlocks:
    # per packed token [Tb]
    input_ids: Tensor  # anchor id at slot 0, mask_token_id at the other slots
    positions: Tensor  # a + j: the position ids (RoPE) of the block tokens
    labels: Tensor  # ids[a + label_shift + j] where valid, ignore_index elsewhere
    valid: Tensor  # bool, the contiguous valid prefix of each block
    slot: Tensor  # j, 0-based slot inside the block (loss weight w_k uses k = j + 1)
    block: Tensor  # index of the token's block
    prev_ids: Tensor  # the token before the label, x_{k-1} (x_0 = anchor); 0 where not valid
    teacher_rows: Tensor  # context row whose last hidden state gives p_t for this slot (clamped)
    ctx_start: Tensor
    ctx_end: Tensor
    blk_start: Tensor
    blk_end: Tensor
    # per block [B]
    block_seq: Tensor  # sequence of each block
    block_anchor: Tensor  # anchor position of each block (inside its sequence)
    block_cu: Tensor  # [B+1] block boundaries in the packed dimension
    ctx_cu: Tensor  # [S+1] sequence boundaries in the context dimension
    num_context: int  # Tc

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.block_seq.shape[0])

    def dense_mask(self) -> Tensor:
        """``[Tb, Tc + Tb]`` bool, True where a block token may attend (context cols first)."""
        c = torch.arange(self.num_context, device=self.ctx_start.device)
        k = torch.arange(self.num_tokens, device=self.ctx_start.device)
        ctx = (c[None] >= self.ctx_start[:, None]) & (c[None] < self.ctx_end[:, None])
        blk = (k[None] >= self.blk_start[:, None]) & (k[None] < self.blk_end[:, None])
        return torch.cat([ctx, blk], dim=1)


def anchor_candidates(loss_mask: Tensor) -> Tensor:
    """Positions a with ``mask[a] = mask[a+1] = 1``: an anchor inside the loss mask whose first
    prediction (a+1) is inside the sequence and the loss mask."""
    m = torch.as_tensor(loss_mask).reshape(-1).bool()
    return torch.nonzero(m[:-1] & m[1:]).reshape(-1)


def sample_anchors(loss_mask: Tensor, max_anchors: int, generator: torch.Generator | None = None) -> Tensor:
    """Up to ``max_anchors`` distinct candidate positions, uniformly without replacement, sorted.

    The draw uses ``generator`` only, so a seeded generator reproduces a run's anchors exactly."""
    cand = anchor_candidates(loss_mask)
    if len(cand) > max_anchors:
        cand = cand[torch.randperm(len(cand), generator=generator)[:max_anchors]]
    return torch.sort(cand).values


def pack_blocks(
    sequences: Sequence[Any],
    block_size: int,
    *,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
    anchors: Sequence[Tensor | Sequence[int]] | None = None,
    mask_token_id: int = 0,
    label_shift: int = 1,
    trim: bool = False,
    ignore_index: int = -100,
) -> PackedBlocks:
    """Sample anchors (or take ``anchors``, one list per sequence) and pack their blocks.

    ``sequences``: (ids, loss_mask) pairs, TokenizedChat or SequenceFeatures, in context order.
    ``trim=False`` keeps every block at ``block_size`` tokens (what the drafter sees at inference;
    the slots past the valid prefix are inputs without a loss); ``trim=True`` cuts each block to
    its valid prefix, saving compute on blocks that hit a sequence end or a mask boundary.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    pairs = [as_pair(s) for s in sequences]
    if anchors is None:
        if max_anchors is None:
            raise ValueError("give max_anchors (to sample anchors) or explicit anchors")
        anchors = [sample_anchors(mask, max_anchors, generator) for _, mask in pairs]
    elif len(anchors) != len(pairs):
        raise ValueError(f"{len(anchors)} anchor lists for {len(pairs)} sequences")
    anchors = [torch.as_tensor(a, dtype=torch.long).reshape(-1) for a in anchors]
    for s, ((_, mask), a) in enumerate(zip(pairs, anchors)):
        bad = a[~torch.isin(a, anchor_candidates(mask))]
        if len(bad):
            raise ValueError(f"sequence {s}: anchors {bad.tolist()} are not inside the loss mask with "
                             f"a supervised next token")

    lengths = torch.tensor([len(ids) for ids, _ in pairs], dtype=torch.long)
    ctx_cu = torch.zeros(len(pairs) + 1, dtype=torch.long)
    ctx_cu[1:] = torch.cumsum(lengths, 0)
    flat_ids = torch.cat([ids for ids, _ in pairs]) if pairs else torch.zeros(0, dtype=torch.long)
    flat_mask = torch.cat([m for _, m in pairs]).bool() if pairs else torch.zeros(0, dtype=torch.bool)
    block_seq = torch.repeat_interleave(torch.arange(len(pairs)), torch.tensor([len(a) for a in anchors], dtype=torch.long))
    block_anchor = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.long)

    # [B, γ] grid of every slot, then the kept tokens flattened into the packed dimension.
    j = torch.arange(block_size)
    target_pos = block_anchor[:, None] + label_shift + j[None]  # position of each slot's label
    seq_len, base = lengths[block_seq][:, None], ctx_cu[:-1][block_seq][:, None]
    inside = (target_pos >= 0) & (target_pos < seq_len)
    row = base + target_pos.clamp(min=0).minimum(seq_len - 1)  # a context row, clamped into the sequence
    ok = inside & flat_mask[row] if len(flat_mask) else inside
    valid = torch.cumprod(ok.long(), dim=1).bool()  # the contiguous valid prefix
    block_len = valid.sum(1) if trim else torch.full((len(block_anchor),), block_size, dtype=torch.long)
    keep = j[None] < block_len[:, None]
    block_cu = torch.zeros(len(block_anchor) + 1, dtype=torch.long)
    block_cu[1:] = torch.cumsum(block_len, 0)

    block = torch.repeat_interleave(torch.arange(len(block_anchor)), block_len)
    slot = j[None].expand_as(keep)[keep]
    anchor_tok, seq_tok = block_anchor[block], block_seq[block]
    valid_tok = valid[keep]
    label_rows = row[keep]
    labels = torch.where(valid_tok, flat_ids[label_rows] if len(flat_ids) else label_rows, ignore_index)
    prev_rows = torch.maximum(label_rows - 1, ctx_cu[:-1][seq_tok])  # never into the previous sequence
    prev_ids = torch.where(valid_tok, flat_ids[prev_rows] if len(flat_ids) else prev_rows, 0)
    anchor_ids = flat_ids[ctx_cu[:-1][seq_tok] + anchor_tok] if len(flat_ids) else anchor_tok
    return PackedBlocks(
        input_ids=torch.where(slot == 0, anchor_ids, mask_token_id),
        positions=anchor_tok + slot,
        labels=labels,
        valid=valid_tok,
        slot=slot,
        block=block,
        prev_ids=prev_ids,
        # p_t for the label at position q comes from the target's hidden state at q − 1.
        teacher_rows=prev_rows,
        ctx_start=ctx_cu[:-1][seq_tok],
        ctx_end=ctx_cu[:-1][seq_tok] + anchor_tok,  # strictly before the anchor
        blk_start=block_cu[:-1][block],
        blk_end=block_cu[1:][block],
        block_seq=block_seq,
        block_anchor=block_anchor,
        block_cu=block_cu,
        ctx_cu=ctx_cu,
        num_context=int(ctx_cu[-1]),
    )


def flex_block_mask(packed: PackedBlocks, block: int = 128, device: str | torch.device | None = None) -> Any:
    """The packed mask as a flex_attention ``BlockMask`` (queries: Tb block tokens; keys: Tc
    context rows then Tb block rows).  Raises a clear error where flex_attention is missing."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:  # older torch: the dense mask (or per-token ranges) still works
        raise RuntimeError(f"flex_attention is not available in this torch ({torch.__version__}); "
                           f"use PackedBlocks.dense_mask()") from e
    device = device or packed.ctx_start.device
    cs, ce = packed.ctx_start.to(device), packed.ctx_end.to(device)
    bs, be = packed.blk_start.to(device), packed.blk_end.to(device)
    tc = packed.num_context

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        kb = kv - tc  # negative for context columns, so they never fall in a block range
        return ((kv >= cs[q]) & (kv < ce[q])) | ((kb >= bs[q]) & (kb < be[q]))

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=packed.num_tokens, KV_LEN=tc + packed.num_tokens,
                             device=device, BLOCK_SIZE=block)

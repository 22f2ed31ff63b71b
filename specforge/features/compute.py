"""Computing target features: one flattened varlen pass per chunk of sequences (docs/training.md).

Shared by the offline cache writer (:mod:`.cache`) and the online mode (:class:`OnlineFeatures`,
the target run inside the training step), so both give the same :class:`SequenceFeatures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specforge.features.manifest import FeatureCacheError, check_layer_ids
from specforge.passes import VarlenBatch

__all__ = [
    "OnlineFeatures",
    "SequenceFeatures",
    "compute_features",
    "project_logits",
    "stack_context",
]


@dataclass
class SequenceFeatures:
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] int64, 0/1
    taps: Tensor  # [T, m, d] tapped layer outputs, in layer_ids order (taps.flatten(1) = [H(l1);…;H(lm)])
    hidden: Tensor  # [T, d] last hidden state (after the final norm): logits = hidden @ lm_headᵀ
    index: int = -1  # position of the sequence in the cache / input list

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def project_logits(hidden_rows: Tensor, lm_head: Tensor) -> Tensor:
    """``[M, V]`` float32 logits of hidden rows through the frozen LM head ``[V, d]``
    (``target.runtime.lm_head``).  fp32 so teacher softmaxes are not computed from bf16 logits."""
    return F.linear(hidden_rows.float(), lm_head.detach().float())


def stack_context(features: Sequence[SequenceFeatures]) -> tuple[Tensor, Tensor, Tensor]:
    """Back-to-back context of a batch: taps ``[Tc, m, d]``, hidden ``[Tc, d]`` and ``cu [S+1]``,
    in the order :func:`specforge.features.packing.pack_blocks` numbers context rows."""
    lengths = torch.tensor([len(f) for f in features], dtype=torch.long)
    cu = torch.zeros(len(features) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    return torch.cat([f.taps for f in features]), torch.cat([f.hidden for f in features]), cu


def as_pair(seq: Any) -> tuple[Tensor, Tensor]:
    """(ids, mask) from a TokenizedChat, a SequenceFeatures, a mapping or an (ids, mask) pair."""
    if hasattr(seq, "input_ids"):
        ids, mask = seq.input_ids, seq.loss_mask
    elif isinstance(seq, dict):
        ids, mask = seq["input_ids"], seq["loss_mask"]
    else:
        ids, mask = seq
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1), torch.as_tensor(mask, dtype=torch.long).reshape(-1)


def validate_sequences(pairs: Sequence[tuple[Tensor, Tensor]], target: Any) -> None:
    vocab, longest = target.args.vocab_size, target.max_positions
    for i, (ids, mask) in enumerate(pairs):
        if len(ids) == 0:
            raise FeatureCacheError(f"sequence {i} is empty")
        if len(ids) != len(mask):
            raise FeatureCacheError(f"sequence {i}: {len(ids)} ids but a loss mask of {len(mask)}")
        if len(ids) > longest:
            raise FeatureCacheError(f"sequence {i} has {len(ids)} tokens; the target takes at most {longest}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise FeatureCacheError(f"sequence {i} has token ids outside the vocabulary 0..{vocab - 1}")


def _micro_batches(lengths: Sequence[int], max_tokens: int) -> list[range]:
    """Consecutive sequences whose KV cache (slots × longest) stays within ``max_tokens``
    positions per layer; a longer sequence goes alone.  The grouping depends on the inputs only,
    so a rerun computes bit-identical shards."""
    groups, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, n) > max_tokens:
            groups.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def forward_flat(target: Any, ids: Sequence[Tensor], layer_ids: Sequence[int], dtype: torch.dtype,
                  max_batch_tokens: int) -> tuple[Tensor, Tensor]:
    """Taps ``[T, m, d]`` and hidden ``[T, d]`` of sequences back to back, each from position 0."""
    device = target.runtime.embed.device
    # The teacher's backend (the torch runtime) even where the engine decodes on llama.cpp: these
    # passes need every row's taps and final hidden state.
    runner = target.teacher()
    taps_out, hidden_out = [], []
    for group in _micro_batches([len(x) for x in ids], max_batch_tokens):
        runs = [ids[i] for i in group]
        cache = runner.new_cache(len(runs), max(len(r) for r in runs))  # fresh: no stale context
        batch = VarlenBatch.build(runs, list(range(len(runs))), [0] * len(runs), device=device)
        with torch.inference_mode():
            out = runner.forward(batch, cache, None, tuple(layer_ids))  # logits_rows=None: no LM head
        # torch.stack / .to(copy=True) outside inference mode turn the forward's inference tensors
        # into normal ones, which autograd accepts (an inference tensor cannot be saved for backward).
        taps_out.append(torch.stack([out.taps[layer] for layer in layer_ids], dim=1).to(dtype))
        hidden_out.append(out.hidden.to(dtype, copy=True))
    return torch.cat(taps_out), torch.cat(hidden_out)


def compute_features(target: Any, sequences: Sequence[Any], layer_ids: Sequence[int],
                     dtype: torch.dtype | None = None, max_batch_tokens: int = 8192) -> list[SequenceFeatures]:
    """The features of ``sequences`` (TokenizedChat or (ids, mask)) by one target pass per chunk."""
    layer_ids = check_layer_ids(layer_ids, target.args.n_layers)
    pairs = [as_pair(s) for s in sequences]
    validate_sequences(pairs, target)
    if not pairs:
        return []
    taps, hidden = forward_flat(target, [p[0] for p in pairs], layer_ids, dtype or target.dtype, max_batch_tokens)
    sizes = [len(p[0]) for p in pairs]
    return [SequenceFeatures(ids.to(taps.device), mask.to(taps.device), t, h, i)
            for i, ((ids, mask), t, h) in enumerate(zip(pairs, taps.split(sizes), hidden.split(sizes)))]


class OnlineFeatures:
    """The cache's features computed on the fly, inside the training step (no disk, always fresh).

    ``features(batch)`` returns what iterating a :class:`FeatureCache` over the same sequences
    returns, so the trainer's code after this point is the same in both modes.
    """

    def __init__(self, target: Any, layer_ids: Sequence[int], dtype: torch.dtype | None = None,
                 max_batch_tokens: int = 8192) -> None:
        self.target = target
        self.layer_ids = check_layer_ids(layer_ids, target.args.n_layers)  # fail at setup, not step 1
        self.dtype = dtype or target.dtype
        self.max_batch_tokens = max_batch_tokens

    def __call__(self, sequences: Sequence[Any]) -> list[SequenceFeatures]:
        return compute_features(self.target, sequences, self.layer_ids, self.dtype, self.max_batch_tokens)

    @property
    def lm_head(self) -> Tensor:
        return self.target.runtime.lm_head

"""A flattened variable-length batch: every new token of every request in one dimension.

There are no padding tokens: request r contributes exactly its ``n_r`` new tokens, tagged with its
cache slot and absolute positions.  The matmuls of a pass run over ``N = Σ n_r`` rows; only
attention needs to know where one request ends and the next begins (``cu_seqlens``).

A *tree* pass (a token tree verified at once) gives each run a parent list: its tokens are then
written at consecutive cache positions as usual, but each sits at RoPE position start + depth and
attends only to its ancestors (``tree``: one bitmask per token over its run) and to the prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VarlenBatch", "split_tokens"]


@dataclass(frozen=True)
class VarlenBatch:
    tokens: Tensor  # [N] int64
    positions: Tensor  # [N] int64, absolute position of each token
    token_slots: Tensor  # [N] int64, cache slot of each token's request
    cu_seqlens: Tensor  # [R+1] int64, run boundaries in the flat dimension
    slots: Tensor  # [R] int64
    start_pos: Tensor  # [R] int64, position of each run's first token
    rope_positions: Tensor | None = None  # [N] int64 of a tree pass (start + depth); None: positions
    tree: Tensor | None = None  # [N] int64 bitmask of the run tokens each token sees; None: causal

    @classmethod
    def build(
        cls, runs: Sequence[Sequence[int] | Tensor], slots: Sequence[int], start_pos: Sequence[int],
        device: torch.device | str = "cpu", parents: Sequence[Sequence[int]] | None = None,
    ) -> VarlenBatch:
        """One run of new tokens per request, written at ``start_pos[r]`` of ``slots[r]``.

        ``parents[r][i]``: the run index of token i's parent (−1 for the run's first token, the
        root; parents come before their children), making this a tree pass; at most 64 tokens
        per run."""
        if not (len(runs) == len(slots) == len(start_pos)):
            raise ValueError("runs, slots and start_pos must have one entry per request")
        lengths = [len(run) for run in runs]
        if any(n == 0 for n in lengths):
            raise ValueError("every request in a pass must contribute at least one token")
        if any(isinstance(run, Tensor) for run in runs):
            tokens = torch.cat([torch.as_tensor(run, dtype=torch.long) for run in runs]) if runs else \
                torch.empty(0, dtype=torch.long)
        else:  # lists of ids (the engine's runs): one tensor, not one per request
            tokens = torch.tensor(list(itertools.chain.from_iterable(runs)), dtype=torch.long)
        n = torch.tensor(lengths, dtype=torch.long)
        start = torch.tensor(list(start_pos), dtype=torch.long)
        slot_t = torch.tensor(list(slots), dtype=torch.long)
        cu = torch.zeros(len(runs) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(n, 0)
        # position of flat token i = start of its run + its offset inside the run
        run_of_token = torch.repeat_interleave(torch.arange(len(runs)), n)
        offset = torch.arange(int(cu[-1])) - cu[:-1][run_of_token]
        rope = tree = None
        if parents is not None:
            depth, bits = _tree_layout(parents, lengths)
            rope, tree = (start[run_of_token] + depth).to(device), bits.to(device)
        return cls(
            rope_positions=rope, tree=tree,
            tokens=tokens.to(device),
            positions=(start[run_of_token] + offset).to(device),
            token_slots=slot_t[run_of_token].to(device),
            cu_seqlens=cu.to(device),
            slots=slot_t.to(device),
            start_pos=start.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.slots.shape[0])


def _tree_layout(parents: Sequence[Sequence[int]], lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Per flat token: its depth in its run's tree and the bitmask of its ancestors-or-self."""
    depth: list[int] = []
    bits: list[int] = []
    for r, (run_parents, n) in enumerate(zip(parents, lengths)):
        if len(run_parents) != n:
            raise ValueError(f"request {r}: {len(run_parents)} parents for a run of {n} tokens")
        if n > 64:
            raise ValueError(f"request {r}: a tree run holds at most 64 tokens, got {n}")
        d_own: list[int] = []
        b_own: list[int] = []
        for i, parent in enumerate(run_parents):
            if (i == 0) != (parent == -1) or parent >= i:
                raise ValueError(f"request {r}, token {i}: parent {parent} (the first token is the root, -1; "
                                 "every other token's parent comes before it)")
            d_own.append(0 if i == 0 else d_own[parent] + 1)
            b_own.append((0 if i == 0 else b_own[parent]) | (1 << i))
        depth += d_own
        bits += [b - (1 << 64) if b >= 1 << 63 else b for b in b_own]  # as signed int64
    return torch.tensor(depth, dtype=torch.long), torch.tensor(bits, dtype=torch.int64)


def split_tokens(batch: int, requests: int) -> list[int]:
    """``batch`` new tokens over min(batch, requests) requests, as evenly as possible."""
    if batch < 1 or requests < 1:
        raise ValueError(f"batch and requests must be positive (got {batch}, {requests})")
    r = min(batch, requests)
    return [batch // r + (1 if i < batch % r else 0) for i in range(r)]

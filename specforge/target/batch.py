"""A flattened variable-length batch: every new token of every request in one dimension.

There are no padding tokens: request r contributes exactly its ``n_r`` new tokens, tagged with its
cache slot and absolute positions.  The matmuls of a pass run over ``N = Σ n_r`` rows; only
attention needs to know where one request ends and the next begins (``cu_seqlens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VarlenBatch"]


@dataclass(frozen=True)
class VarlenBatch:
    tokens: Tensor  # [N] int64
    positions: Tensor  # [N] int64, absolute position of each token
    token_slots: Tensor  # [N] int64, cache slot of each token's request
    cu_seqlens: Tensor  # [R+1] int64, run boundaries in the flat dimension
    slots: Tensor  # [R] int64
    start_pos: Tensor  # [R] int64, position of each run's first token

    @classmethod
    def build(
        cls, runs: Sequence[Sequence[int] | Tensor], slots: Sequence[int], start_pos: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> VarlenBatch:
        """One run of new tokens per request, written at ``start_pos[r]`` of ``slots[r]``."""
        if not (len(runs) == len(slots) == len(start_pos)):
            raise ValueError("runs, slots and start_pos must have one entry per request")
        lengths = [len(run) for run in runs]
        if any(n == 0 for n in lengths):
            raise ValueError("every request in a pass must contribute at least one token")
        tokens = torch.cat([torch.as_tensor(run, dtype=torch.long) for run in runs]) if runs else \
            torch.empty(0, dtype=torch.long)
        n = torch.tensor(lengths, dtype=torch.long)
        start = torch.tensor(list(start_pos), dtype=torch.long)
        slot_t = torch.tensor(list(slots), dtype=torch.long)
        cu = torch.zeros(len(runs) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(n, 0)
        # position of flat token i = start of its run + its offset inside the run
        run_of_token = torch.repeat_interleave(torch.arange(len(runs)), n)
        offset = torch.arange(int(cu[-1])) - cu[:-1][run_of_token]
        return cls(
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

    def run_lengths(self) -> Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def last_rows(self) -> Tensor:
        """``[R]`` flat index of each request's last token."""
        return self.cu_seqlens[1:] - 1

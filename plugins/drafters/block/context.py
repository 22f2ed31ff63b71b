"""The draft-side context cache of a block drafter: per request, the K/V of its fused target context.

Each draft layer prepends its own K/V projections of ``ctx = RMSNorm(W_c [H(l1);…;H(lm)])`` to
the block's keys (paper §2.2 eq. 3).  Those projections depend only on the committed token at each
position, so they are computed once, when the engine hands over that position's target features,
and kept here until the request ends.  Only committed positions ever arrive (the engine taps the
rows its own KV cache keeps), so the cache only grows: there is nothing to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["ContextCache"]

_MIN_CAPACITY = 64


@dataclass
class _Entry:
    k: list[Tensor] = field(default_factory=list)  # per draft layer, [capacity, KV, hd]
    v: list[Tensor] = field(default_factory=list)
    length: int = 0


class ContextCache:
    """Per-request context K/V for ``n_layers`` draft layers of ``kv_heads × head_dim``."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.n_layers, self.kv_heads, self.head_dim, self.dtype = n_layers, kv_heads, head_dim, dtype
        self._entries: dict[int, _Entry] = {}

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def length(self, request_id: int) -> int:
        """Context positions held for a request (0 for one never seen)."""
        entry = self._entries.get(request_id)
        return 0 if entry is None else entry.length

    def extend(self, request_id: int, start: int, kv: list[tuple[Tensor, Tensor]]) -> None:
        """Append K/V ``[n, KV, hd]`` per layer for positions ``start … start+n−1``.

        Positions must continue the request's context exactly: a gap or an overlap means the
        drafter and the engine disagree about what is committed, which would silently draft
        from the wrong context, so it is an error.
        """
        entry = self._entries.setdefault(request_id, _Entry())
        if start != entry.length:
            raise RuntimeError(f"request {request_id}: target features start at position {start}, "
                               f"but the draft context holds positions 0..{entry.length - 1}")
        n = int(kv[0][0].shape[0])
        need = entry.length + n
        capacity = entry.k[0].shape[0] if entry.k else 0
        if need > capacity:
            # Doubling keeps appends amortised O(n) over a long generation.
            grown = max(need, 2 * capacity, _MIN_CAPACITY)
            shape = (grown, self.kv_heads, self.head_dim)
            for store in (entry.k, entry.v):
                old = list(store)
                store[:] = [torch.zeros(shape, dtype=self.dtype, device=kv[0][0].device)
                            for _ in range(self.n_layers)]
                for fresh, buf in zip(store, old):
                    fresh[: entry.length] = buf[: entry.length]
        for i, (k, v) in enumerate(kv):
            entry.k[i][entry.length : need] = k
            entry.v[i][entry.length : need] = v
        entry.length = need

    def gather(self, request_ids: list[int]) -> tuple[list[tuple[Tensor, Tensor]], Tensor, Tensor]:
        """Padded batch of the requests' contexts.

        Returns per-layer ``(K, V)`` ``[R, C, KV, hd]``, positions ``[R, C]`` and validity
        ``[R, C]`` (False past a request's own length), C = the longest context.
        """
        lengths = torch.tensor([self.length(rid) for rid in request_ids], dtype=torch.long)
        c = int(lengths.max()) if len(request_ids) else 0
        positions = torch.arange(c).expand(len(request_ids), c)
        valid = positions < lengths[:, None]
        if len(request_ids) == 1 and c:
            # One request: views of its buffers, no copy.
            entry = self._entries[request_ids[0]]
            kv = [(k[None, :c], v[None, :c]) for k, v in zip(entry.k, entry.v)]
            return kv, positions, valid
        kv = []
        for i in range(self.n_layers):
            k = torch.zeros(len(request_ids), c, self.kv_heads, self.head_dim, dtype=self.dtype)
            v = torch.zeros_like(k)
            for r, rid in enumerate(request_ids):
                n = int(lengths[r])
                if n:
                    entry = self._entries[rid]
                    k[r, :n], v[r, :n] = entry.k[i][:n], entry.v[i][:n]
            kv.append((k, v))
        return kv, positions, valid

    def release(self, request_id: int) -> None:
        self._entries.pop(request_id, None)

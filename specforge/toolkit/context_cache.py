"""The draft-side context cache of a drafter over fused target features: per request, the K/V of
its committed context.

A block drafter's layers prepend their own K/V projections of ``ctx = RMSNorm(W_c [H(l1);…;H(lm)])``
to the block's keys (paper §2.2 eq. 3); EAGLE-3's layer attends to the K/V of (x_{t+1}, g_t) at
every committed row t.  Either depends only on the committed tokens, so it is computed once, when
the engine hands over that position's target features, and kept here until the request ends.
Only committed positions ever arrive (the engine taps the rows its own KV cache keeps), so the
cache only grows: there is nothing to roll back.

Layout: one ``[slots, capacity, KV, hd]`` tensor per layer for K and one for V, a slot per live
request (like the target's KV cache), so that a round's writes for every request are one indexed
copy per layer and its reads one ``index_select`` — no Python loop over the requests of a batch.
Both dimensions grow by doubling, which keeps appends amortised O(n) over a long generation.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

__all__ = ["ContextCache"]

_MIN_CAPACITY = 64
_MIN_SLOTS = 4


class ContextCache:
    """Per-request context K/V for ``n_layers`` draft layers of ``kv_heads × head_dim``."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.n_layers, self.kv_heads, self.head_dim, self.dtype = n_layers, kv_heads, head_dim, dtype
        self._k: list[Tensor] = []  # per layer [slots, capacity, KV, hd]
        self._v: list[Tensor] = []
        # Per slot, in Python: release() runs outside the inference mode the writes run in.
        self._lengths: list[int] = []
        self._slots: dict[int, int] = {}  # request id -> slot
        self._free: list[int] = []  # a min-heap: new requests take the lowest free slot

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def length(self, request_id: int) -> int:
        """Context positions held for a request (0 for one never seen)."""
        slot = self._slots.get(request_id)
        return 0 if slot is None else self._lengths[slot]

    # -- storage --------------------------------------------------------------------------------

    def _slot(self, request_id: int) -> int:
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                self._grow(slots=max(_MIN_SLOTS, 2 * len(self._lengths)))
            slot = heapq.heappop(self._free)
            self._slots[request_id] = slot
            self._lengths[slot] = 0
        return slot

    def _grow(self, slots: int | None = None, capacity: int | None = None, device: torch.device | None = None) -> None:
        """Reallocate every layer's store to at least ``slots`` × ``capacity``, keeping its contents."""
        old_slots = len(self._lengths)
        old_cap = self._k[0].shape[1] if self._k else 0
        new_slots, new_cap = max(slots or 0, old_slots), max(capacity or 0, old_cap, _MIN_CAPACITY)
        device = device if device is not None else (self._k[0].device if self._k else None)
        shape = (new_slots, new_cap, self.kv_heads, self.head_dim)
        for store in (self._k, self._v):
            fresh = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.n_layers)]
            for new, old in zip(fresh, store):
                new[:old_slots, :old_cap] = old
            store[:] = fresh
        if new_slots > old_slots:
            self._lengths += [0] * (new_slots - old_slots)
            for s in range(old_slots, new_slots):
                heapq.heappush(self._free, s)

    # -- writes and reads -------------------------------------------------------------------------

    def extend_many(self, request_ids: list[int], starts: Tensor, counts: Tensor,
                    kv: list[tuple[Tensor, Tensor]]) -> None:
        """Append, for every request r, ``counts[r]`` positions from ``starts[r]`` on; ``kv`` holds
        per layer ``(K, V)`` ``[Σ counts, KV, hd]``, the requests' rows one after another.

        Positions must continue each request's context exactly: a gap or an overlap means the
        drafter and the engine disagree about what is committed, which would silently draft from
        the wrong context, so it is an error.
        """
        keep = [i for i, n in enumerate(counts.tolist()) if n > 0]
        if not keep:
            return
        slots = torch.tensor([self._slot(request_ids[i]) for i in keep], dtype=torch.long)
        starts, counts = starts[keep].to(torch.long), counts[keep].to(torch.long)
        held = torch.tensor([self._lengths[s] for s in slots.tolist()], dtype=torch.long)
        wrong = (held != starts).nonzero()
        if len(wrong):
            i = int(wrong[0, 0])
            raise RuntimeError(f"request {request_ids[keep[i]]}: target features start at position "
                               f"{int(starts[i])}, but the draft context holds positions 0..{int(held[i]) - 1}")
        need = int((starts + counts).max())
        if not self._k or need > self._k[0].shape[1]:
            self._grow(capacity=max(need, 2 * (self._k[0].shape[1] if self._k else 0)), device=kv[0][0].device)
        rows_slot = torch.repeat_interleave(slots, counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        rows_pos = torch.repeat_interleave(starts, counts) + torch.arange(int(counts.sum())) - first
        for store_k, store_v, (k, v) in zip(self._k, self._v, kv):
            store_k[rows_slot, rows_pos] = k.to(self.dtype)
            store_v[rows_slot, rows_pos] = v.to(self.dtype)
        for s, end in zip(slots.tolist(), (starts + counts).tolist()):
            self._lengths[s] = end

    def extend(self, request_id: int, start: int, kv: list[tuple[Tensor, Tensor]]) -> None:
        """Append K/V ``[n, KV, hd]`` per layer for positions ``start … start+n−1`` of one request."""
        n = int(kv[0][0].shape[0])
        self.extend_many([request_id], torch.tensor([start]), torch.tensor([n]), kv)

    def gather(self, request_ids: list[int]) -> tuple[list[tuple[Tensor, Tensor]], Tensor, Tensor]:
        """Padded batch of the requests' contexts.

        Returns per-layer ``(K, V)`` ``[R, C, KV, hd]``, positions ``[R, C]`` and validity
        ``[R, C]`` (False past a request's own length), C = the longest context.
        """
        slots = torch.tensor([self._slots.get(rid, -1) for rid in request_ids], dtype=torch.long)
        lengths = torch.tensor([self.length(rid) for rid in request_ids], dtype=torch.long)
        c = int(lengths.max()) if len(request_ids) else 0
        positions = torch.arange(c).expand(len(request_ids), c)
        valid = positions < lengths[:, None]
        if c == 0:
            empty = torch.zeros(len(request_ids), 0, self.kv_heads, self.head_dim, dtype=self.dtype)
            return [(empty, empty) for _ in range(self.n_layers)], positions, valid
        if len(request_ids) == 1:  # one request: views of its slot, no copy
            s = int(slots[0])
            return [(k[s:s + 1, :c], v[s:s + 1, :c]) for k, v in zip(self._k, self._v)], positions, valid
        index = slots.clamp_min(0)  # a request without context reads slot 0, all of it masked
        return [(k[:, :c].index_select(0, index), v[:, :c].index_select(0, index))
                for k, v in zip(self._k, self._v)], positions, valid

    def release(self, request_id: int) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._lengths[slot] = 0
            heapq.heappush(self._free, slot)

"""The target's KV cache: one preallocated tensor per layer, one slot per request.

Each request owns a slot; its keys and values for positions 0..length-1 live at
``k[layer][slot, :, :length]``.  Rolling back after a rejection is only moving ``length`` back
(:meth:`KVCache.crop`): entries past it are never attended to and are overwritten by the next pass.

Entries past ``length`` are still *read* under a mask by the padded attention path (many requests
in one SDPA), where a NaN or inf would leak through the masked product.  Stale entries of the same
request are finite (a non-finite key would already have made its own logits non-finite), so only a
previous occupant's leftovers can hurt: a freed slot's written range is zeroed before
:meth:`KVCache.allocate` hands it out again — every slot freed since the last scrub in one indexed
write per layer, not one per freed request (per-request zeroing was ≈ 3 % of the conformance
suite's time, py-spy on its fast tier: thousands of short requests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specforge.runtime.contract import SlotTable

__all__ = ["KVCache"]


class KVCache(SlotTable):
    def __init__(
        self,
        n_layers: int,
        slots: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(slots, capacity)
        # One tensor per layer, not one [layers, ...] tensor: a compiled forward writes layer i's
        # keys in place into its own input; into a view of a shared tensor it would copy it whole.
        shape = (slots, n_kv_heads, capacity, head_dim)
        self.k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers))
        self.v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers))
        self._static = False
        self._dirty: dict[int, int] = {}  # freed slot -> positions its last occupant wrote (not yet zeroed)

    def mark_static(self) -> None:
        """Tell torch.compile the cache's shapes are fixed for its life: a compiled forward may
        then specialise on them (head counts decide code paths) while the lengths and slots it
        reads stay symbolic.  Done on first use by a compiled forward (importing dynamo costs
        seconds, which eager users should not pay)."""
        if not self._static:
            for t in (*self.k, *self.v):
                torch._dynamo.mark_static(t)
            self._static = True

    def allocate(self) -> int:
        slot = super().allocate()
        if slot in self._dirty:
            self._scrub()
        return slot

    def free(self, slot: int) -> None:
        if self._written[slot] and slot not in self._free:
            self._dirty[slot] = self._written[slot]
        super().free(slot)

    def _scrub(self) -> None:
        """Zero the leftovers of every slot freed since the last scrub (up to the longest of
        them: the extra positions of the others are free too)."""
        slots = torch.tensor(list(self._dirty), dtype=torch.long, device=self.k[0].device)
        end = max(self._dirty.values())
        for k, v in zip(self.k, self.v):
            k[slots, :, :end] = 0
            v[slots, :, :end] = 0
        self._dirty.clear()

    def update(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Write ``k``/``v`` ``[N, Hkv, D]`` of N tokens at their (slot, position)."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def compact(self, slot: int, keep: list[int], start: int) -> None:
        if keep == list(range(start, start + len(keep))):
            return
        src = torch.tensor(keep, dtype=torch.long, device=self.k[0].device)
        for k, v in zip(self.k, self.v):
            k[slot, :, start:start + len(keep)] = k[slot, :, src]  # the gather copies before the write
            v[slot, :, start:start + len(keep)] = v[slot, :, src]

"""What a target runtime promises the engine: one pass over a flattened batch, into a cache of
request slots.

The engine, the step-curve measurement and the conformance suite talk to a target's passes through
two calls — ``new_cache(slots, capacity)`` and ``forward(batch, cache, logits_rows, taps)`` — and
nothing else, so a backend is a sibling module behind this contract (:mod:`.torch`, :mod:`.llamacpp`),
never a branch through its callers.  Sampling and verification stay in specforge, over the logits a
backend returns, so a backend changes speed, never the law a pipeline samples from.

What a caller needs of the passes is said up front, as :class:`Needs`: the layers a drafter reads
(taps) and whether it reads every row's final hidden state.  The loader (:mod:`.load`) gives a
runtime whose backend has them, and says so once; a backend that lacks one says which in
:meth:`TargetBackend.lacks`.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from specforge.passes import VarlenBatch

__all__ = ["CacheFullError", "ForwardOutput", "Needs", "SlotTable", "TargetBackend"]


@dataclass(frozen=True)
class ForwardOutput:
    logits: Tensor | None  # [M, V] float32 for the requested rows, or None
    hidden: Tensor | None  # [N, d] final (normed) hidden state of every token (None: a backend without it)
    taps: dict[int, Tensor]  # layer index -> [N, d] residual stream after that layer


@dataclass(frozen=True)
class Needs:
    """What a caller reads from the passes besides logits."""

    taps: tuple[int, ...] = ()  # target layers whose output the drafter reads
    final_hidden: bool = False  # every row's final (normed) hidden state (teacher-forced features, Medusa)
    # The load: requests decoded together, as the caller expects to serve (1: a single user; None:
    # not known).  Not a capability — it picks which measured passes decide ``auto``.
    requests: int | None = None
    # Whether the caller verifies drafted blocks (True: a drafter; False: plain decoding, whose
    # passes are all one-token decode steps; None: not known).  Like ``requests``, a load hint.
    drafts: bool | None = None

    def __or__(self, other: Needs) -> Needs:
        loads = [n for n in (self.requests, other.requests) if n is not None]
        known = [d for d in (self.drafts, other.drafts) if d is not None]
        return Needs(tuple(sorted({*self.taps, *other.taps})), self.final_hidden or other.final_hidden,
                     max(loads) if loads else None, any(known) if known else None)


@runtime_checkable
class TargetBackend(Protocol):
    name: str

    def new_cache(self, slots: int, capacity: int) -> Any: ...

    def cache_bytes(self, slots: int, capacity: int) -> int:
        """The most memory a cache of ``slots`` × ``capacity`` positions can take (its K/V when full)."""
        ...

    def forward(self, batch: VarlenBatch, cache: Any, logits_rows: Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOutput: ...

    def lacks(self, needs: Needs) -> str | None:
        """Why this backend cannot serve ``needs`` (one sentence), or None when it can."""
        ...


class CacheFullError(RuntimeError):
    """No free slot, or a write past a slot's capacity."""


class SlotTable(ABC):
    """The engine's view of a cache: one slot per request and how many of its positions hold
    valid keys and values.  Where those live is a subclass's: :class:`~specforge.runtime.torch.cache.KVCache` (tensors),
    :class:`~specforge.runtime.llamacpp.backend.LlamaCppCache` (llama.cpp's memory)."""

    def __init__(self, slots: int, capacity: int) -> None:
        self.capacity = capacity
        self.lengths = [0] * slots
        self._written = [0] * slots  # positions 0..written-1 of each slot may hold this request's K/V
        # A min-heap: the lowest free slot goes first, so requests admitted together get
        # consecutive slots in admission order whatever order earlier ones finished in — the
        # padded attention then reads them as one block without a gather, and a compiled forward
        # sees the same layout on every batch instead of a new graph after the first.
        self._free = list(range(slots))

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.slots} cache slots are in use")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        self._written[slot] = 0
        heapq.heappush(self._free, slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def note_written(self, slots: list[int], ends: list[int]) -> None:
        """Record that a pass writes positions below ``ends[i]`` of ``slots[i]`` (host lists)."""
        written = self._written
        for slot, end in zip(slots, ends):
            if end > written[slot]:
                written[slot] = end

    def advance(self, slot: int, length: int) -> None:
        """Declare positions ``0..length-1`` of ``slot`` valid (after a pass wrote them)."""
        if length > self.capacity:
            raise CacheFullError(f"slot {slot}: length {length} exceeds the capacity {self.capacity}")
        self.lengths[slot] = length

    @abstractmethod
    def compact(self, slot: int, keep: list[int], start: int) -> None:
        """Move the K/V at positions ``keep`` (ascending, each ≥ ``start``) of ``slot`` to
        ``start, start + 1, …``: after a tree pass, the accepted path's entries become the
        consecutive positions they hold from now on (where the K/V live decides how)."""

    def crop(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` positions."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot crop to {length} (length {self.lengths[slot]})")
        self.lengths[slot] = length

"""Whether one training step fits in this machine's memory, measured before the first step.

A step's peak memory grows with the draft blocks it trains (``batch.sequences`` × ``batch.anchors``
per rank): per block slot the teacher's law over the target's whole vocabulary, the drafter's
logits and their gradients, attention over the sequence's context.  On a CPU a step that does not
fit is ended by the kernel's OOM killer — no exception, no message, the run just dies (256 anchors
× 8 sequences of 512 tokens took 17.7 GB on a 23 GB machine).  So before the first step the trainer
measures: forward and backward (no optimizer update) on the first batch's own sequences at two
small anchor counts, the process's peak resident memory read after each (Linux: ``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs`` after malloc has handed its free
pages back), never less than the bytes autograd saved for the backward pass (a floor the
allocator cannot hide by reusing resident pages), a straight line through the two
over the number of blocks, extrapolated to the configured step and compared with what the kernel
reports available (``MemAvailable``).  A step that would not fit is refused with one line naming
``batch.anchors`` and ``batch.sequences`` and the largest anchor count that fits.

Where the kernel offers no peak to reset (not Linux) or the drafter trains on a GPU (whose own
out-of-memory error is clear), nothing is measured.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specforge import machine
from specforge.machine import GiB

__all__ = ["StepMemory", "check_step_memory", "largest_fitting", "measure_step_memory", "saved_for_backward"]


@dataclass(frozen=True)
class StepMemory:
    """The measured line: bytes a step takes above the resident size before it, at ``blocks``."""

    blocks: tuple[int, int]
    peaks: tuple[int, int]
    step_blocks: int
    available: int

    @property
    def per_block(self) -> float:
        return max(0.0, (self.peaks[1] - self.peaks[0]) / max(1, self.blocks[1] - self.blocks[0]))

    def at(self, blocks: int) -> float:
        return self.peaks[1] + self.per_block * (blocks - self.blocks[1])

    @property
    def needed(self) -> float:
        return self.at(self.step_blocks)

    @property
    def fits(self) -> bool:
        return self.needed <= self.available

    def summary(self) -> str:
        return (f"one training step ≈ {self.needed / GiB:.1f} GiB above what is resident "
                f"({self.step_blocks} draft blocks, {self.per_block / (1 << 20):.2f} MiB each, measured on "
                f"{self.blocks[0]} and {self.blocks[1]}); {self.available / GiB:.1f} GiB available")


def measure_step_memory(probe: Callable[[int], tuple[int, int]], anchors: int,
                        blocks_at: Callable[[int], int]) -> StepMemory | None:
    """``probe(a)`` runs forward and backward at ``a`` anchors per sequence and returns its number
    of blocks and the bytes autograd kept for the backward pass; ``blocks_at(a)`` counts blocks
    without running.  A probe's memory is the larger of the peak's growth and those bytes: the
    peak can read low where the allocator reuses pages it kept resident, the saved tensors cannot.
    None where nothing can be measured or the configured step is no bigger than a probe (it then
    fits: the probe ran)."""
    if machine.peak_resident() is None or machine.memory_available() is None:
        return None
    small = max(1, min(anchors // 8, 8))
    if blocks_at(anchors) <= blocks_at(2 * small):
        return None
    probe(small)  # warm-up: gradient buffers and the autograd's first allocations stay resident
    blocks, peaks = [], []
    for a in (small, 2 * small):
        base = machine.peak_resident(reset=True)  # None: the kernel refused the reset
        n, saved = probe(a)
        blocks.append(n)
        peaks.append(max(machine.peak_resident() - base if base is not None else 0, saved))
    return StepMemory((blocks[0], blocks[1]), (peaks[0], peaks[1]), blocks_at(anchors), machine.memory_available())


def saved_for_backward() -> tuple[Any, dict[int, int]]:
    """A context that tallies the distinct storages autograd saves for the backward pass (bytes by
    storage), and the tally it fills."""
    import torch

    tally: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            storage = t.untyped_storage()
            tally[storage.data_ptr()] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tally


def largest_fitting(memory: StepMemory, blocks_at: Callable[[int], int], anchors: int) -> int:
    """The largest anchor count ≤ ``anchors`` whose step the measured line fits (0: none)."""
    return bisect.bisect_left(range(1, anchors + 1), True, key=lambda a: memory.at(blocks_at(a)) > memory.available)


def check_step_memory(trainer: Any) -> StepMemory | None:
    """Measure the trainer's step (:func:`measure_step_memory`) on its first batch; raise
    :class:`~specforge.training.config.TrainConfigError` when it would not fit, naming the keys."""
    from specforge.training.config import TrainConfigError
    from specforge.training.data import anchors_for

    c = trainer.config
    if trainer.dist.device.type != "cpu":
        return None
    mine = trainer.global_batch(trainer.epoch, trainer.batch_index)[trainer.dist.rank::trainer.dist.world]
    feats = trainer.source.get(mine) if mine else []
    if not feats:
        return None

    def blocks_at(a: int) -> int:
        return sum(len(x) for x in anchors_for(feats, a, c.seed, trainer.epoch))

    def probe(a: int) -> tuple[int, int]:
        batch = trainer._inputs(feats, anchors_for(feats, a, c.seed, trainer.epoch))
        if batch is None:
            return 0, 0
        trainer.module.train()
        saving, saved = saved_for_backward()
        with trainer.forward_context(train=True), saving:
            out = trainer.module(batch)  # the bare module: no gradient all-reduce across ranks
            # The eager loss: a compiled one fuses its passes and takes no more memory than this.
            loss = trainer.method.loss(out, batch).total
        loss.backward()
        trainer.optimizer.zero_grad(set_to_none=True)
        return int(batch.valid.shape[0]), sum(saved.values())

    memory = measure_step_memory(probe, c.batch.anchors, blocks_at)
    if memory is not None and not memory.fits:
        fit = largest_fitting(memory, blocks_at, c.batch.anchors)
        advice = (f"batch.anchors={fit} fits" if fit else "no anchor count fits with these sequences: "
                  "lower batch.sequences or data.max_length")
        sequences = len(feats) if trainer.dist.world == 1 else f"{len(feats)} on this rank"
        raise TrainConfigError([
            f"batch.anchors={c.batch.anchors} × batch.sequences={sequences}: {memory.summary()} — the step "
            f"would not fit and the kernel would kill the run; {advice} (or lower batch.sequences)"])
    return memory

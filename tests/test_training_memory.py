"""The training step's memory, measured before the first step: a step that would not fit is
refused with one line naming the keys, before anything is written; one that fits says what it takes."""

from __future__ import annotations

import sys

import pytest

from specforge import machine
from specforge.training.config import TrainConfigError
from specforge.training.memory import StepMemory, largest_fitting, measure_step_memory, saved_for_backward
from specforge.training.trainer import Trainer
from train_fixtures import one_thread, tiny_config, tiny_source, tiny_target  # noqa: F401 - fixture

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or machine.peak_resident() is None,
                           reason="the peak resident size is read from Linux's /proc")


def test_the_line_through_two_probes_predicts_the_step_and_the_anchors_that_fit():
    m = StepMemory(blocks=(8, 16), peaks=(100, 180), step_blocks=96, available=500)
    assert m.per_block == 10 and m.at(16) == 180 and m.needed == 980 and not m.fits
    # 4 sequences of up to 20 anchors each: blocks = 4·a up to 80
    assert largest_fitting(m, lambda a: 4 * min(a, 20), 24) == 12  # 4·12 = 48 blocks: 500 bytes
    assert largest_fitting(StepMemory((8, 16), (100, 180), 96, 50), lambda a: 4 * a, 24) == 0
    assert "GiB available" in m.summary()


def test_a_step_that_would_not_fit_is_refused_naming_the_keys_and_nothing_is_written(tmp_path, monkeypatch):
    target = tiny_target()
    config = tiny_config(tmp_path, steps=3).model_copy(deep=True)
    config.batch.anchors = 64
    logs = []
    trainer = Trainer(config, target=target, source=tiny_source(target), log=logs.append)
    monkeypatch.setattr(machine, "memory_available", lambda: 1 << 16)  # a machine with 64 KiB left
    # A peak that never grows: a long process whose allocator reuses pages it kept resident (the
    # CI's test session did).  The bytes autograd saves for the backward pass still count.
    monkeypatch.setattr(machine, "peak_resident", lambda reset=False: 1 << 30)
    with pytest.raises(TrainConfigError) as err:
        trainer.train()
    message = str(err.value)
    assert "batch.anchors=64" in message and "batch.sequences=4" in message, message
    assert "would not fit" in message and ("fits" in message or "lower batch.sequences" in message), message
    assert trainer.step == 0 and not (tmp_path / "checkpoints").exists() and not (tmp_path / "drafter").exists()


def test_a_probe_counts_at_least_what_autograd_saved_for_backward(monkeypatch):
    monkeypatch.setattr(machine, "peak_resident", lambda reset=False: 1 << 30)  # the peak reads flat
    monkeypatch.setattr(machine, "memory_available", lambda: 1 << 40)
    saved = {2: 1000, 4: 2000}  # bytes saved at 2 and 4 anchors (the probes of a 16-anchor step)
    m = measure_step_memory(lambda a: (8 * a, saved[a]), anchors=16, blocks_at=lambda a: 8 * a)
    assert m.blocks == (16, 32) and m.peaks == (1000, 2000) and m.needed == 2000 + 1000 / 16 * (128 - 32)


def test_saved_for_backward_tallies_each_storage_once():
    import torch

    x = torch.randn(64, 32, requires_grad=True)
    saving, saved = saved_for_backward()
    with saving:
        y = (x * x).sum()  # x saved twice, one storage
    y.backward()
    assert sum(saved.values()) == x.untyped_storage().nbytes()


@linux
def test_a_step_that_fits_says_what_it_takes_and_trains(tmp_path):
    target = tiny_target()
    config = tiny_config(tmp_path, steps=2).model_copy(deep=True)
    config.batch.anchors = 64
    logs = []
    trainer = Trainer(config, target=target, source=tiny_source(target), log=logs.append)
    trainer.train()
    assert trainer.step == 2
    assert any(line.startswith("one training step ≈") and "GiB available" in line for line in logs), logs

"""A tiny target, tiny data and a tiny drafter config for the trainer tests.

Also the script ``torchrun`` runs in tests/test_trainer.py: ``python -m torch.distributed.run
--nproc_per_node=2 train_fixtures.py OUT_DIR STEPS`` trains the same run as the single-process
test and leaves rank 0's metrics.jsonl and checkpoint in OUT_DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_model  # noqa: E402

from specforge.features import compute_features  # noqa: E402
from specforge.runtime.target import TargetModel  # noqa: E402
from specforge.training.config import TrainConfig  # noqa: E402
from specforge.training.data import MemorySource  # noqa: E402

LAYERS = [0, 2]
VOCAB = 96


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from a second thread, and on a busy machine lose to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return tiny_target()


def tiny_target() -> TargetModel:
    return TargetModel(tiny_model("llama", vocab=VOCAB), None, torch.float32, name="tiny")


def tiny_sequences(distinct: int = 4, repeats: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``distinct`` random conversations (a prompt part, then an assistant part) repeated."""
    g = torch.Generator().manual_seed(seed)
    base = []
    for _ in range(distinct):
        n = int(torch.randint(16, 33, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3:] = 1
        base.append((ids, mask))
    return base * repeats


def tiny_source(target: TargetModel, **kw) -> MemorySource:
    return MemorySource(compute_features(target, tiny_sequences(**kw), LAYERS), LAYERS)


def tiny_config(out_dir: str | Path, steps: int = 8, **output) -> TrainConfig:
    return TrainConfig.model_validate({
        "target": {"model": "tiny", "dtype": "float32"},
        "drafter": {"layers": 1, "gamma": 4, "target_layers": LAYERS, "head": {"name": "markov", "rank": 8},
                    "confidence": {"name": "dspark-head", "rank": 8}, "norm_init_scale": None},
        "optimizer": {"lr": 3e-3},
        "schedule": {"total_steps": steps, "warmup_steps": 2, "min_lr": 3e-4},
        "batch": {"sequences": 4, "anchors": 4},
        "device": "cpu",
        "output": {"dir": str(out_dir), "checkpoint_interval": 1000, "progress": False, **output},
    })


def run(out_dir: str | Path, steps: int):
    from specforge.training.trainer import Trainer

    target = tiny_target()
    trainer = Trainer(tiny_config(out_dir, steps), target=target, source=tiny_source(target), log=lambda _: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1], int(sys.argv[2]))

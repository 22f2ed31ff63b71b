"""Writes tests/data/training-golden/: what the trainer produced before training became a plug-in
contract, so tests can check that the move changed nothing.

Run once with the trainer of the commit named in golden.json (``python tests/data/make_training_golden.py``);
tests/test_training_contract.py trains the same runs and compares.  Two runs on the tiny target of
tests/train_fixtures.py: DSpark with the Markov head and the confidence head, and DSpark with the
gated head and no confidence head; each keeps its per-step metrics and its exported drafter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from train_fixtures import tiny_config, tiny_source, tiny_target  # noqa: E402

RUNS = {
    "markov": {"head": {"name": "markov", "rank": 8}, "confidence": {"name": "dspark-head", "rank": 8}},
    "gated": {"head": {"name": "gated", "rank": 8}, "confidence": {"name": "none"}},
}
STEPS = 6


def main() -> None:
    from specforge.training.trainer import Trainer

    torch.set_num_threads(1)
    out = HERE / "training-golden"
    shutil.rmtree(out, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    record = {"commit": commit, "steps": STEPS, "runs": {}}
    target = tiny_target()
    for name, drafter in RUNS.items():
        work = out / f"work-{name}"
        config = tiny_config(work, steps=STEPS)
        config = config.model_validate({**config.to_dict(), "drafter": {**config.to_dict()["drafter"], **drafter}})
        trainer = Trainer(config, target=target, source=tiny_source(target), log=lambda _: None)
        try:
            history = trainer.train()
        finally:
            trainer.close()
        record["runs"][name] = {"drafter": drafter, "history": [
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time")} for r in history]}
        shutil.move(str(work / "drafter"), str(out / f"drafter-{name}"))
        shutil.rmtree(work)
    (out / "golden.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

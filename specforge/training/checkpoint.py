"""Training checkpoints that survive a kill: safetensors + JSON only (nothing is ever unpickled).

Layout of ``<output.dir>/checkpoints/step-NNNNNNNN/``::

    drafter/config.json, drafter/model.safetensors   the drafter (save_drafter's format: loadable
                                                     for inference as it is)
    optimizer.safetensors   AdamW state per parameter: "<param name>/exp_avg", "/exp_avg_sq", "/step"
    rng.safetensors         "torch_cpu" (uint8 generator state), "torch_cuda_<i>", "numpy_keys"
    train_config.json       the TrainConfig of the run
    trainer.json            written last: step, data position (epoch, batch, seed), optimizer param
                            groups, python/numpy RNG scalars, and the size + sha256 of every file

A checkpoint is written into a hidden temporary directory and renamed into place when complete,
so a kill leaves either the whole checkpoint or none of it.  Resuming picks the newest checkpoint
whose files all match trainer.json; a damaged one is reported and skipped (and set aside, never
deleted, when a new checkpoint of the same step replaces it).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from torch import Tensor

from specforge.errors import SpecforgeError
from specforge.files import file_problem, file_record, fsync, remove_leftovers, replace_atomically

__all__ = ["Checkpoint", "CheckpointError", "checkpoint_problem", "find_checkpoints", "latest_checkpoint",
           "optimizer_from_tensors", "optimizer_to_tensors", "read_checkpoint", "rng_restore", "rng_state",
           "write_checkpoint"]

FORMAT, VERSION = "specforge-train-checkpoint", 1
STATE = "trainer.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(SpecforgeError, RuntimeError):
    """A checkpoint that cannot be used, with what is wrong in words."""


# -- optimizer and RNG state as tensors + JSON -------------------------------------------------


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, Tensor], dict]:
    """Per-parameter state tensors keyed ``"<param name>/<key>"``; param groups (hyperparameters,
    parameter names) and non-tensor state as JSON.  ``names`` maps ``id(param)`` to its name."""
    sd = optimizer.state_dict()
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"{ordered[idx]}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{ordered[idx]}/{key}"] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [ordered[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, Tensor],
                           meta: dict) -> None:
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved = [n for g in meta["param_groups"] for n in g["params"]]
    if saved != ordered:
        raise CheckpointError("the checkpoint's optimizer holds other parameters than this drafter "
                              f"({len(saved)} saved, {len(ordered)} now; first difference: "
                              f"{next((a, b) for a, b in zip(saved + [None], ordered + [None]) if a != b)})")
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        name, _, field = key.rpartition("/")
        state.setdefault(ordered.index(name), {})[field] = value
    index = {n: i for i, n in enumerate(ordered)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> tuple[dict[str, Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, words, gauss = random.getstate()
    meta: dict[str, Any] = {"python": [version, list(words), gauss]}
    if "numpy" in sys.modules:  # only if something imported it; we never import it for this
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def rng_restore(tensors: dict[str, Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda][: torch.cuda.device_count()])
    version, words, gauss = meta["python"]
    random.setstate((version, tuple(words), gauss))
    if "numpy" in meta and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, tensors["numpy_keys"].numpy().astype("uint32"), pos, has_gauss, cached))


# -- writing -----------------------------------------------------------------------------------


def write_checkpoint(root: Path, step: int, write_drafter: Any, optimizer_tensors: dict[str, Tensor],
                     state: dict[str, Any], config: dict[str, Any]) -> Path:
    """Write ``root/step-NNNNNNNN`` atomically; ``write_drafter(dir)`` writes the drafter files."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    remove_leftovers(root)  # half-written by a killed run: never a checkpoint
    with replace_atomically(final) as tmp:
        tmp.mkdir()
        write_drafter(tmp / "drafter")
        save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"), metadata={"format": FORMAT})
        rng_tensors, rng_meta = rng_state()
        save_file(rng_tensors, str(tmp / "rng.safetensors"), metadata={"format": FORMAT})
        (tmp / "train_config.json").write_text(json.dumps(config, indent=2) + "\n")
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            fsync(path)
            files[path.relative_to(tmp).as_posix()] = file_record(path)
        meta = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(), **state,
                "rng": rng_meta, "files": files}
        (tmp / STATE).write_text(json.dumps(meta, indent=2) + "\n")
        fsync(tmp / STATE)
        if final.exists():  # a damaged checkpoint of this step from a killed run: set aside, never deleted
            final.rename(root / f"{final.name}.damaged-{int(time.time())}")
    return final


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (damaged ones set aside are left alone)."""
    for _, path in find_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


# -- reading -----------------------------------------------------------------------------------


def find_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step-N`` directory, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint directory, in words, or None when every file checks out."""
    state = path / STATE
    if not state.is_file():
        return f"{STATE} is missing (the checkpoint was never completed)"
    try:
        meta = json.loads(state.read_text())
    except ValueError as e:
        return f"{STATE} is not valid JSON ({e})"
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return f"{STATE} is not a {FORMAT} v{VERSION} file"
    for rel, info in meta.get("files", {}).items():
        if (problem := file_problem(path / rel, info, STATE, name=rel)) is not None:
            return problem
    return None


def latest_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under ``root`` and a line per newer damaged one skipped."""
    skipped = []
    for step, path in reversed(find_checkpoints(root)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"checkpoint {path} is damaged: {problem}; skipped")
    return None, skipped


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]  # trainer.json
    config: dict[str, Any]
    optimizer: dict[str, Tensor]
    rng: dict[str, Tensor]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def drafter_dir(self) -> Path:
        return self.path / "drafter"


def read_checkpoint(path: Path) -> Checkpoint:
    """Check and read one checkpoint; a damaged one raises :class:`CheckpointError` naming the file."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    state = json.loads((path / STATE).read_text())
    return Checkpoint(path, state, json.loads((path / "train_config.json").read_text()),
                      st_load((path / "optimizer.safetensors").read_bytes()),
                      st_load((path / "rng.safetensors").read_bytes()))

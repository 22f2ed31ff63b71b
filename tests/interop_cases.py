"""Shared cases of the interop tests: a pickle-only checkpoint folder, the checks that an import
or an export is refused with its message and writes nothing, and our eagle3 drafter's chain that
the foreign layouts' reference forwards are compared with; reading a layout folder and writing a
broken copy of it."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.interop import export_checkpoint, import_checkpoint
from specforge.toolkit.formats import InteropError

if TYPE_CHECKING:
    from specforge_plugins.drafters.eagle3.model import Eagle3Model

PICKLE_REFUSED = r"pytorch_model.bin: a pickle checkpoint; specforge loads weights only from safetensors"


def read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A layout folder's ``config.json`` and ``model.safetensors``."""
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def broken_copy(good: Path, directory: Path, change: Callable[[dict, dict[str, torch.Tensor]], Any]) -> Path:
    """A copy of the layout folder ``good`` in ``directory`` with ``change(config, tensors)`` applied: a bad input."""
    directory.mkdir()
    config, tensors = read(good)
    change(config, tensors)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def pickle_only(directory: Path, config: dict[str, Any], key: str = "w") -> Path:
    """A folder with ``config`` and only a PyTorch pickle of weights (what a trainer's ``save`` may leave)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    torch.save({key: torch.ones(2)}, directory / "pytorch_model.bin")
    return directory


def assert_imports_refused(cases: list[tuple[Path, str]], tmp_path: Path, target: Any) -> None:
    """Each folder's import fails with its message, and its output folder is never created."""
    for directory, message in cases:
        out = tmp_path / f"out-{directory.name}"
        with pytest.raises(InteropError, match=message):
            import_checkpoint(directory, out, target=target)
        assert not out.exists(), directory.name


def assert_export_refused(source: Path, fmt: str, out: Path, message: str, **kwargs: Any) -> None:
    """The export fails with its message, and ``out`` is never created."""
    with pytest.raises(InteropError, match=message):
        export_checkpoint(source, fmt, out, **kwargs)
    assert not out.exists()


def our_chain(model: Eagle3Model, ids: torch.Tensor, feats: torch.Tensor, a: int, steps: int) -> torch.Tensor:
    """Our chain from anchor x_a over the context rows 0…a−1, teacher-forced with ``ids``: ``[steps, N]``."""
    k, v, g = model.context_kv(feats[None, :a], ids[None, 1:a + 1], torch.arange(a)[None])
    with torch.no_grad():
        _, logits = model.chain(model.embed(ids[a:a + 1]), g[:, a - 1], torch.tensor([a - 1]), k, v,
                                torch.ones(1, a, dtype=torch.bool), steps,
                                lambda j, _l: model.embed(ids[a + 1 + j:a + 2 + j]))
    return logits[0]

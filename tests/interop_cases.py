"""Shared cases of the interop tests: a pickle-only checkpoint folder, and the check that an
import is refused with its message and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specforge.interop import InteropError, import_checkpoint

PICKLE_REFUSED = r"pytorch_model.bin: a pickle checkpoint; specforge loads weights only from safetensors"


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

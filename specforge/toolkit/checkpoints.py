"""The on-disk form every shipped drafter's checkpoint shares: a directory with one safetensors
file of weights and a ``config.json`` (never pickle).

``config.json`` always carries ``format`` and ``version`` (which loader reads it), ``method`` (the
training method that wrote it: ``dspark``, ``dflash``, ``medusa``, …), ``target`` (the target it
was trained for) and ``files`` (size and sha256 of the weights, checked on every load, so a
truncated or corrupted file is one clear error naming it).  Each format adds its own sections.
A checkpoint of another format — e.g. a Medusa checkpoint given to ``dspark`` — is one error that
names the method it holds and the drafter that loads it.

A config may name a checkpoint that ships inside a plug-in package as ``shipped:<name>``: the
package makes its directories known with :func:`ship` when it is imported, so this module — which
every drafter's loader imports — never imports a plug-in to find them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from specforge.errors import SpecforgeError
from specforge.files import file_problem, file_record
from specforge.vocab import DraftVocab

__all__ = ["CONFIG", "SHIPPED", "TARGET_SHAPE", "WEIGHTS", "DrafterCheckpointError", "check_fits", "checkpoint_method",
           "read_checkpoint", "read_meta", "read_vocab", "resolve_checkpoint", "ship", "vocab_tensors",
           "write_checkpoint"]

CONFIG, WEIGHTS = "config.json", "model.safetensors"
SHIPPED = "shipped:"  # the prefix of a shipped checkpoint's name in a config
# A drafter with layers of the target's shape: its config field -> the target's ModelArgs attribute.
TARGET_SHAPE = {"vocab_size": "vocab_size", "dim": "dim", "n_heads": "n_heads", "n_kv_heads": "n_kv_heads",
                "head_dim": "head_dim", "n_target_layers": "n_layers"}


class DrafterCheckpointError(SpecforgeError, ValueError):
    """A drafter directory that is missing, damaged or of another format (the message says which)."""


_shipped: dict[str, Path] = {}


def ship(directories: Mapping[str, Path]) -> None:
    """Make checkpoint directories nameable as ``shipped:<name>`` (``name -> directory``)."""
    _shipped.update({name: Path(path) for name, path in directories.items()})


def resolve_checkpoint(ref: str | Path) -> Path:
    """The directory a config's ``checkpoint`` names: ``shipped:<name>`` or a path."""
    text = str(ref)
    if not text.startswith(SHIPPED):
        return Path(ref)
    name = text[len(SHIPPED):]
    if name not in _shipped:
        raise DrafterCheckpointError(f"{text}: no such shipped drafter; shipped: "
                                     f"{', '.join(SHIPPED + n for n in sorted(_shipped)) or '(none)'}")
    return _shipped[name]


def write_checkpoint(directory: str | Path, meta: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    """Write ``tensors`` and ``meta`` (which must name ``format`` and ``version``) into
    ``directory``: weights first, config last, so a directory with a config.json always has its
    weights."""
    directory = Path(directory)
    json.dumps(meta)  # fail before writing anything if the config is not JSON
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS),
              metadata={"format": str(meta["format"])})
    meta = {**meta, "files": {WEIGHTS: file_record(directory / WEIGHTS)}}
    (directory / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint in ``directory`` (or ``shipped:<name>``), unchecked."""
    directory = resolve_checkpoint(directory)
    try:
        meta = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        raise DrafterCheckpointError(f"{directory}: no drafter checkpoint here (no {CONFIG})") from None
    except (OSError, ValueError) as exc:
        raise DrafterCheckpointError(f"{directory / CONFIG}: unreadable ({exc}); train or export the "
                                     "drafter again") from None
    if not isinstance(meta, dict):
        raise DrafterCheckpointError(f"{directory / CONFIG}: not a drafter config (a JSON object is expected)")
    return meta


def checkpoint_method(directory: str | Path) -> str:
    """The drafter that serves the checkpoint in ``directory``: the training method its config
    records."""
    method = read_meta(directory).get("method")
    if not isinstance(method, str):
        raise DrafterCheckpointError(f"{directory}: its {CONFIG} records no method (written before methods were "
                                     "recorded); save it again with save_drafter(..., method=...)")
    return method


def read_checkpoint(directory: str | Path, fmt: str, version: int, loader: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config, tensors)`` of the checkpoint in ``directory`` (or ``shipped:<name>``), checked to
    be of ``fmt`` v``version``; ``loader`` names the drafter that reads it, for messages."""
    directory = resolve_checkpoint(directory)
    meta = read_meta(directory)
    if meta.get("format") != fmt:
        held = meta.get("method") or meta.get("format")
        hint = f" (serve it with drafter.name={held})" if isinstance(held, str) and meta.get("method") else ""
        raise DrafterCheckpointError(f"{directory}: a {held!r} checkpoint (format {meta.get('format')!r}); the "
                                     f"{loader} drafter reads {fmt} checkpoints{hint}")
    if meta.get("version") != version:
        raise DrafterCheckpointError(f"{directory}: a {fmt} checkpoint of version {meta.get('version')!r}; this "
                                     f"specforge reads version {version}")
    for name, record in meta.get("files", {}).items():
        if (problem := file_problem(directory / name, record, str(directory / CONFIG))) is not None:
            raise DrafterCheckpointError(f"{problem}; train or export it again (a shipped drafter: reinstall specforge)")
    try:
        tensors = load_file(str(directory / WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise DrafterCheckpointError(f"{directory / WEIGHTS}: missing or damaged ({exc}); train or export the "
                                     "drafter again") from None
    return meta, tensors


def vocab_tensors(vocab: DraftVocab | None) -> dict[str, Tensor]:
    """A draft vocabulary's maps as checkpoint tensors ``vocab.d2t`` / ``vocab.t2d`` (none without one)."""
    return {} if vocab is None else {f"vocab.{k}": v for k, v in vocab.tensors().items()}


def read_vocab(tensors: dict[str, Tensor], where: str | Path) -> DraftVocab | None:
    """The draft vocabulary stored by :func:`vocab_tensors` (``None`` when there is none)."""
    maps = {k[len("vocab."):]: v for k, v in tensors.items() if k.startswith("vocab.")}
    try:
        return DraftVocab.from_maps(maps["d2t"], maps["t2d"]) if maps else None
    except (KeyError, ValueError) as exc:
        raise DrafterCheckpointError(f"{where}: its draft vocabulary maps are unusable ({exc})") from None


def check_fits(shape: Any, args: Any, where: str | Path | None, keys: dict[str, str]) -> None:
    """A checkpoint trained on another target shape cannot be served on this one: ``keys`` maps
    each field of the checkpoint's ``shape`` to the target ``args`` attribute it must equal."""
    for key, attr in keys.items():
        mine, theirs = getattr(shape, key), getattr(args, attr)
        if mine != theirs:
            raise DrafterCheckpointError(f"{where}: trained for a target with {key}={mine}; "
                                         f"the bound target has {key}={theirs}")

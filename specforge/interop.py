"""Drafter checkpoints in other projects' layouts: ``specforge export`` and ``specforge import``
(docs/interop.md).

A drafter plug-in lists the foreign layouts of its checkpoints in its registration
(``formats=(...)``, :class:`CheckpointFormat` objects): the layout a serving engine loads
(``vllm``, ``sglang``) or a training project writes.  The core only dispatches:

* **export** reads the checkpoint's ``method`` (its ``config.json``), finds the drafter registered
  under that name and the format asked for, and lets it write the layout into a temporary folder
  that replaces ``--out`` only when complete — a failed export leaves nothing behind;
* **import** asks every registered format whether a folder is in its layout (``detect``); exactly
  one must say yes, and it writes a specforge checkpoint the same way.

Loading never unpickles: a folder with only PyTorch pickles (``*.bin``, ``*.pt``) is refused,
naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from specforge.errors import SpecforgeError
from specforge.files import replace_atomically

__all__ = ["CheckpointFormat", "InteropError", "check_shapes", "drop_frozen", "export_checkpoint",
           "import_checkpoint", "load_tensors", "mismatch", "read_config", "recorded_target", "require_safetensors",
           "rope_theta", "target_tensor"]

_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class InteropError(SpecforgeError, ValueError):
    """A checkpoint that cannot be exported or imported; the message names the file and the problem."""


@runtime_checkable
class CheckpointFormat(Protocol):
    """One foreign layout of a drafter method's checkpoints.

    ``name`` is what ``--to``/``--from`` select (``vllm``, ``sglang``…); ``export`` writes the
    layout of the specforge checkpoint ``source`` into the empty folder ``out`` and returns notes
    for the user; ``detect`` says whether a folder is in this layout; ``import_checkpoint`` writes
    a specforge checkpoint of it into the empty folder ``out`` (``target``: a bound target to check
    re-stored frozen weights against, or None) and returns notes.  Both check every required
    tensor's presence and shape first and raise :class:`InteropError` naming the file.
    """

    name: str
    description: str

    def export(self, source: Path, out: Path) -> list[str]: ...

    def detect(self, directory: Path) -> bool: ...

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]: ...


def require_safetensors(directory: Path, weights: str) -> Path:
    """The safetensors file ``weights`` of ``directory``; a folder holding only pickles is refused
    (loading one could run code)."""
    path = directory / weights
    if path.is_file():
        return path
    pickles = sorted(p.name for pattern in _PICKLES for p in directory.glob(pattern))
    if pickles:
        raise InteropError(f"{directory / pickles[0]}: a pickle checkpoint; specforge loads weights only from "
                           f"safetensors (convert it with the project that wrote it, e.g. safetensors' "
                           f"`save_file`, then import the result)")
    raise InteropError(f"{path}: missing (no weights in {directory})")


def read_config(directory: Path, name: str = "config.json") -> dict[str, Any] | None:
    """The JSON object ``directory/name``; None when it is missing, unreadable or not an object
    (``detect`` then says no)."""
    try:
        config = json.loads((Path(directory) / name).read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def load_tensors(directory: Path, weights: str = "model.safetensors") -> tuple[Path, dict[str, Tensor]]:
    """``(file, tensors)``: every tensor of ``directory/weights``, or of the shards its
    ``weights.index.json`` lists (Hugging Face's ``save_pretrained`` splits large models); an
    unreadable file is one error naming it, a pickle-only folder is refused."""
    directory = Path(directory)
    index = directory / f"{weights}.index.json"
    if index.is_file() and not (directory / weights).is_file():
        shards = sorted(set(((read_config(directory, index.name) or {}).get("weight_map") or {}).values()))
        if not shards:
            raise InteropError(f"{index}: no weight_map naming its shards")
        where, paths = index, [directory / shard for shard in shards]
    else:
        where = require_safetensors(directory, weights)
        paths = [where]
    tensors: dict[str, Tensor] = {}
    for path in paths:
        try:
            tensors.update(load_file(str(path)))
        except (OSError, SafetensorError) as exc:
            raise InteropError(f"{path}: not a readable safetensors file ({exc})") from None
    return where, tensors


def check_shapes(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]], where: Path) -> None:
    """Every ``expected`` tensor present with its shape, before anything is written."""
    for key, want in expected.items():
        if key not in tensors:
            raise InteropError(f"{where}: the tensor {key!r} is missing")
        if tuple(tensors[key].shape) != tuple(want):
            raise InteropError(f"{where}: {key!r} has shape {tuple(tensors[key].shape)}, the config says {tuple(want)}")


def drop_frozen(tensor: Tensor, reference: Tensor | None, key: str, what: str, where: Path) -> str:
    """A re-stored copy of one of the target's frozen tensors (its embedding, its LM head): checked
    equal to the bound target's ``reference`` when there is one, then dropped — the drafter reads
    the target's own.  Returns the note."""
    if reference is not None and not torch.equal(tensor.to(reference.dtype), reference):
        raise InteropError(f"{where}: its {key!r} is not the target's {what} (another target?)")
    return (f"dropped {key!r}: the drafter reads the target's own {what}"
            + ("" if reference is None else " (checked equal to the bound target's)"))


def mismatch(pairs: dict[str, tuple[Any, Any]]) -> str:
    """``"dim 32 (target: 64), …"`` for the ``{name: (checkpoint's, target's)}`` that differ; ""
    when all agree."""
    return ", ".join(f"{k} {mine} (target: {theirs})" for k, (mine, theirs) in pairs.items() if mine != theirs)


def _formats(host: Any) -> dict[str, dict[str, CheckpointFormat]]:
    """Per drafter method, its registered formats by name."""
    return {name: {f.name: f for f in reg.metadata.formats}
            for name, reg in host.registry.of_kind("drafter").items() if reg.metadata.formats}


def _write(out: Path, make) -> list[str]:
    """Run ``make(tmp)`` into a temporary folder that replaces ``out`` only if it succeeds."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out}: not empty; choose a new folder (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replace_atomically(out) as tmp:
        tmp.mkdir()
        notes = make(tmp)
    return notes


def export_checkpoint(source: str | Path, to: str, out: str | Path, host: Any = None,
                      evaluation: str | Path | None = None, conformance: str | Path | None = None) -> list[str]:
    """Write the specforge checkpoint ``source`` in layout ``to`` under ``out``; returns notes.
    ``to="hf"`` (every method): the checkpoint with a model card (:mod:`specforge.model_card`),
    which shows the ``evaluation`` and ``conformance`` result files when given."""
    from specforge.plugins import get_host

    host = host or get_host()
    source = Path(source)
    try:
        meta = json.loads((source / "config.json").read_text())
    except FileNotFoundError:
        raise InteropError(f"{source}: no specforge checkpoint here (no config.json)") from None
    except ValueError as exc:
        raise InteropError(f"{source / 'config.json'}: not JSON ({exc})") from None
    method = meta.get("method") if isinstance(meta, dict) else None
    formats = _formats(host)
    if method not in formats:
        known = ", ".join(f"{m} ({', '.join(f)})" for m, f in sorted(formats.items())) or "none"
        raise InteropError(f"{source}: a {method!r} checkpoint; exportable methods: {known}")
    if to == "hf":
        from specforge.model_card import export_hf

        return _write(Path(out), lambda tmp: export_hf(source, tmp, evaluation, conformance))
    if to not in formats[method]:
        raise InteropError(f"{source}: {method} exports to {', '.join([*formats[method], 'hf'])}, not {to!r}")
    fmt = formats[method][to]
    return _write(Path(out), lambda tmp: fmt.export(source, tmp))


def import_checkpoint(directory: str | Path, out: str | Path, source_format: str | None = None, target: Any = None,
                      host: Any = None) -> tuple[str, str, list[str]]:
    """Write a specforge checkpoint of the foreign checkpoint in ``directory`` under ``out``;
    returns ``(method, format, notes)``.  ``source_format`` limits detection to the formats of that
    name (several methods may share one, e.g. ``vllm``; detection then picks the method)."""
    from specforge.plugins import get_host

    host = host or get_host()
    directory = Path(directory)
    if not directory.is_dir():
        raise InteropError(f"{directory}: no such folder")
    candidates = [(m, f) for m, fs in _formats(host).items() for f in fs.values()
                  if (source_format is None or f.name == source_format)]
    if source_format is not None and not candidates:
        names = sorted({f.name for fs in _formats(host).values() for f in fs.values()})
        raise InteropError(f"--from {source_format!r}: no such format; formats: {', '.join(names)}")
    hits = [(m, f) for m, f in candidates if f.detect(directory)]
    if not hits:
        require_safetensors(directory, "model.safetensors")  # a pickle-only folder says so first
        names = ", ".join(f"{m}/{f.name}" for m, f in candidates)
        raise InteropError(f"{directory}: an unknown checkpoint layout (none of {names} recognises its config.json "
                           "and tensors)")
    if len(hits) > 1:
        raise InteropError(f"{directory}: matches several layouts ({', '.join(f'{m}/{f.name}' for m, f in hits)}); "
                           "choose one with --from")
    method, fmt = hits[0]
    notes = _write(Path(out), lambda tmp: fmt.import_checkpoint(directory, tmp, target))
    return method, fmt.name, notes


# -- the target a checkpoint records (layouts that copy its config or its frozen tensors) --------


def rope_theta(config: dict[str, Any]) -> float | None:
    """The RoPE base of an HF ``config.json`` (``rope_parameters`` in newer transformers, else top level)."""
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return None if theta is None else float(theta)


def recorded_target(name: Any, shape: Any, fields: dict[str, str], source: Path) -> tuple[dict[str, Any], Path, Any]:
    """The recorded target's ``config.json``, folder (a GGUF's cached conversion) and
    :class:`~specforge.target.args.ModelArgs`, checked to be the one the drafter was trained for
    (``fields``: the drafter shape's field → the ModelArgs attribute it must equal): layouts that
    copy the target's config, or re-store its embedding, read them from here."""
    from transformers import AutoConfig

    from specforge.target.args import ModelArgs
    from specforge.target.loading import converted_checkpoint

    if not name:
        raise InteropError(f"{source}: the checkpoint does not record its target, whose config the layout copies")
    try:
        directory = converted_checkpoint(str(name))
        config = json.loads((directory / "config.json").read_text())
        args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    except (SpecforgeError, OSError, ValueError) as exc:
        raise InteropError(f"{source}: its target {name!r} cannot be read ({exc}); the layout copies the target's "
                           "config") from None
    wrong = mismatch({k: (getattr(shape, k), getattr(args, t)) for k, t in fields.items()})
    if wrong:
        raise InteropError(f"{source}: its recorded target {name!r} is another model — {wrong}")
    return config, directory, args


def target_tensor(directory: Path, *keys: str) -> Tensor:
    """The first of ``keys`` found in the target's safetensors, read alone (not the whole model)."""
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found = next((k for k in keys if k in f.keys()), None)
            if found is not None:
                return f.get_tensor(found)
    raise InteropError(f"{directory}: none of {', '.join(keys)} in the target's safetensors")

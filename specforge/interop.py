"""Drafter checkpoints in other projects' layouts: the ``specforge export`` and ``specforge import``
jobs (docs/interop.md).

A drafter plug-in lists the foreign layouts of its checkpoints in its registration
(``formats=(...)``, :class:`~specforge.toolkit.formats.CheckpointFormat` objects — the format
authors' API lives in :mod:`specforge.toolkit.formats`): the layout a serving engine loads
(``vllm``, ``sglang``) or a training project writes.  The jobs only dispatch:

* **export** reads the checkpoint's ``method`` (its ``config.json``), finds the drafter registered
  under that name and the format asked for, and lets it write the layout into a temporary folder
  that replaces ``--out`` only when complete — a failed export leaves nothing behind; a layout that
  is one file (a format with a ``suffix``: llama.cpp's ``.gguf``) is written under a temporary name
  and renamed to ``--out``, a new file; ``--to hf`` (every method) is :mod:`specforge.model_card`'s;
* **import** asks every registered format whether a folder is in its layout (``detect``); exactly
  one must say yes, and it writes a specforge checkpoint the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specforge.files import replace_atomically
from specforge.model_card import export_hf
from specforge.plugins import get_host
from specforge.toolkit.checkpoints import resolve_checkpoint
from specforge.toolkit.formats import CheckpointFormat, InteropError, require_safetensors

__all__ = ["drafter_directory", "export_checkpoint", "import_checkpoint"]


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


def _write_file(out: Path, suffix: str, make) -> list[str]:
    """Run ``make(tmp)``, which writes one file, under a temporary name renamed to ``out`` (a new
    file named ``*suffix``) only if it succeeds."""
    out = Path(out)
    if out.suffix != suffix:
        raise InteropError(f"{out}: this layout is one {suffix} file; give --out a file name ending in {suffix} "
                           "(nothing was written)")
    if out.exists():
        raise InteropError(f"{out}: exists; choose a new file (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replace_atomically(out) as tmp:
        notes = make(tmp)
    return notes


def drafter_directory(ref: str | Path) -> Path:
    """The directory of a drafter checkpoint named by a path or ``shipped:NAME`` — the shipped
    drafters are registered by the plug-ins, so they are loaded first."""
    get_host()
    return resolve_checkpoint(ref)


def export_checkpoint(source: str | Path, to: str, out: str | Path, host: Any = None,
                      evaluation: str | Path | None = None, conformance: str | Path | None = None) -> list[str]:
    """Write the specforge checkpoint ``source`` in layout ``to`` under ``out``; returns notes.
    ``to="hf"`` (every method): the checkpoint with a model card (:mod:`specforge.model_card`),
    which shows the ``evaluation`` and ``conformance`` result files when given."""
    host = host or get_host()
    source = resolve_checkpoint(source)  # a directory, or shipped:NAME (registered by the plug-ins just loaded)
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
        return _write(Path(out), lambda tmp: export_hf(source, tmp, evaluation, conformance))
    if to not in formats[method]:
        raise InteropError(f"{source}: {method} exports to {', '.join([*formats[method], 'hf'])}, not {to!r}")
    fmt = formats[method][to]
    if getattr(fmt, "suffix", None):  # one file, not a folder
        return _write_file(Path(out), fmt.suffix, lambda tmp: fmt.export(source, tmp))
    return _write(Path(out), lambda tmp: fmt.export(source, tmp))


def import_checkpoint(directory: str | Path, out: str | Path, source_format: str | None = None, target: Any = None,
                      host: Any = None) -> tuple[str, str, list[str]]:
    """Write a specforge checkpoint of the foreign checkpoint in ``directory`` under ``out``;
    returns ``(method, format, notes)``.  ``source_format`` limits detection to the formats of that
    name (several methods may share one, e.g. ``vllm``; detection then picks the method)."""
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

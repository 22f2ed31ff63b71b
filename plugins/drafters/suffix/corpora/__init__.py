"""Corpora shipped with the ``suffix`` drafter, named ``shipped:<name>`` in its ``corpus`` list.

Each is the regenerated-data directory of a ``specforge`` run (``progress.json`` — the target,
its sampling and the source's hash — and the ``regen-*.jsonl`` shards of conversations the
target answered itself) plus ``CORPUS.md`` saying how it was made and what it measured
(docs/composition.md#suffix).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from specforge.errors import SpecforgeError
from specforge.toolkit.checkpoints import SHIPPED

__all__ = ["resolve_corpus", "shipped_corpora"]


def shipped_corpora() -> dict[str, Path]:
    """``name -> directory`` of every corpus shipped in this package."""
    root = Path(str(files(__name__)))
    return {p.name: p for p in sorted(root.iterdir()) if (p / "CORPUS.md").is_file()}


def resolve_corpus(entry: str, key: str) -> str:
    """The path a ``corpus`` entry names: ``shipped:<name>`` or the entry itself."""
    if not entry.startswith(SHIPPED):
        return entry
    shipped = shipped_corpora()
    name = entry[len(SHIPPED):]
    if name not in shipped:
        raise SpecforgeError(f"{key}: {entry!r} is no shipped corpus; shipped: "
                             f"{', '.join(SHIPPED + n for n in shipped) or '(none)'}")
    return str(shipped[name])

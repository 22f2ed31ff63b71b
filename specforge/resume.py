"""Resumable jobs: the record a run keeps of its settings and progress, and what a rerun checks.

Regeneration, the feature cache, the main job's evaluation, ``specforge bench serving`` and the
conformance suite's seeds all take longer than a session may last, so each keeps a record beside
its output: the settings the output was made with (every one that changes its content: inputs,
target, sampling, the machine where speeds are compared, the code) and how far it got.  A rerun
continues a record only when its own settings are the same, so that one output never mixes two
runs' numbers; where the job cannot just redo the work it refuses, naming every setting that
differs and what to do (:func:`refuse_other_settings`).

A record is one JSON object, replaced atomically (:func:`write_record`): a kill leaves the old
record or the new one, never half of one.  :func:`tree_digest` fingerprints what a record cannot
hold itself (the files of a drafter, the source of the code under test).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from specforge.errors import SpecforgeError
from specforge.files import write_atomic

__all__ = ["UnreadableRecord", "differences", "read_record", "refuse_other_settings", "tree_digest",
           "write_record"]


class UnreadableRecord(SpecforgeError, ValueError):
    """A record that is there but is not a JSON object (truncated by a full disk, edited by hand);
    the message names the file and why.  Each job says what to do about it."""


def read_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The record at ``path``; None when there is none (a first run)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnreadableRecord(f"{path} is unreadable ({exc})") from None
    if not isinstance(record, dict):
        raise UnreadableRecord(f"{path} is unreadable (a JSON {type(record).__name__}, not an object)")
    return record


def write_record(path: str | os.PathLike, record: Mapping[str, Any], *, indent: int = 2) -> None:
    """Replace the record at ``path`` atomically (its folder made if need be).  Values JSON has no
    type for (a path, say) are written as their text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=indent, allow_nan=True, default=str) + "\n")


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The keys of ``current`` whose value ``recorded`` does not hold (a key it lacks counts: a
    record from before a setting existed says nothing about it)."""
    return [key for key, value in current.items() if recorded.get(key) != value]


def _shown(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def refuse_other_settings(recorded: Mapping[str, Any], current: Mapping[str, Any], *, subject: str, remedy: str,
                          error: type[Exception], summaries: Mapping[str, str] | None = None) -> None:
    """Raise ``error`` when ``recorded`` (what the output on disk was made with) differs from
    ``current`` (this run's settings), in one line naming each differing key with both values;
    ``summaries`` replaces a value too long to show (a list of shards, say) by a phrase."""
    keys = differences(recorded, current)
    if not keys:
        return
    summaries = summaries or {}
    shown = "; ".join(f"{key}: {summaries[key]}" if key in summaries
                      else f"{key}: {_shown(recorded.get(key))} on disk, {_shown(current[key])} now" for key in keys)
    raise error(f"{subject} was made with other inputs or settings ({shown}); {remedy}")


def tree_digest(roots: Mapping[str, Iterable[str | os.PathLike]], suffix: str = "") -> str:
    """Hex SHA-256 over every file under each root whose name ends in ``suffix``: its label, its
    path relative to the root and its bytes, in path order (``__pycache__`` left out), so the same
    files give the same digest on any machine or checkout."""
    digest = hashlib.sha256()
    for label, dirs in roots.items():
        for root in map(Path, dirs):
            for path in sorted(p for p in root.rglob(f"*{suffix}") if p.is_file()):
                relative = path.relative_to(root)
                if "__pycache__" in relative.parts:
                    continue
                digest.update(f"{label}/{relative.as_posix()}\0".encode())
                with open(path, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(chunk)
                digest.update(b"\0")
    return digest.hexdigest()

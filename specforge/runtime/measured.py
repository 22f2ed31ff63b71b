"""A choice measured once per machine and cached under ``$SPECFORGE_CACHE_DIR/profiles``.

The target's precision plan (:mod:`.precision`) and whether its compiled forward pays
(:mod:`.compile_choice`) are measured the same way: look for the record this machine made before
under a key that names everything the choice depends on (:func:`specforge.machine.machine_key`),
else measure and write it.  A damaged record is measured again; a read-only home only means
measuring again next time.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["cached_choice"]

T = TypeVar("T")


def cached_choice(path: Path, measure: Callable[[], T], load: Callable[[Mapping[str, Any]], T],
                  dump: Callable[[T], Mapping[str, Any]]) -> tuple[T, bool]:
    """``(choice, cached)``: ``load`` of the record at ``path``, or ``measure()`` written there
    with ``dump``.  ``load`` raises ``ValueError`` on a record it cannot read."""
    from specforge.files import write_atomic

    if path.is_file():
        try:
            return load(json.loads(path.read_text(encoding="utf-8"))), True
        except (OSError, ValueError) as exc:
            warnings.warn(f"the cached record {path} is unreadable ({exc}); measuring again",
                          RuntimeWarning, stacklevel=3)
    choice = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(dump(choice), indent=2) + "\n")
    except OSError as exc:
        warnings.warn(f"could not cache {path} ({exc}); it will be measured again", RuntimeWarning, stacklevel=3)
    return choice, False

"""A choice measured once per machine and cached under ``$SPECFORGE_CACHE_DIR/profiles``.

The target's precision plan (:mod:`specforge.runtime.torch.precision`), whether its compiled
forward pays (:mod:`specforge.runtime.torch.compile_choice`), the backend
(:mod:`specforge.runtime.choice`), the step curve (:mod:`specforge.toolkit.step_curve`) and what
drafting costs (:mod:`specforge.engine.draft_cost`) are all cached here: look for the record this
machine made before under a key that names everything the choice depends on
(:func:`specforge.machine.machine_key`), else measure and write it.  A damaged record is
measured again; a read-only home only means measuring again next time.

A choice timed while other processes kept the machine's CPUs busy is used for the run at hand but
not written: timings taken against another process's load say nothing about this machine (a
llama.cpp pass spinning against a busy core read 2.4 s for a 10 ms step, and the plan it cached
then steered every later run).  Each record says how busy the machine was while it was measured
(``others_cpu``); a record without it predates that check and is measured again.
``SPECFORGE_CACHE_WHEN_BUSY=1`` caches it anyway (the test suite does: its timings are not what
its cache is for, and a CI host's neighbours are not its own).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["BUSY", "cached_choice"]

T = TypeVar("T")

#: Other processes' share of all CPUs above which a measured choice is not cached (0.5 is one
#: core of two fully taken; a shell or a log writer stays far below 0.2).
BUSY = 0.2
_LOAD_KEY = "others_cpu"


def cached_choice(path: Path, measure: Callable[[], T], load: Callable[[Mapping[str, Any]], T],
                  dump: Callable[[T], Mapping[str, Any]]) -> tuple[T, bool]:
    """``(choice, cached)``: ``load`` of the record at ``path``, or ``measure()`` written there
    with ``dump``.  ``load`` raises ``ValueError`` on a record it cannot read."""
    from specforge.files import write_atomic
    from specforge.machine import cpu_times, others_share

    if path.is_file():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(record, dict) and _LOAD_KEY in record:
                return load({k: v for k, v in record.items() if k != _LOAD_KEY}), True
            warnings.warn(f"the cached record {path} was measured without checking that the machine was quiet; "
                          "measuring again", RuntimeWarning, stacklevel=3)
        except (OSError, ValueError, TypeError) as exc:
            warnings.warn(f"the cached record {path} is unreadable ({exc}); measuring again",
                          RuntimeWarning, stacklevel=3)
    before = cpu_times()
    choice = measure()
    others = others_share(before, cpu_times())
    if others is not None and others > BUSY and os.environ.get("SPECFORGE_CACHE_WHEN_BUSY") != "1":
        warnings.warn(f"other processes took {others:.0%} of this machine's CPUs while {path.name} was measured: "
                      "used for this run, not cached (measured again next time)", RuntimeWarning, stacklevel=3)
        return choice, False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {**dump(choice), _LOAD_KEY: None if others is None else round(others, 3)}
        write_atomic(path, json.dumps(record, indent=2) + "\n")
    except OSError as exc:
        warnings.warn(f"could not cache {path} ({exc}); it will be measured again", RuntimeWarning, stacklevel=3)
    return choice, False

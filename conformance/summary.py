"""``specforge conformance summary``: pool the reports of a false-alarm run of correct combinations.

A many-seed false-alarm run (``specforge conformance --seeds K --out FILE``) is best split over
several resumable files, one per core; this pools them: seeds, statistical cases, failures,
re-runs, the smallest p-value of any statistic against its level, the largest total-variation
distance, and
the combinations and seeds where those extremes occurred::

    specforge conformance summary runs/conformance/false-alarms*.json
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from specforge.errors import SpecforgeError

__all__ = ["ReportError", "read_seeds", "summarize"]


class ReportError(SpecforgeError):
    """A report file that cannot be read, or files that hold no statistical case."""


def read_seeds(paths: Iterable[str]) -> dict[int, dict]:
    """Every seed's report in the files, by seed (a seed found twice keeps its last report).

    Seeds run on different code (their ``code`` fingerprints differ,
    :mod:`specforge_conformance.fingerprint`) are refused: pooled, they would certify no code."""
    seeds: dict[int, dict] = {}
    where: dict[str, list[str]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: {exc}") from None
        # a multi-seed run writes {"seeds": [...]}, a single seed its report itself
        for rec in data["seeds"] if "seeds" in data else [data]:
            seeds[rec["seed"]] = rec
            where.setdefault(rec.get("code", "unrecorded"), []).append(f"{path} seed {rec['seed']}")
    if len(where) > 1:
        raise ReportError("the reports were run on different code (fingerprints "
                          + "; ".join(f"{code}: {', '.join(w[:3])}{' …' if len(w) > 3 else ''}"
                                      for code, w in where.items())
                          + "); pool only seeds of one fingerprint")
    return seeds


def _tests(case: dict) -> dict[str, dict]:
    """Every statistic of a case report (reports older than the mechanism statistics: the sequence)."""
    if case.get("tests"):
        return case["tests"]
    return {"sequence": case["fit"]} if case.get("fit") else {}


def summarize(seeds: dict[int, dict]) -> tuple[str, bool]:
    """The summary as text, and whether every seed passed."""
    cases = [(s, case) for s, rec in seeds.items() for combo in rec["combinations"] for case in combo["cases"]]
    fits = [(t["p_value"], t["tv"], c.get("level", c["alpha"]), f"{c['combination']} [{name}]", s)
            for s, c in cases for name, t in _tests(c).items()]
    if not fits:
        raise ReportError("the reports hold no statistical case")
    failed = sorted(s for s, rec in seeds.items() if not rec["passed"])
    reruns = [c for _, c in cases if c.get("rerun")]
    p_min = min(fits, key=lambda f: f[0])
    tv_max = max(fits, key=lambda f: f[1])
    span = sorted(seeds)
    missing = sorted(set(range(span[0], span[-1] + 1)) - set(span)) or "none"
    median_seconds = sorted(r["seconds"] for r in seeds.values())[len(seeds) // 2]
    code = next(iter(seeds.values())).get("code", "unrecorded")
    lines = [
        f"seeds: {len(seeds)} ({span[0]}..{span[-1]}; missing: {missing}), code fingerprint {code}",
        f"statistical cases: {len(cases)} ({len(fits)} statistics), failed seeds: {failed or 'none'}, cases re-run at 10x N: {len(reruns)}",
        f"smallest p-value: {p_min[0]:.3g} (its level {p_min[2]:.2g}; {p_min[3]}, seed {p_min[4]})",
        f"largest TV: {tv_max[1]:.4f} ({tv_max[3]}, seed {tv_max[4]})",
        f"median seconds per seed: {median_seconds:.0f}",
    ]
    return "\n".join(lines), not failed

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

__all__ = ["OTHER_SHARD", "ReportError", "join_shards", "read_seeds", "summarize"]

OTHER_SHARD = "other shard"  # the status of a row a sharded run (--shard I/K) leaves to another shard


class ReportError(SpecforgeError):
    """A report file that cannot be read, or files that hold no statistical case."""


def read_seeds(paths: Iterable[str], incomplete: list[str] | None = None) -> dict[int, dict]:
    """Every seed's report in the files, by seed (a seed found twice keeps its last report).

    The shards of a seed (``--shard I/K``) are joined into one report; a seed some of whose
    shards are missing is left out (and named in ``incomplete`` when a list is given).  Seeds run
    on different code (their ``code`` fingerprints differ,
    :mod:`specforge_conformance.fingerprint`) are refused: pooled, they would certify no code."""
    seeds: dict[int, dict] = {}
    shards: dict[int, dict[tuple[int, int], dict]] = {}
    where: dict[str, list[str]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: {exc}") from None
        # a multi-seed run writes {"seeds": [...]}, a single seed its report itself
        for rec in data["seeds"] if "seeds" in data else [data]:
            if rec.get("shard"):
                shards.setdefault(rec["seed"], {})[tuple(rec["shard"])] = rec
            else:
                seeds[rec["seed"]] = rec
            where.setdefault(rec.get("code", "unrecorded"), []).append(f"{path} seed {rec['seed']}")
    if len(where) > 1:
        raise ReportError("the reports were run on different code (fingerprints "
                          + "; ".join(f"{code}: {', '.join(w[:3])}{' …' if len(w) > 3 else ''}"
                                      for code, w in where.items())
                          + "); pool only seeds of one fingerprint")
    for seed, parts in sorted(shards.items()):
        joined = join_shards(parts)
        if joined is None:
            if incomplete is not None:
                have = ", ".join(f"{i}/{k}" for i, k in sorted(parts))
                incomplete.append(f"seed {seed} (shards {have} only)")
        elif seed not in seeds:
            seeds[seed] = joined
    return seeds


def join_shards(parts: dict[tuple[int, int], dict]) -> dict | None:
    """One seed's report from its K shard reports (``None`` unless all K are there, of one K):
    each row from the shard that ran it, the components' checks from the first, the seconds
    summed (CPU time when the shards ran side by side)."""
    counts = {k for _, k in parts}
    if len(counts) != 1 or set(parts) != {(i, k) for k in counts for i in range(1, k + 1)}:
        return None
    ordered = [parts[key] for key in sorted(parts)]
    first = ordered[0]
    rows = [next((p["combinations"][j] for p in ordered if p["combinations"][j]["status"] != OTHER_SHARD),
                 first["combinations"][j]) for j in range(len(first["combinations"]))]
    return {**{k: v for k, v in first.items() if k != "shard"}, "combinations": rows,
            "passed": all(p["passed"] for p in ordered), "seconds": sum(p["seconds"] for p in ordered),
            "shards": len(ordered)}


def _tests(case: dict) -> dict[str, dict]:
    """Every statistic of a case report (reports older than the mechanism statistics: the sequence)."""
    if case.get("tests"):
        return case["tests"]
    return {"sequence": case["fit"]} if case.get("fit") else {}


def summarize(seeds: dict[int, dict], incomplete: Iterable[str] = ()) -> tuple[str, bool]:
    """The summary as text, and whether every seed passed (``incomplete``: seeds left out for
    missing shards, named in the text)."""
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
    incomplete = list(incomplete)
    if incomplete:
        lines.append(f"not pooled, shards missing: {', '.join(incomplete)}")
    return "\n".join(lines), not failed

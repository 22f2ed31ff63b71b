"""Summarise one or more ``specforge conformance --out`` files of correct combinations.

The 50-seed false-alarm run of the fast tier was split over several resumable files (one per
core); this pools them: seeds, statistical cases, failures, re-runs, the smallest p-value against
the per-case α, the largest total-variation distance, and the per-combination extremes.

    python scripts/false_alarm_summary.py runs/conformance/false-alarms*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    seeds: dict[int, dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        # a multi-seed run writes {"seeds": [...]}, a single seed its report itself
        for rec in data["seeds"] if "seeds" in data else [data]:
            seeds[rec["seed"]] = rec
    cases = [(s, case) for s, rec in seeds.items() for combo in rec["combinations"] for case in combo["cases"]]
    failed = sorted({s for s, rec in seeds.items() if not rec["passed"]})
    reruns = [c for _, c in cases if c.get("rerun")]
    fits = [(c["fit"]["p_value"], c["fit"]["tv"], c["alpha"], c["combination"], s) for s, c in cases if c.get("fit")]
    p_min = min(fits, key=lambda f: f[0])
    tv_max = max(fits, key=lambda f: f[1])
    span = sorted(seeds)
    print(f"seeds: {len(seeds)} ({span[0]}..{span[-1]}; missing: {sorted(set(range(span[0], span[-1] + 1)) - set(span)) or 'none'})")
    print(f"statistical cases: {len(fits)}, failed seeds: {failed or 'none'}, cases re-run at 10x N: {len(reruns)}")
    print(f"smallest p-value: {p_min[0]:.3g} (per-case alpha {p_min[2]:.2g}; {p_min[3]}, seed {p_min[4]})")
    print(f"largest TV: {tv_max[1]:.4f} ({tv_max[3]}, seed {tv_max[4]})")
    print(f"median seconds per seed: {sorted(r['seconds'] for r in seeds.values())[len(seeds) // 2]:.0f}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

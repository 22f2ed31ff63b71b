"""False alarms of the conformance suite's tree probes (docs/conformance.md#proving-the-suites-power).

Every shipped verifier that verifies trees and samples (``rejection``, ``match``) in its two tree
probe cases, seeds START..STOP-1, each through the suite's two-stage check at the per-case level
of a fast-tier run over every shipped component (α = 10⁻⁶ over ~70 cases).  OUT is a resumable
record (:mod:`specforge.resume`) holding the code fingerprint and one entry per case; a rerun
keeps the cases of the same code and runs the rest::

    OMP_NUM_THREADS=1 python scripts/tree_false_alarms.py runs/fa-trees.json 0 50
"""
import json
import sys
import time

import torch

from specforge.registry import ComponentKind
from specforge.resume import read_record, write_record
from specforge_conformance import probes
from specforge_conformance.fingerprint import code_fingerprint
from specforge_conformance.harness import check_case
from specforge_conformance.suite import ALPHA, suite_host

PER_CASE = ALPHA / 70
torch.set_num_threads(1)
host = suite_host()
out, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
code = code_fingerprint()
previous = read_record(out) or {}
cases = [c for c in previous.get("cases", []) if previous.get("code") == code]
done = {(c["seed"], c["verifier"], c["drafter"]) for c in cases}
for seed in range(start, stop):
    for name in ("rejection", "match"):
        for case in probes.probe_cases(host, ComponentKind.VERIFIER, name, 20_000, seed)[1:]:  # the tree probes
            key = (seed, name, json.dumps(case.pipeline["drafter"][1], sort_keys=True))
            if key in done:
                continue
            t = time.time()
            r = check_case(case, host, PER_CASE)
            cases.append({"seed": seed, "verifier": name, "drafter": key[2], "n": case.n, "failed": r.failed,
                          "min_p": r.min_p, "rerun": r.rerun is not None, "seconds": round(time.time() - t, 1),
                          "p": {k: f.p_value for k, f in r.tests.items()}, "tau": round(r.tau, 3)})
            write_record(out, {"code": code, "cases": cases})
            print(json.dumps({k: cases[-1][k] for k in ("seed", "verifier", "failed", "min_p", "seconds")}), flush=True)
failed = [c for c in cases if c["failed"]]
print(f"{len(cases)} cases, {len({c['seed'] for c in cases})} seeds, {len(failed)} failed, "
      f"{sum(c['rerun'] for c in cases)} re-run at 10·N, smallest p {min(c['min_p'] for c in cases):.3g}")

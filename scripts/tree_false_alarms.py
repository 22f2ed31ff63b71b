"""False alarms of the conformance suite's tree probes (docs/conformance.md#proving-the-suites-power).

Every shipped verifier that verifies trees and samples (``rejection``, ``match``) in its two tree
probe cases, seeds START..STOP-1, each through the suite's two-stage check at the per-case level
of a fast-tier run over every shipped component (α = 10⁻⁶ over ~70 cases); one JSON line per
(seed, case) appended to OUT, so a killed run resumes::

    OMP_NUM_THREADS=1 python scripts/tree_false_alarms.py runs/fa-trees.jsonl 0 50
"""
import json, sys, time
import torch
from specforge.registry import ComponentKind
from specforge_conformance import probes
from specforge_conformance.harness import check_case
from specforge_conformance.suite import suite_host, ALPHA
torch.set_num_threads(1)
host = suite_host()
out, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
PER_CASE = ALPHA / 70
done = set()
try:
    for line in open(out):
        r = json.loads(line); done.add((r["seed"], r["verifier"], r["drafter"]))
except FileNotFoundError:
    pass
for seed in range(start, stop):
    for name in ("rejection", "match"):
        cases = probes.probe_cases(host, ComponentKind.VERIFIER, name, 20_000, seed)
        for case in cases[1:]:  # the tree probes
            key = (seed, name, json.dumps(case.pipeline["drafter"][1], sort_keys=True))
            if key in done:
                continue
            t = time.time()
            r = check_case(case, host, PER_CASE)
            rec = {"seed": seed, "verifier": name, "drafter": key[2], "n": case.n, "failed": r.failed,
                   "min_p": r.min_p, "rerun": r.rerun is not None, "seconds": round(time.time() - t, 1),
                   "p": {k: f.p_value for k, f in r.tests.items()}, "tau": round(r.tau, 3)}
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps({k: rec[k] for k in ("seed", "verifier", "failed", "min_p", "seconds")}), flush=True)

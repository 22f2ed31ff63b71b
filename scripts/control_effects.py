"""How much a negative control moves the output law (docs/conformance.md#proving-the-suites-power).

Each named control runs in its own case (``specforge_conformance.power.control_case``) at N
requests, and so does the correct verifier in the same case; printed per arm: the total
variation between the empirical and the exact law of the first emitted token (V cells) and of the
first two (V² cells).  The correct arm's TV is the sampling noise at this N, so a control's
effect is the excess over it::

    OMP_NUM_THREADS=1 python scripts/control_effects.py 100000 tree-sibling-echo tree-late-sibling
"""
import json
import sys
from dataclasses import replace

import torch

from specforge_conformance.harness import run_case
from specforge_conformance.power import control_case, control_host

torch.set_num_threads(1)
host = control_host()
n, names = int(sys.argv[1]), sys.argv[2:]
for name in names:
    base = replace(control_case(name, n=n, seed=0, host=host), n=n)
    law = base.law()
    v, h = law.vocab, law.horizon
    exact = law.probs.reshape(v, v, -1)
    row = {"control": name, "n": n, "vocab": v}
    for arm, case in (("control", base), ("correct", replace(base, pipeline={**base.pipeline,
                                                                          "verifier": ("rejection", {})}))):
        counts = run_case(case, host, law).counts.to(torch.float64).reshape(v, v, -1) / n
        row[f"{arm} first"] = round(0.5 * float((counts.sum((1, 2)) - exact.sum((1, 2))).abs().sum()), 4)
        row[f"{arm} first two"] = round(0.5 * float((counts.sum(2) - exact.sum(2)).abs().sum()), 4)
    print(json.dumps(row), flush=True)

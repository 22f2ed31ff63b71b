"""``specforge conformance``: the suite from the command line.

Exit status 0 when every tested combination is certified (and, with ``--controls``, every control
is rejected on every seed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="statistically check that registered pipelines keep the target's output law",
        description="Runs the real engine with registered plug-ins on an exactly enumerable tiny "
        "target and tests the law of the generated sequences (chi-square, α = 1e-6 over the run). "
        "Lossy components are listed, never certified.",
    )
    p.add_argument("--plugin", action="append", default=[], metavar="NAME",
                   help="check only combinations that use this component (repeatable)")
    p.add_argument("--full", action="store_true",
                   help="full tier: every combination, 3 cases each, N = 200,000")
    p.add_argument("--n", type=int, default=None, help="samples per case (overrides the tier)")
    p.add_argument("--seed", type=int, default=0, help="seed of the case draws and of the requests")
    p.add_argument("--seeds", type=int, default=None,
                   help="repeat the run with seeds seed..seed+K-1 (false-alarm check; default 1) or, "
                        "with --controls, the number of seeds per control (default 20)")
    p.add_argument("--case", metavar="JSON", help="re-run exactly one case printed by a failure")
    p.add_argument("--controls", nargs="*", default=None, metavar="NAME",
                   help="prove the suite's power: run the negative controls (all, or those named)")
    p.add_argument("--no-deterministic", action="store_true", help="skip the deterministic checks")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the JSON report here")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.set_defaults(func=run)


def _write(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


def _emit(args, payload: dict, text: str) -> None:
    if args.out:
        _write(args.out, payload)
    print(json.dumps(payload, indent=2) if args.json else text)


def _progress(message: str) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    if args.case:
        return _run_case(args)
    if args.controls is not None:
        return _run_controls(args)
    from specforge_conformance.suite import run_suite

    reports = []
    args.seeds = args.seeds or 1
    for k in range(args.seeds):
        report = run_suite(tier="full" if args.full else "fast", plugins=args.plugin, seed=args.seed + k,
                           n=args.n, progress=_progress, deterministic=not args.no_deterministic)
        reports.append(report)
        if args.out and args.seeds > 1:  # partial results survive an interrupted long run
            _write(args.out, {"seeds": [r.to_dict() for r in reports], "passed": all(r.passed for r in reports),
                              "complete": k + 1 == args.seeds})
        if args.seeds > 1:
            print(f"seed {args.seed + k}: {'passed' if report.passed else 'FAILED'} "
                  f"({report.seconds:.0f} s)", file=sys.stderr)
    passed = all(r.passed for r in reports)
    if len(reports) == 1:
        report = reports[0]
        text = report.table() + ("\n\n" + report.explain() if not report.passed else "")
        text += f"\n\n{'PASSED' if passed else 'FAILED'} ({report.tier} tier, {report.seconds:.0f} s)"
        _emit(args, report.to_dict(), text)
    else:
        failed = [r.seed for r in reports if not r.passed]
        cases = sum(len(c.results) for r in reports for c in r.combos)
        text = (f"{len(reports)} seeds, {cases} statistical cases: "
                + ("no failures" if not failed else f"failures at seeds {failed}"))
        for r in reports:
            if not r.passed:
                text += "\n" + r.explain()
        _emit(args, {"seeds": [r.to_dict() for r in reports], "passed": passed}, text)
    return 0 if passed else 1


def _run_case(args: argparse.Namespace) -> int:
    from specforge_conformance.harness import Case, check_case
    from specforge_conformance.power import control_host

    case = Case.from_json(args.case)
    if args.n:
        case = Case.from_dict({**case.to_dict(), "n": args.n})
    result = check_case(case, control_host(), 1e-6)
    payload = result.to_dict()
    text = (f"{case.combination.label()}: N = {case.n:,}, p = {result.fit.p_value:.3g}, TV = {result.fit.tv:.4f}"
            + ("" if result.rerun is None else
               f"; re-run at N = {result.rerun.case.n:,}: p = {result.rerun.fit.p_value:.3g}")
            + f"\n{'FAILED' if result.failed else 'passed'} at α = 1e-6")
    _emit(args, payload, text)
    return 1 if result.failed else 0


def _run_controls(args: argparse.Namespace) -> int:
    from specforge_conformance.power import controls_table, run_controls

    seeds = args.seeds or 20
    def partial(done):
        if args.out:
            _write(args.out, {"controls": [r.to_dict() for r in done], "passed": all(r.ok for r in done),
                              "complete": False})

    reports = run_controls(args.controls or None, seeds=seeds, n=args.n or 20_000,
                           progress=lambda m: print(m, file=sys.stderr), on_report=partial)
    ok = all(r.ok for r in reports)
    text = controls_table(reports) + f"\n\n{'every control rejected on every seed' if ok else 'SOME CONTROL SURVIVED'}"
    _emit(args, {"controls": [r.to_dict() for r in reports], "passed": ok}, text)
    return 0 if ok else 1

"""``specforge conformance``: the suite from the command line.

The command reaches the CLI like any plug-in's, through the ``specforge`` entry-point group and
:func:`~specforge.hookspecs.specforge_register_commands`; this module stays cheap to import
(the suite itself is imported when the command runs).

Exit status 0 when no tested combination failed — each is certified, or listed as lossy, not
certifiable or not exercised (its cases verified nothing) — and, with ``--controls``, every
control is rejected on every seed; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from specforge import hookimpl
from specforge.errors import ConfigError
from specforge.resume import UnreadableRecord, differences, read_record, write_record

__all__ = ["add_arguments", "run"]


@hookimpl
def specforge_register_commands(register):
    register(
        "conformance", add_arguments, run,
        help="statistically check that registered pipelines keep the target's output law",
        description="Runs the real engine with registered plug-ins on an exactly enumerable tiny "
        "target and tests the law of the generated sequences (chi-square, α = 1e-6 over the run). "
        "Lossy components are listed, never certified.",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="NAME",
                   help="check only combinations that use this component (repeatable)")
    p.add_argument("--full", action="store_true",
                   help="full tier: every combination, 3 cases each, N = 200,000")
    p.add_argument("--n", type=int, default=None, help="samples per case (overrides the tier)")
    p.add_argument("--seed", type=int, default=0, help="seed of the case draws and of the requests")
    p.add_argument("--seeds", type=int, default=None,
                   help="repeat the run with seeds seed..seed+K-1 (false-alarm check; default 1) or, "
                        "with --controls, the number of seeds per control (default 20)")
    p.add_argument("--case", metavar="JSON", help="re-run exactly one case printed by a failure (same "
                   "target, prompt, sampling, batch, seeds and thread count)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing probe or combination")
    p.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help="start no new probe or combination after S seconds (what is left is reported "
                        "as not run, and the run does not pass)")
    p.add_argument("--shard", type=_shard, default=(1, 1), metavar="I/K",
                   help="run the I-th of K interleaved shares of the probes and combinations (one seed "
                        "split over K cores or machines; `conformance summary` joins the K reports)")
    p.add_argument("--controls", nargs="*", default=None, metavar="NAME",
                   help="prove the suite's power: run the negative controls (all, or those named)")
    p.add_argument("--no-deterministic", action="store_true", help="skip the deterministic checks")
    p.add_argument("--engine", action="append", default=None, metavar="NAME",
                   help="black-box tier: check an engine we do not own through its public interface (repeatable; "
                        "`--engine list` lists them and what installs each); --n sets the T = 1 arm's requests")
    p.add_argument("--drafter", default=None, metavar="DRAFTER",
                   help="with --engine llama.cpp-dspark / llama.cpp-dflash: the drafter, a GGUF (`specforge export --to "
                        "llama.cpp`) or a checkpoint directory or shipped:NAME (exported beside --out, or to a "
                        "temporary file)")
    p.add_argument("--draft", default=None, metavar="DRAFT.gguf",
                   help="with --engine llama.cpp-draft: the draft model (default: the target GGUF itself)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the JSON report here")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    actions = p.add_subparsers(dest="action", metavar="ACTION", title="actions",
                               description="optional: without one, the suite runs")
    summary = actions.add_parser(
        "summary",
        help="pool the --out files of a false-alarm run (--seeds) split over several processes",
        description="Seeds, statistical cases, failures, re-runs, the smallest p-value against the "
        "per-case α and the largest total-variation distance over every seed of the files given; "
        "exit 1 if any seed failed.",
    )
    summary.add_argument("reports", nargs="+", metavar="FILE.json",
                         help="reports written by `specforge conformance --out` (one seed or several)")


def _shard(text: str) -> tuple[int, int]:
    try:
        i, k = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/K, e.g. 1/2") from None
    if not 1 <= i <= k:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: I must be between 1 and K")
    return i, k


def _emit(args, payload: dict, text: str) -> None:
    if args.out:
        write_record(args.out, payload)  # atomic: a killed multi-seed run keeps whole files only
    print(json.dumps(payload, indent=2) if args.json else text)


def _progress(message: str) -> None:
    pass


def _previous(out: str | None) -> dict:
    """What an interrupted run with the same ``--out`` left there ({} when there is nothing to
    pick up: the run starts over)."""
    try:
        return (read_record(out) if out else None) or {}
    except UnreadableRecord as exc:
        print(f"{exc}; starting over", file=sys.stderr)
        return {}


def run(args: argparse.Namespace) -> int:
    if args.action == "summary":
        return _run_summary(args)
    if args.case:
        return _run_case(args)
    if args.controls is not None:
        return _run_controls(args)
    if args.engine:
        return _run_engines(args)
    from specforge_conformance.suite import run_suite

    args.seeds = args.seeds or 1
    tier = "full" if args.full else "fast"
    if args.seeds > 1:
        return _run_seeds(args, tier)
    report = run_suite(tier=tier, plugins=args.plugin, seed=args.seed, n=args.n, progress=_progress,
                       deterministic=not args.no_deterministic, fail_fast=args.fail_fast,
                       max_seconds=args.max_seconds, shard=args.shard)
    text = report.table() + ("\n\n" + report.explain() if not report.passed else "")
    text += f"\n\n{'PASSED' if report.passed else 'FAILED'} ({report.tier} tier, {report.seconds:.0f} s)"
    _emit(args, report.to_dict(), text)
    return 0 if report.passed else 1


def _run_engines(args: argparse.Namespace) -> int:
    """The black-box tier (docs/engines.md): each engine started, drawn from, tested and stopped."""
    from specforge_conformance.engines import ENGINES, engine_list, run_engines

    if "list" in args.engine:
        print(engine_list())
        return 0
    unknown = [e for e in args.engine if e not in ENGINES]
    if unknown:
        print(f"unknown engine {', '.join(unknown)}; choose from {', '.join(ENGINES)} (or `list`)", file=sys.stderr)
        return 2
    if args.draft and not Path(args.draft).is_file():
        print(f"--draft {args.draft}: no such file (a .gguf)", file=sys.stderr)
        return 2
    drafter = _drafter_gguf(args.drafter, Path(args.out).parent if args.out else None) if args.drafter else None
    report = run_engines(args.engine, n=args.n, seed=args.seed, drafter=drafter,
                         draft=args.draft and Path(args.draft),
                         log_dir=Path(args.out).parent if args.out else None, progress=_progress)
    text = report.table() + f"\n\n{'PASSED' if report.passed else 'FAILED'} (engines)"
    _emit(args, report.to_dict(), text)
    return 0 if report.passed else 1


def _drafter_gguf(drafter: str, out_dir: Path | None) -> Path:
    """``drafter`` as a GGUF llama.cpp loads: the file itself, or a drafter checkpoint (a directory
    or ``shipped:NAME``) exported ``--to llama.cpp`` into ``out_dir`` (or a temporary folder)."""
    import tempfile

    from specforge.interop import drafter_directory, export_checkpoint

    if Path(drafter).is_file():
        return Path(drafter)
    source = drafter_directory(drafter)
    if not (source / "config.json").is_file():
        raise ConfigError([f"--drafter {drafter}: neither a .gguf file nor a drafter checkpoint directory"])
    folder = out_dir if out_dir is not None else Path(tempfile.mkdtemp(prefix="specforge-drafter-"))
    path = folder / f"{source.name}.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    # The file is derived from the checkpoint: a rerun of the same command (or one killed while
    # exporting) exports again beside it and replaces it whole, instead of refusing the run.
    staging = Path(tempfile.mkdtemp(prefix=f".{source.name}-", dir=folder))
    try:
        export_checkpoint(source, "llama.cpp", staging / path.name)
        os.replace(staging / path.name, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _run_seeds(args: argparse.Namespace, tier: str) -> int:
    """The false-alarm check: seeds seed..seed+K-1, one suite run each.  With ``--out`` the file
    is rewritten after every seed, and a file left by an interrupted run of the same tier and
    sample size is picked up: its seeds are kept, not run again."""
    from specforge_conformance.fingerprint import code_fingerprint
    from specforge_conformance.suite import run_suite

    wanted = [args.seed + k for k in range(args.seeds)]
    done: dict[int, dict] = {}
    previous = _previous(args.out)
    if previous:
        # a seed run on other code says nothing about this code: run again, not pooled
        same = {"tier": tier, "n": args.n, "shard": list(args.shard) if args.shard[1] > 1 else None}
        code, stale = code_fingerprint(), 0
        for rec in previous.get("seeds", []):
            if isinstance(rec, dict) and rec.get("seed") in wanted and not differences(rec, same):
                if rec.get("code") != code:
                    stale += 1
                else:
                    done[rec["seed"]] = rec
        if stale:
            print(f"{args.out}: {stale} seeds were run on other code (fingerprint is now {code}); "
                  "they are run again", file=sys.stderr)
        if done:
            print(f"{args.out}: {len(done)} of {len(wanted)} seeds already done, resuming", file=sys.stderr)

    def save() -> None:
        if args.out:
            recs = [done[s] for s in wanted if s in done]
            write_record(args.out, {"seeds": recs, "passed": all(r["passed"] for r in recs),
                                    "complete": len(recs) == len(wanted)})

    explanations = {}
    for seed in wanted:
        if seed in done:
            continue
        report = run_suite(tier=tier, plugins=args.plugin, seed=seed, n=args.n, progress=_progress,
                           deterministic=not args.no_deterministic, fail_fast=args.fail_fast,
                           max_seconds=args.max_seconds, shard=args.shard)
        done[seed] = report.to_dict()
        if not report.passed:
            explanations[seed] = report.explain()
        save()
        print(f"seed {seed}: {'passed' if report.passed else 'FAILED'} ({report.seconds:.0f} s)", file=sys.stderr)
    recs = [done[s] for s in wanted]
    failed = [r["seed"] for r in recs if not r["passed"]]
    cases = sum(len(c["cases"]) for r in recs for c in r["combinations"])
    text = (f"{len(recs)} seeds, {cases} statistical cases: "
            + ("no failures" if not failed else f"failures at seeds {failed}"))
    for seed, why in explanations.items():
        text += f"\n{why}"
    if failed and len(explanations) < len(failed):
        text += f"\n(failures from an earlier run are described in {args.out})"
    _emit(args, {"seeds": recs, "passed": not failed, "complete": True}, text)
    return 0 if not failed else 1


def _run_summary(args: argparse.Namespace) -> int:
    from specforge_conformance.summary import read_seeds, summarize

    incomplete: list[str] = []
    text, passed = summarize(read_seeds(args.reports, incomplete), incomplete)
    print(text)
    return 0 if passed else 1


def _run_case(args: argparse.Namespace) -> int:
    from specforge.plugins import PluginHost
    from specforge_conformance.harness import Case, check_case
    from specforge_conformance.power import control_host

    case = Case.from_json(args.case)
    if args.n:
        case = Case.from_dict({**case.to_dict(), "n": args.n})
    # every installed plug-in (the case may name a third party's component), the suite's probe
    # components and the negative controls
    result = check_case(case, control_host(PluginHost()), 1e-6)
    payload = result.to_dict()
    lines = [f"{case.combination.label()}: N = {case.n:,}" + (f", {case.threads} threads" if case.threads else "")]
    for run in (result, result.rerun):
        if run is None:
            continue
        for name, f in run.tests.items():
            lines.append(f"  N = {run.case.n:,}  {name:<12} p = {f.p_value:.3g}  TV = {f.tv:.4f}"
                         + (f"  ({f.impossible} impossible draws)" if f.impossible else ""))
    lines.append(f"{'FAILED' if result.failed else 'passed'} at α = 1e-6")
    text = "\n".join(lines)
    _emit(args, payload, text)
    return 1 if result.failed else 0


def _run_controls(args: argparse.Namespace) -> int:
    """The power run.  With ``--out`` the file is rewritten after every seed, and a file left by an
    interrupted run at the same N is picked up: its finished seeds are kept, not run again."""
    from specforge_conformance import controls
    from specforge_conformance.power import controls_table, resumable, run_controls

    seeds = args.seeds or 20
    names = args.controls or [*controls.SUBTLE, *controls.CONTROL_CASES]
    resume = {}
    previous = _previous(args.out)
    if previous:
        try:
            resume = resumable(previous, names, args.n)
        except (KeyError, TypeError, ValueError) as exc:
            print(f"{args.out}: unreadable ({exc}); starting over", file=sys.stderr)
        if resume:
            print(f"{args.out}: resuming {', '.join(resume)}", file=sys.stderr)

    def partial(done, in_progress):
        if args.out:
            write_record(args.out, {"controls": [r.to_dict() for r in done], "in_progress": in_progress,
                                    "passed": all(r.ok for r in done), "complete": False})

    reports = run_controls(names, seeds=seeds, n=args.n, progress=lambda m: print(m, file=sys.stderr),
                           on_report=partial, resume=resume)
    ok = all(r.ok for r in reports)
    text = controls_table(reports) + f"\n\n{'every control rejected on every seed' if ok else 'SOME CONTROL SURVIVED'}"
    _emit(args, {"controls": [r.to_dict() for r in reports], "passed": ok, "complete": True}, text)
    return 0 if ok else 1

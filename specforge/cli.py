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
from specforge.config import BACKENDS, TargetConfig, load_pipeline, preset_names
from specforge.errors import ConfigError
from specforge.errors import SpecforgeError
from specforge.bench import commands as bench_commands
from specforge.commands import Subcommand, add_subcommand
from specforge.machine import machine_line
from specforge.plugins import PluginHost, get_host
from specforge.toolkit.step_curve import DEFAULT_BATCHES
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


def _table(title: str, columns: Sequence[str], rows: list[Sequence[str]], **style: Any) -> Table:
    table = Table(title=title, **style)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def cmd_plugins(args: argparse.Namespace) -> int:
    """list every registered component and failed plug-in"""
    info = get_host().describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    console = Console()
    console.print(_table("specforge components", ("kind", "name", "package", "version", "metadata", "description"),
                         [(c["kind"], c["name"], c["package"], c["version"], _meta_summary(c["metadata"]),
                           c["metadata"].get("description", "")) for c in info["components"]], show_lines=False))
    missing = [k.value for k in ComponentKind if not any(c["kind"] == k.value for c in info["components"])]
    if missing:
        console.print(f"no component registered yet for: {', '.join(missing)}")
    if info["commands"]:
        console.print(_table("sub-commands from plug-ins", ("command", "package", "version", "help"),
                             [(c["name"], c["package"], c["version"], c["help"]) for c in info["commands"]]))
    if info["failed"]:
        columns = ("plugin", "package", "version", "stage", "error")
        console.print(_table("plug-ins that failed to load (skipped)", columns,
                             [[f[k] for k in columns] for f in info["failed"]], style="red"))
    return EXIT_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    """print the resolved, validated pipeline

    Merge config files or presets left to right, apply key=value overrides, validate, and print the
    result (defaults filled in).
    """
    sources = [s for s in args.items if "=" not in s] or ["default"]
    overrides = [s for s in args.items if "=" in s]
    pipeline = load_pipeline(sources, overrides)
    if args.json:
        print(json.dumps(pipeline.to_dict(), indent=2))
    else:
        sys.stdout.write(pipeline.to_yaml())
    return EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    """generate text with a pipeline, streaming

    Decode one prompt (streamed to stdout) or a JSONL file of prompts with the pipeline's target and
    components; a stats line follows on stderr.
    """
    from specforge.engine import Engine, GenerationRequest
    from specforge.evalsets import read_prompt_file

    sources = args.config or ["default"]
    pipeline = load_pipeline(sources, args.overrides)
    prompts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompts)
    engine = Engine.from_pipeline(pipeline, requests=min(len(prompts), pipeline.engine.max_batch))
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


def cmd_export(args: argparse.Namespace) -> int:
    """write a trained drafter in the layout vLLM, SGLang or llama.cpp serves

    Read a specforge drafter checkpoint and write it in another project's layout (see `specforge
    plugins --json` for each drafter's checkpoint_formats; `--to llama.cpp` writes one .gguf file);
    every required tensor and shape is checked first, and nothing is written on error.
    """
    from specforge.interop import export_checkpoint

    if args.to != "hf" and (args.eval or args.conformance):
        raise ConfigError(["--eval and --conformance fill the model card of --to hf; other layouts have none"])
    notes = export_checkpoint(args.drafter, args.to, args.out, evaluation=args.eval, conformance=args.conformance)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"exported {args.drafter} → {args.out} ({args.to})")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    """write a specforge checkpoint of a drafter trained elsewhere

    Detect the layout of a foreign drafter checkpoint (safetensors only; pickles are refused) and
    write a specforge checkpoint; with --target, re-stored frozen weights and shapes are checked
    against that target.
    """
    from specforge.interop import import_checkpoint

    target = None
    if args.target:
        from specforge.runtime import load_target

        # Only the target's weights and shapes are read (no pass runs): its torch runtime.
        target = load_target(args.target, dtype=args.dtype, backend="torch")
    method, fmt, notes = import_checkpoint(args.checkpoint, args.out, args.source_format, target)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"imported {args.checkpoint} ({fmt}) → {args.out}: serve it with drafter.name={method} "
          f"drafter.checkpoint={args.out}")
    return EXIT_OK


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
    """fit a calibrator (STS) on a pipeline's own rounds; ECE, AUROC, Brier before and after

    Decode held-out prompts (drawn between the ones `specforge eval` picks) with every drafted token
    verified, record each round's raw confidences and outcome, fit the calibrator on the rounds of
    even-numbered prompts and score it on the others, per temperature.  Writes
    calibrator-T<t>.safetensors, reliability-T<t>.png and calibration.json.
    """
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


def cmd_profile(args: argparse.Namespace) -> int:
    """measure the target's step curve SPS(B) (the hardware profile hw-prefix/async-topk read)

    Time verify passes of B flattened tokens (spread over cached requests, logits for every row) for
    each B; write profile.json, timings.json, a table and profile.png.
    """
    from specforge.profiling import plot_profile, profile_table
    from specforge.toolkit.step_curve import measure_sps
    from specforge.runtime import load_target

    target = load_target(args.model, dtype=args.dtype, compile=args.compile, weights=args.weights,
                         backend=args.backend)
    profile, records = measure_sps(target, args.batches, context=args.context, requests=args.requests,
                                   reps=args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    (out / "timings.json").write_text(json.dumps({"model": args.model, "dtype": args.dtype,
                                                  "precision": target.precision.to_dict(),
                                                  "weights": args.weights, "compiled": args.compile,
                                                  "backend": target.backend.name,
                                                  "context": args.context, "device": profile.device,
                                                  "records": records}, indent=2) + "\n")
    plot_profile(records, out / "profile.png", f"{args.model} ({target.precision_label}), {profile.device}")
    print(json.dumps(records, indent=2) if args.json else profile_table(records))
    print(machine_line(), file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    print(f"wrote {out / 'profile.json'} (use it as scheduler.profile=...), timings.json and profile.png",
          file=sys.stderr)
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    """train a drafter (resumes from the output directory's last checkpoint)

    Compose training configs (presets: quick, medium, full; or YAML files) with key=value overrides,
    build or reuse the feature cache, and train; a killed run resumes where its last checkpoint left
    off.
    """
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
    """EvalSettings from the options :func:`_eval_options` declared (plus command-specific ones)."""
    from specforge.evaluation import EvalSettings

    return EvalSettings(datasets=args.dataset or EvalSettings.datasets, prompts=args.prompts,
                        temperatures=args.temperature, max_new_tokens=args.max_new_tokens,
                        eval_dir=args.eval_dir, **more)


def cmd_eval(args: argparse.Namespace) -> int:
    """τ, acceptance per draft position and speedup of a pipeline on prompt sets

    Decode prompts from each set with the pipeline and, in the same run, with plain decoding of the
    same target; report τ (accepted drafts + the bonus token per round), conditional acceptance and
    prefix survival per position, tokens/s and the speedup, at each temperature.  Writes eval.json
    and acceptance.png.
    """
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
    """the main job: regenerate data with the target, train a DSpark drafter, evaluate it

    On the embedded SmolLM2 by default: answer ShareGPT prompts with the target, train DSpark on its
    hidden states, then measure τ and the speedup over plain decoding on the eval sets.  Each stage
    resumes or reuses what an earlier call made.
    """
    from specforge.main_job import DEFAULT_COMPARE, run_main_job, summary

    compare = [] if args.no_compare else (args.compare or list(DEFAULT_COMPARE))
    result = run_main_job(args.config or ["quick"], args.overrides, _eval_settings(args), compare=compare)
    print(json.dumps(result, indent=2) if args.json else summary(result))
    return EXIT_OK


def cmd_config_presets(args: argparse.Namespace) -> int:
    """list the shipped pipeline presets"""
    for name in preset_names():
        print(name)
    return EXIT_OK


# --- the parser: each built-in sub-command's options, then the list of them ----------------------
# (a command's help and description are the docstring of the function that runs it)


def _config_options(p: argparse.ArgumentParser, config: str, overrides: str) -> None:
    """``--config FILE|PRESET`` (repeatable) and trailing ``key=value`` overrides."""
    p.add_argument("--config", action="append", metavar="FILE|PRESET", help=config)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=overrides)


def _eval_options(p: argparse.ArgumentParser, prompts: int, max_new_tokens: int) -> None:
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


def _plugins_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _config_show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("items", nargs="*", metavar="FILE|PRESET|key=value",
                   help="config files or preset names (default: 'default'), then dot-list overrides")
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML")


_CONFIG_ACTIONS = (Subcommand.documented("show", _config_show_arguments, cmd_config_show),
                   Subcommand.documented("presets", lambda p: None, cmd_config_presets))


def _config_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    for action in _CONFIG_ACTIONS:
        add_subcommand(actions, action)


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    _config_options(p, "pipeline config (repeatable, merged left to right; default: 'default')", "config overrides")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one user message")
    what.add_argument("--prompts", metavar="FILE.jsonl", help="one prompt per line")
    p.add_argument("--json", action="store_true", help="print tokens, text and stats per request")


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    whats = p.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    for command in bench_commands():
        add_subcommand(whats, command)


def _profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="embedded default, HF directory or GGUF file")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the target's precision (auto: measured on this machine per pass size)")
    p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), metavar="B",
                   help="flattened batch sizes to time")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--requests", type=int, default=16, help="requests a batch is spread over (at most)")
    p.add_argument("--reps", type=int, default=5, help="timed passes per B (the median is kept)")
    p.add_argument("--compile", action="store_true",
                   help="measure the compiled forward (target.compile), whose curve has another shape")
    p.add_argument("--weights", choices=["auto", "dense", "native"], default="auto",
                   help="measure with a GGUF's 4-bit blocks run natively (target.weights=native)")
    p.add_argument("--backend", choices=BACKENDS, default=TargetConfig.model_fields["backend"].default,
                   help="what runs the passes (target.backend; docs/backends.md)")
    p.add_argument("--out", default="runs/profile", help="output directory")
    p.add_argument("--json", action="store_true", help="print the timings as JSON instead of the table")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    _config_options(p, "training config (repeatable, merged left to right; default: 'quick')", "config overrides")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (this run)")
    p.add_argument("--restart", action="store_true", help="ignore existing checkpoints and start over")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    _config_options(p, "training config (presets: quick, medium, full; default: quick)", "training config overrides")
    _eval_options(p, prompts=3, max_new_tokens=96)
    p.add_argument("--no-compare", action="store_true",
                   help="measure only the trained drafter (default: also ngram and the shipped drafter)")
    p.add_argument("--json", action="store_true", help="print the JSON result")


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    _config_options(p, "pipeline config (repeatable; default: 'dspark', the main job's trained drafter)",
                    "pipeline overrides")
    _eval_options(p, prompts=8, max_new_tokens=128)
    p.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    p.add_argument("--no-speedup", action="store_true", help="skip the plain-decoding baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/eval", help="where eval.json and acceptance.png go")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")


def _calibrate_arguments(p: argparse.ArgumentParser) -> None:
    _config_options(p, "pipeline config (repeatable; default: 'dspark')", "pipeline overrides")
    p.add_argument("--dataset", action="append", metavar="NAME|FILE.jsonl",
                   help="prompt set (repeatable; default: gsm8k math500 humaneval mbpp mt-bench)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per set (half fit, half score)")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--calibrator", default="sts", help="the registered calibrator to fit")
    p.add_argument("--calibrator-option", action="append", metavar="KEY=VALUE",
                   help="a key of the calibrator's config, e.g. offsets=true (sts: a Platt offset per position)")
    p.add_argument("--online", nargs="?", const="online-sts", default=None, metavar="CALIBRATOR",
                   help="also replay the fit rounds, in serving order, into this online calibrator (default "
                        "online-sts) from identity, and across a code → chat shift: held-out ECE against rounds "
                        "seen (online-T<t>.png)")
    p.add_argument("--replay", nargs="+", default=None, metavar="ROUNDS_FILE",
                   help="fit and score the rounds-T<t>.safetensors of an earlier run instead of decoding (another "
                        "--calibrator, other --online settings)")
    p.add_argument("--online-window", type=int, default=None, metavar="ROUNDS",
                   help="the online calibrator's window (its memory; it follows a shift within about one window)")
    p.add_argument("--eval-dir", default=None, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/calibrate")
    p.add_argument("--json", action="store_true")


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", metavar="DRAFTER_DIR", help="a drafter checkpoint directory, or shipped:NAME")
    p.add_argument("--to", required=True, metavar="FORMAT",
                   help="vllm, sglang, llama.cpp, … (per drafter method), or hf: the checkpoint with a model card")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="a new (or empty) folder; --to llama.cpp: a new .gguf file")
    p.add_argument("--eval", default=None, metavar="EVAL_JSON",
                   help="--to hf: the τ table of this `specforge eval` result")
    p.add_argument("--conformance", default=None, metavar="JSON",
                   help="--to hf: the result of this `specforge conformance --out` run")


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="DIR")
    p.add_argument("--out", required=True, metavar="DRAFTER_DIR", help="a new (or empty) folder")
    p.add_argument("--from", dest="source_format", default=None, metavar="FORMAT", help="skip detection")
    p.add_argument("--target", default=None, help="the target it serves (embedded default, HF dir or GGUF), to check")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")


_BUILT_IN = (
    Subcommand.documented("plugins", _plugins_arguments, cmd_plugins),
    Subcommand("config", _config_arguments, None, help="compose and validate pipeline configs"),
    Subcommand.documented("generate", _generate_arguments, cmd_generate),
    Subcommand("bench", _bench_arguments, None, help="benchmarks (JSON, a table and a plot)"),
    Subcommand.documented("profile", _profile_arguments, cmd_profile),
    Subcommand.documented("train", _train_arguments, cmd_train),
    Subcommand.documented("run", _run_arguments, cmd_run),
    Subcommand.documented("eval", _eval_arguments, cmd_eval),
    Subcommand.documented("calibrate", _calibrate_arguments, cmd_calibrate),
    Subcommand.documented("export", _export_arguments, cmd_export),
    Subcommand.documented("import", _import_arguments, cmd_import),
)


def _add_plugin_commands(sub, host: PluginHost) -> list[str]:
    """The sub-commands plug-ins register (``specforge_register_commands``), after the built-in
    ones; returns a note for each that could not be added."""
    notes = []
    for command in host.commands.values():
        origin = f"plug-in {command.plugin!r} ({command.package})"
        if command.name in sub.choices:
            notes.append(f"command {command.name!r} of {origin} skipped: it is built in")
            continue
        try:
            add_subcommand(sub, command)
        except Exception as exc:  # noqa: BLE001 - one broken command must not take the whole CLI down
            reason = f"command {command.name!r} of {origin} cannot declare its options: {type(exc).__name__}: {exc}"
            sub.choices[command.name].set_defaults(func=_unusable(reason))
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
    for command in _BUILT_IN:
        add_subcommand(sub, command)
    parser.epilog = _plugin_epilog(host, _add_plugin_commands(sub, host))
    return parser


def _interrupt_on_sigterm() -> None:
    """SIGTERM (``kill``, a job scheduler, a CI timeout) ends a command as Ctrl-C does: Python's
    default would die at once, skipping every ``finally`` — the processes a command started
    (llama-server, vLLM) would outlive it and a checkpoint being written would be left half done."""
    import signal
    import threading

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _interrupt_on_sigterm()
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

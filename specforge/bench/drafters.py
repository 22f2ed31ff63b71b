"""``specforge bench drafters``: several drafters trained on the same data at the same budget, then
compared in one run (docs/comparison.md; the protocol of the DSpark paper's §4, Table 1
and Fig. 2).

1. *Data.*  Every method trains on one regenerated dataset (``<out>/regenerated``, answered by the
   target once) and methods that tap the same target layers share one feature cache
   (``<out>/features/<layers>``).  Both are data preparation, outside the budget.
2. *Budget.*  Each method first runs ``probe_steps`` steps in a scratch directory; the median step
   time turns ``budget_minutes`` of training (wall clock at this process's thread count) into a
   step count, and the method is then trained for exactly that many steps with its learning-rate
   schedule fitted to them — equal time, not equal steps, since a 2-layer backbone steps faster
   than a 5-layer one.  ``<out>/<method>/budget.json`` records the probe; a killed run resumes
   from the method's last checkpoint.
3. *Evaluation.*  Every trained drafter, and every tree arm (a trained drafter served with a token
   tree), decodes the same prompts of each eval set at each temperature, with plain decoding of the
   same target in the same run (:func:`specforge.evaluation.evaluate`): τ, the speedup, each
   method's round as a multiple of a plain step, and the conditional acceptance per position.

Writes ``bench.json``, ``table.md`` (the Table-1-shaped tables), ``acceptance.png`` (Fig. 2) and
``learning.png`` (held-out τ̂ against training minutes, to see whether τ has flattened).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specforge.bench.runner import Report, add_output_arguments, bench_command
from specforge.config import compose, validation_problems
from specforge.errors import ConfigError
from specforge.files import write_atomic
from specforge.machine import machine
from specforge.resume import read_record, write_record

__all__ = ["BENCH_PRESETS", "COMMAND", "REPORT", "DraftersBench", "bench_table", "load_bench_config", "prepare",
           "run_drafters_bench"]


class BenchMethod(BaseModel):
    """One trained arm: its ``drafter.*`` training section, training overrides of its own, and
    pipeline overrides for serving it."""

    model_config = ConfigDict(extra="forbid")
    drafter: dict[str, Any] = Field(description="the drafter.* section of its training config (name + keys)")
    train: list[str] = Field(default_factory=list,
                             description="key=value overrides of the shared training config for this method only "
                                         "(batch.*, optimizer.*, schedule.*: the data is every method's)")
    serve: list[str] = Field(default_factory=list, description="pipeline key=value overrides when serving it")

    @field_validator("train")
    @classmethod
    def _not_the_data(cls, value: list[str]) -> list[str]:
        shared = [o for o in value if o.split("=", 1)[0].strip().split(".")[0] in ("data", "features", "target")]
        if shared:
            raise ValueError(f"{', '.join(shared)}: the data, features and target are shared by every method "
                             "(set them in the bench's overrides)")
        return value


class TreeArm(BaseModel):
    """A trained method served with a token tree, compared with its own chain at concurrency 1."""

    model_config = ConfigDict(extra="forbid")
    of: str = Field(description="the trained method it serves")
    drafter: dict[str, Any] = Field(description="drafter.* keys that make it a tree, e.g. {tree: {topk: 4, nodes: 16}}")


class DraftersBench(BaseModel):
    """``specforge bench drafters``: what to train, for how long, and what to measure."""

    model_config = ConfigDict(extra="forbid")
    train: list[str] = Field(default_factory=lambda: ["cpu"],
                             description="training presets or YAML files every method shares (data, features, optimizer)")
    overrides: list[str] = Field(default_factory=list, description="key=value overrides of that shared training config")
    budget_minutes: float = Field(60.0, gt=0, description="training wall-clock minutes per method (at the "
                                                          "process's thread count: say which when you quote it)")
    probe_steps: int = Field(6, ge=2, description="steps timed to turn the budget into a step count")
    steps: int | None = Field(None, ge=1, description="train every method exactly this many steps instead of "
                                                      "budget_minutes (equal steps: no probe)")
    eval_points: int = Field(8, ge=1, description="held-out evaluations over a method's run (the learning curve)")
    methods: dict[str, BenchMethod]
    trees: dict[str, TreeArm] = Field(default_factory=dict)
    datasets: list[str] = Field(default_factory=lambda: ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"])
    on_training_prompts: bool = Field(
        False, description="evaluate on the first user turns of the conversations the methods trained on "
                           "(written to <out>/training-prompts.jsonl) instead of `datasets`: the memorisation check")
    prompts: int = Field(8, ge=1, description="prompts per eval set")
    max_new_tokens: int = Field(128, ge=1)
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    eval_dir: str | None = Field(None, description="folder of the named prompt sets (default: the shipped ones)")
    out: str = Field("runs/bench-drafters", description="output directory")

    @model_validator(mode="after")
    def _trees_name_methods(self) -> DraftersBench:
        bad = [f"trees.{k}.of: {t.of!r} is not one of the methods ({', '.join(self.methods)})"
               for k, t in self.trees.items() if t.of not in self.methods]
        clash = sorted(set(self.trees) & set(self.methods))
        if bad or clash:
            raise ValueError("; ".join(bad + [f"trees.{k}: the name is a method's too" for k in clash]))
        if not self.methods:
            raise ValueError("methods: name at least one")
        return self


# The paper's comparison (§4, Table 1) at SmolLM2's scale: chain drafting, γ = 7 (TTT 7 for Eagle3,
# 7 heads for Medusa), every drafter over the same 8,192-token draft vocabulary (DSpark's Markov
# stage on the top 32 of each position, as the shipped drafter serves), on the `cpu`
# preset's data (~3,600 of the target's own answers).  The trees — EAGLE-2's dynamic tree and a
# Medusa static tree (the top-k per head, widest near the root) — come in 8 and 16 nodes: on a
# CPU a verify pass of up to ~8 tokens costs about one of 1, so the best size is measured, not assumed.
_MEDUSA_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
                [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
_VOCAB = 8192
TRAINING_PROMPTS = "training-prompts.jsonl"
# The DSpark recipe study (docs/comparison.md#recipe): the shipped drafter's
# architecture on the `medium` data (~640 of the target's own answers), one change per arm, every
# arm at the same wall-clock budget, so learning.png answers "which change buys held-out τ̂ per
# CPU-hour".  Data changes (T = 0 answers) are a second run of the same preset with
# `overrides=[data.regenerate.temperature=0]` and its own `out`.
_SHIPPED_DSPARK = {"name": "dspark", "layers": 2, "gamma": 7, "draft_vocab": _VOCAB,
                   "head": {"name": "markov", "rank": 256},
                   "confidence": {"name": "dspark-head", "rank": 256, "embedding": "head"}}
BENCH_PRESETS: dict[str, dict[str, Any]] = {
    "recipe": {
        "train": ["medium"],
        "budget_minutes": 20.0,
        "prompts": 4,
        "max_new_tokens": 96,
        "out": "runs/recipe",
        "methods": {
            "base": {"drafter": _SHIPPED_DSPARK},
            # the last two target layers: the closest to the next-token law the drafter learns
            "init-28-29": {"drafter": {**_SHIPPED_DSPARK, "init_from_target": [28, 29]}},
            "full-vocab": {"drafter": {**_SHIPPED_DSPARK, "draft_vocab": None}},
            "ce-heavy": {"drafter": {**_SHIPPED_DSPARK, "loss": {"ce_weight": 1.0, "tv_weight": 0.9}}},
        },
    },
    # The memorisation check (docs/reference-run.md#memorisation): the target's greedy answers to 48
    # prompts, trained on until the loss stops falling, then decoded greedily on the same prompts
    # with every block verified.  A drafter whose inputs are right approaches τ = γ + 1 there; one
    # that stays far below has a defect no amount of data fixes (tap offset, label shift, mask
    # leak, positions).  The target runs in float32, one request at a time, in the answers and in
    # the evaluation: in 4-bit weights a pass's numerics depend on its row count, and SmolLM2's
    # greedy text then leaves the answers it was trained on within a few dozen tokens (measured:
    # 9 of 12 prompts), after which the check would score new text, not memorisation.
    "memorise": {
        "train": ["quick"],
        "overrides": ["target.dtype=float32", "data.limit=64", "data.max_length=320", "data.eval_sequences=0",
                      "data.regenerate.temperature=0", "data.regenerate.max_new_tokens=160",
                      "data.regenerate.max_batch=1",
                      "batch.sequences=8", "batch.anchors=32", "optimizer.lr=2e-3", "schedule.warmup_steps=20"],
        "budget_minutes": 25.0,
        "on_training_prompts": True,
        "prompts": 48,
        "max_new_tokens": 128,
        "temperatures": [0.0],
        "out": "runs/memorise",
        "methods": {
            "dspark": {"drafter": _SHIPPED_DSPARK, "serve": ["scheduler.name=fixed"]},
            "eagle3": {"drafter": {"name": "eagle3", "steps": 7, "draft_vocab": _VOCAB},
                       "serve": ["scheduler.name=fixed"]},
        },
    },
    # Anchors per sequence (DeepSpec trains 512, the `cpu` preset 16): the shipped architecture on
    # the `medium` data, each arm at the same wall-clock budget — more anchors make a step dearer,
    # so the curves say whether positions or steps buy held-out τ̂ per CPU-hour.
    "anchors": {
        "train": ["medium"],
        "budget_minutes": 20.0,
        "prompts": 4,
        "max_new_tokens": 96,
        "out": "runs/anchors",
        "methods": {f"anchors-{n}": {"drafter": _SHIPPED_DSPARK, "train": [f"batch.anchors={n}"],
                                     "serve": ["scheduler.name=fixed"]} for n in (16, 64, 256, 512)},
    },
    "paper": {
        "methods": {
            "dspark-2": {"drafter": {"name": "dspark", "layers": 2, "gamma": 7, "draft_vocab": _VOCAB},
                         "serve": ["drafter.candidates=32"]},
            "dspark-5": {"drafter": {"name": "dspark", "layers": 5, "gamma": 7, "draft_vocab": _VOCAB},
                         "serve": ["drafter.candidates=32"]},
            "dflash-5": {"drafter": {"name": "dflash", "layers": 5, "gamma": 7, "draft_vocab": _VOCAB}},
            "eagle3": {"drafter": {"name": "eagle3", "steps": 7, "draft_vocab": _VOCAB}},
            "medusa": {"drafter": {"name": "medusa", "heads": 7, "draft_vocab": _VOCAB}},
        },
        "trees": {
            "eagle3-tree-8": {"of": "eagle3", "drafter": {"tree": {"topk": 2, "nodes": 8}}},
            "eagle3-tree-16": {"of": "eagle3", "drafter": {"tree": {"topk": 4, "nodes": 16}}},
            "medusa-tree-8": {"of": "medusa", "drafter": {"tree": _MEDUSA_TREE[:8]}},
            "medusa-tree-16": {"of": "medusa", "drafter": {"tree": _MEDUSA_TREE}},
        },
    },
}


def load_bench_config(sources: Sequence[str] = ("paper",), overrides: Sequence[str] = ()) -> DraftersBench:
    """Presets (:data:`BENCH_PRESETS`) or YAML files merged left to right, then ``key=value``
    overrides; every problem is reported at once, naming the key and the valid keys."""
    layers = []
    for src in sources:
        if src in BENCH_PRESETS and not Path(src).is_file():
            layers.append(OmegaConf.create(copy.deepcopy(BENCH_PRESETS[src])))
        elif Path(src).is_file():
            layers.append(OmegaConf.create(compose([src])))
        else:
            raise ConfigError([f"{src}: no such bench config file or preset; presets: {', '.join(BENCH_PRESETS)}"])
    merged = OmegaConf.merge(*layers, OmegaConf.create(compose([], list(overrides))))
    raw = OmegaConf.to_container(merged, resolve=True)
    try:
        return DraftersBench.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc, DraftersBench)) from None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _shared(bench: DraftersBench) -> dict[str, Any]:
    """The training config every method shares, as a dict."""
    from specforge.training.config import load_train_config

    return load_train_config(list(bench.train), list(bench.overrides)).to_dict()


def _train_config(bench: DraftersBench, label: str, out: Path, layers: Sequence[int] | None,
                  schedule: dict[str, Any] | None, directory: Path | None = None,
                  output: dict[str, Any] | None = None) -> Any:
    """The training config of one method: the shared one with its drafter section, the shared data
    and feature cache, and (once known) its budgeted schedule."""
    from specforge.training.config import validate_train_config

    method = bench.methods[label]
    raw = _shared(bench)
    if method.train:
        raw = OmegaConf.to_container(OmegaConf.merge(raw, OmegaConf.from_dotlist(list(method.train))), resolve=True)
    raw["drafter"] = copy.deepcopy(method.drafter)
    raw["output"]["dir"] = str(directory or out / label)
    regen = raw["data"]["regenerate"]
    if regen.get("enabled") and not regen.get("dir"):
        regen["dir"] = str(out / "regenerated")
    if layers is not None and not raw["features"].get("cache_dir"):
        raw["features"]["cache_dir"] = str(out / "features" / "-".join(map(str, layers)))
    if schedule is not None:
        raw["schedule"].update(schedule)
    raw["output"].update(output or {})
    return validate_train_config(raw, source=f"bench method {label}")


def _tap_layers(config: Any, target: Any) -> tuple[int, ...]:
    """The target layers a method's features hold (its training method says)."""
    method_cls, options = config.training_method()
    return tuple(method_cls(options, target, "cpu").needs().layers)


def _step_seconds(metrics: Path) -> float:
    """Median step time of a probe, the first step (allocation, first-call kernels) left out."""
    times = [r["step_time"] for r in map(json.loads, metrics.read_text().splitlines())
             if r.get("split") == "train" and r.get("step", 0) > 1]
    if not times:
        raise ConfigError([f"{metrics}: the budget probe recorded no step after the first"])
    return statistics.median(times)


def _budget(bench: DraftersBench, label: str, out: Path, layers: tuple[int, ...], target: Any,
            say: Callable[[str], None]) -> dict[str, Any]:
    """Probe the method's step time (once; cached in budget.json) and size its run to the budget."""
    from specforge.training import Trainer

    path = out / label / "budget.json"
    record = read_record(path)
    if record is not None:
        return record
    if bench.steps is not None:
        record = {"steps": bench.steps, "probe_step_seconds": None, "machine": machine()}
        write_record(path, record)
        return record
    probe_dir = out / label / "probe"
    shutil.rmtree(probe_dir, ignore_errors=True)
    steps = bench.probe_steps
    config = _train_config(bench, label, out, layers, {"total_steps": 10 * steps, "epochs": None, "warmup_steps": 0},
                           directory=probe_dir)
    trainer = Trainer(config, target=target)
    try:
        trainer.train(max_steps=steps)
    finally:
        trainer.close()
    seconds = _step_seconds(probe_dir / "metrics.jsonl")
    total = max(1, int(bench.budget_minutes * 60 / seconds))
    record = {"budget_minutes": bench.budget_minutes, "probe_step_seconds": seconds, "steps": total,
              "machine": machine()}
    write_record(path, record)
    shutil.rmtree(probe_dir, ignore_errors=True)
    say(f"{label}: {seconds:.2f} s per step → {total} steps in {bench.budget_minutes:g} min")
    return record


def _train(bench: DraftersBench, label: str, out: Path, target: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """Train (or resume, or reuse) one method at the budget; its serving sections and its curve."""
    from specforge.training import Trainer
    from specforge.training.checkpoint import latest_checkpoint

    layers = _tap_layers(_train_config(bench, label, out, None, None), target)
    budget = _budget(bench, label, out, layers, target, say)
    steps = budget["steps"]
    warmup = min(int(_train_config(bench, label, out, None, None).schedule.warmup_steps), steps // 10)
    interval = max(1, steps // bench.eval_points)
    config = _train_config(bench, label, out, layers, {"total_steps": steps, "epochs": None, "warmup_steps": warmup},
                           output={"eval_interval": interval, "checkpoint_interval": interval})
    run = out / label
    ckpts = run / "checkpoints"
    last = latest_checkpoint(ckpts)[0] if ckpts.is_dir() else None
    trainer = Trainer.resume(run, config, target=target) if last is not None else Trainer(config, target=target)
    try:
        if trainer.step < trainer.total_steps:
            say(f"{label}: training steps {trainer.step}..{trainer.total_steps}")
            trainer.train()
        elif not (run / "drafter").is_dir():
            trainer.export(run / "drafter")
        serving = trainer.method.pipeline(run / "drafter")
    finally:
        trainer.close()
    return {"budget": budget, "serving": serving, "curve": _curve(run / "metrics.jsonl", budget["probe_step_seconds"])}


def _curve(metrics: Path, step_seconds: float | None) -> dict[str, Any]:
    """Held-out τ̂ against budget minutes (steps × the probe's step time, so a busy machine does
    not stretch the axis) from a run's metrics.jsonl, and the step time actually measured."""
    minutes, tau, spent = [], [], 0.0
    for rec in map(json.loads, metrics.read_text().splitlines()):
        if rec.get("split") == "train":
            spent += rec.get("step_time", 0.0)
        elif rec.get("split") == "eval" and "tau" in rec:
            # equal steps (no probe): the minutes the steps took
            minutes.append((rec["step"] * step_seconds if step_seconds is not None else spent) / 60)
            tau.append(rec["tau"])
    return {"minutes": minutes, "tau": tau, "train_seconds": spent}


def _pipelines(bench: DraftersBench, trained: dict[str, dict[str, Any]], target_section: dict[str, Any]) -> dict:
    from specforge.config import load_pipeline

    arms = {}
    for label, spec in bench.methods.items():
        sections = {**trained[label]["serving"], "target": target_section}
        arms[label] = load_pipeline(["default"], list(spec.serve), sections=sections)
    for label, tree in bench.trees.items():
        base = trained[tree.of]["serving"]
        sections = {**base, "target": target_section, "drafter": {**base["drafter"], **tree.drafter}}
        arms[label] = load_pipeline(["default"], list(bench.methods[tree.of].serve), sections=sections)
    return arms


def prepare(bench: DraftersBench, target: Any, say: Callable[[str], None] = _say) -> None:
    """Data preparation only: the regenerated answers and every method's feature cache — no step
    is timed, so it may run while the machine is busy; the budget probe and the training then
    reuse them."""
    from specforge.training import Trainer

    out = Path(bench.out)
    for label in bench.methods:
        layers = _tap_layers(_train_config(bench, label, out, None, None), target)
        say(f"{label}: data and feature cache for layers {list(layers)}")
        config = _train_config(bench, label, out, layers, {"total_steps": 1, "epochs": None, "warmup_steps": 0},
                               directory=out / label / "probe")
        Trainer(config, target=target).close()
        shutil.rmtree(out / label / "probe", ignore_errors=True)


def run_drafters_bench(bench: DraftersBench, say: Callable[[str], None] = _say,
                       prepare_only: bool = False, train_only: bool = False) -> dict[str, Any] | None:
    """Train every method at the budget (resuming what an earlier call made), then measure every
    arm against plain decoding in one run; returns the JSON-ready result (see the module docstring).
    ``prepare_only``: stop after the data and feature caches (:func:`prepare`) and return None.
    ``train_only``: stop after training (None) — training is counted in steps, so it may share the
    machine; the measuring call that follows wants it quiet."""
    from specforge.evaluation import EvalSettings, evaluate
    from specforge.runtime import Needs, load_target

    out = Path(bench.out)
    datasets = [str(out / TRAINING_PROMPTS)] if bench.on_training_prompts else list(bench.datasets)
    settings = EvalSettings(datasets=datasets, prompts=bench.prompts, temperatures=list(bench.temperatures),
                            max_new_tokens=bench.max_new_tokens, concurrency=1, eval_dir=bench.eval_dir)
    if not bench.on_training_prompts:
        settings.prompt_sets()  # a missing eval set fails now, not after hours of training
    first = _train_config(bench, next(iter(bench.methods)), out, None, None)
    # One target for every method, trained and evaluated on it: the pipeline's target section whole,
    # with a backend that can tap any layer a method picks (they are known only once built on it).
    target = load_target(first.target, needs=lambda args: Needs(tuple(range(args.n_layers))))
    if prepare_only:
        prepare(bench, target, say)
        return None
    trained = {}
    t0 = time.perf_counter()
    for i, label in enumerate(bench.methods, 1):
        say(f"[{i}/{len(bench.methods)}] {label} → {out / label}")
        trained[label] = _train(bench, label, out, target, say)
    train_s = time.perf_counter() - t0
    if train_only:
        return None
    if bench.on_training_prompts:
        _write_training_prompts(bench, out)
    say("evaluation: every arm and plain decoding, same prompts, same run")
    target_section = {"model": first.target.model, "dtype": first.target.dtype}
    arms = _pipelines(bench, trained, target_section)
    names = list(arms)
    result = evaluate(arms[names[0]], settings, target=target, compare={n: arms[n] for n in names[1:]})
    rows = {names[0]: result["results"], **{n: result["compare"][n]["results"] for n in names[1:]}}
    return {
        "machine": machine(),
        "precision": target.precision.to_dict(),
        "config": bench.model_dump(mode="json"),
        "settings": settings.to_dict(),
        "seconds": {"training_and_data": train_s},
        "methods": {label: {"budget": t["budget"], "curve": t["curve"]} for label, t in trained.items()},
        "trees": {label: tree.of for label, tree in bench.trees.items()},
        "arms": {n: {"pipeline": arms[n].to_dict(), "results": rows[n], "summary": _summary(rows[n])} for n in names},
    }


def _write_training_prompts(bench: DraftersBench, out: Path) -> Path:
    """``<out>/training-prompts.jsonl``: the first user turn of every conversation the methods
    trained on (the regenerated ones, less the ``data.eval_sequences`` held out at the end)."""
    from specforge.data.regeneration import iter_regenerated
    from specforge.training.config import TrainConfig

    shared = TrainConfig.model_validate(_shared(bench))
    if not shared.data.regenerate.enabled:
        raise ConfigError(["on_training_prompts: needs data.regenerate.enabled (the target's own answers)"])
    regen = shared.data.regenerate.dir
    conversations = list(iter_regenerated(Path(regen) if regen else out / "regenerated"))
    kept = conversations[:len(conversations) - shared.data.eval_sequences]
    path = out / TRAINING_PROMPTS
    write_atomic(path, "".join(json.dumps({"turns": c.user_turns[:1]}) + "\n" for c in kept if c.user_turns))
    return path


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """:func:`specforge.evaluation.runner.summarize` (macro τ and mean speedup per temperature),
    plus τ per set and the round's cost in plain steps (its wall time × plain tokens/s: at
    concurrency 1 one plain step per token)."""
    from specforge.evaluation.runner import summarize

    out = summarize(rows)
    for key, s in out.items():
        mine = [r for r in rows if f"T={r['temperature']:g}" == key]
        cost = [r["seconds"] / r["rounds"] * r["ar_tok_s"] for r in mine if r.get("rounds") and r.get("ar_tok_s")]
        s["tau_by_set"] = {r["dataset"]: r["tau"] for r in mine}
        s["round_cost"] = statistics.fmean(cost) if cost else None
    return out


def bench_table(result: dict[str, Any]) -> str:
    """Markdown: per temperature, τ per eval set and their macro average (Table 1's shape), the
    speedup and the round's cost in plain steps; then each tree against its own chain."""
    from specforge.evaluation.report import fmt

    arms = result["arms"]
    lines = []
    temps = [k for k in next(iter(arms.values()))["summary"]]
    for key in temps:
        sets = list(next(iter(arms.values()))["summary"][key]["tau_by_set"])
        lines += [f"**{key}** — τ per eval set (accepted drafts + 1 per round)", "",
                  "| method | " + " | ".join(sets) + " | macro τ | speedup | round (plain steps) |",
                  "|---|" + "---|" * (len(sets) + 3)]
        for name, arm in arms.items():
            s = arm["summary"][key]
            lines.append(f"| {name} | " + " | ".join(fmt(s["tau_by_set"].get(d)) for d in sets)
                         + f" | {fmt(s['tau'])} | {fmt(s['speedup'])}× | {fmt(s['round_cost'])} |")
        lines.append("")
    if result.get("trees"):
        lines += ["**Trees against their own chain** (concurrency 1; the best tree of each method in bold)", "",
                  "| tree | chain | T | τ tree / chain | speedup tree / chain |", "|---|---|---|---|---|"]
        for key in temps:
            best = {}
            for tree, chain in result["trees"].items():
                speed = arms[tree]["summary"][key]["speedup"] or 0.0
                if chain not in best or speed > best[chain][1]:
                    best[chain] = (tree, speed)
            for tree, chain in result["trees"].items():
                a, b = arms[tree]["summary"][key], arms[chain]["summary"][key]
                name = f"**{tree}**" if best[chain][0] == tree else tree
                lines.append(f"| {name} | {chain} | {key[2:]} | {fmt(a['tau'])} / {fmt(b['tau'])} | "
                             f"{fmt(a['speedup'])} / {fmt(b['speedup'])} |")
        lines.append("")
    budgets = result["methods"]
    lines += ["**Budget** — the probe's step time sets each method's steps; the minutes its steps took", "",
              "| method | step (s) | steps | budget (min) | steps took (min) | held-out τ̂ at the end |",
              "|---|---|---|---|---|---|"]
    for name, m in budgets.items():
        curve, b = m["curve"], m["budget"]
        probe = b["probe_step_seconds"]  # None: equal steps, no budget
        lines.append(f"| {name} | {fmt(probe)} | {b['steps']} | "
                     f"{fmt(None if probe is None else b['steps'] * probe / 60, '.1f')} | "
                     f"{fmt(curve['train_seconds'] / 60, '.1f')} | {fmt(curve['tau'][-1] if curve['tau'] else None)} |")
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    """acceptance.png (Fig. 2: acceptance per draft position, a panel per temperature) and
    learning.png (held-out τ̂ against training minutes) under ``out``."""
    from specforge.plots import new_figure, save_figure

    paths = []
    arms = result["arms"]
    temps = list(next(iter(arms.values()))["summary"])
    fig = new_figure(5.2 * len(temps), 4.2)
    for i, key in enumerate(temps):
        ax = fig.add_subplot(1, len(temps), i + 1)
        t = float(key[2:])
        for name, arm in arms.items():
            if name in result.get("trees", {}):
                continue  # a tree's depth-k acceptance is another quantity than a chain's position-k
            rows = [r["acceptance"] for r in arm["results"] if r["temperature"] == t and r["acceptance"]]
            width = min(len(a) for a in rows) if rows else 0
            if width:
                ax.plot(range(1, width + 1), [statistics.fmean(a[k] for a in rows) for k in range(width)],
                        marker="o", label=f"{name} (τ {arm['summary'][key]['tau']:.2f})")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(x_k accepted | x_<k accepted), mean over sets")
        ax.set_title(f"T = {t:g}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(save_figure(fig, out / "acceptance.png", title=f"{result['machine']['cpu']}"))
    fig = new_figure(6, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    for name, m in result["methods"].items():
        if m["curve"]["tau"]:
            ax.plot(m["curve"]["minutes"], m["curve"]["tau"], marker="o", label=name)
    ax.set_xlabel("training minutes (steps × probe step time)")
    ax.set_ylabel("held-out τ̂")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out / "learning.png", title="same data, same budget"))
    return paths


REPORT = Report("bench.json", bench_table, table_file="table.md", files=plots)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", metavar="PRESET|FILE",
                   help="bench config (repeatable, merged left to right; default: 'paper')")
    p.add_argument("--prepare-only", action="store_true",
                   help="only regenerate the data and build every method's feature cache (nothing is timed, so "
                        "the machine may be busy); a later call trains and measures")
    p.add_argument("--train-only", action="store_true",
                   help="train every method at the budget and stop (steps are fixed by the probe, so training "
                        "may share the machine; run the probe and the measuring call on a quiet one)")
    add_output_arguments(p, None, help="output directory (the config's 'out' key)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="bench config overrides, e.g. budget_minutes=30 prompts=4")


def _measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """train drafters on the same data at the same budget, then τ, speedup and acceptance in one run

    Every method of the bench config (preset 'paper': DSpark 2 and 5 layers, DFlash 5, Eagle3,
    Medusa, plus Eagle3's and Medusa's trees) trains on one regenerated dataset for budget_minutes
    each (its step count from a timed probe), then every arm decodes the same prompts as plain
    decoding in the same run.  Writes bench.json, table.md, acceptance.png and learning.png; a
    second call resumes or reuses what the first made.
    """
    overrides = list(args.overrides) + ([f"out={args.out}"] if args.out else [])
    bench = load_bench_config(args.config or ["paper"], overrides)
    result = run_drafters_bench(bench, prepare_only=args.prepare_only, train_only=args.train_only)
    if result is None:
        done = "data and feature caches" if args.prepare_only else "every method trained"
        print(f"{done}: ready under {bench.out}", file=sys.stderr)
    return result


# Under the config's out key (which --out sets), recorded in the result.
COMMAND = bench_command("drafters", _arguments, _measure, REPORT, out=lambda args, result: result["config"]["out"])

"""The main job (``specforge run``): data → drafter → evaluation on the embedded default, one command.

1. *Data.*  The first ``data.limit`` ShareGPT conversations are answered by the target itself
   (``data.regenerate``), so the drafter learns what SmolLM2 writes, not what ChatGPT wrote.
2. *Features and training.*  The target's tapped hidden states go to the offline cache; a DSpark
   drafter (backbone, Markov head, confidence head) is trained on them.
3. *Evaluation.*  The trained drafter decodes prompts from each eval set at T = 0 and T = 1, and
   plain decoding of the same target decodes the same prompts in the same run: τ, acceptance per
   position and the speedup.  Beside it, in the same run, the comparison arms (by default
   ``ngram``, the drafter shipped for the embedded target — the ``dspark`` preset — and the
   ``composed`` preset, the two as a cascade) — arms for another target than the trained one are
   left out with a note.

Every stage leaves its output under ``output.dir`` and is resumed or reused by the next call:
regeneration continues at its first missing shard, the feature cache is reused when its
manifest matches, training resumes from its last checkpoint (and is skipped when complete), and
an evaluation is reused when it was made with the same drafter and the same settings.

The eval prompt sets are read before anything else runs, so a missing set fails in seconds, not
after training.  A stage that fails on its input or its environment (a damaged file, a full
disk) raises one :class:`MainJobError` naming the stage, the cause and what was kept; the
command line prints it on one line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specforge.errors import SpecforgeError
from specforge.resume import UnreadableRecord, differences, read_record, tree_digest

__all__ = ["DEFAULT_COMPARE", "MainJobError", "drafter_fingerprint", "run_main_job", "summary"]

# What a user compares a freshly trained drafter with: prompt lookup (no training), the drafter
# shipped for the embedded target, and the two composed (prompt lookup first, the shipped
# drafter where it finds nothing; docs/composition.md).
DEFAULT_COMPARE = ("ngram", "shipped=dspark", "composed=composed")


class MainJobError(SpecforgeError):
    """A stage of the main job failed on its input or environment; earlier stages' output is kept."""


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return "; ".join(part.strip() for part in str(exc).splitlines() if part.strip())


@contextmanager
def _stage(name: str, out: Path) -> Iterator[None]:
    """Turn a failure of stage ``name`` into one line that says what is kept and how to go on."""
    try:
        yield
    except (SpecforgeError, OSError) as exc:
        if isinstance(exc, MainJobError):
            raise
        raise MainJobError(
            f"{name} failed: {_one_line(exc)} — what earlier stages made is kept in {out}; "
            "fix the cause and run the same command again to continue from there") from exc


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def drafter_fingerprint(directory: Path) -> str:
    """The digest of a drafter directory's files (names and bytes): which weights were evaluated."""
    return tree_digest({"drafter": [directory]})


def _reusable(path: Path, made_with: dict[str, Any], say: Callable[[str], None]) -> dict | None:
    """The evaluation in ``path`` if it was made with exactly ``made_with`` (drafter digest,
    settings, pipeline, comparison arms); None when it must be made (again)."""
    try:
        old = read_record(path)
    except UnreadableRecord:
        return None
    if old is None:
        return None
    recorded = {"drafter_sha256": old.get("main_job", {}).get("drafter_sha256"), "settings": old.get("settings"),
                "pipeline": old.get("pipeline"),
                "compare": {k: v.get("pipeline") for k, v in (old.get("compare") or {}).items()}}
    changed = differences(recorded, made_with)
    if changed:
        say(f"evaluating again: {path} was made with another {', '.join(changed)}")
        return None
    return old


def run_main_job(train_sources: Sequence[str] = ("quick",), overrides: Sequence[str] = (),
                 eval_settings: Any = None, eval_overrides: Sequence[str] = (),
                 say: Callable[[str], None] = _say, compare: Sequence[str] = DEFAULT_COMPARE) -> dict[str, Any]:
    """Run (or resume) the three stages; returns the evaluation result with a ``main_job`` section
    (stage timings, the training summary, where everything is).  ``compare``: pipelines measured
    beside the trained drafter (:func:`specforge.evaluation.parse_arms`)."""
    from specforge.config import load_pipeline
    from specforge.evaluation import EvalSettings, evaluate, parse_arms, save
    from specforge.training import Trainer, load_train_config
    from specforge.training.checkpoint import latest_checkpoint

    config = load_train_config(list(train_sources), list(overrides))
    settings = eval_settings or EvalSettings(prompts=3, max_new_tokens=96)
    out = Path(config.output.dir)
    settings.prompt_sets()  # a missing or malformed eval set fails now, not after training
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    drafter = config.drafter
    shape = ", ".join(f"{k} {drafter.options()[k] if k != 'head' else drafter.options()[k]['name']}"
                      for k in ("layers", "gamma", "head") if k in drafter.options())
    say(f"[1/3] data and training → {out} (regenerate: {config.data.regenerate.enabled}, "
        f"{config.data.limit or 'all'} conversations, drafter {drafter.name}" + (f": {shape})" if shape else ")"))
    ckpts = out / "checkpoints"
    with _stage("data preparation (regeneration and feature cache)", out):
        last = latest_checkpoint(ckpts)[0] if ckpts.is_dir() else None
        trainer = Trainer.resume(out, config) if last is not None else Trainer(config)
    timings["data_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        with _stage("training", out):
            if trainer.step < trainer.total_steps:
                say(f"training steps {trainer.step}..{trainer.total_steps}"
                    + (f" (resumed from {trainer.resumed_from})" if trainer.resumed_from else ""))
                trainer.train()
            else:
                say(f"training already complete ({trainer.total_steps} steps); reusing {out / 'drafter'}")
                if not (out / "drafter").is_dir():
                    trainer.export(out / "drafter")
        train_summary = _train_summary(out)
        serving = trainer.method.pipeline(out / "drafter")
    finally:
        trainer.close()
    timings["training_s"] = time.perf_counter() - t1

    say("[2/3] evaluation: trained drafter vs plain decoding, same prompts, same run")
    t2 = time.perf_counter()
    eval_dir = out / "eval"
    with _stage("evaluation", out):
        # The default pipeline, with the sections the training method says serve its drafter.
        sections = {**serving, "target": {"model": config.target.model, "dtype": config.target.dtype}}
        pipeline = load_pipeline(["default"], list(eval_overrides), sections=sections)
        arms = {}
        for label, arm in parse_arms(compare).items():
            if (arm.target.model, arm.target.dtype) != (pipeline.target.model, pipeline.target.dtype):
                say(f"comparison arm {label!r} left out: it serves {arm.target.model}, this run trained for "
                    f"{pipeline.target.model}")
            else:
                arms[label] = arm
        fingerprint = drafter_fingerprint(out / "drafter")
        result = _reusable(eval_dir / "eval.json", {
            "drafter_sha256": fingerprint, "settings": settings.to_dict(), "pipeline": pipeline.to_dict(),
            "compare": {k: v.to_dict() for k, v in arms.items()}}, say)
        if result is not None:
            say(f"reusing {eval_dir / 'eval.json'} (same drafter, same settings)")
        else:
            # Loaded again for the evaluation, not the trainer's: its backend is decided with what
            # the evaluated pipelines tap and the load they are measured at (one request at a time).
            result = evaluate(pipeline, settings, compare=arms)
            result["main_job"] = {"drafter_sha256": fingerprint}
        timings["eval_s"] = time.perf_counter() - t2
        result["main_job"].update({"output_dir": str(out), "training": train_summary, "seconds": timings,
                                   "train_config": config.to_dict()})
        save(result, eval_dir)
    say(f"[3/3] done in {time.perf_counter() - t0:.0f} s; results in {eval_dir}")
    return result


def _train_summary(out: Path) -> dict[str, Any]:
    """Last training line of metrics.jsonl, and the last held-out eval line if any."""
    path = out / "metrics.jsonl"
    last: dict[str, Any] = {}
    held: dict[str, Any] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("split") == "train":
                last = rec
            elif rec.get("split") == "eval":
                held = rec
    keep = ("step", "loss", "tau", "accept_rate@1")
    return {"train": {k: last[k] for k in keep if k in last}, "held_out": {k: held[k] for k in keep if k in held}}


def summary(result: dict[str, Any]) -> str:
    """What ``specforge run`` prints: the drafter trained, the evaluation table, every comparison
    arm beside it, and where the time went."""
    from specforge.evaluation import comparison_table, table

    job = result["main_job"]
    tr = job["training"]
    lines = [f"drafter: {job['output_dir']}/drafter — trained {tr['train'].get('step', '?')} steps, "
             f"final train loss {tr['train'].get('loss', float('nan')):.3f}"
             + (f", held-out τ̂ {tr['held_out']['tau']:.2f}" if "tau" in tr.get("held_out", {}) else ""),
             table(result)]
    if "compare" in result:
        lines += ["\nSame prompts, same run — τ and speedup over plain decoding of every arm:",
                  comparison_table(result, label="trained")]
    secs = job["seconds"]
    lines.append(f"time: data {secs['data_s']:.0f} s, training {secs['training_s']:.0f} s, evaluation "
                 f"{secs['eval_s']:.0f} s; plot {job['output_dir']}/eval/acceptance.png")
    return "\n".join(lines)

"""The main job (``specforge run``): data → drafter → evaluation on the embedded default, one command.

1. *Data.*  The first ``data.limit`` ShareGPT conversations are answered by the target itself
   (``data.regenerate``), so the drafter learns what SmolLM2 writes, not what ChatGPT wrote.
2. *Features and training.*  The target's tapped hidden states go to the offline cache; a DSpark
   drafter (backbone, Markov head, confidence head) is trained on them.
3. *Evaluation.*  The trained drafter decodes prompts from each eval set at T = 0 and T = 1, and
   plain decoding of the same target decodes the same prompts in the same run: τ, acceptance per
   position and the speedup.  Beside it, in the same run, the comparison arms (by default
   ``ngram`` and the drafter shipped for the embedded target, the ``dspark`` preset) — arms for
   another target than the trained one are left out with a note.

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

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specforge.errors import SpecforgeError

__all__ = ["DEFAULT_COMPARE", "MainJobError", "drafter_fingerprint", "run_main_job"]

# What a user compares a freshly trained drafter with: prompt lookup (no training) and the
# drafter shipped for the embedded target.
DEFAULT_COMPARE = ("ngram", "shipped=dspark")


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
    """SHA-256 over a drafter directory's files (names and bytes): which weights were evaluated."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(path.relative_to(directory).as_posix().encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _reusable(path: Path, fingerprint: str, settings: dict[str, Any], pipeline: dict[str, Any],
              compare: dict[str, Any]) -> dict | None:
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return None
    meta = old.get("main_job", {})
    if (meta.get("drafter_sha256") == fingerprint and old.get("settings") == settings
            and old.get("pipeline") == pipeline
            and {k: v["pipeline"] for k, v in old.get("compare", {}).items()} == compare):
        return old
    return None


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
        target = trainer.target
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
        result = _reusable(eval_dir / "eval.json", fingerprint, settings.to_dict(), pipeline.to_dict(),
                           {k: v.to_dict() for k, v in arms.items()})
        if result is not None:
            say(f"reusing {eval_dir / 'eval.json'} (same drafter, same settings)")
        else:
            result = evaluate(pipeline, settings, target=target, compare=arms)
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

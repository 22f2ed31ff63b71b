"""Evaluate a speculative pipeline on prompt sets: acceptance and speedup, one run.

The metrics are defined in docs/design/metrics.md and computed by :mod:`specforge.acceptance`.

For every prompt set and temperature the same prompts are decoded twice by engines that share
one loaded target: once by the pipeline (its drafter, heads, scheduler and verifier) and once by
plain decoding (no drafter, same verifier) — the speedup is the ratio of the two tokens/s
measured back to back, never against a number from another run.  Acceptance comes from the
engine's per-request counters:

* τ — committed tokens per round: accepted drafts plus the correction/bonus token;
* conditional acceptance at k — P(x_k accepted | x_<k accepted and x_k verified) (paper Fig. 2);
* prefix survival at k — P(x_1..x_k all accepted) = the product of the conditional rates;
* latency shares — the round's wall time split by phase (draft, target pass, verify, commit),
  and, for block drafters, the sequential correction head's part of the draft.

Other pipelines can be measured in the same run (``compare``: e.g. ``ngram`` and a shipped
drafter beside the one just trained): every arm decodes the same prompts, one after the other
for each set and temperature, against the one plain baseline — so their speedups share a
denominator and a machine state.

Requests are seeded (``seed + i``), so a run is reproducible up to timing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specforge.acceptance import AcceptanceCounts
from specforge.config import EngineConfig, PipelineConfig, load_pipeline
from specforge.engine import Engine, GenerationRequest, RequestOutput
from specforge.errors import ConfigError
from specforge.evalsets import apply_chat_template, select_prompts
from specforge.protocols import Learns

__all__ = ["EvalSettings", "aggregate", "evaluate", "parse_arms"]


@dataclass
class EvalSettings:
    """What to measure.  ``datasets`` are names of sets in the eval directory or JSONL paths."""

    datasets: Sequence[str] = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
    prompts: int = 8  # per dataset
    temperatures: Sequence[float] = (0.0, 1.0)
    max_new_tokens: int = 128
    concurrency: int = 1  # requests decoded together (1: per-user latency, the paper's setting)
    speedup: bool = True  # also decode the prompts plainly and report the ratio
    seed: int = 0
    eval_dir: str | None = None
    progress: bool = True

    def prompt_sets(self) -> dict[str, list[Any]]:
        """The prompts of every set, read now: a missing or malformed set fails before any work."""
        return {name: select_prompts(name, self.prompts, self.eval_dir) for name in self.datasets}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["datasets"], d["temperatures"] = list(self.datasets), list(self.temperatures)
        d.pop("progress")
        return d


def aggregate(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Acceptance statistics of a set of finished requests, pooled over all their rounds."""
    pooled = AcceptanceCounts.pooled(o.stats for o in outputs)
    return {
        "requests": len(outputs),
        "failed": sum(1 for o in outputs if o.error),
        "new_tokens": sum(len(o.token_ids) for o in outputs),
        "rounds": pooled.rounds,
        "tau": pooled.tau,
        "acceptance": pooled.conditional_acceptance(),
        "survival": pooled.survival(),
        "verified_per_position": pooled.verified_per_position,
        "reached_per_position": pooled.reached_per_position,
        "accepted_per_position": pooled.accepted_per_position,
        "verify_waste": pooled.verify_waste,
    }


def _timed(engine: Engine, requests: list[GenerationRequest]) -> tuple[list[RequestOutput], float]:
    t0 = time.perf_counter()
    outputs = engine.generate(requests)
    return outputs, time.perf_counter() - t0


def _requests(prompt_ids: list[list[int]], temperature: float, settings: EvalSettings,
              max_new_tokens: int | None = None) -> list[GenerationRequest]:
    # Pure sampling at T > 0 (no top-k/top-p): the acceptance the paper reports at T = 1.
    return [GenerationRequest(prompt_ids=ids, max_new_tokens=max_new_tokens or settings.max_new_tokens,
                              temperature=temperature, top_k=0, top_p=1.0, seed=settings.seed + i)
            for i, ids in enumerate(prompt_ids)]


def _phase_shares(engine: Engine, head_seconds: float) -> dict[str, float]:
    total = sum(engine.phase_seconds.values())
    if total <= 0:
        return {}
    shares = {k: v / total for k, v in engine.phase_seconds.items()}
    shares["correction_head"] = head_seconds / total
    return shares


def _row(name: str, temperature: float, outs: list[RequestOutput], seconds: float) -> dict[str, Any]:
    row = {"dataset": name, "temperature": float(temperature), **aggregate(outs), "seconds": seconds}
    row["tok_s"] = row["new_tokens"] / seconds if seconds > 0 else math.nan
    return row


def _coverage(drafter: Any, outputs: list[RequestOutput]) -> float | None:
    """Share of what the target wrote that the drafter could have proposed (None: no draft vocabulary)."""
    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is None:
        return None
    return vocab.coverage(torch.tensor([t for o in outputs for t in o.token_ids], dtype=torch.long))


def parse_arms(specs: Sequence[str]) -> dict[str, PipelineConfig]:
    """``[LABEL=]CONFIG[+CONFIG…][,key=value…]`` → ``{label: PipelineConfig}``; CONFIG is a preset
    name or a YAML file, the overrides apply on top (``full=dspark,drafter.candidates=null``), and
    the label defaults to the last config's name."""
    arms = {}
    for spec in specs:
        head, *overrides = spec.split(",")
        label, _, sources = head.partition("=") if "=" in head else ("", "", head)
        parts = sources.split("+")
        arms[label or Path(parts[-1]).stem] = load_pipeline(parts, overrides)
    return arms


def evaluate(pipeline: PipelineConfig, settings: EvalSettings, target: Any = None,
             compare: Mapping[str, PipelineConfig] | None = None) -> dict[str, Any]:
    """Measure ``pipeline`` (and every pipeline of ``compare``, by name, in the same run and
    against the same plain baseline) on ``settings``; returns a JSON-ready dict (see the module
    docstring): ``results`` and ``summary`` of ``pipeline``, and under ``compare`` each other
    arm's ``pipeline``, ``results`` and ``summary``."""
    from tqdm.auto import tqdm

    from specforge.engine import load_pipeline_target
    from specforge.engine.request import positions_needed

    compare = dict(compare or {})
    for name, p in {"": pipeline, **compare}.items():
        where = f"compare.{name}." if name else ""
        if p.component("drafter") is None:
            raise ConfigError([f"{where}drafter.name: the pipeline has no drafter, so there is nothing to evaluate"])
        if (p.target.model, p.target.dtype) != (pipeline.target.model, pipeline.target.dtype):
            raise ConfigError([f"{where}target: {p.target.model} ({p.target.dtype}) differs from the evaluated "
                               f"pipeline's {pipeline.target.model} ({pipeline.target.dtype}); arms share one target"])
    prompt_sets = settings.prompt_sets()
    target = target or load_pipeline_target(pipeline, *compare.values(), requests=settings.concurrency)
    # The KV cache holds what these prompts can reach, not the pipeline's 4,096 positions for
    # prompts unseen: every arm keeps its own cache, and 64 of them at 4,096 would not fit here.
    prompt_ids = {name: [apply_chat_template(target.tokenizer, p.text) for p in ps] for name, ps in prompt_sets.items()}
    reach = positions_needed([ids for each in prompt_ids.values() for ids in each], settings.max_new_tokens)
    limits = EngineConfig(max_batch=settings.concurrency, max_context=min(pipeline.engine.max_context, reach))
    spec = Engine.from_pipeline(replace(pipeline, engine=limits), target)
    arms = {name: Engine.from_pipeline(replace(p, engine=limits), target) for name, p in compare.items()}
    plain = Engine(target, pipeline.component("verifier").create(), engine=limits) if settings.speedup else None
    drafter = spec.drafter
    results: list[dict[str, Any]] = []
    arm_rows: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    jobs = [(name, t) for name in settings.datasets for t in settings.temperatures]
    bar = tqdm(jobs, desc="eval", unit="set", disable=not settings.progress, file=sys.stderr)
    warmed = False
    for name, temperature in bar:
        bar.set_postfix_str(f"{name} T={temperature:g}")
        prompts = prompt_sets[name]
        dataset = prompts[0].dataset if prompts else str(name)
        ids = prompt_ids[name]
        engines = [e for e in (spec, *arms.values(), plain) if e is not None]
        if not warmed:  # first-call allocations and kernel selection, untimed
            for engine in engines:
                engine.generate(_requests(ids[:1], temperature, settings, max_new_tokens=8))
            warmed = True
        for engine in engines:
            engine.phase_seconds = dict.fromkeys(engine.phase_seconds, 0.0)
            # no set drafted from answers to its own prompts, nor gated by another set's rounds
            for part in (engine.drafter, engine.scheduler):
                if isinstance(part, Learns):
                    part.forget()
        head_before = getattr(drafter, "head_seconds", 0.0)
        outs, seconds = _timed(spec, _requests(ids, temperature, settings))
        head = getattr(drafter, "head_seconds", 0.0) - head_before
        row = _row(dataset, temperature, outs, seconds)
        row["latency_share"] = _phase_shares(spec, head)
        others = {arm: _row(dataset, temperature, *_timed(e, _requests(ids, temperature, settings)))
                  for arm, e in arms.items()}
        written = outs
        if plain is not None:
            ar, ar_seconds = _timed(plain, _requests(ids, temperature, settings))
            row["ar_new_tokens"] = sum(len(o.token_ids) for o in ar)
            ar_tok_s = row["ar_new_tokens"] / ar_seconds if ar_seconds > 0 else math.nan
            for r in (row, *others.values()):
                r["ar_tok_s"] = ar_tok_s
                r["speedup"] = r["tok_s"] / ar_tok_s if ar_tok_s else math.nan
            written = ar
        if (cov := _coverage(drafter, written)) is not None:
            row["vocab_coverage"] = cov
        for arm, r in others.items():
            if (cov := _coverage(arms[arm].drafter, written)) is not None:
                r["vocab_coverage"] = cov
            arm_rows[arm].append(r)
        results.append(row)
    out = {
        "pipeline": pipeline.to_dict(),
        "settings": settings.to_dict(),
        "gamma": getattr(drafter, "gamma", None),
        "results": results,
        "summary": summarize(results),
    }
    if compare:
        out["compare"] = {arm: {"pipeline": compare[arm].to_dict(), "gamma": getattr(arms[arm].drafter, "gamma", None),
                                "results": rows, "summary": summarize(rows)} for arm, rows in arm_rows.items()}
    return out


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean τ and speedup per temperature over the datasets (unweighted: each set counts once)."""
    out: dict[str, Any] = {}
    for t in sorted({r["temperature"] for r in results}):
        rows = [r for r in results if r["temperature"] == t]
        speed = [r["speedup"] for r in rows if not math.isnan(r.get("speedup", math.nan))]
        out[f"T={t:g}"] = {"tau": sum(r["tau"] for r in rows) / len(rows),
                           "speedup": sum(speed) / len(speed) if speed else None}
    return out


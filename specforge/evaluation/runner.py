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

Requests are seeded (``seed + i``), so a run is reproducible up to timing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from specforge.acceptance import AcceptanceCounts
from specforge.config import ConfigError, EngineConfig, PipelineConfig
from specforge.engine import Engine, GenerationRequest, RequestOutput
from specforge.evalsets import apply_chat_template, select_prompts

__all__ = ["EvalSettings", "aggregate", "evaluate"]


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


def evaluate(pipeline: PipelineConfig, settings: EvalSettings, target: Any = None) -> dict[str, Any]:
    """Measure ``pipeline`` on ``settings``; returns a JSON-ready dict (see the module docstring)."""
    from tqdm.auto import tqdm

    from specforge.target import TargetModel

    if pipeline.component("drafter") is None:
        raise ConfigError(["drafter.name: the pipeline has no drafter, so there is nothing to evaluate"])
    prompt_sets = settings.prompt_sets()
    target = target or TargetModel.load(pipeline.target.model, pipeline.target.dtype, pipeline.target.compile,
                                           pipeline.target.weights)
    limits = EngineConfig(max_batch=settings.concurrency, max_context=pipeline.engine.max_context)
    spec = Engine.from_pipeline(replace(pipeline, engine=limits), target)
    plain = Engine(target, pipeline.component("verifier").create(), engine=limits) if settings.speedup else None
    drafter = spec.drafter
    results = []
    jobs = [(name, t) for name in settings.datasets for t in settings.temperatures]
    bar = tqdm(jobs, desc="eval", unit="set", disable=not settings.progress, file=sys.stderr)
    warmed = False
    for name, temperature in bar:
        bar.set_postfix_str(f"{name} T={temperature:g}")
        prompts = prompt_sets[name]
        ids = [apply_chat_template(target.tokenizer, p.text) for p in prompts]
        if not warmed:  # first-call allocations and kernel selection, untimed
            for engine in (spec, plain):
                if engine is not None:
                    engine.generate(_requests(ids[:1], temperature, settings, max_new_tokens=8))
            warmed = True
        for engine in (spec, plain):
            if engine is not None:
                engine.phase_seconds = dict.fromkeys(engine.phase_seconds, 0.0)
        head_before = getattr(drafter, "head_seconds", 0.0)
        outs, seconds = _timed(spec, _requests(ids, temperature, settings))
        head = getattr(drafter, "head_seconds", 0.0) - head_before
        row = {"dataset": prompts[0].dataset if prompts else str(name), "temperature": float(temperature),
               **aggregate(outs), "seconds": seconds}
        row["tok_s"] = row["new_tokens"] / seconds if seconds > 0 else math.nan
        row["latency_share"] = _phase_shares(spec, head)
        written = outs
        if plain is not None:
            ar, ar_seconds = _timed(plain, _requests(ids, temperature, settings))
            row["ar_new_tokens"] = sum(len(o.token_ids) for o in ar)
            row["ar_tok_s"] = row["ar_new_tokens"] / ar_seconds if ar_seconds > 0 else math.nan
            row["speedup"] = row["tok_s"] / row["ar_tok_s"] if row["ar_tok_s"] else math.nan
            written = ar
        vocab = getattr(drafter, "draft_vocab", None)
        if vocab is not None:  # share of what the target wrote that the drafter could have proposed
            row["vocab_coverage"] = vocab.coverage(torch.tensor([t for o in written for t in o.token_ids],
                                                                dtype=torch.long))
        results.append(row)
    return {
        "pipeline": pipeline.to_dict(),
        "settings": settings.to_dict(),
        "gamma": getattr(drafter, "gamma", None),
        "results": results,
        "summary": summarize(results),
    }


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean τ and speedup per temperature over the datasets (unweighted: each set counts once)."""
    out: dict[str, Any] = {}
    for t in sorted({r["temperature"] for r in results}):
        rows = [r for r in results if r["temperature"] == t]
        speed = [r["speedup"] for r in rows if not math.isnan(r.get("speedup", math.nan))]
        out[f"T={t:g}"] = {"tau": sum(r["tau"] for r in rows) / len(rows),
                           "speedup": sum(speed) / len(speed) if speed else None}
    return out


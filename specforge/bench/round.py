"""``specforge bench round``: what each part of a speculative round costs, in plain decoding steps.

A speculative round pays for its draft (context ingest, the backbone pass, the LM head, the
sequential stage with its correction head), for the confidence estimate and the scheduler, for
one target pass over every verified draft (the verify pass), for the verifier and for the commit.
It wins when τ tokens per round cost less than τ plain steps.  This benchmark decodes the same
prompts plainly and speculatively in the same run — alternating, so that a machine's drift hits
both arms — and reports each part in milliseconds per round and as a share of one plain decoding
step, for every (concurrency, γ) asked for.  The paper's figure for its Markov head is 0.2–1.3 %
of a round on GPUs; on a CPU the LM head and the head's W2 reads weigh much more.

Outputs: ``round.json``, a table, and ``round.png``: stacked bars (each part in plain steps, per setting).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specforge.bench.runner import (TEMPERATURE, Report, add_output_arguments, add_temperature_argument,
                                    aligned, bench_command)
from specforge.config import EngineConfig, load_pipeline
from specforge.engine import Engine, GenerationRequest
from specforge.evalsets import apply_chat_template, select_prompts
from specforge.machine import machine

__all__ = ["COMMAND", "DRAFT_PARTS", "PARTS", "REPORT", "plot", "run_round_benchmark", "table"]

DRAFT_PARTS = ("ingest", "backbone", "lm_head", "sequential")  # inside the drafter, in order
# Every part of a round, in the order it runs; ``draft_other`` is the drafter's and the engine's
# bookkeeping around them (building the context, gathering features, bounds).
PARTS = (*DRAFT_PARTS, "draft_other", "confidence", "scheduler", "verify_pass", "verifier", "commit")
DEFAULT_SETS = ("gsm8k", "humaneval", "mt-bench")


def _drive(engine: Engine, requests: list[GenerationRequest]) -> tuple[int, int, float]:
    """Run ``requests`` to the end; returns (rounds, new tokens, seconds inside rounds)."""
    before = sum(engine.phase_seconds.values())
    for r in requests:
        engine.submit(r)
    rounds = 0
    while engine.busy:
        spent = sum(engine.phase_seconds.values())
        engine.step()
        rounds += sum(engine.phase_seconds.values()) > spent  # a step that ran a round (not only prefill)
    outs = [engine.take_output(r.request_id) for r in requests]
    return rounds, sum(len(o.token_ids) for o in outs), sum(engine.phase_seconds.values()) - before


def _reset(engine: Engine) -> None:
    engine.reset_clocks()
    parts = getattr(engine.drafter, "part_seconds", None)
    if parts is not None:
        engine.drafter.part_seconds = dict.fromkeys(parts, 0.0)


def _requests(prompt_ids: list[list[int]], max_new_tokens: int, first_id: int,
              temperature: float) -> list[GenerationRequest]:
    # Greedy (the default): both arms write the same text, so they decode the same number of tokens.
    return [GenerationRequest(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=temperature,
                              request_id=first_id + i) for i, ids in enumerate(prompt_ids)]


def _parts(engine: Engine, rounds: int) -> dict[str, float]:
    """Milliseconds per round of every part of ``engine``'s speculative rounds."""
    per = 1000.0 / max(rounds, 1)
    drafter = getattr(engine.drafter, "part_seconds", {})
    out = {p: drafter.get(p, 0.0) * per for p in DRAFT_PARTS}
    d, ph = engine.draft_seconds, engine.phase_seconds
    out["confidence"], out["scheduler"] = d["confidence"] * per, d["scheduler"] * per
    out["draft_other"] = max(0.0, ph["draft"] * per - sum(out[p] for p in DRAFT_PARTS) - out["confidence"]
                             - out["scheduler"])
    out["verify_pass"], out["verifier"], out["commit"] = ph["target"] * per, ph["verify"] * per, ph["commit"] * per
    return out


def measure_setting(sources: Sequence[str], overrides: Sequence[str], target: Any, prompt_ids: list[list[int]],
                    gamma: int, max_new_tokens: int, repeats: int, temperature: float = TEMPERATURE) -> dict[str, Any]:
    """One (concurrency, γ): plain and speculative decoding of the same prompts, alternated."""
    c = len(prompt_ids)
    pipeline = load_pipeline(list(sources), [*overrides, f"drafter.gamma={gamma}"])
    limits = EngineConfig(max_batch=c, max_context=pipeline.engine.max_context)
    spec = Engine.from_pipeline(replace(pipeline, engine=limits), target)
    plain = Engine(target, pipeline.component("verifier").create(), engine=limits)
    for engine in (plain, spec):  # first-call allocations and kernel choices, untimed
        _drive(engine, _requests(prompt_ids[:1], 8, 10_000, temperature))
        _reset(engine)
    plain_rounds = plain_tokens = spec_rounds = spec_tokens = 0
    plain_s = spec_s = 0.0
    rid = 0
    for i in range(repeats):
        order = (plain, spec) if i % 2 == 0 else (spec, plain)  # alternate which arm goes first
        for engine in order:
            rounds, tokens, seconds = _drive(engine, _requests(prompt_ids, max_new_tokens, rid, temperature))
            rid += c
            if engine is plain:
                plain_rounds, plain_tokens, plain_s = plain_rounds + rounds, plain_tokens + tokens, plain_s + seconds
            else:
                spec_rounds, spec_tokens, spec_s = spec_rounds + rounds, spec_tokens + tokens, spec_s + seconds
    plain_ms = 1000.0 * plain_s / max(plain_rounds, 1)
    parts = _parts(spec, spec_rounds)
    round_ms = sum(parts.values())
    tau = spec_tokens / max(spec_rounds, 1) / c  # tokens per request per round
    return {
        "concurrency": c, "gamma": gamma, "rounds": spec_rounds, "tau": tau,
        "plain_step_ms": plain_ms, "round_ms": round_ms, "parts_ms": parts,
        "parts_in_plain_steps": {p: v / plain_ms for p, v in parts.items()},
        "round_in_plain_steps": round_ms / plain_ms,
        # What the round adds on top of the target's own pass over the verified drafts.
        "overhead_in_plain_steps": (round_ms - parts["verify_pass"]) / plain_ms,
        "verify_pass_in_plain_steps": parts["verify_pass"] / plain_ms,
        "speedup": (spec_tokens / spec_s) / (plain_tokens / plain_s) if spec_s and plain_s and plain_tokens else None,
    }


def run_round_benchmark(sources: Sequence[str] = ("dspark",), overrides: Sequence[str] = (),
                        concurrency: Sequence[int] = (1, 16), gammas: Sequence[int] = (4, 7, 16),
                        datasets: Sequence[str] = DEFAULT_SETS, max_new_tokens: int = 64, repeats: int = 2,
                        eval_dir: str | None = None, temperature: float = TEMPERATURE,
                        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every (concurrency, γ) of a speculative pipeline against plain decoding, same run."""
    from specforge.engine import load_pipeline_target

    base = load_pipeline(list(sources), list(overrides))
    if base.component("drafter") is None:
        from specforge.errors import ConfigError

        raise ConfigError(["drafter.name: bench round measures a speculative pipeline; this one has no drafter"])
    target = load_pipeline_target(base, requests=max(concurrency))
    prompts = select_prompts(list(datasets), max(concurrency), eval_dir)
    ids = [apply_chat_template(target.tokenizer, p.text) for p in prompts]
    started = time.perf_counter()
    rows = []
    for c in concurrency:
        for g in gammas:
            progress(f"c={c} γ={g} …")
            rows.append(measure_setting(sources, overrides, target, ids[:c], g, max_new_tokens, repeats, temperature))
    return {"machine": machine(), "precision": target.precision.to_dict(), "pipeline": base.to_dict(), "datasets": list(datasets),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "repeats": repeats,
            "seconds": time.perf_counter() - started,
            "rows": rows}


def table(result: dict[str, Any]) -> str:
    """Parts in plain steps per (c, γ), then the round, its overhead, τ and the speedup."""
    short = {"ingest": "ingest", "backbone": "backb.", "lm_head": "LMhead", "sequential": "seq.",
             "draft_other": "other", "confidence": "conf.", "scheduler": "sched.", "verify_pass": "verify",
             "verifier": "verif.", "commit": "commit"}
    head = ["c", "γ", "plain ms", *(short[p] for p in PARTS), "round", "overhead", "τ", "speedup"]
    lines = [head]
    for r in result["rows"]:
        s = r["parts_in_plain_steps"]
        lines.append([str(r["concurrency"]), str(r["gamma"]), f"{r['plain_step_ms']:.1f}",
                      *(f"{s[p]:.3f}" for p in PARTS), f"{r['round_in_plain_steps']:.2f}",
                      f"{r['overhead_in_plain_steps']:.2f}", f"{r['tau']:.2f}",
                      "-" if r["speedup"] is None else f"{r['speedup']:.2f}"])
    m = result["machine"]
    return f"{m['cpu']} ({', '.join(m['flags']) or 'no AVX-512/AMX'}; {m['torch_threads']} threads); parts in plain " \
           f"decoding steps\n" + aligned(lines)


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Stacked bars: each part of a round in plain steps, one bar per (c, γ); the line at 1 is a
    plain step, and τ over each bar is what the round buys."""
    from specforge.plots import new_figure, save_figure

    rows = result["rows"]
    fig = new_figure(max(5.0, 1.1 * len(rows) + 2.5), 4.6)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"c={r['concurrency']}\nγ={r['gamma']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        heights = [r["parts_in_plain_steps"][part] for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, (r, top) in enumerate(zip(rows, bottom)):
        ax.annotate(f"τ={r['tau']:.2f}", (x, top), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("plain decoding steps per round")
    ax.set_title(f"one speculative round, part by part ({result['machine']['cpu']})", fontsize=9)
    ax.legend(fontsize=7, ncols=2, loc="upper left")
    return save_figure(fig, path, dpi=120)


REPORT = Report("round.json", table, files=lambda result, out: [plot(result, out / "round.png")])


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", metavar="PRESET|FILE", help="pipeline (default: dspark)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--gamma", type=int, nargs="+", default=[4, 7, 16])
    p.add_argument("--datasets", nargs="+", default=list(DEFAULT_SETS))
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_temperature_argument(p)
    p.add_argument("--repeats", type=int, default=2, help="alternated plain/speculative runs per setting")
    p.add_argument("--eval-dir", default=None, metavar="DIR")
    add_output_arguments(p, "runs/bench-round")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """each part of a speculative round, in plain decoding steps measured in the same run

    Plain and speculative decoding (greedy by default) of the same eval prompts, alternated; for
    each concurrency and γ: ingest, backbone, LM head, sequential stage, confidence, scheduler,
    verify pass, verifier and commit, in ms and in plain steps (JSON, table, stacked bars).
    """
    return run_round_benchmark(args.config or ["dspark"], args.overrides, concurrency=args.concurrency,
                               gammas=args.gamma, datasets=args.datasets, max_new_tokens=args.max_new_tokens,
                               repeats=args.repeats, eval_dir=args.eval_dir, temperature=args.temperature,
                               progress=lambda line: print(line, file=sys.stderr, flush=True))


COMMAND = bench_command("round", _arguments, _measure, REPORT)

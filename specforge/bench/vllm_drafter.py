"""``specforge bench vllm-drafter``: a drafter trained here, served by vLLM's CPU build as its
speculative model, beside the same drafter in specforge's engine (docs/interop.md).

vLLM is a real client here: the drafter is written with ``specforge export --to vllm`` and vLLM
loads that folder itself (``speculative_config={"method": …, "model": <folder>}``).  Both systems
decode the same chat-templated prompts of the eval sets greedily, EOS ignored, ``max_new_tokens``
each, one request at a time, plainly and with the drafter (γ = the drafter's, vLLM's
``num_speculative_tokens``).  Three checks:

a. **Lossless in vLLM.**  At T = 0 vLLM's tokens with the drafter equal its plain tokens, prompt by
   prompt (the first differing position is reported otherwise).
b. **Same acceptance.**  vLLM's mean acceptance length — 1 + accepted draft tokens per draft, from
   its own ``spec_decode`` counters — against ours, 1 + accepted per round over the same prompts;
   they agree within ``tolerance`` (10 %) when vLLM runs the drafter as it was trained.  The two
   targets are the same weights (vLLM gets the GGUF's dequantized copy) in the same dtype, so
   only near-ties can make the greedy paths, and hence the counts, differ.
c. **Speedups**, each system over its own plain decoding in the same run.

Speeds are ratios within one system; vLLM runs in its own venv and process
(:mod:`specforge.bench.vllm_client`), after specforge's arms, on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specforge.bench.runner import TEMPERATURE, Report, add_output_arguments, bench_command
from specforge.errors import ConfigError

__all__ = ["COMMAND", "REPORT", "VLLM_METHODS", "VllmDrafterSettings", "passed", "run_vllm_drafter", "table"]

# One request of a few hundred tokens needs megabytes of KV cache; vLLM's CPU default here (4 GiB,
# vllm_runner) fails to start on a 24 GiB machine that is also training.  The caller's setting wins.
_KV_SPACE_GIB = "1"

#: specforge drafter method -> vLLM's ``speculative_config.method``.
VLLM_METHODS = {"eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash", "dspark": "dspark"}


@dataclass
class VllmDrafterSettings:
    """What to decode (the eval sets, prompts per set, tokens per prompt) and the acceptance tolerance."""

    datasets: Sequence[str] = ("gsm8k", "humaneval", "mt-bench")
    prompts: int = 4
    max_new_tokens: int = 128
    tolerance: float = 0.10
    # float32 by default: in bfloat16 a verify pass over γ + 1 positions rounds differently from a
    # one-token step, so near-ties flip and even a drafter that is never accepted changes vLLM's
    # greedy output (measured: 1 of 2 prompts at position 30) — check (a) would test rounding.
    dtype: str = "float32"
    trials: int = 2  # specforge's arms, interleaved; the fastest trial counts
    timeout: float = 1800.0  # seconds per vLLM variant, its start-up (compilation) included
    eval_dir: str | None = None
    overrides: Sequence[str] = field(default_factory=tuple)  # pipeline key=value for specforge's side


def _pipeline(drafter_dir: Path, overrides: Sequence[str], dtype: str) -> tuple[str, Any]:
    from specforge.config import load_pipeline

    try:
        meta = json.loads((drafter_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{drafter_dir}: not a specforge drafter checkpoint ({exc})"]) from None
    method = meta.get("method") if isinstance(meta, dict) else None
    if method not in VLLM_METHODS:
        raise ConfigError([f"{drafter_dir}: a {method!r} drafter; vLLM serves {', '.join(VLLM_METHODS)}"])
    sections = {"drafter": {"name": method, "checkpoint": str(drafter_dir)}}
    return method, load_pipeline(["default"], [f"target.dtype={dtype}", *overrides], sections=sections)


def _decode(engines: dict[str, Any], prompt_ids: list[list[int]], max_new_tokens: int,
            trials: int) -> dict[str, tuple[list[Any], float]]:
    """Every prompt on every engine, greedy, EOS ignored, one at a time (the engines' batch is 1):
    an untimed warm-up, then ``trials`` interleaved trials; the fastest one's outputs and seconds."""
    from specforge.engine import GenerationRequest

    def requests(n: int, ids: list[list[int]]) -> list[Any]:
        # the benches' greedy decoding: check (a) compares vLLM's tokens with the drafter to its plain ones
        return [GenerationRequest(prompt_ids=p, max_new_tokens=n, temperature=TEMPERATURE, ignore_eos=True)
                for p in ids]

    for engine in engines.values():
        engine.generate(requests(8, prompt_ids[:1]))
    best: dict[str, tuple[list[Any], float]] = {}
    for _ in range(trials):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outs = engine.generate(requests(max_new_tokens, prompt_ids))
            seconds = time.perf_counter() - t0
            failed = [o.error for o in outs if o.error]
            if failed:
                raise RuntimeError(f"specforge's engine ({name}) failed a request: {failed[0]}")
            if name not in best or seconds < best[name][1]:
                best[name] = (outs, seconds)
    return best


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_vllm_drafter(drafter_dir: str | Path, settings: VllmDrafterSettings, out: str | Path,
                     progress: bool = True) -> dict[str, Any]:
    """Export ``drafter_dir`` for vLLM under ``out``, decode with both systems, check (a)–(c)."""
    from specforge.acceptance import AcceptanceCounts, tau
    from specforge.machine import machine
    from specforge.bench.vllm_client import bench_vllm, find_vllm_python, vllm_version
    from specforge.config import EngineConfig
    from specforge.engine import Engine
    from specforge.evalsets import apply_chat_template, select_prompts
    from specforge.interop import export_checkpoint
    from specforge.target import TargetModel

    drafter_dir, out = Path(drafter_dir), Path(out)
    method, pipeline = _pipeline(drafter_dir, settings.overrides, settings.dtype)
    python = find_vllm_python()  # VllmNotInstalled says how to install it, before any work
    version = vllm_version(python)
    export = out / f"{method}-vllm"
    shutil.rmtree(export, ignore_errors=True)  # our own output of an earlier run
    notes = export_checkpoint(drafter_dir, "vllm", export)

    target = TargetModel.from_config(pipeline.target)
    names, prompt_ids = [], []
    for name in settings.datasets:
        for p in select_prompts(name, settings.prompts, settings.eval_dir):
            names.append(p.dataset)
            prompt_ids.append(apply_chat_template(target.tokenizer, p.text))
    limits = EngineConfig(max_batch=1, max_context=pipeline.engine.max_context)
    spec = Engine.from_pipeline(replace(pipeline, engine=limits), target)
    gamma = int(spec.drafter.gamma)
    plain = Engine(target, pipeline.component("verifier").create(), engine=limits)
    say = (lambda m: print(m, file=sys.stderr)) if progress else (lambda m: None)
    say(f"specforge: {len(prompt_ids)} prompts, plain and {method} (γ = {gamma})")
    runs = _decode({"plain": plain, method: spec}, prompt_ids, settings.max_new_tokens, settings.trials)
    (ours_plain, plain_s), (ours_spec, spec_s) = runs["plain"], runs[method]
    pooled = AcceptanceCounts.pooled(o.stats for o in ours_spec)
    ours_len = pooled.tau  # 1 + accepted per round

    say(f"vLLM {version}: plain and {method} from {export}")
    variants = [{"name": "plain"},
                {"name": method, "speculative_config": {"method": VLLM_METHODS[method], "model": str(export.resolve()),
                                                        "num_speculative_tokens": gamma}}]
    records = {r["variant"]: r for r in bench_vllm(prompt_ids, [1], variants, settings.max_new_tokens, min_rounds=1,
                                                    warmup_tokens=8, dtype=settings.dtype,
                                                    timeout=settings.timeout, keep_tokens=True, progress=progress,
                                                    log_dir=out / "vllm-logs",
                                                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", _KV_SPACE_GIB)})}
    failed = {v: r.get("reason") for v, r in records.items() if r.get("status") != "ok"}
    result: dict[str, Any] = {
        "machine": machine(), "vllm": version, "drafter": str(drafter_dir), "method": method, "gamma": gamma,
        "export": str(export), "export_notes": notes, "settings": {**asdict(settings), "datasets": list(settings.datasets),
                                                                   "overrides": list(settings.overrides)},
        "prompts": names, "vllm_records": records,
        "specforge": {"plain_tok_s": _rate(ours_plain, plain_s), "drafter_tok_s": _rate(ours_spec, spec_s),
                      "rounds": pooled.rounds, "acceptance_length": ours_len,
                      "acceptance": pooled.conditional_acceptance(),
                      "identical_to_plain": sum(a.token_ids == b.token_ids for a, b in zip(ours_spec, ours_plain))},
    }
    ours = result["specforge"]
    ours["speedup"] = ours["drafter_tok_s"] / ours["plain_tok_s"]
    if failed:
        result["checks"] = {"vllm_failed": failed}
        return result
    tokens = {v: {o["prompt"]: o["tokens"] for o in r["outputs"]} for v, r in records.items()}
    diffs = {i: _first_difference(tokens[method][i], tokens["plain"][i]) for i in range(len(prompt_ids))}
    counters = records[method]["extra"].get("spec_decode") or {}
    vllm_len = tau(counters.get("accepted_tokens", 0), counters.get("drafts", 0))  # the same definition
    ratio = vllm_len / ours_len
    result["vllm"] = {"version": version, "plain_tok_s": records["plain"]["tok_s"],
                      "drafter_tok_s": records[method]["tok_s"], "acceptance_length": vllm_len,
                      "spec_decode": counters, "startup_s": records[method]["extra"].get("startup_s"),
                      "speedup": records[method]["tok_s"] / records["plain"]["tok_s"]}
    result["checks"] = {
        "lossless_in_vllm": {"identical": sum(d is None for d in diffs.values()), "prompts": len(diffs),
                             "first_difference": {names[i] + f"#{i}": d for i, d in diffs.items() if d is not None}},
        "same_plain_tokens": sum(tokens["plain"][i] == o.token_ids for i, o in enumerate(ours_plain)),
        "acceptance_ratio": ratio, "acceptance_within_tolerance": abs(ratio - 1) <= settings.tolerance,
    }
    return result


def _rate(outs: Sequence[Any], seconds: float) -> float:
    return sum(len(o.token_ids) for o in outs) / seconds if seconds > 0 else float("nan")


def passed(result: dict[str, Any]) -> bool:
    """Checks (a) and (b) hold."""
    c = result.get("checks", {})
    lossless = c.get("lossless_in_vllm", {})
    return bool(lossless) and lossless["identical"] == lossless["prompts"] and bool(c.get("acceptance_within_tolerance"))


def table(result: dict[str, Any]) -> str:
    """Markdown: the two systems side by side, then the checks."""
    ours, c = result["specforge"], result.get("checks", {})
    lines = [f"{result['method']} drafter {result['drafter']} (γ = {result['gamma']}), "
             f"{len(result['prompts'])} prompts × {result['settings']['max_new_tokens']} tokens, greedy, c = 1, "
             f"{result['settings']['dtype']} — "
             f"{result['machine'].get('cpu')}", ""]
    if "vllm_failed" in c:
        return "\n".join(lines + [f"vLLM failed: {c['vllm_failed']}"])
    v = result["vllm"]
    lines += ["| system | plain tok/s | with drafter tok/s | speedup | mean acceptance length |",
              "|---|---:|---:|---:|---:|",
              f"| specforge | {ours['plain_tok_s']:.1f} | {ours['drafter_tok_s']:.1f} | {ours['speedup']:.2f}× | "
              f"{ours['acceptance_length']:.3f} |",
              f"| vLLM {v['version']} (CPU) | {v['plain_tok_s']:.1f} | {v['drafter_tok_s']:.1f} | {v['speedup']:.2f}× | "
              f"{v['acceptance_length']:.3f} |", ""]
    ll = c["lossless_in_vllm"]
    lines += [f"- (a) vLLM with the drafter = vLLM plain, token for token: {ll['identical']}/{ll['prompts']} prompts"
              + (f" (first differences: {ll['first_difference']})" if ll["first_difference"] else ""),
              f"- (b) acceptance length vLLM / specforge = {c['acceptance_ratio']:.3f} "
              f"({'within' if c['acceptance_within_tolerance'] else 'OUTSIDE'} ±{result['settings']['tolerance']:.0%})",
              f"- plain tokens identical across the two systems: {c['same_plain_tokens']}/{ll['prompts']} prompts; "
              f"specforge with the drafter = specforge plain: {ours['identical_to_plain']}/{ll['prompts']}",
              f"- result: {'PASSED' if passed(result) else 'FAILED'}"]
    return "\n".join(lines)


REPORT = Report("bench.json", table, table_file="table.md")


def _arguments(p: argparse.ArgumentParser) -> None:
    d = VllmDrafterSettings()
    p.add_argument("drafter", metavar="DRAFTER_DIR", help="a specforge drafter checkpoint (eagle3, medusa, …)")
    p.add_argument("--datasets", nargs="+", default=list(d.datasets))
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per eval set")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--tolerance", type=float, default=d.tolerance,
                   help="largest relative difference of the mean acceptance lengths")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"],
                   help="both systems' dtype (bfloat16 rounds a γ+1-token verify pass differently from a one-token "
                        "step, so near-ties flip the greedy output)")
    p.add_argument("--eval-dir", default=None, metavar="DIR")
    add_output_arguments(p, "runs/bench-vllm-drafter")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="pipeline overrides for specforge's side, e.g. drafter.gamma=5")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """serve a drafter trained here with vLLM's CPU build (exported with `specforge export --to vllm`) and
    compare it with specforge's engine

    Exports DRAFTER_DIR in vLLM's layout, then decodes the same prompts greedily with vLLM (plain and
    with the drafter as its speculative model) and with specforge's engine (plain and with the
    drafter).  Checks that vLLM's output with the drafter equals its plain output token for token and
    that vLLM's mean acceptance length is within the tolerance of ours; reports both systems'
    speedups over their own plain decoding.  Needs vLLM's CPU build (`make vllm`).  Exit status 1
    when a check fails.
    """
    settings = VllmDrafterSettings(datasets=args.datasets, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                   tolerance=args.tolerance, dtype=args.dtype, eval_dir=args.eval_dir,
                                   overrides=args.overrides)
    return run_vllm_drafter(args.drafter, settings, args.out)


COMMAND = bench_command("vllm-drafter", _arguments, _measure, REPORT, passed=passed)

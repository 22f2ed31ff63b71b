"""``specforge bench ab``: paired A/B of decoding setups in one process, in short interleaved trials.

These machines drift by ±30 % within minutes, so one run of A followed by one run of B says
little, and even runs minutes apart pair poorly.  Here every trial is short (one batch of
``concurrency`` prompts, ``max_new_tokens`` tokens, a second or two per arm) and runs every arm
back to back, the order reversed from trial to trial; each arm's speed is divided by the baseline
arm's *in the same trial*.  The median and quartiles of those ratios over many trials are what
this reports — seconds apart, the machine's drift mostly cancels.

Arms: ``hf`` (Hugging Face ``generate``, the batch left-padded), and
``{eager,compiled}-{plain,ngram,ngram-hw,ngram-shut}`` (this engine, eager or compiled target
forward; ``ngram`` with γ = 5 and the fixed scheduler, ``ngram-hw`` the same drafter under the
hardware-aware scheduler and its draft gate with this machine's step curve, as in ``specforge
bench engine``; ``ngram-shut`` the same with drafting priced so high that the gate keeps almost
every round plain — paired with ``plain``, what a pipeline that drafts nothing costs); a
``native-`` prefix runs the same arm with the GGUF's 4-bit blocks as stored
(``target.weights=native``); ``llamacpp-{plain,ngram,ngram-hw,ngram-shut}`` run the same engine
arms on the llama.cpp backend (``target.backend=llama.cpp``), so one run pairs both backends.  A ``/PRECISION``
suffix sets the precision: ``/auto`` (the engine's default: measured on this machine, see
docs/engine.md#precision), ``/float32`` or ``/bfloat16`` (without one: ``auto`` for the engine,
bfloat16 for ``hf``); a last ``:model`` or ``:float32`` gives an engine arm that KV-cache dtype
(``target.kv_dtype``; without one, ``auto``'s choice on this machine)::

    specforge bench ab --arms hf eager-plain compiled-plain compiled-ngram --trials 40 --out runs/engine-ab
    specforge bench ab --arms eager-plain/bfloat16 eager-plain/float32 eager-plain/auto hf/float32 --concurrency 8
    specforge bench ab --arms eager-plain:model eager-plain:float32 --concurrency 16 --trials 20
    specforge bench ab --arms eager-plain eager-ngram-shut llamacpp-plain llamacpp-ngram-shut --trials 40
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Any

import torch

from specforge.bench.engine_bench import needs_profile, variant_engine
from specforge.engine.request import positions_needed
from specforge.bench.hf_baseline import load_smollm2, run_generate
from specforge.bench.runner import Report, add_output_arguments, bench_command
from specforge.bench.serving import prompt_mix
from specforge.engine import GenerationRequest
from specforge.errors import SpecforgeError
from specforge.evalsets import apply_chat_template, select_prompts
from specforge.machine import machine
from specforge.runtime import load_target
from specforge.runtime.target import dtype_name
from specforge.toolkit.step_curve import machine_profile

__all__ = ["ARMS", "ABError", "COMMAND", "REPORT", "own_plain", "quartiles", "ratios", "run_ab", "table"]

_VARIANTS = ("plain", "ngram", "ngram-hw", "ngram-shut")
_BASE_ARMS = [f"{w}{f}-{v}" for w in ("", "native-") for f in ("eager", "compiled") for v in _VARIANTS]
_PRECISIONS = ("auto", "float32", "bfloat16")
# An engine arm may name its precision (``eager-plain/float32``; default auto) and its KV cache's
# dtype (specforge.runtime.torch.kv_dtype): ``eager-plain:float32``; without one the cache is ``auto``'s
# choice on this machine.
_WITH_PRECISION = [*_BASE_ARMS, *(f"{a}/{p}" for a in _BASE_ARMS for p in _PRECISIONS)]
# The llama.cpp backend runs the GGUF's own types: no compiled forward, precision or KV dtype to name.
LLAMACPP_ARMS = [f"llamacpp-{v}" for v in _VARIANTS]
ENGINE_ARMS = [*_WITH_PRECISION, *(f"{a}:{kv}" for a in _WITH_PRECISION for kv in ("model", "float32")),
               *LLAMACPP_ARMS]
ARMS = ["hf", "hf/float32", "hf/bfloat16", *ENGINE_ARMS]
DATASETS = ["humaneval", "mt-bench"]


class ABError(SpecforgeError):
    """An A/B run that cannot be set up as asked."""


def quartiles(xs: list[float]) -> list[float]:
    return [round(q, 3) for q in statistics.quantiles(xs, n=4)] if len(xs) > 1 else [round(xs[0], 3)] * 3


def _weights(arm: str) -> str:
    return "native" if arm.startswith("native-") else "auto"


def _backend(arm: str) -> str:
    return "llama.cpp" if arm.startswith("llamacpp-") else "torch"


def _target_key(arm: str) -> tuple[str, str, str]:
    """(backend, weights, precision): the arms that share a target."""
    return _backend(arm), _weights(arm), _parts(arm)[1]


def _parts(arm: str) -> tuple[str, str, str]:
    """``native-eager-plain/float32:model`` → (``native-eager-plain``, ``float32``, ``model``)."""
    head, _, kv = arm.partition(":")
    base, _, precision = head.partition("/")
    return base, precision or ("bfloat16" if base == "hf" else "auto"), kv


class _Arms:
    """Everything the arms decode with, loaded once: a target per kind of weights (with its
    compiled trunk where an arm needs it), an engine per engine arm, and HF's model for ``hf``."""

    def __init__(self, arms: Sequence[str], concurrency: int, max_new_tokens: int) -> None:
        engine_arms = [a for a in arms if _parts(a)[0] != "hf"]
        # one target per (backend, weights, precision) the arms name
        self.targets = {key: load_target("smollm2", dtype=key[2], weights=key[1], backend=key[0])
                        for key in dict.fromkeys(_target_key(a) for a in engine_arms)}
        self.tokenizer = (next(iter(self.targets.values())).tokenizer if self.targets
                          else load_smollm2("float32")[1])
        self.trunks: dict[tuple[str, str, str], dict[str, Any]] = {}
        for key, target in self.targets.items():
            if any("compiled" in a and _target_key(a) == key for a in engine_arms):
                if not target.compile():
                    raise ABError("torch.compile is not available here (no C++ compiler)")
                self.trunks[key] = target.trunks
        self.engine_arms, self.concurrency, self.max_new_tokens = engine_arms, concurrency, max_new_tokens
        self.engines: dict[str, Any] = {}
        self.hf_models: dict[str, Any] = {}
        self.pad_id = 0
        hf_precisions = {_parts(a)[1] for a in arms if _parts(a)[0] == "hf"}
        if hf_precisions:
            model = load_smollm2("float32", tokenizer=False)[0]
            self.pad_id = model.generation_config.pad_token_id or 0
            # Module.to works in place: each precision its own copy
            self.hf_models = {p: model if p == "float32" else copy.deepcopy(model).to(getattr(torch, p))
                              for p in sorted(hf_precisions)}

    def build_engines(self, prompts: Sequence[Sequence[int]]) -> None:
        """An engine per engine arm, its KV cache sized for ``prompts`` (:func:`positions_needed`)."""
        context = positions_needed(prompts, self.max_new_tokens)
        for a in self.engine_arms:
            base, _, kv = _parts(a)
            target = self.targets[_target_key(a)]
            target.runtime.kv_dtype = kv or "auto"  # read when the engine allocates its cache
            variant = base.removeprefix("native-").split("-", 1)[1]
            profile = machine_profile(target) if needs_profile(variant) else None
            self.engines[a] = variant_engine(target, variant, self.concurrency, self.max_new_tokens, profile, context)

    def speed(self, arm: str, batch: list[list[int]], tokens: int) -> float:
        """Tokens per second of ``arm`` decoding ``batch`` for ``tokens`` tokens each."""
        base, precision, _ = _parts(arm)
        if base == "hf":
            rows, seconds = run_generate(self.hf_models[precision], batch, tokens, self.pad_id)
            return sum(len(r) for r in rows) / seconds
        key = _target_key(arm)
        self.targets[key].use_trunks(self.trunks.get(key) if "compiled" in arm else None)
        started = time.perf_counter()
        outs = self.engines[arm].generate([GenerationRequest(prompt_ids=p, max_new_tokens=tokens, ignore_eos=True)
                                           for p in batch])
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)


def run_ab(
    arms: Sequence[str],
    baseline: str | None = None,
    trials: int = 40,
    concurrency: int = 1,
    prompts: int = 8,
    max_new_tokens: int = 32,
    threads: int | None = None,
    sharegpt: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Warm every arm up, then run ``trials`` paired trials; ``baseline`` (default: the first arm)
    is what the ratios divide by; ``sharegpt`` ShareGPT first turns (at their real lengths) join the
    prompts.  ``progress`` hears a line every 10 trials."""
    arms = list(arms)
    baseline = baseline or arms[0]
    if baseline not in arms:
        raise ABError(f"--baseline {baseline!r} is not one of --arms")
    if threads:
        torch.set_num_threads(threads)
    c, n = concurrency, max_new_tokens
    setup = _Arms(arms, c, n)
    ids = [apply_chat_template(setup.tokenizer, p.text) for p in select_prompts(DATASETS, max(prompts, c))]
    if sharegpt:  # long real contexts, interleaved so that every trial's batch mixes both
        turns = prompt_mix(setup.tokenizer, [], 0, sharegpt)
        ids = [x for pair in zip_longest(ids, turns) for x in pair if x is not None]
    setup.build_engines(ids)

    def batch(first: int) -> list[list[int]]:
        return [ids[(first + j) % len(ids)] for j in range(c)]

    started = time.perf_counter()
    for arm in arms:  # compile the graphs (sizes generalise over the first passes), untimed
        for i in range(3 if "compiled" in arm else 1):
            setup.speed(arm, batch(i), n)
    warmup = time.perf_counter() - started
    speeds: dict[str, list[float]] = {a: [] for a in arms}
    for t in range(trials):
        for arm in (arms if t % 2 == 0 else arms[::-1]):  # alternate the order: no arm always goes first
            speeds[arm].append(setup.speed(arm, batch(t * c), n))
        if progress is not None and (t + 1) % 10 == 0:
            progress(f"trial {t + 1}/{trials}: " + ", ".join(f"{a} {speeds[a][-1]:.1f}" for a in arms))
    return {"arms": arms, "baseline": baseline, "trials": trials, "concurrency": c, "max_new_tokens": n,
            "prompts": len(ids), "sharegpt": sharegpt,
            "threads": torch.get_num_threads(), "warmup_seconds": round(warmup, 1),
            "kv_dtype": {a: dtype_name(e.cache.k[0].dtype) if _backend(a) == "torch" else e.target.precision_label
                         for a, e in setup.engines.items()},
            "precision": {a: e.target.precision.to_dict() for a, e in setup.engines.items()},
            "machine": machine(),
            "compile_failed": {f"{w}/{p}": trunk.failed for (_, w, _), trunks in setup.trunks.items()
                               for p, trunk in trunks.items()},
            # rounds a drafting arm ran without drafting (its scheduler's draft gate), warm-up included
            "plain_rounds": {a: e.plain_rounds for a, e in setup.engines.items() if e.drafter is not None},
            "summary": ratios(speeds, baseline), "tok_s": speeds}


def own_plain(arm: str) -> str:
    """The plain arm of ``arm``'s backend, weights, forward and precision (``llamacpp-ngram-shut`` →
    ``llamacpp-plain``, ``eager-ngram/float32:model`` → ``eager-plain/float32:model``)."""
    base, sep, rest = arm.partition("/") if "/" in arm else arm.partition(":")
    head, _, _ = base.partition("-ngram")
    return f"{head}-plain{sep}{rest}" if head != base else arm


def ratios(speeds: dict[str, list[float]], baseline: str) -> dict[str, dict[str, Any]]:
    """Per arm: the median and quartiles of its speed and of its ratio to the baseline's speed in
    the same trial; a drafting arm whose own plain arm (:func:`own_plain`) ran too, also its ratio
    to that one — what its drafting costs or buys on its own backend."""
    summary = {}
    for arm, xs in speeds.items():
        per_trial = [x / b for x, b in zip(xs, speeds[baseline])]
        summary[arm] = {"tok_s_median": round(statistics.median(xs), 2), "tok_s_quartiles": quartiles(xs),
                        f"ratio_to_{baseline}_median": round(statistics.median(per_trial), 3),
                        f"ratio_to_{baseline}_quartiles": quartiles(per_trial)}
        plain = own_plain(arm)
        if plain != arm and plain in speeds:
            own = [x / b for x, b in zip(xs, speeds[plain])]
            summary[arm].update(ratio_to_own_plain_median=round(statistics.median(own), 3),
                                ratio_to_own_plain_quartiles=quartiles(own))
    return summary


def json_name(result: dict[str, Any]) -> str:
    """``ab-ARMS-cC.json``: no ``:`` (Windows) or ``/`` in a file name, so ``=`` and ``@`` for them."""
    arms = "-".join(a.replace(":", "=").replace("/", "@") for a in result["arms"])
    return f"ab-{arms}-c{result['concurrency']}.json"


def table(result: dict[str, Any]) -> str:
    baseline = result["baseline"]
    w = max(16, *(len(a) for a in result["summary"]))
    ratio = "÷ " + baseline + " median"
    r = max(22, len(ratio))
    own = any("ratio_to_own_plain_median" in s for s in result["summary"].values())
    head = f"{'arm':<{w}} {'tok/s median':>12} {ratio:>{r}} {'quartiles':>16}"
    head += f" {'÷ own plain median':>19} {'quartiles':>16}" if own else ""
    lines = [head, "-" * len(head)]
    for arm, s in result["summary"].items():
        q = s[f"ratio_to_{baseline}_quartiles"]
        line = (f"{arm:<{w}} {s['tok_s_median']:>12.1f} {s[f'ratio_to_{baseline}_median']:>{r}.2f} "
                f"{q[0]:>7.2f}–{q[2]:.2f}")
        if "ratio_to_own_plain_median" in s:
            q = s["ratio_to_own_plain_quartiles"]
            line += f" {s['ratio_to_own_plain_median']:>19.2f} {q[0]:>7.2f}–{q[2]:.2f}"
        lines.append(line)
    return "\n".join(lines)


def _report_table(result: dict[str, Any]) -> str:
    return table(result) + (f"\n({result['trials']} trials, c={result['concurrency']}, {result['max_new_tokens']} new "
                            f"tokens, {result['threads']} threads)")


REPORT = Report(json_name, _report_table)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=["hf", "eager-plain", "compiled-plain"], choices=ARMS, metavar="ARM",
                   help="hf[/PRECISION], [native-]{eager,compiled}-{plain,ngram,ngram-hw,ngram-shut}[/PRECISION]"
                        "[:model|:float32], llamacpp-{plain,ngram,ngram-hw,ngram-shut}")
    p.add_argument("--baseline", default=None, help="arm the ratios divide by (default: the first)")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8, help="prompts cycled through (humaneval, mt-bench)")
    p.add_argument("--sharegpt", type=int, default=0, help="also this many ShareGPT first turns, at their real lengths")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    add_output_arguments(p, "runs/engine-ab")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """paired A/B of decoding setups: short trials, every arm back to back, ratios per trial

    Each trial runs one batch with every arm back to back (the order reversed from trial to trial)
    and divides each arm's tokens/s by the baseline arm's in the same trial, so the machine's drift
    mostly cancels; reports the median and quartiles of those ratios.  Arms: hf (HF generate) and
    {eager,compiled}-{plain,ngram,ngram-hw,ngram-shut} of the engine (ngram-shut: a draft gate
    that keeps almost every round plain), llamacpp-… the same on the llama.cpp backend; a native-
    prefix runs the engine arm on the GGUF's 4-bit blocks, a /PRECISION suffix (auto, float32,
    bfloat16) in that precision (default: auto for the engine, bfloat16 for hf), a :model or
    :float32 suffix with that KV-cache dtype (default: auto's choice on this machine).
    """
    return run_ab(args.arms, baseline=args.baseline, trials=args.trials, concurrency=args.concurrency,
                  prompts=args.prompts, max_new_tokens=args.max_new_tokens, threads=args.threads,
                  sharegpt=args.sharegpt, progress=lambda line: print(line, flush=True))


COMMAND = bench_command("ab", _arguments, _measure, REPORT)

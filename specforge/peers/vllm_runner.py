"""Time vLLM's CPU build on a set of prompts.  Runs INSIDE the vLLM venv (``.venv-vllm``).

This file is a standalone script: it imports vLLM and the standard library only, never
specforge (the vLLM venv does not have it).  :mod:`specforge.peers.vllm_client` runs it in a
subprocess; it can also be run by hand::

    .venv-vllm/bin/python specforge/peers/vllm_runner.py request.json     # or '-' for stdin

Request (JSON)::

    {
      "model": "/home/u/.cache/specforge/gguf/SmolLM2-…", # an HF directory (safetensors)
      "prompt_token_ids": [[1, 2, ...], ...],             # chat-templated prompts, or
      "prompts": ["text", ...],                           #   raw first turns (templated here)
      "variants": [{"name": "plain"},
                   {"name": "ngram", "speculative_config": {"method": "ngram",
                    "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}}],
      "concurrency": [1, 4, 16],
      "max_new_tokens": 128,
      "temperature": 0.0,       # vLLM's sampling temperature (the caller's; greedy when absent)
      "min_rounds": 2,          # timed rounds per concurrency, at least (c requests per round)
      "warmup_tokens": 16,      # untimed: every prompt once (c at a time), this many tokens
      "dtype": "bfloat16",
      "llm_kwargs": {},         # passed to vllm.LLM as they are
      "keep_tokens": false,     # include generated token ids in the records
      "closed_loop": false      # true: per concurrency c, ONE generate call over every prompt with
                                #   max_num_seqs = c (vLLM admits the next as one finishes: c in
                                #   flight at every moment, like specforge's engine with max_batch = c)
    }

Reply: ONE line of JSON on stdout (everything vLLM prints is sent to stderr)::

    {"format": "specforge.bench.vllm", "version": 1, "vllm": "0.32.0", "torch": "...",
     "env": {...VLLM_CPU_* ...}, "wall_s": 123.4,
     "results": [<record per variant × concurrency>, ...]}

Records have the shape documented in :mod:`specforge.bench.hf_baseline` with
``"system": "vllm-cpu"`` and ``"variant"`` the variant's name; ``extra`` holds the variant's
startup time (``LLM(...)`` construction: load, compile, KV-cache allocation) and, for
speculative variants, draft acceptance counted from vLLM's metrics over the timed rounds.
``extra.loadavg`` is the 1-minute load average before and after the
timed rounds.  Prefix caching is off unless ``llm_kwargs`` turns it on.  Per-request latency is taken from vLLM's per-request timestamps (queued → last token) when it
reports them, else it is the round's wall time.

A variant that fails yields a record with ``"status": "error"`` and the reason; the script
exits 0 unless the request itself is unusable.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

FORMAT = "specforge.bench.vllm"
VERSION = 1


def _all_cpus() -> str:
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return ",".join(map(str, cpus))


# Defaults for a small CPU box; the caller's environment wins.  vLLM's own default binding
# ("auto") keeps one core per worker free for its scheduler process, which on a 2-core machine
# halves the compute: measured on SmolLM2 there, binding the OpenMP threads to every core with
# none reserved ran at 25 / 86 / 255 tok/s (concurrency 1 / 4 / 16) against 15-18 / 55-58 /
# 141-179 with "auto".  Set VLLM_CPU_OMP_THREADS_BIND=auto to get vLLM's default back.
_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": _all_cpus(),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # keep stdout for the JSON reply
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _log(msg: str) -> None:
    print(f"[vllm_runner] {msg}", file=sys.stderr, flush=True)


def rounds_for(n_prompts: int, concurrency: int, min_rounds: int) -> list[list[int]]:
    """Same plan as specforge.peers.records.rounds_for (kept in sync by a test)."""
    if n_prompts < 1 or concurrency < 1:
        raise ValueError("need at least one prompt and concurrency >= 1")
    rounds = max(min_rounds, math.ceil(n_prompts / concurrency))
    return [[(r * concurrency + j) % n_prompts for j in range(concurrency)] for r in range(rounds)]


def _spec_counters(llm: Any) -> dict[str, float]:
    """Cumulative speculative-decoding counters from vLLM's metrics ({} when unavailable)."""
    want = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    out: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            key = want.get(m.name)
            if key is not None and hasattr(m, "value"):
                out[key] = out.get(key, 0) + float(m.value)
    except Exception:  # noqa: BLE001 - metrics are a bonus
        return {}
    return out


def _spec_decode(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """What vLLM's draft counters say of the timed span (None: no drafts, or no counters)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    if not after or d["drafts"] <= 0:
        return None
    return {**{k: int(v) for k, v in d.items()},
            "acceptance_rate": round(d["accepted_tokens"] / d["draft_tokens"], 4) if d["draft_tokens"] else None,
            "mean_accepted_per_draft": round(d["accepted_tokens"] / d["drafts"], 4)}


def _temperature(req: dict[str, Any]) -> float:
    """The request's sampling temperature; its caller (specforge.peers.vllm_client) always sends the
    benches' own, and a request written by hand decodes greedily."""
    return float(req.get("temperature", 0.0))


def _loadavg() -> float | None:
    """1-minute load average: other work on the machine skews the timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _latency(o: Any, round_s: float) -> tuple[float, str]:
    m = getattr(o, "metrics", None)
    try:
        lat = float(m.last_token_ts) - float(m.queued_ts)
        if 0 < lat <= round_s * 1.05:
            return lat, "engine"
    except (AttributeError, TypeError, ValueError):
        pass
    return round_s, "round"


def _measure(llm: Any, prompts: list[Any], c: int, req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    max_new = int(req.get("max_new_tokens", 128))
    sp = SamplingParams(temperature=_temperature(req), max_tokens=max_new, ignore_eos=True)
    warm = SamplingParams(temperature=_temperature(req), max_tokens=int(req.get("warmup_tokens", 16)), ignore_eos=True)
    plan = rounds_for(len(prompts), c, int(req.get("min_rounds", 2)))
    load_before = _loadavg()
    # Warm-up, untimed: every prompt once, c at a time, a few tokens each, so that the shapes
    # of every prefill and of a c-wide decode have been seen (compiled, cached) before timing.
    order = sorted({i for r in plan for i in r})
    for k in range(0, len(order), c):
        llm.generate([prompts[i] for i in order[k:k + c]], warm, use_tqdm=False)

    before = _spec_counters(llm)
    times: list[float] = []
    lats: list[float] = []
    per_req: list[float] = []
    sources: set[str] = set()
    new_tokens = prompt_tokens = 0
    outputs: list[dict[str, Any]] = []
    for k, r in enumerate(plan):
        t0 = time.perf_counter()
        outs = llm.generate([prompts[i] for i in r], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        times.append(dt)
        for i, o in zip(r, outs):
            n = len(o.outputs[0].token_ids)
            lat, src = _latency(o, dt)
            sources.add(src)
            lats.append(lat)
            per_req.append(n / lat)
            new_tokens += n
            prompt_tokens += len(o.prompt_token_ids or [])
            if req.get("keep_tokens"):
                outputs.append({"prompt": i, "tokens": list(o.outputs[0].token_ids)})
        _log(f"  c={c} round {k + 1}/{len(plan)}: {dt:.2f}s, {sum(len(o.outputs[0].token_ids) for o in outs) / dt:.1f} tok/s")
    after = _spec_counters(llm)

    wall = sum(times)
    rec: dict[str, Any] = {
        "status": "ok",
        "reason": None,
        "n_requests": len(lats),
        "rounds": len(plan),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "wall_s": round(wall, 4),
        "tok_s": round(new_tokens / wall, 3) if wall > 0 else None,
        "per_request_tok_s": round(statistics.fmean(per_req), 3),
        "latency_s": {
            "mean": round(statistics.fmean(lats), 4),
            "p50": round(statistics.median(lats), 4),
            "max": round(max(lats), 4),
        },
        "extra": {"latency_source": "+".join(sorted(sources)), "loadavg": [load_before, _loadavg()]},
    }
    spec = _spec_decode(before, after)
    if spec:
        rec["extra"]["spec_decode"] = spec
    if req.get("keep_tokens"):
        rec["outputs"] = outputs
    return rec


def _measure_closed(llm: Any, prompts: list[Any], c: int, req: dict[str, Any]) -> dict[str, Any]:
    """Every prompt once in ONE generate call; the engine was built with ``max_num_seqs = c``, so
    c requests are in flight at every moment.  Per request, from vLLM's engine timestamps: time to
    first token and inter-token latency counted from when it was first scheduled (the wait for a
    free seat excluded, as specforge's closed loop counts from admission), and its own tokens/s —
    every request's value (``ttft_s_each``, ``itl_s_each``), for the caller to summarise."""
    from vllm import SamplingParams

    max_new = int(req.get("max_new_tokens", 128))
    sp = SamplingParams(temperature=_temperature(req), max_tokens=max_new, ignore_eos=True)
    warm = SamplingParams(temperature=_temperature(req), max_tokens=int(req.get("warmup_tokens", 16)), ignore_eos=True)
    llm.generate(prompts[:c], warm, use_tqdm=False)  # untimed: a c-wide decode and its prefills seen once
    load_before = _loadavg()
    before = _spec_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _spec_counters(llm)
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft, itl, per_user = [], [], []
    for o in outs:
        m, n = getattr(o, "metrics", None), len(o.outputs[0].token_ids)
        try:
            start, first, last = float(m.scheduled_ts), float(m.first_token_ts), float(m.last_token_ts)
        except (AttributeError, TypeError, ValueError):
            continue
        if not 0 <= first - start <= wall * 1.05 or last < first:
            continue  # timestamps from different clocks: leave the latencies out rather than guess
        ttft.append(first - start)
        if n > 1:
            itl.append((last - first) / (n - 1))
        if last > start:
            per_user.append(n / (last - start))
    rec: dict[str, Any] = {
        "status": "ok", "reason": None, "n_requests": len(outs), "new_tokens": new_tokens,
        "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs), "wall_s": round(wall, 4),
        "tok_s": round(new_tokens / wall, 3) if wall > 0 else None,
        "per_request_tok_s": round(statistics.fmean(per_user), 3) if per_user else None,
        "ttft_s_each": [round(x, 5) for x in ttft], "itl_s_each": [round(x, 5) for x in itl],
        "extra": {"closed_loop": True, "loadavg": [load_before, _loadavg()], "timed_requests": len(ttft)},
    }
    spec = _spec_decode(before, after)
    if spec:
        rec["extra"]["spec_decode"] = spec
    return rec


def _prompts(req: dict[str, Any]) -> list[Any]:
    if req.get("prompt_token_ids"):
        return [{"prompt_token_ids": [int(t) for t in ids]} for ids in req["prompt_token_ids"]]
    if req.get("prompts"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(req["model"])
        out = []
        for text in req["prompts"]:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            out.append({"prompt_token_ids": [int(t) for t in ids]})
        return out
    raise ValueError("request has neither prompt_token_ids nor prompts")


def run_variant(req: dict[str, Any], variant: dict[str, Any], prompts: list[Any]) -> list[dict[str, Any]]:
    name = variant.get("name", "plain")
    concurrency = [int(c) for c in req.get("concurrency", [1])]
    dtype = req.get("dtype", "bfloat16")
    base = {
        "system": "vllm-cpu",
        "variant": name,
        "dtype": dtype,
        "max_new_tokens": int(req.get("max_new_tokens", 128)),
    }
    kwargs: dict[str, Any] = {
        "model": req["model"],
        "dtype": dtype,
        "seed": 0,
        "generation_config": "vllm",  # ignore the checkpoint's sampling defaults
        "disable_log_stats": False,  # needed for per-request timestamps and spec-decode counters
        "max_num_seqs": max(concurrency),
        # Off so that every timed request pays for its prefill, as in HF generate and the
        # engine: rounds reuse prompts (and all share the chat template's system prompt), which
        # a prefix cache would serve for free.  Pass llm_kwargs to turn it back on.
        "enable_prefix_caching": False,
    }
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    kwargs["max_model_len"] = longest + int(req.get("max_new_tokens", 128)) + 64
    if variant.get("speculative_config"):
        kwargs["speculative_config"] = variant["speculative_config"]
    kwargs.update(req.get("llm_kwargs") or {})
    kwargs.update(variant.get("llm_kwargs") or {})

    if req.get("closed_loop"):
        # max_num_seqs is fixed when the engine starts: one engine per concurrency
        records = []
        for c in concurrency:
            llm, startup, error = _start({**kwargs, "max_num_seqs": c}, name)
            if llm is None:
                records.append({**base, "concurrency": c, "status": "error", "reason": error})
                continue
            records.append(_record(base, c, name, startup, variant, lambda: _measure_closed(llm, prompts, c, req)))
            _stop(llm)
            del llm
            gc.collect()
        return records
    llm, startup, error = _start(kwargs, name)
    if llm is None:
        return [{**base, "concurrency": c, "status": "error", "reason": error} for c in concurrency]
    records = [_record(base, c, name, startup, variant, lambda c=c: _measure(llm, prompts, c, req)) for c in concurrency]
    _stop(llm)
    del llm
    gc.collect()
    return records


def _start(kwargs: dict[str, Any], name: str) -> tuple[Any, float, str | None]:
    """``(LLM, startup seconds, None)``, or ``(None, 0, reason)`` when it does not start."""
    from vllm import LLM

    t0 = time.perf_counter()
    try:
        _log(f"variant {name}: starting LLM({', '.join(f'{k}={v!r}' for k, v in kwargs.items() if k != 'model')})")
        llm = LLM(**kwargs)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return None, 0.0, f"LLM start failed: {type(e).__name__}: {e}"
    startup = time.perf_counter() - t0
    _log(f"variant {name}: started in {startup:.1f}s")
    return llm, startup, None


def _record(base: dict[str, Any], c: int, name: str, startup: float, variant: dict[str, Any], measure: Any) -> dict[str, Any]:
    try:
        rec = measure()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rec = {"status": "error", "reason": f"{type(e).__name__}: {e}", "extra": {}}
    rec["extra"] = {**rec.get("extra", {}), "startup_s": round(startup, 2),
                    "speculative_config": variant.get("speculative_config")}
    _log(f"variant {name} c={c}: {rec.get('tok_s')} tok/s aggregate, {rec.get('per_request_tok_s')} per request")
    return {**base, "concurrency": c, **rec}


def _stop(llm: Any) -> None:
    """Free the engine (its core runs in a child process) before the next one starts."""
    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def main(argv: list[str]) -> int:
    # All of vLLM's (and its children's) printing goes to stderr; the reply goes to real stdout.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    src = argv[1] if len(argv) > 1 else "-"
    try:
        req = json.load(sys.stdin) if src == "-" else json.load(open(src, encoding="utf-8"))
        if "model" not in req:
            raise ValueError("request has no 'model'")
    except (OSError, ValueError) as e:
        reply.write(json.dumps({"format": FORMAT, "version": VERSION, "error": f"bad request: {e}"}) + "\n")
        reply.flush()
        return 2
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)

    t0 = time.perf_counter()
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    try:
        import torch
        import vllm

        doc.update(vllm=vllm.__version__, torch=torch.__version__, cpus=os.cpu_count())
        prompts = _prompts(req)
        results: list[dict[str, Any]] = []
        for variant in req.get("variants") or [{"name": "plain"}]:
            results.extend(run_variant(req, variant, prompts))
        doc["results"] = results
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        doc["error"] = f"{type(e).__name__}: {e}"
    doc["env"] = {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("VLLM_CPU_", "OMP_", "VLLM_ENABLE_V1"))}
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    reply.write(json.dumps(doc) + "\n")
    reply.flush()
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Paired A/B of decoding setups in one process, in short interleaved trials.

These machines drift by ±30 % within minutes, so one run of A followed by one run of B says
little, and even runs minutes apart pair poorly.  Here every trial is short (one batch of
``--concurrency`` prompts, ``--max-new-tokens`` tokens, a second or two per arm) and runs every
arm back to back, the order reversed from trial to trial; each arm's speed is divided by the
baseline arm's *in the same trial*.  The median and quartiles of those ratios over many trials
are what this reports — seconds apart, the machine's drift mostly cancels.

Arms: ``hf`` (Hugging Face ``generate``, bf16, the batch left-padded), and
``{eager,compiled}-{plain,ngram}`` (this engine, bf16, eager or compiled target forward; ``ngram``
with γ = 5 and the fixed scheduler, as in ``specforge bench engine``); a ``native-`` prefix runs
the same arm with the GGUF's 4-bit blocks as stored (``target.weights=native``).

    python scripts/engine_ab.py --arms hf eager-plain compiled-plain compiled-ngram --trials 40 --out runs/engine-ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specforge.bench.engine_bench import _engine
from specforge.bench.hf_baseline import load_smollm2, run_generate
from specforge.evalsets import apply_chat_template, select_prompts
from specforge.engine import GenerationRequest
from specforge.target import TargetModel

ENGINE_ARMS = [f"{w}{f}-{v}" for w in ("", "native-") for f in ("eager", "compiled") for v in ("plain", "ngram")]


def quartiles(xs: list[float]) -> list[float]:
    return [round(q, 3) for q in statistics.quantiles(xs, n=4)] if len(xs) > 1 else [round(xs[0], 3)] * 3


def _weights(arm: str) -> str:
    return "native" if arm.startswith("native-") else "dense"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=["hf", "eager-plain", "compiled-plain"],
                    choices=["hf", *ENGINE_ARMS])
    ap.add_argument("--baseline", default=None, help="arm the ratios divide by (default: the first)")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8, help="prompts cycled through (humaneval, mt-bench)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/engine-ab")
    args = ap.parse_args()
    baseline = args.baseline or args.arms[0]
    if baseline not in args.arms:
        raise SystemExit(f"--baseline {baseline!r} is not one of --arms")
    if args.threads:
        torch.set_num_threads(args.threads)
    c, n = args.concurrency, args.max_new_tokens
    targets = {w: TargetModel.load("smollm2", "bfloat16", weights=w)
               for w in ("dense", "native") if any(_weights(a) == w for a in args.arms if a != "hf")}
    tokenizer = next(iter(targets.values())).tokenizer if targets else load_smollm2("float32")[1]
    prompts = [apply_chat_template(tokenizer, p.text)
               for p in select_prompts(["humaneval", "mt-bench"], max(args.prompts, c))]
    trunks = {}
    for w, target in targets.items():
        if any("compiled" in a and _weights(a) == w for a in args.arms):
            if not target.runtime.compile():
                raise SystemExit("torch.compile is not available here (no C++ compiler)")
            trunks[w] = target.runtime.compiled
    engines = {a: _engine(targets[_weights(a)], a.rsplit("-", 1)[1], c, n) for a in args.arms if a != "hf"}
    hf_model, pad_id = None, 0
    if "hf" in args.arms:
        hf_model = load_smollm2("float32", tokenizer=False)[0].to(torch.bfloat16)
        pad_id = hf_model.generation_config.pad_token_id or 0

    def trial(arm: str, batch: list[list[int]], tokens: int) -> float:
        if arm == "hf":
            rows, seconds = run_generate(hf_model, batch, tokens, pad_id)
            return sum(len(r) for r in rows) / seconds
        w = _weights(arm)
        targets[w].runtime.compiled = trunks.get(w) if "compiled" in arm else None
        started = time.perf_counter()
        outs = engines[arm].generate([GenerationRequest(prompt_ids=p, max_new_tokens=tokens, ignore_eos=True)
                                      for p in batch])
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)

    started = time.perf_counter()
    for arm in args.arms:  # compile the graphs (sizes generalise over the first passes), untimed
        for i in range(3 if "compiled" in arm else 1):
            trial(arm, [prompts[(i + j) % len(prompts)] for j in range(c)], n)
    warmup = time.perf_counter() - started
    speeds: dict[str, list[float]] = {a: [] for a in args.arms}
    for t in range(args.trials):
        batch = [prompts[(t * c + j) % len(prompts)] for j in range(c)]
        for arm in (args.arms if t % 2 == 0 else args.arms[::-1]):
            speeds[arm].append(trial(arm, batch, n))
        if (t + 1) % 10 == 0:
            print(f"trial {t + 1}/{args.trials}: " + ", ".join(f"{a} {speeds[a][-1]:.1f}" for a in args.arms),
                  flush=True)
    summary = {}
    for arm, xs in speeds.items():
        ratios = [x / b for x, b in zip(xs, speeds[baseline])]
        summary[arm] = {"tok_s_median": round(statistics.median(xs), 2), "tok_s_quartiles": quartiles(xs),
                        f"ratio_to_{baseline}_median": round(statistics.median(ratios), 3),
                        f"ratio_to_{baseline}_quartiles": quartiles(ratios)}
    result = {"arms": args.arms, "baseline": baseline, "trials": args.trials, "concurrency": c,
              "max_new_tokens": n, "threads": torch.get_num_threads(), "warmup_seconds": round(warmup, 1),
              "compile_failed": {w: t.failed for w, t in trunks.items()}, "summary": summary, "tok_s": speeds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ab-{'-'.join(args.arms)}-c{c}.json"
    path.write_text(json.dumps(result, indent=2))
    head = f"{'arm':<16} {'tok/s median':>12} {'÷ ' + baseline + ' median':>22} {'quartiles':>16}"
    print(f"{head}\n{'-' * len(head)}")
    for arm, s in summary.items():
        q = s[f"ratio_to_{baseline}_quartiles"]
        print(f"{arm:<16} {s['tok_s_median']:>12.1f} {s[f'ratio_to_{baseline}_median']:>22.2f} "
              f"{q[0]:>7.2f}–{q[2]:.2f}")
    print(f"({args.trials} trials, c={c}, {n} new tokens, {torch.get_num_threads()} threads; wrote {path})")


if __name__ == "__main__":
    main()

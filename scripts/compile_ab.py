"""Interleaved A/B of the engine's eager and compiled target forward, in one process.

These machines drift by ±30 % within minutes, so a single eager run followed by a single
compiled run says little.  This loads SmolLM2 once, compiles (and warms up) the forward, then
alternates eager and compiled runs of each variant (ABBA order) and reports the median tok/s of
each and the median of the per-pair ratios.  ``--hf`` adds Hugging Face ``generate`` (bf16,
one request) to every pair, so "× HF" is also a median of same-moment ratios.

    python scripts/compile_ab.py --variants plain ngram --concurrency 1 --pairs 6 --hf --out runs/compile-ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specforge.bench.engine_bench import bench_engine_variant
from specforge.bench.hf_baseline import bench_hf, load_smollm2
from specforge.bench.prompts import apply_chat_template, select_prompts
from specforge.target import TargetModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["plain", "ngram"])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=6, help="eager/compiled pairs per variant")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hf", action="store_true", help="also time HF generate (bf16, c=1) in every pair")
    ap.add_argument("--out", default="runs/compile-ab")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = TargetModel.load("smollm2", "bfloat16")
    prompts = [apply_chat_template(target.tokenizer, p.text)
               for p in select_prompts(["humaneval", "mt-bench"], max(args.prompts, args.concurrency))]
    if not target.runtime.compile():
        raise SystemExit("torch.compile is not available here (no C++ compiler)")
    trunk = target.runtime.compiled
    started = time.perf_counter()
    for variant in args.variants:  # compile every graph these runs need, untimed
        for _ in range(2):
            bench_engine_variant(target, prompts[: args.concurrency], variant, args.concurrency, 32,
                                 progress=False, min_rounds=1)
    warmup = time.perf_counter() - started
    hf_model = load_smollm2("float32", tokenizer=False)[0] if args.hf else None
    hf: list[float] = []
    runs: dict[str, dict[str, list[float]]] = {v: {"eager": [], "compiled": []} for v in args.variants}
    for pair in range(args.pairs):
        if hf_model is not None:
            hf.append(bench_hf(prompts, dtypes=["bf16"], concurrencies=[1], max_new_tokens=args.max_new_tokens,
                               model=hf_model, progress=False, min_rounds=1)[0]["tok_s"])
        order = ["eager", "compiled"] if pair % 2 == 0 else ["compiled", "eager"]
        for mode in order:
            target.runtime.compiled = trunk if mode == "compiled" else None
            for variant in args.variants:
                rec = bench_engine_variant(target, prompts, variant, args.concurrency, args.max_new_tokens,
                                           progress=False, min_rounds=1)
                runs[variant][mode].append(rec["tok_s"])
        print(f"pair {pair + 1}/{args.pairs}: " + ", ".join(
            f"{v} {runs[v]['eager'][-1]:.1f} → {runs[v]['compiled'][-1]:.1f}" for v in args.variants), flush=True)
    summary = {}
    for variant, r in runs.items():
        ratios = [c / e for e, c in zip(r["eager"], r["compiled"])]
        summary[variant] = {"eager_median": statistics.median(r["eager"]),
                            "compiled_median": statistics.median(r["compiled"]),
                            "ratio_median": round(statistics.median(ratios), 3),
                            "ratios": [round(x, 3) for x in ratios], "runs": r}
        if hf:
            for mode in ("eager", "compiled"):
                summary[variant][f"{mode}_vs_hf_median"] = round(
                    statistics.median(x / h for x, h in zip(r[mode], hf)), 3)
    result = {"concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens, "pairs": args.pairs,
              "threads": torch.get_num_threads(), "warmup_seconds": round(warmup, 1),
              "compile_failed": trunk.failed, "hf_bf16_c1": hf, "variants": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"compile-ab-c{args.concurrency}.json").write_text(json.dumps(result, indent=2))
    print(f"{'variant':<10} {'eager':>8} {'compiled':>9} {'ratio':>6} {'eager×HF':>9} {'comp×HF':>8}"
          f"  (medians, tok/s; c={args.concurrency})")
    for variant, s in summary.items():
        print(f"{variant:<10} {s['eager_median']:>8.1f} {s['compiled_median']:>9.1f} {s['ratio_median']:>6.2f} "
              f"{s.get('eager_vs_hf_median', float('nan')):>9.2f} {s.get('compiled_vs_hf_median', float('nan')):>8.2f}")
    if hf:
        print(f"HF generate bf16 c=1: median {statistics.median(hf):.1f} tok/s")


if __name__ == "__main__":
    main()

"""The first verdict on a CUDA machine (``make gpu-check``, docs/engine.md#on-a-gpu), in minutes.

Each check runs on its own, is timed, and ends as ``pass``, ``fail`` (with what differed) or
``not built`` (what specforge does not do on CUDA yet, said plainly rather than skipped):

1. ``kernel``: the Triton varlen attention on CUDA against its torch twin in float64, for decode,
   verify, prefill and token-tree passes, in float32, bfloat16 and float16, with tolerances from
   each dtype's rounding;
2. ``runtime-greedy``: the target runtime (SmolLM2, moved to CUDA, attention through the Triton
   kernel) decoding greedily against Hugging Face ``generate`` on the same GPU — exact in float32,
   the share of matching tokens reported in bfloat16;
3. ``training``: a few optimizer steps of a DSpark drafter on CUDA over the target's own features
   (finite losses that fall);
4. ``engine`` and ``serving``: the engine's rounds build their batches, uniforms and caches on the
   CPU (specforge/engine/engine.py), so neither the engine's greedy parity nor the serving bench
   runs on CUDA yet: reported as ``not built``.

Without a CUDA device it says so and exits 0 (CI runs without one).  The verdict goes to
``runs/gpu-check/verdict.json`` and a table on stdout; the exit code is 1 when a check failed.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

OUT = Path("runs/gpu-check")
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "What is 17 times 23? Explain step by step.",
           "Give three tips for a job interview.",
           "Translate 'good morning' into French and Spanish."]
NEW_TOKENS = 32


def _case(n_runs: int, run_len: int, context: tuple[int, int], dtype: torch.dtype, tree: bool, gen: torch.Generator):
    from specforge.passes import VarlenBatch

    heads, kv_heads, dim = 9, 3, 64
    starts = torch.randint(context[0], context[1] + 1, (n_runs,), generator=gen).tolist()
    runs = [[0] * run_len for _ in range(n_runs)]
    parents = None
    if tree:  # every node's parent is an earlier node of its run
        parents = [[-1, *(int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, run_len))]
                   for _ in range(n_runs)]
    batch = VarlenBatch.build(runs, list(range(n_runs)), starts, parents=parents)
    capacity = max(starts) + run_len
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(n_runs, kv_heads, capacity, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(n_runs, kv_heads, capacity, dim, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(dtype).to(torch.float64) for t in (q, k, v))  # the values the dtype can hold
    return batch, q, k, v, dim ** -0.5


def check_kernel() -> dict:
    from specforge_kernels.varlen_attention import varlen_attention

    gen = torch.Generator().manual_seed(0)
    # the output's rounding plus that of the probabilities in the P·V product
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
    shapes = {"decode": (16, 1, (50, 900), False), "verify": (8, 8, (50, 600), False),
              "prefill": (2, 300, (0, 0), False), "tree": (6, 12, (20, 400), True)}
    worst, failures = {}, []
    for dtype, tol in tolerance.items():
        for name, (n_runs, run_len, context, tree) in shapes.items():
            batch, q, k, v, scale = _case(n_runs, run_len, context, dtype, tree, gen)
            ref = varlen_attention(q, k, v, batch.cu_seqlens, batch.slots, batch.start_pos, scale, backend="torch",
                                   tree=batch.tree)
            dev = [t.to("cuda") for t in (q.to(dtype), k.to(dtype), v.to(dtype))]
            cuda_batch = [t.to("cuda") for t in (batch.cu_seqlens, batch.slots, batch.start_pos)]
            tree_bits = None if batch.tree is None else batch.tree.to("cuda")
            got = varlen_attention(*dev, *cuda_batch, scale, backend="triton", tree=tree_bits)
            err = float(((got.double().cpu() - ref).abs() / (1 + ref.abs())).max())
            worst[f"{name}/{str(dtype).split('.')[-1]}"] = err
            if not err <= tol:
                failures.append(f"{name} in {dtype}: error {err:.2e} > {tol:.0e}")
    return {"status": "fail" if failures else "pass", "worst_error": worst, "failures": failures}


def _runtime_greedy(runtime, prompt: list[int], n: int) -> list[int]:
    from specforge.passes import VarlenBatch

    cache = runtime.new_cache(1, len(prompt) + n + 1, device="cuda")
    ids, out = list(prompt), []
    batch = VarlenBatch.build([ids], [0], [0], device="cuda")
    logits = runtime(batch, cache, torch.tensor([len(ids) - 1], device="cuda")).logits
    cache.advance(0, len(ids))
    for _ in range(n):
        token = int(logits[-1].argmax())
        out.append(token)
        batch = VarlenBatch.build([[token]], [0], [len(ids)], device="cuda")
        logits = runtime(batch, cache, torch.tensor([0], device="cuda")).logits
        ids.append(token)
        cache.advance(0, len(ids))
    return out


def check_runtime_greedy(state: dict) -> dict:
    from specforge.runtime import load_target
    from specforge.toolkit.linear_plan import LinearPlan

    result, failures = {}, []
    for dtype in ("float32", "bfloat16"):
        target = load_target("smollm2", dtype=dtype, backend="torch")
        hf = target.hf_model.to(device="cuda", dtype=getattr(torch, dtype))
        runtime = target.runtime.to("cuda")
        runtime.set_linear_plan(LinearPlan.fixed("linear"))  # the CPU's measured kernels are CPU kernels
        same = total = 0
        for text in PROMPTS:
            prompt = target.encode(text, chat=True)
            # (an answer may end at EOS before NEW_TOKENS: the runtime decodes as many)
            ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
            got = _runtime_greedy(runtime, prompt, len(ref))
            agree = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
            same, total = same + agree, total + len(ref)
            if dtype == "float32" and got != ref:
                failures.append(f"float32, prompt {text[:30]!r}: first difference at token {agree}")
            if dtype == "float32":
                state.setdefault("sequences", []).append((prompt, ref))
        result[dtype] = {"tokens_before_first_difference": same, "tokens": total}
        if dtype == "float32":
            state["target"] = target
    return {"status": "fail" if failures else "pass", **result, "failures": failures}


def check_training(state: dict) -> dict:
    from specforge.features import compute_features
    from specforge.training.config import TrainConfig
    from specforge.training.data import MemorySource
    from specforge.training.trainer import Trainer

    target = state.get("target")
    if target is None or not state.get("sequences"):
        return {"status": "fail", "failures": ["no target features (the runtime check did not finish)"]}
    target.runtime.to("cpu")
    target.hf_model.to(device="cpu", dtype=torch.float32)
    sequences = []
    for prompt, answer in state["sequences"]:
        ids = torch.tensor(prompt + answer)
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[len(prompt):] = 1
        sequences.append((ids, mask))
    layers = [1, 15, 28]
    source = MemorySource(compute_features(target, sequences * 4, layers), layers)
    steps = 12
    config = TrainConfig.model_validate({
        "target": {"model": "smollm2", "dtype": "float32"}, "device": "cuda",
        "drafter": {"name": "dspark", "layers": 2, "gamma": 7, "target_layers": layers},
        "schedule": {"total_steps": steps, "warmup_steps": 2}, "batch": {"sequences": 4, "anchors": 8},
        "output": {"dir": str(OUT / "train"), "checkpoint_interval": 1000, "progress": False},
    })
    trainer = Trainer(config, target=target, source=source, log=lambda _: None)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    loss = [r["loss"] for r in history]
    ok = len(loss) == steps and all(math.isfinite(x) for x in loss) and sum(loss[-3:]) < sum(loss[:3])
    return {"status": "pass" if ok else "fail", "loss": loss, "device": str(trainer.dist.device),
            "failures": [] if ok else ["losses not finite or not falling"]}


NOT_BUILT = {
    "engine": "the engine's rounds build batches, uniforms and the KV cache on the CPU "
              "(specforge/engine/engine.py); greedy parity is checked on the runtime instead",
    "serving": "`specforge bench serving` drives that engine; no CUDA arm to time yet",
}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing run, "
              "nothing failed — run it where a GPU is")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    state: dict = {}
    checks = {"kernel": check_kernel, "runtime-greedy": lambda: check_runtime_greedy(state),
              "training": lambda: check_training(state)}
    verdict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": {}}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 — a crash is that check's verdict; the others still run
            result = {"status": "fail", "failures": [f"{type(exc).__name__}: {exc}"],
                      "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 1)
        verdict["checks"][name] = result
        print(f"{name:15} {result['status']:9} {result['seconds']:7.1f} s  {'; '.join(result.get('failures', []))}",
              flush=True)
    for name, why in NOT_BUILT.items():
        verdict["checks"][name] = {"status": "not built", "why": why}
        print(f"{name:15} not built  {why}")
    (OUT / "verdict.json").write_text(json.dumps(verdict, indent=2) + "\n", encoding="utf-8")
    print(f"verdict: {OUT / 'verdict.json'}")
    return 1 if any(c["status"] == "fail" for c in verdict["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark: the varlen torch twin against a naive padded-batch SDPA, on CPU.

The baseline is what a runtime without varlen attention does: gather every request's K/V out of
its cache slot into a padded ``[R, Hkv, Lmax, D]`` batch, pad the queries to ``[R, nmax]``, and
run one SDPA with a combined causal + padding mask.  The twin runs one SDPA per request on views
of the cache.  Shapes are decode/verification-like (SmolLM2-135M heads: Hq=9, Hkv=3, D=64);
each request's context length is drawn from [L/2, L] so that padding costs what it does in a real
batch.  Both sides are timed interleaved in the same run, so machine load hits them alike, and
their outputs are compared.

    python kernels/bench_attention.py [--reps 60] [--dtypes float32,bfloat16] [--threads 1]

One intra-op thread by default: on a small shared machine, OpenMP workers that lose their core to
a neighbour stall every parallel region for a scheduler quantum, and the medians then measure the
neighbours (tens of ms per call were seen on 2 busy cores).  ``--threads 0`` keeps torch's default.

Prints one JSON document, then a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specforge_kernels.varlen_attention import varlen_attention_reference

HQ, HKV, D, CAPACITY = 9, 3, 64, 4096


def make_batch(n_req: int, run: int, cache_len: int, dtype: torch.dtype, seed: int) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [cache_len] + [rng.randint(max(run, cache_len // 2), cache_len) for _ in range(n_req - 1)]
    n_slots = n_req + 4
    slots = rng.sample(range(n_slots), n_req)
    k_cache = torch.randn(n_slots, HKV, CAPACITY, D, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, HKV, CAPACITY, D, generator=gen).to(dtype)
    q = torch.randn(n_req * run, HQ, D, generator=gen).to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens=torch.arange(0, n_req * run + 1, run, dtype=torch.long),
        slots=torch.tensor(slots, dtype=torch.long),
        start_pos=torch.tensor([length - run for length in lengths], dtype=torch.long),
        scale=D**-0.5,
    )


def padded_sdpa(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale):
    """The naive baseline: pad everything to the longest request, one batched SDPA."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    n_req, n_max = lens.shape[0], int(lens.max())
    ctx = start_pos + lens
    l_max = int(ctx.max())
    k = k_cache[slots, :, :l_max]  # advanced indexing: a copy of every request's keys
    v = v_cache[slots, :, :l_max]
    req = torch.repeat_interleave(torch.arange(n_req), lens)
    tok = torch.arange(q.shape[0]) - cu_seqlens[:-1][req]
    qp = q.new_zeros(n_req, n_max, q.shape[1], q.shape[2])
    qp[req, tok] = q
    pos = start_pos[:, None] + torch.arange(n_max)[None, :]  # [R, nmax]
    keys = torch.arange(l_max)
    mask = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < ctx[:, None, None])
    o = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2)[req, tok]


def twin(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale):
    return varlen_attention_reference(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale)


def measure(batch: dict, reps: int) -> tuple[float, float, float]:
    args = tuple(batch.values())
    a, b = twin(*args), padded_sdpa(*args)
    max_diff = (a.double() - b.double()).abs().max().item()
    for _ in range(3):
        twin(*args)
        padded_sdpa(*args)
    t_twin, t_base = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        twin(*args)
        t1 = time.perf_counter()
        padded_sdpa(*args)
        t2 = time.perf_counter()
        t_twin.append(t1 - t0)
        t_base.append(t2 - t1)
    return statistics.median(t_twin) * 1e6, statistics.median(t_base) * 1e6, max_diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for n_req in (1, 4, 16):
            for run in (1, 8):
                for cache_len in (256, 1024):
                    batch = make_batch(n_req, run, cache_len, dtype, seed=n_req * 1000 + run * 10 + cache_len)
                    t_twin, t_base, diff = measure(batch, args.reps)
                    rows.append(dict(
                        dtype=dtype_name, requests=n_req, run=run, cache_len=cache_len,
                        twin_us=round(t_twin, 1), padded_us=round(t_base, 1),
                        speedup=round(t_base / t_twin, 2), max_abs_diff=diff,
                    ))
    doc = dict(
        benchmark="varlen_attention_reference vs padded-batch SDPA (CPU)",
        heads=dict(hq=HQ, hkv=HKV, head_dim=D, capacity=CAPACITY),
        torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
        reps=args.reps, statistic="median microseconds per call", results=rows,
    )
    print(json.dumps(doc, indent=1))
    head = f"{'dtype':<9} {'R':>3} {'run':>4} {'L':>5} {'twin us':>10} {'padded us':>10} {'speedup':>8} {'max|diff|':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['dtype']:<9} {r['requests']:>3} {r['run']:>4} {r['cache_len']:>5} {r['twin_us']:>10.1f} "
              f"{r['padded_us']:>10.1f} {r['speedup']:>7.2f}x {r['max_abs_diff']:>10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

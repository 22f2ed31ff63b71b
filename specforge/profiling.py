"""``specforge profile``: measure the step curve SPS(B) of a target on this machine (SPEC §6).

SPS(B) is how many verify passes of B flattened tokens the target runs per second.  A verify
pass is what the engine runs every round: R requests, each with a cached context, contribute
their new tokens (the bonus token plus the draft tokens it verifies) to one flattened pass, and
every one of those rows needs logits.  The profiler builds exactly that: ``requests`` cache
slots prefilled with ``context`` tokens each, then, for every B, B new tokens spread as evenly as
possible over min(B, requests) of them, written at the same positions each repetition (nothing
is committed, so the cache never grows and every repetition costs the same).

Small B is memory-bound (reading the weights dominates, so SPS barely moves between B = 1 and
B = 8 on a CPU in bf16); large B becomes compute-bound and SPS falls like 1/B.  Hardware-aware
schedulers (``hw-prefix``, ``async-topk``) read the curve to decide how many draft tokens a round
can afford at the current load.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specforge.hardware import HardwareProfile
from specforge.target import TargetModel
from specforge.target.batch import VarlenBatch

__all__ = ["DEFAULT_BATCHES", "measure_sps", "plot_profile", "profile_table", "split_tokens"]

DEFAULT_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def split_tokens(batch: int, requests: int) -> list[int]:
    """``batch`` new tokens over min(batch, requests) requests, as evenly as possible."""
    if batch < 1 or requests < 1:
        raise ValueError(f"batch and requests must be positive (got {batch}, {requests})")
    r = min(batch, requests)
    return [batch // r + (1 if i < batch % r else 0) for i in range(r)]


def _device_label() -> str:
    return f"cpu: {torch.get_num_threads()} threads"


@torch.inference_mode()
def measure_sps(
    target: TargetModel,
    batches: Sequence[int] = DEFAULT_BATCHES,
    *,
    context: int = 256,
    requests: int = 16,
    reps: int = 5,
    warmup: int = 2,
    seed: int = 0,
    progress: bool = True,
) -> tuple[HardwareProfile, list[dict[str, Any]]]:
    """Time verify passes of every B in ``batches``; the profile and one record per B.

    Each record holds B, the requests it was spread over, every repetition's seconds, the median
    and SPS = 1 / median (the median, because a noisy machine's outliers are slow, never fast).
    """
    from tqdm.auto import tqdm

    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1:
        raise ValueError(f"batch sizes must be positive integers, got {list(batches)}")
    if context < 1 or reps < 1 or warmup < 0:
        raise ValueError("context and reps must be at least 1, warmup at least 0")
    longest = max(split_tokens(b, requests)[0] for b in batches)
    if context + longest > target.max_positions:
        raise ValueError(f"context {context} + {longest} new tokens exceed the target's "
                         f"{target.max_positions} positions")
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    slots = min(requests, batches[-1])
    cache = target.new_cache(slots, context + longest)
    # Prefill every slot with random tokens (one pass): attention then reads a realistic context.
    ids = [cache.allocate() for _ in range(slots)]
    prompts = [torch.randint(0, vocab, (context,), generator=gen) for _ in ids]
    target.forward(VarlenBatch.build(prompts, ids, [0] * slots), cache)
    for s in ids:
        cache.advance(s, context)

    records: list[dict[str, Any]] = []
    points: dict[int, float] = {}
    for b in tqdm(batches, desc="profile SPS(B)", unit="B", disable=not progress, file=sys.stderr):
        runs = split_tokens(b, requests)
        tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in runs]
        batch = VarlenBatch.build(tokens, list(range(len(runs))), [context] * len(runs))
        rows = torch.arange(b)  # a verify pass needs the logits of every token it carries
        times = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            target.forward(batch, cache, logits_rows=rows)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        points[b] = 1.0 / median
        records.append({"batch": b, "requests": len(runs), "seconds": [round(t, 6) for t in times],
                        "median_s": round(median, 6), "sps": round(1.0 / median, 3),
                        "tokens_per_s": round(b / median, 1)})
    profile = HardwareProfile(points, device=_device_label(), target=target.name)
    return profile, records


def profile_table(records: Sequence[dict[str, Any]]) -> str:
    base = records[0]["sps"]
    head = f"{'B':>5} {'requests':>8} {'ms/pass':>8} {'SPS':>8} {'tokens/s':>9} {'SPS/SPS(B0)':>11}"
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r['batch']:>5} {r['requests']:>8} {1e3 * r['median_s']:>8.2f} {r['sps']:>8.2f} "
                     f"{r['tokens_per_s']:>9.1f} {r['sps'] / base:>11.3f}")
    return "\n".join(lines)


def plot_profile(records: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """SPS(B) and tokens/s per pass against B (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bs = [r["batch"] for r in records]
    ax.plot(bs, [r["sps"] for r in records], marker="o", color="tab:blue", label="SPS(B): passes / s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("flattened verify batch B (tokens)")
    ax.set_ylabel("verify passes / s", color="tab:blue")
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    twin.plot(bs, [r["tokens_per_s"] for r in records], marker="s", color="tab:orange", label="B · SPS(B)")
    twin.set_ylabel("tokens verified / s", color="tab:orange")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path

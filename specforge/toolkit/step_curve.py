"""The target's step curve SPS(B) on this machine, as a hardware-aware scheduler reads it.

SPS(B) is how many verify passes of B flattened tokens the target runs per second
(:class:`specforge.hardware.HardwareProfile`; how schedulers use it:
docs/design/calibration-scheduling.md#scheduling).  A scheduler with ``profile: auto`` calls
:func:`machine_profile` in its ``bind(target)``: the curve is measured once per machine, target and
precision (about a minute) and cached.  ``specforge profile`` (:mod:`specforge.profiling`) runs the
same measurement with a table and a plot.

The measurement builds what the engine runs every round: ``requests`` cache slots prefilled with
``context`` tokens each, then, for every B, B new tokens spread as evenly as possible over
min(B, requests) of them, written at the same positions each repetition (nothing is committed, so
the cache never grows and every repetition costs the same).  On a shared machine the speed drifts
by tens of percent within a minute, so the repetitions are interleaved (each sweep times every B
once, alternating direction) and the curve kept is the closest non-increasing fit to the per-B
medians: a pass that carries more tokens is never cheaper, and a curve that says so would have the
scheduler verify more tokens to go faster.  A profile measured in a slow minute showed
SPS(1) = 16.5 below SPS(8) = 24.6 and SPS(16) = 13.4 below SPS(32) = 18.4, and ``ngram-hw`` then
speculated at 16 requests for 0.68x of plain decoding.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from specforge.hardware import HardwareProfile
from specforge.machine import machine_key
from specforge.passes import VarlenBatch, split_tokens
from specforge.caches import profile_file

__all__ = ["AUTO_BATCHES", "DEFAULT_BATCHES", "machine_profile", "measure_sps", "non_increasing", "profile_key"]

DEFAULT_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def non_increasing(values: Sequence[float]) -> list[float]:
    """The non-increasing sequence closest to ``values`` in least squares (pool adjacent
    violators: a run that rises is replaced by its mean, repeatedly, until nothing rises)."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs, left to right
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _device_label() -> str:
    return f"cpu: {torch.get_num_threads()} threads"


@torch.inference_mode()
def measure_sps(
    target: Any,
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

    ``reps`` sweeps over all of ``batches`` (after ``warmup`` passes of each), alternating
    direction, so a slow minute lands on every B alike.  Each record holds B, the requests it was
    spread over, every repetition's seconds, the median, ``sps_measured`` = 1 / median (the
    median, because a noisy machine's outliers are slow, never fast) and ``sps``, that curve made
    non-increasing in B (:func:`non_increasing`), which is what the profile holds.
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

    passes = []
    for b in batches:
        runs = split_tokens(b, requests)
        tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in runs]
        batch = VarlenBatch.build(tokens, list(range(len(runs))), [context] * len(runs))
        # a verify pass needs the logits of every token it carries
        passes.append((b, len(runs), batch, torch.arange(b)))
    times: dict[int, list[float]] = {b: [] for b in batches}
    bar = tqdm(total=(warmup + reps) * len(passes), desc="profile SPS(B)", unit="pass",
               disable=not progress, file=sys.stderr)
    with bar:
        for b, _, batch, rows in passes:
            for _ in range(warmup):
                target.forward(batch, cache, logits_rows=rows)
                bar.update()
        for rep in range(reps):
            for b, _, batch, rows in (passes if rep % 2 == 0 else passes[::-1]):
                t0 = time.perf_counter()
                target.forward(batch, cache, logits_rows=rows)
                times[b].append(time.perf_counter() - t0)
                bar.update()

    medians = [statistics.median(times[b]) for b in batches]
    fitted = non_increasing([1.0 / m for m in medians])
    points = dict(zip(batches, fitted))
    records = [{"batch": b, "requests": r, "seconds": [round(t, 9) for t in times[b]],
                "median_s": round(m, 9), "sps_measured": round(1.0 / m, 3), "sps": round(f, 3),
                "tokens_per_s": round(b * f, 1)}
               for (b, r, _, _), m, f in zip(passes, medians, fitted)]
    profile = HardwareProfile(points, device=_device_label(), target=target.name, dtype=target.precision_label)
    return profile, records


# What a profile measured on first use covers: enough for hw-prefix up to 64 requests × γ.
AUTO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def profile_key(target: Any) -> str:
    """What a step curve depends on: the target and how it runs (precision, weights, KV-cache
    dtype, compiled or not) and the machine (:func:`specforge.machine.machine_key`)."""
    return machine_key(target=target.name, precision=target.precision_label, weights=target.weights,
                       kv_dtype=str(target.runtime.cache_dtype()),
                       compiled=bool(getattr(target.runtime, "compiled", False)))


def machine_profile(target: Any, log: Any = None) -> HardwareProfile:
    """This machine's step curve for ``target``: measured once (≈ a minute) and cached under
    ``$SPECFORGE_CACHE_DIR/profiles``, keyed by target, dtype, KV-cache dtype, weights, CPU, threads and torch —
    what ``profile: auto`` of the hardware-aware schedulers reads."""
    from specforge.measured import cached_choice

    path = profile_file(target.name, profile_key(target))

    def measure() -> HardwareProfile:
        (log or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
            f"measuring the step curve of {target.name} on this machine once (cached in {path})")
        longest = split_tokens(AUTO_BATCHES[-1], 16)[0]
        return measure_sps(target, AUTO_BATCHES, context=max(1, min(256, target.max_positions - longest)), reps=3)[0]

    return cached_choice(path, measure, HardwareProfile.from_dict, HardwareProfile.to_dict)[0]

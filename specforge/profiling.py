"""``specforge profile``: measure the step curve SPS(B) of a target on this machine.

Usage: docs/engine.md#hardware-profiles; how schedulers use the curve:
docs/design/calibration-scheduling.md#scheduling.

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

On a shared machine the speed drifts by tens of percent within a minute, so the repetitions are
interleaved (each sweep times every B once, alternating direction) and the curve the profile keeps
is the closest non-increasing fit to the per-B medians: a pass that carries more tokens is never
cheaper, and a curve that says so would have the scheduler verify more tokens to go faster.  A
profile measured in a slow minute showed SPS(1) = 16.5 below SPS(8) = 24.6 and SPS(16) = 13.4
below SPS(32) = 18.4, and ``ngram-hw`` then speculated at 16 requests for 0.68x of plain decoding.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specforge.hardware import DraftCost, HardwareProfile
from specforge.target import TargetModel
from specforge.target.batch import VarlenBatch, split_tokens

__all__ = ["DEFAULT_BATCHES", "DRAFT_COST_REQUESTS", "machine_draft_cost", "machine_profile", "measure_draft_cost",
           "measure_sps", "non_increasing", "plot_profile", "profile_table", "split_tokens"]

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


def _profile_key(target: TargetModel) -> str:
    """What a step curve depends on: the target and how it runs (precision, weights, KV-cache
    dtype, compiled or not) and the machine (:func:`specforge.machine.machine_key`)."""
    from specforge.machine import machine_key

    return machine_key(target=target.name, precision=target.precision_label, weights=target.weights,
                       kv_dtype=str(target.runtime.cache_dtype()),
                       compiled=bool(getattr(target.runtime, "compiled", False)))


def machine_profile(target: TargetModel, log: Any = None) -> HardwareProfile:
    """This machine's step curve for ``target``: measured once (≈ a minute) and cached under
    ``$SPECFORGE_CACHE_DIR/profiles``, keyed by target, dtype, KV-cache dtype, weights, CPU, threads and torch —
    what ``profile: auto`` of the hardware-aware schedulers reads."""
    from specforge.files import write_atomic
    from specforge.target.loading import cache_root

    path = cache_root() / "profiles" / f"{Path(target.name).name}-{_profile_key(target)}.json"
    if path.is_file():
        return HardwareProfile.load(path)
    (log or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
        f"measuring the step curve of {target.name} on this machine once (cached in {path})")
    longest = split_tokens(AUTO_BATCHES[-1], 16)[0]
    profile, _ = measure_sps(target, AUTO_BATCHES, context=max(1, min(256, target.max_positions - longest)), reps=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(profile.to_dict(), indent=2) + "\n")
    return profile


DRAFT_COST_REQUESTS = (1, 2, 4, 8, 16, 32, 64)
_DRAFT_COST_METHOD = {"requests": DRAFT_COST_REQUESTS, "context": 256, "rounds": 8}


class _VerifyNothing:
    """The scheduler a drafting-cost measurement runs with: every round drafts, none verifies."""

    def schedule(self, confidence: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(available, dtype=torch.long)


def measure_draft_cost(engine: Any, requests: Sequence[int] = DRAFT_COST_REQUESTS,
                       context: int = _DRAFT_COST_METHOD["context"], rounds: int = _DRAFT_COST_METHOD["rounds"]
                       ) -> DraftCost:
    """ρ(R) of ``engine``'s drafting side (drafter, correction head, confidence, calibrator): for
    each R, R synthetic requests of ``context`` tokens (the step curve's, at most what the target
    takes; a ratio measured at far shorter contexts than served overstates ρ, since the target's
    pass grows with the context and a drafter's much less) run ``rounds`` rounds that draft a full
    block and verify none of it, in a cache of their own; ρ is the median seconds of a round's
    drafting over the median seconds of its (plain) target pass, the first two rounds left out
    (first-call allocations).  The engine comes back as it was."""
    from specforge.engine import GenerationRequest

    saved = engine.scheduler, engine.cache, engine.context_limit
    vocab = engine.target.vocab_size
    new_tokens = rounds + int(getattr(engine.drafter, "gamma", 0) or 0) + 2
    context = max(1, min(context, engine.target.max_positions - new_tokens - 8))
    ids = torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    points = {}
    try:
        engine.scheduler = _VerifyNothing()
        engine._measuring = True  # the calibrator's observe() must not learn from these rounds
        # Enough new tokens (above) that every measured round drafts a whole block (verifying
        # nothing, each round commits one token).
        engine.context_limit = context + new_tokens + 8
        engine.cache = engine.target.new_cache(max(requests), engine.context_limit)
        for r in requests:
            rids = [engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens, temperature=0.0,
                                                    ignore_eos=True)) for _ in range(r)]
            draft, target = [], []
            while engine.busy:
                before = sum(engine.draft_seconds.values()), engine.phase_seconds["target"]
                engine.step()
                draft.append(sum(engine.draft_seconds.values()) - before[0])
                target.append(engine.phase_seconds["target"] - before[1])
            for rid in rids:
                engine.take_output(rid)
            draft, target = draft[2:rounds], target[2:rounds]
            points[r] = statistics.median(draft) / max(statistics.median(target), 1e-9)
    finally:
        engine.scheduler, engine.cache, engine.context_limit = saved
        engine._measuring = False
        engine.reset_clocks()
    from specforge.machine import machine

    return DraftCost(points, device=machine()["cpu"], target=str(engine.target.name))


def _drafting_key(engine: Any) -> str:
    """What a drafting cost depends on: the target and machine (as a step curve), and every
    drafting-side component with its settings."""
    import hashlib

    parts = []
    for slot in ("drafter", "correction_head", "confidence", "calibrator"):
        part = getattr(engine, slot)
        config = getattr(part, "config", None)
        settings = config.model_dump_json() if hasattr(config, "model_dump_json") else repr(config)
        parts.append([slot, f"{type(part).__module__}.{type(part).__qualname__}", settings,
                      getattr(part, "gamma", None)])
    # The measurement's own settings too: a file measured another way is not this measurement.
    key = json.dumps([_profile_key(engine.target), parts, _DRAFT_COST_METHOD], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def machine_draft_cost(engine: Any, log: Any = None) -> DraftCost:
    """This machine's ρ(R) for ``engine``'s drafting side: measured once (seconds) and cached
    under ``$SPECFORGE_CACHE_DIR/profiles`` beside the step curve — what ``draft_cost: auto``
    of the hardware-aware schedulers reads."""
    from specforge.files import write_atomic
    from specforge.target.loading import cache_root

    path = cache_root() / "profiles" / f"{Path(engine.target.name).name}-draft-{_drafting_key(engine)}.json"
    if path.is_file():
        return DraftCost.load(path)
    (log or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
        f"measuring what drafting costs on this machine once (cached in {path})")
    cost = measure_draft_cost(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(cost.to_dict(), indent=2) + "\n")
    return cost


def profile_table(records: Sequence[dict[str, Any]]) -> str:
    base = records[0]["sps"]
    head = (f"{'B':>5} {'requests':>8} {'ms/pass':>8} {'measured':>9} {'SPS':>8} {'tokens/s':>9} "
            f"{'SPS/SPS(B0)':>11}")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r['batch']:>5} {r['requests']:>8} {1e3 * r['median_s']:>8.2f} "
                     f"{r.get('sps_measured', r['sps']):>9.2f} {r['sps']:>8.2f} "
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
    if all("sps_measured" in r for r in records):  # the medians the non-increasing curve was fitted to
        ax.plot(bs, [r["sps_measured"] for r in records], linestyle="none", marker="x",
                color="tab:blue", alpha=0.6, label="measured (median)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("flattened verify batch B (tokens)")
    ax.set_ylabel("verify passes / s", color="tab:blue")
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    twin.plot(bs, [r["tokens_per_s"] for r in records], marker="s", color="tab:orange", label="B · SPS(B)")
    twin.set_ylabel("tokens verified / s", color="tab:orange")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path

"""The target's precision per pass size, chosen by measuring this machine (``target.dtype: auto``).

No single precision is right on every CPU, nor for every pass on one CPU.  A decoding step of one
request streams the weights through memory once, so fewer bytes a weight win (bf16, or a GGUF's
4-bit blocks); a pass over many rows is compute-bound, so the precision the CPU multiplies fastest
wins.  On an AMD EPYC with AVX2 only a bf16 linear is ~5x slower than float32 (no native bf16
arithmetic: every value is widened), yet one-row decoding ran 1.7x faster in bf16 (half the
bytes); on a Xeon with AMX bf16 wins at every size.  Guessing from CPU flags would tune a default
on one kind of machine, so ``auto`` times the target's own passes in each candidate precision and
keeps, for each pass size, the fastest one whose logits stay close to float32's:

* candidates: ``float32`` (always; the reference), ``bfloat16``, ``float16`` where the CPU computes
  it natively (AVX512-FP16 / AMX-FP16), and ``q4`` — a GGUF's own 4-bit blocks through torch's
  int4 kernel (bf16 activations, :mod:`.quantized`) — where the file and the kernel allow it.
  Each one that cannot run here is skipped with its reason;
* pass sizes: verify/decode passes of 1, 2, 4, … 64 flattened rows, and one prompt of
  :data:`PREFILL_ROWS` tokens standing for every larger pass;
* the plan is a list of bands, ``rows → precision``; the runtime keeps one copy of the weights per
  precision it uses (two copies of a 135M model cost ~0.8 GB) and each pass runs in its band's.

The hidden states a pass hands out (taps for drafters, the feature cache) come in the *primary*
precision — the dense one (float32, bfloat16, float16) fastest on passes of :data:`PRIMARY_ROWS`
rows, the size of a drafter's block and of the batched decoding the heads see — and the drafter,
heads and training compute in it too (a 4-bit pass is fast for its weights' bytes, not for its
arithmetic, so it never sets the primary).  Each precision's projections also get the matmul
kernel measured fastest for each pass size (:mod:`.linear_plan`).

The choice is measured once per machine, target, torch version and thread count (tens of seconds
for SmolLM2, the candidates that fall far behind are not timed on larger passes) and cached
beside the step curve.  docs: docs/engine.md#precision
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.errors import SpecforgeError
from specforge.toolkit.bands import Bands, band_for, bands_from_choices, check_bands
from specforge.passes import VarlenBatch, split_tokens
from specforge.toolkit.linear_plan import LinearPlan
from specforge.runtime.timing import interleaved_seconds

__all__ = ["CHUNK_ROWS", "DTYPE", "PRECISIONS", "PREFILL_ROWS", "PRIMARY_ROWS", "ROWS", "PrecisionError", "PrecisionPlan",
           "measure_precision", "method_key", "precision_candidates", "require_float16", "resolve_precision"]

PRECISIONS = ("float32", "bfloat16", "float16", "q4")
# q4 computes on bf16 activations (the int4 kernel's input type)
DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "q4": torch.bfloat16}
ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode and verify passes, in flattened rows
PREFILL_ROWS = 128  # one prompt: the compute-bound regime, standing for every pass past ROWS[-1]
# A longer prompt, timed only in the precision and kernel chosen at PREFILL_ROWS: where the cost
# per row stops falling (see PrecisionPlan.prefill_chunk), the engine's prefill chunk.
CHUNK_ROWS = 512
# A pass within this factor of the cheapest cost per row measured is as efficient as a larger one
CHUNK_SLACK = 1.1
PRIMARY_ROWS = 16
# A candidate whose next-token law moves further than this from float32's (mean KL, nats, over a
# teacher-forced sequence) is refused: bf16 and 4-bit renderings of SmolLM2 sit near 1e-3; an
# overflowing float16 gives inf/NaN.
MAX_KL = 0.05
SLOW = 3.0  # this much slower than the best at some size: not timed at larger ones (compute only grows)
TIE = 1.03  # within 3 % of the best, the smaller pass's choice is kept (fewer bands, fewer copies)
_CONTEXT, _REQUESTS, _CHECK = 32, 8, 48  # each slot's cached context, slots, tokens of the accuracy check
_METHOD = {"rows": ROWS, "prefill": PREFILL_ROWS, "chunk": CHUNK_ROWS, "context": _CONTEXT, "requests": _REQUESTS,
           "max_kl": MAX_KL, "slow": SLOW, "tie": TIE, "version": 3}


class PrecisionError(SpecforgeError, ValueError):
    """A precision that cannot run on this machine or with this target; the message says why."""


def _span(bands: Bands, i: int) -> str:
    first = bands[i][0]
    last = bands[i + 1][0] - 1 if i + 1 < len(bands) else None
    if last is None:
        return f"{first}+ rows"
    return f"{first} row{'s' * (first > 1)}" if last == first else f"{first}-{last} rows"


def _label(bands: Bands) -> str:
    if len(bands) == 1:
        return bands[0][1]
    return ",".join(f"{c}@{_span(bands, i).split()[0]}" for i, (_, c) in enumerate(bands))


@dataclass(frozen=True)
class PrecisionPlan:
    """Which precision runs a pass of a given number of flattened rows, and which matmul kernel
    each precision's projections use.

    ``bands`` are ``(first_rows, precision)`` in increasing ``first_rows``, the first at 1: a pass
    of r rows runs in the precision of the last band starting at or below r.  ``kernels`` holds
    each precision's :class:`~specforge.toolkit.linear_plan.LinearPlan` bands (absent: the
    runtime's default).  ``seconds`` holds the measurement (``precision/kernel`` → rows → seconds
    a pass), ``skipped`` each candidate left out and why; ``measured`` says the *precision* was
    chosen by measurement (``dtype: auto``) rather than set.
    """

    bands: Bands
    kernels: Mapping[str, Bands] = field(default_factory=dict)
    seconds: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    measured: bool = False
    dense: str | None = None  # the measured primary (see `primary`); None: the band's at 16 rows

    def __post_init__(self) -> None:
        try:
            check_bands(self.bands, PRECISIONS, "precision")
            if self.dense is not None and self.dense not in PRECISIONS:
                raise ValueError(f"unknown precision {self.dense!r}; valid: {', '.join(PRECISIONS)}")
            for kernel_bands in self.kernels.values():
                LinearPlan(kernel_bands)
        except ValueError as exc:
            raise PrecisionError(str(exc)) from None

    @classmethod
    def fixed(cls, precision: str) -> PrecisionPlan:
        """One precision for every pass (an explicit ``target.dtype``), default kernels."""
        return cls(((1, precision),))

    def precision_for(self, rows: int) -> str:
        return band_for(self.bands, rows)

    def linear_plan(self, precision: str) -> LinearPlan | None:
        """The matmul kernels measured for ``precision`` (None: not measured)."""
        bands = self.kernels.get(precision)
        return LinearPlan(bands) if bands else None

    @property
    def primary(self) -> str:
        """What the target hands hidden states out in, and what drafters, heads and training
        compute in: the dense precision (float32, bfloat16 or float16 — a 4-bit pass's speed is
        its weights', not its arithmetic's) measured fastest on passes of :data:`PRIMARY_ROWS`
        rows, the size of a drafter's block; for one set precision, that one."""
        return self.dense or self.precision_for(PRIMARY_ROWS)

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision the plan runs, the primary first."""
        return tuple(dict.fromkeys((self.primary, *(p for _, p in self.bands))))

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens the engine prefills per pass (``engine.prefill_chunk: auto``): the
        smallest measured pass whose cost per row is within :data:`CHUNK_SLACK` of the cheapest
        per row measured — a larger chunk would prefill no faster, only stall the decoding rows
        sharing its pass longer.  Unmeasured (one precision with one kernel): :data:`CHUNK_ROWS`."""
        per_row: dict[int, float] = {}
        for by_rows in self.seconds.values():
            for rows, s in by_rows.items():
                per_row[rows] = min(per_row.get(rows, math.inf), s / rows)
        if not per_row:
            return CHUNK_ROWS
        cheapest = min(per_row.values())
        return min(r for r, c in per_row.items() if c <= CHUNK_SLACK * cheapest)

    @property
    def label(self) -> str:
        """``bfloat16`` for one precision, ``bfloat16@1,float32@2+`` for bands: what profiles,
        manifests and benchmark records name."""
        return _label(self.bands)

    def describe(self) -> str:
        """One line: what runs where and why."""
        parts = []
        for i, (first, p) in enumerate(self.bands):
            why = _versus(self.seconds, p, _measured_rows_in(self.bands, i)) if self.measured else ""
            parts.append(f"{p} for passes of {_span(self.bands, i)}" + (f" ({why})" if why else ""))
        head = "target precision (auto, measured on this machine): " if self.measured else \
            "target precision (set explicitly): "
        kernels = "; ".join(f"{p} matmuls: " + ", ".join(f"{k} for {_span(b, i)}" for i, (_, k) in enumerate(b))
                            for p, b in self.kernels.items() if p in self.precisions)
        skipped = "; ".join(f"{p} not tried: {why}" for p, why in self.skipped.items())
        return head + ", ".join(parts) + "".join(f"; {x}" for x in (kernels, skipped) if x)

    def to_dict(self) -> dict[str, Any]:
        return {"format": "specforge.precision", "version": 2, "label": self.label,
                "bands": [[first, p] for first, p in self.bands], "primary": self.primary,
                "kernels": {p: [[first, k] for first, k in b] for p, b in self.kernels.items()},
                "measured": self.measured, "skipped": dict(self.skipped), "dense": self.dense,
                "seconds": {a: {str(r): round(s, 7) for r, s in rows.items()} for a, rows in self.seconds.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPlan:
        try:
            return cls(tuple((int(first), str(p)) for first, p in data["bands"]),
                       {str(p): tuple((int(f), str(k)) for f, k in b) for p, b in data.get("kernels", {}).items()},
                       {str(a): {int(r): float(s) for r, s in rows.items()} for a, rows in data.get("seconds", {}).items()},
                       {str(p): str(w) for p, w in data.get("skipped", {}).items()}, bool(data.get("measured", True)),
                       data.get("dense"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PrecisionError(f"not a precision plan: {exc}") from None


def _measured_rows_in(bands: Bands, i: int) -> int:
    """The measured size that stands for band ``i`` (its largest measured row count)."""
    first = bands[i][0]
    last = bands[i + 1][0] - 1 if i + 1 < len(bands) else None
    inside = [r for r in (*ROWS, PREFILL_ROWS) if r >= first and (last is None or r <= last)]
    return inside[-1] if inside else first


def _versus(seconds: Mapping[str, Mapping[int, float]], chosen: str, rows: int) -> str:
    """``1.7x float32's speed at 1 row``: the chosen precision (its best kernel) against the
    runner-up precision (its best kernel)."""
    best: dict[str, float] = {}
    for arm, by_rows in seconds.items():
        p = arm.split("/")[0]
        if rows in by_rows:
            best[p] = min(best.get(p, math.inf), by_rows[rows])
    mine = best.pop(chosen, None)
    if mine is None or not best:
        return ""
    runner = min(best, key=best.get)
    return f"{best[runner] / mine:.2f}x {runner}'s speed at {rows} row{'s' * (rows > 1)}"


# -- measuring -------------------------------------------------------------------------------------

Build = Callable[[str], Any]  # precision -> a runtime Transformer (or raises PrecisionError and kin)


def _mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    if not torch.isfinite(logits).all():
        return math.inf
    ref = torch.log_softmax(reference.double(), -1)
    got = torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def _time_passes(arms: Mapping[str, Callable[[], object]], rows: int, reps: int) -> dict[str, float]:
    """Seconds of one pass of ``rows`` rows for each arm (one warm-up each: first-call
    allocations)."""
    return interleaved_seconds(arms, reps, warmup=1)


def _kernels(runtime: Any, precision: str) -> tuple[str, ...]:
    """The matmul kernels worth timing for a runtime: none to choose for q4 (the int4 kernel);
    ``packed`` only where oneDNN packed its weights."""
    if precision == "q4":
        return ("linear",)
    packed = getattr(runtime.head_projection, "packed", None) is not None
    return ("linear", "wx", "packed") if packed else ("linear", "wx")


def _choose(timed: Mapping[str, float], previous: str | None) -> str:
    """The fastest arm, or ``previous`` when it is within :data:`TIE` of it (fewer bands)."""
    best = min(timed, key=timed.get)
    return previous if previous in timed and timed[previous] <= TIE * timed[best] else best


@torch.inference_mode()
def measure_precision(build: Build, candidates: Sequence[str], skipped: Mapping[str, str] | None = None, *,
                      auto: bool = True, reps: int = 4, seed: int = 0, progress: bool = True) -> PrecisionPlan:
    """Time the runtimes ``build`` makes for ``candidates``, each with every matmul kernel it can
    use, on the pass sizes of :data:`ROWS` and a :data:`PREFILL_ROWS`-token prompt, interleaved,
    and return the plan (see the module doc).  With ``auto`` ``float32`` is always measured: the
    reference the others' logits are checked against; without it (one explicit precision) only
    the kernels are chosen."""
    from tqdm.auto import tqdm

    skipped = dict(skipped or {})
    runtimes: dict[str, Any] = {}
    for p in dict.fromkeys(("float32", *candidates) if auto else candidates):
        try:
            runtimes[p] = build(p)
        except (SpecforgeError, RuntimeError, NotImplementedError, ValueError) as exc:
            if p == "float32" or not auto:
                raise
            skipped[p] = str(exc).splitlines()[0]
    gen = torch.Generator().manual_seed(seed)
    vocab = int(next(iter(runtimes.values())).lm_head.shape[0])
    if auto:
        check = torch.randint(0, vocab, (_CHECK,), generator=gen)
        check_batch = VarlenBatch.build([check], [0], [0])

        def logits(runtime: Any) -> torch.Tensor:
            return runtime(check_batch, runtime.new_cache(1, _CHECK), torch.arange(_CHECK)).logits

        reference = logits(runtimes["float32"])
        for p in [p for p in runtimes if p != "float32"]:
            try:
                kl = _mean_kl(reference, logits(runtimes[p]))
            except (RuntimeError, NotImplementedError) as exc:
                skipped[p] = f"its pass failed: {str(exc).splitlines()[0]}"
                del runtimes[p]
                continue
            if not kl <= MAX_KL:
                skipped[p] = (f"its logits differ from float32's (mean KL {kl:.3g} > {MAX_KL})" if math.isfinite(kl)
                              else "its logits overflow (inf/NaN)")
                del runtimes[p]

    # Each runtime its own cache (in the KV dtype it would use), with _REQUESTS slots of context.
    longest = max(CHUNK_ROWS, max(split_tokens(r, _REQUESTS)[0] for r in ROWS))
    context = [torch.randint(0, vocab, (_CONTEXT,), generator=gen) for _ in range(_REQUESTS)]
    caches = {}
    for p, runtime in runtimes.items():
        cache = runtime.new_cache(_REQUESTS, _CONTEXT + longest)
        slots = [cache.allocate() for _ in range(_REQUESTS)]
        runtime(VarlenBatch.build(context, slots, [0] * _REQUESTS), cache)
        for s in slots:
            cache.advance(s, _CONTEXT)
        caches[p] = cache

    def pass_of(rows: int) -> tuple[VarlenBatch, torch.Tensor | None]:
        if rows >= PREFILL_ROWS:  # a prompt: one request, logits of its last token only
            return VarlenBatch.build([torch.randint(0, vocab, (rows,), generator=gen)], [0], [_CONTEXT]), \
                torch.tensor([rows - 1])
        runs = split_tokens(rows, _REQUESTS)
        tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in runs]
        return VarlenBatch.build(tokens, list(range(len(runs))), [_CONTEXT] * len(runs)), torch.arange(rows)

    def arm(p: str, kernel: str, batch: VarlenBatch, rows: torch.Tensor | None) -> Callable[[], object]:
        def run() -> object:
            runtimes[p].set_linear_plan(LinearPlan.fixed(kernel))
            return runtimes[p](batch, caches[p], rows)
        return run

    live = [f"{p}/{k}" for p, runtime in runtimes.items() for k in _kernels(runtime, p)]
    if len(live) == 1 and not auto:  # one precision with one kernel (q4): nothing to choose
        return PrecisionPlan(((1, candidates[0]),), skipped=skipped)
    seconds: dict[str, dict[int, float]] = {a: {} for a in live}
    kernel_choice: dict[str, list[tuple[int, str]]] = {p: [] for p in runtimes}
    choice: list[tuple[int, str]] = []
    primary: str | None = None  # the fastest dense precision at PRIMARY_ROWS (or the last size it ran)
    sizes = [*ROWS, PREFILL_ROWS]
    bar = tqdm(total=len(sizes), desc="measuring the target's precision and matmul kernels", unit="size",
               disable=not progress, file=sys.stderr)
    with bar:
        for rows in sizes:
            batch, logits_rows = pass_of(rows)
            timed = _time_passes({a: arm(*a.split("/"), batch, logits_rows) for a in live}, rows, reps)
            for a, t in timed.items():
                seconds[a][rows] = t
            per_precision: dict[str, float] = {}
            for p in dict.fromkeys(a.split("/")[0] for a in timed):
                mine = {a.split("/")[1]: t for a, t in timed.items() if a.split("/")[0] == p}
                previous = kernel_choice[p][-1][1] if kernel_choice[p] else None
                k = _choose(mine, previous)
                kernel_choice[p].append((rows, k))
                per_precision[p] = mine[k]
            choice.append((rows, _choose(per_precision, choice[-1][1] if choice else None)))
            dense_times = {p: t for p, t in per_precision.items() if p != "q4"}
            if dense_times and (rows <= PRIMARY_ROWS or primary is None):
                primary = min(dense_times, key=dense_times.get)
            # A precision far behind the best, or a kernel far behind its precision's best, is not
            # timed on larger passes (compute-bound, the gap only grows).
            fastest = min(per_precision.values())
            live = [a for a in live if per_precision[a.split("/")[0]] <= SLOW * fastest
                    and timed[a] <= SLOW * per_precision[a.split("/")[0]]]
            bar.update()
        # The chunk: a longer prompt in what runs prompts (the last band's precision and kernel).
        p = choice[-1][1]
        chunk_arm = f"{p}/{kernel_choice[p][-1][1]}"
        batch, logits_rows = pass_of(CHUNK_ROWS)
        timed = _time_passes({chunk_arm: arm(*chunk_arm.split("/"), batch, logits_rows)}, CHUNK_ROWS, reps)
        seconds[chunk_arm][CHUNK_ROWS] = timed[chunk_arm]
    for p, runtime in runtimes.items():  # the runtimes go on with their measured kernels
        if kernel_choice[p]:
            runtime.set_linear_plan(LinearPlan(bands_from_choices(kernel_choice[p])))
    kernels = {p: bands_from_choices(c) for p, c in kernel_choice.items() if c and p != "q4"}
    bands = bands_from_choices(choice)
    return PrecisionPlan(bands, kernels, seconds, skipped, measured=auto, dense=primary if auto else None)


def resolve_precision(name: str, build: Build, candidates: Sequence[str], skipped: Mapping[str, str],
                      key: str, log: Callable[[str], None] | None = None, progress: bool = True,
                      auto: bool = True) -> PrecisionPlan:
    """The measured plan for target ``name`` (``auto``: its precision and kernels; else the
    kernels of the one precision in ``candidates``): read from ``$SPECFORGE_CACHE_DIR/profiles``
    where this machine measured it before under ``key`` (see
    :func:`specforge.machine.machine_key`), else measured now and written there.  An unreadable
    cache file is measured again."""
    from specforge.caches import profile_file
    from specforge.measured import cached_choice

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path = profile_file(name, key, "precision")

    def measure() -> PrecisionPlan:
        what = "precision and matmul kernels" if auto else f"{candidates[0]} matmul kernels"
        say(f"measuring which {what} run {name}'s passes fastest on this machine, once (cached in {path})")
        return measure_precision(build, candidates, skipped, auto=auto, progress=progress)

    plan, cached = cached_choice(path, measure, PrecisionPlan.from_dict, PrecisionPlan.to_dict)
    say(plan.describe() + (f" [cached: {path}]" if cached else ""))
    return plan


def require_float16() -> None:
    """Refuse float16 on a CPU that only emulates it (one clear error, before any load)."""
    from specforge.machine import machine, native_float16

    if not native_float16():
        raise PrecisionError(
            f"target.dtype=float16: this CPU has no native float16 arithmetic (torch's kernels run at "
            f"{machine()['cpu_capability']}; float16 needs AVX512-FP16 or AMX-FP16), so every value would be "
            "widened to float32 and rounded back — slower than float32 and less precise; use auto, bfloat16 "
            "or float32")


def precision_candidates(gguf: Path | None, weights: str = "auto") -> tuple[tuple[str, ...], dict[str, str]]:
    """The precisions ``auto`` times for a target (``gguf``: its file, where it is one;
    ``weights``: the target's ``weights`` setting) and those it leaves out, each with its reason."""
    from specforge.machine import machine, native_float16

    candidates, skipped = ["float32", "bfloat16"], {}
    if native_float16():
        candidates.append("float16")
    else:
        skipped["float16"] = (f"no native float16 arithmetic on this CPU (torch runs at "
                              f"{machine()['cpu_capability']}; needs AVX512-FP16 or AMX-FP16)")
    if weights == "dense":
        skipped["q4"] = "target.weights is dense"
    elif gguf is None:
        skipped["q4"] = "not a GGUF target (q4 runs a GGUF's own 4-bit blocks)"
    elif not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        skipped["q4"] = "this torch has no CPU int4 kernel (aten._weight_int4pack_mm_for_cpu)"
    else:
        candidates.append("q4")
    return tuple(candidates), skipped


def method_key() -> dict[str, Any]:
    """The measurement's own settings: part of the cache key, so a plan measured another way is
    measured again."""
    return dict(_METHOD)

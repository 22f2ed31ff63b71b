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
precision, the one of passes of :data:`PRIMARY_ROWS` rows — the size of a drafter's block and of
the batched decoding the heads see — and the drafter, heads and training compute in it too.

The choice is measured once per machine, target, torch version and thread count (tens of seconds
for SmolLM2, the candidates that fall far behind are not timed on larger passes) and cached
beside the step curve.  docs: docs/engine.md#precision
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.errors import SpecforgeError
from specforge.target.batch import VarlenBatch, split_tokens
from specforge.target.timing import interleaved_seconds

__all__ = ["DTYPE", "PRECISIONS", "PREFILL_ROWS", "PRIMARY_ROWS", "ROWS", "PrecisionError", "PrecisionPlan",
           "measure_precision", "method_key", "precision_candidates", "require_float16", "resolve_precision"]

PRECISIONS = ("float32", "bfloat16", "float16", "q4")
# q4 computes on bf16 activations (the int4 kernel's input type)
DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "q4": torch.bfloat16}
ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode and verify passes, in flattened rows
PREFILL_ROWS = 128  # one prompt: the compute-bound regime, standing for every pass past ROWS[-1]
PRIMARY_ROWS = 16
# A candidate whose next-token law moves further than this from float32's (mean KL, nats, over a
# teacher-forced sequence) is refused: bf16 and 4-bit renderings of SmolLM2 sit near 1e-3; an
# overflowing float16 gives inf/NaN.
MAX_KL = 0.05
SLOW = 3.0  # this much slower than the best at some size: not timed at larger ones (compute only grows)
TIE = 1.03  # within 3 % of the best, the smaller pass's choice is kept (fewer bands, fewer copies)
_CONTEXT, _REQUESTS, _CHECK = 32, 8, 48  # each slot's cached context, slots, tokens of the accuracy check
_METHOD = {"rows": ROWS, "prefill": PREFILL_ROWS, "context": _CONTEXT, "requests": _REQUESTS, "max_kl": MAX_KL,
           "slow": SLOW, "tie": TIE, "version": 1}


class PrecisionError(SpecforgeError, ValueError):
    """A precision that cannot run on this machine or with this target; the message says why."""


@dataclass(frozen=True)
class PrecisionPlan:
    """Which precision runs a pass of a given number of flattened rows.

    ``bands`` are ``(first_rows, precision)`` in increasing ``first_rows``, the first at 1: a pass
    of r rows runs in the precision of the last band starting at or below r.  ``seconds`` holds the
    measurement (precision → rows → seconds a pass), ``skipped`` each candidate left out and why.
    """

    bands: tuple[tuple[int, str], ...]
    seconds: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    measured: bool = False

    def __post_init__(self) -> None:
        if not self.bands or self.bands[0][0] != 1:
            raise PrecisionError(f"precision bands must start at 1 row: {self.bands!r}")
        if any(b[0] >= a[0] for b, a in zip(self.bands, self.bands[1:])):  # noqa: B905 - offset pairs
            raise PrecisionError(f"precision bands must start at increasing row counts: {self.bands!r}")
        bad = [p for _, p in self.bands if p not in PRECISIONS]
        if bad:
            raise PrecisionError(f"unknown precision {bad[0]!r}; valid: {', '.join(PRECISIONS)}")

    @classmethod
    def fixed(cls, precision: str) -> PrecisionPlan:
        """One precision for every pass (an explicit ``target.dtype``)."""
        return cls(((1, precision),))

    def precision_for(self, rows: int) -> str:
        chosen = self.bands[0][1]
        for first, precision in self.bands:
            if first > rows:
                break
            chosen = precision
        return chosen

    @property
    def primary(self) -> str:
        """The precision of passes of :data:`PRIMARY_ROWS` rows: what the target hands hidden
        states out in, and what drafters, heads and training compute in."""
        return self.precision_for(PRIMARY_ROWS)

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision the plan runs, the primary first."""
        return tuple(dict.fromkeys((self.primary, *(p for _, p in self.bands))))

    @property
    def label(self) -> str:
        """``bfloat16`` for one precision, ``bfloat16@1,float32@2+`` for bands: what profiles,
        manifests and benchmark records name."""
        if len(self.bands) == 1:
            return self.bands[0][1]
        spans = []
        for i, (first, p) in enumerate(self.bands):
            last = self.bands[i + 1][0] - 1 if i + 1 < len(self.bands) else None
            spans.append(f"{p}@{first}" + ("+" if last is None else "" if last == first else f"-{last}"))
        return ",".join(spans)

    def describe(self) -> str:
        """One line: what runs where and why."""
        if not self.measured:
            return f"target precision: {self.label} (set explicitly)"
        parts = []
        for i, (first, p) in enumerate(self.bands):
            last = self.bands[i + 1][0] - 1 if i + 1 < len(self.bands) else None
            span = f"{first}+ rows" if last is None else (f"{first} row{'s' * (first > 1)}" if last == first
                                                         else f"{first}-{last} rows")
            at = _measured_rows_in(first, last)
            why = _versus(self.seconds, p, at)
            parts.append(f"{p} for passes of {span}" + (f" ({why})" if why else ""))
        skipped = "; ".join(f"{p} not tried: {why}" for p, why in self.skipped.items())
        return "target precision (auto, measured on this machine): " + ", ".join(parts) + (
            f"; {skipped}" if skipped else "")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "specforge.precision", "version": 1, "label": self.label,
                "bands": [[first, p] for first, p in self.bands], "primary": self.primary,
                "measured": self.measured, "skipped": dict(self.skipped),
                "seconds": {p: {str(r): round(s, 7) for r, s in rows.items()} for p, rows in self.seconds.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPlan:
        try:
            return cls(tuple((int(first), str(p)) for first, p in data["bands"]),
                       {str(p): {int(r): float(s) for r, s in rows.items()} for p, rows in data.get("seconds", {}).items()},
                       {str(p): str(w) for p, w in data.get("skipped", {}).items()}, bool(data.get("measured", True)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PrecisionError(f"not a precision plan: {exc}") from None


def _measured_rows_in(first: int, last: int | None) -> int:
    """The measured size that stands for a band (its largest measured row count)."""
    sizes = [*ROWS, PREFILL_ROWS]
    inside = [r for r in sizes if r >= first and (last is None or r <= last)]
    return inside[-1] if inside else first


def _versus(seconds: Mapping[str, Mapping[int, float]], chosen: str, rows: int) -> str:
    """``1.7x faster than float32 at 1 row``: the chosen precision against the runner-up."""
    mine = seconds.get(chosen, {}).get(rows)
    others = {p: s[rows] for p, s in seconds.items() if p != chosen and rows in s}
    if mine is None or not others:
        return ""
    runner = min(others, key=others.get)
    return f"{others[runner] / mine:.2f}x {runner}'s speed at {rows} row{'s' * (rows > 1)}"


# -- measuring -------------------------------------------------------------------------------------

Build = Callable[[str], Any]  # precision -> a runtime Transformer (or raises PrecisionError and kin)


def _mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    if not torch.isfinite(logits).all():
        return math.inf
    ref = torch.log_softmax(reference.double(), -1)
    got = torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def _time_passes(arms: Mapping[str, Callable[[], object]], rows: int, reps: int) -> dict[str, float]:
    """Seconds of one pass of ``rows`` rows in each precision (one warm-up each: first-call
    allocations)."""
    return interleaved_seconds(arms, reps, warmup=1)


@torch.inference_mode()
def measure_precision(build: Build, candidates: Sequence[str], skipped: Mapping[str, str] | None = None, *,
                      reps: int = 4, seed: int = 0, progress: bool = True) -> PrecisionPlan:
    """Time the runtimes ``build`` makes for ``candidates`` on the pass sizes of :data:`ROWS` and
    a :data:`PREFILL_ROWS`-token prompt, interleaved, and return the plan (see the module doc).
    ``float32`` is always measured: it is the reference the others' logits are checked against."""
    from tqdm.auto import tqdm

    skipped = dict(skipped or {})
    runtimes: dict[str, Any] = {}
    for p in dict.fromkeys(("float32", *candidates)):
        try:
            runtimes[p] = build(p)
        except (SpecforgeError, RuntimeError, NotImplementedError, ValueError) as exc:
            if p == "float32":
                raise
            skipped[p] = str(exc).splitlines()[0]
    ref = runtimes["float32"]
    gen = torch.Generator().manual_seed(seed)
    vocab = int(ref.lm_head.shape[0])
    check = torch.randint(0, vocab, (_CHECK,), generator=gen)
    check_batch = VarlenBatch.build([check], [0], [0])
    check_rows = torch.arange(_CHECK)

    def logits(runtime: Any) -> torch.Tensor:
        return runtime(check_batch, runtime.new_cache(1, _CHECK), check_rows).logits

    reference = logits(ref)
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
    longest = max(PREFILL_ROWS, max(split_tokens(r, _REQUESTS)[0] for r in ROWS))
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
        if rows == PREFILL_ROWS:  # a prompt: one request, logits of its last token only
            return VarlenBatch.build([torch.randint(0, vocab, (rows,), generator=gen)], [0], [_CONTEXT]), \
                torch.tensor([rows - 1])
        runs = split_tokens(rows, _REQUESTS)
        tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in runs]
        return VarlenBatch.build(tokens, list(range(len(runs))), [_CONTEXT] * len(runs)), torch.arange(rows)

    live = list(runtimes)
    seconds: dict[str, dict[int, float]] = {p: {} for p in runtimes}
    choice: dict[int, str] = {}
    sizes = [*ROWS, PREFILL_ROWS]
    bar = tqdm(total=len(sizes), desc="measuring the target's precision", unit="size", disable=not progress,
               file=sys.stderr)
    with bar:
        for rows in sizes:
            batch, logits_rows = pass_of(rows)
            timed = _time_passes({p: (lambda p=p: runtimes[p](batch, caches[p], logits_rows)) for p in live},
                                 rows, reps)
            for p, s in timed.items():
                seconds[p][rows] = s
            best = min(timed, key=timed.get)
            previous = choice[sizes[sizes.index(rows) - 1]] if rows != sizes[0] else None
            choice[rows] = previous if previous in timed and timed[previous] <= TIE * timed[best] else best
            live = [p for p in live if timed[p] <= SLOW * timed[best]]
            bar.update()
    bands: list[tuple[int, str]] = []
    first = 1
    for rows in sizes:  # a pass of r rows goes by the smallest measured size ≥ r
        if not bands or bands[-1][1] != choice[rows]:
            bands.append((first, choice[rows]))
        first = rows + 1
    return PrecisionPlan(tuple(bands), seconds, skipped, measured=True)


def resolve_precision(name: str, build: Build, candidates: Sequence[str], skipped: Mapping[str, str],
                      key: str, log: Callable[[str], None] | None = None, progress: bool = True) -> PrecisionPlan:
    """The measured plan for target ``name``: read from ``$SPECFORGE_CACHE_DIR/profiles`` where
    this machine measured it before under ``key`` (see :func:`specforge.machine.machine_key`),
    else measured now and written there.  An unreadable cache file is measured again."""
    from specforge.files import write_atomic
    from specforge.target.loading import cache_root

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path = cache_root() / "profiles" / f"{Path(name).name}-precision-{key}.json"
    if path.is_file():
        try:
            plan = PrecisionPlan.from_dict(json.loads(path.read_text(encoding="utf-8")))
            say(plan.describe() + f" [cached: {path}]")
            return plan
        except (OSError, ValueError) as exc:
            warnings.warn(f"the cached precision plan {path} is unreadable ({exc}); measuring again",
                          RuntimeWarning, stacklevel=2)
    say(f"measuring which precision runs {name}'s passes fastest on this machine, once (cached in {path})")
    plan = measure_precision(build, candidates, skipped, progress=progress)
    say(plan.describe())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(plan.to_dict(), indent=2) + "\n")
    except OSError as exc:  # a read-only home: measured again next time, never an error
        warnings.warn(f"could not cache the precision plan at {path} ({exc})", RuntimeWarning, stacklevel=2)
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


def precision_candidates(gguf: Path | None) -> tuple[tuple[str, ...], dict[str, str]]:
    """The precisions ``auto`` times for a target (``gguf``: its file, where it is one) and
    those it leaves out, each with its reason."""
    from specforge.machine import machine, native_float16

    candidates, skipped = ["float32", "bfloat16"], {}
    if native_float16():
        candidates.append("float16")
    else:
        skipped["float16"] = (f"no native float16 arithmetic on this CPU (torch runs at "
                              f"{machine()['cpu_capability']}; needs AVX512-FP16 or AMX-FP16)")
    if gguf is None:
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

"""Whether the target's compiled forward pays on this machine (``target.compile: auto``).

``torch.compile`` fuses a pass's elementwise work (norms, rotary, residuals, casts) into a few C++
loops (:mod:`.compiled`).  Whether that pays depends on the machine: where the matmuls dominate
a step — float32 on an AVX2-only CPU, or 4-bit weights — there is little left to fuse, and the
compiled graphs cost a minute or more to build.  ``auto`` compiles once, times the passes a
decoding engine runs most — one request's decode step, eight requests' decode step, one
request's verify pass of eight tokens — eager against compiled, interleaved, and keeps the
compiled forward only when it is at least :data:`PAYS` faster on their geometric mean *and* its
graphs built within :data:`MAX_COMPILE_SECONDS` (every process builds them again: inductor's
on-disk cache did not shorten it for these graphs).  The verdict is cached per machine, target,
precision plan and torch version beside the precision plan: a machine where it does not pay
never compiles again.  docs: docs/engine.md#the-compiled-forward
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specforge.passes import VarlenBatch
from specforge.runtime.timing import interleaved_seconds

__all__ = ["PAYS", "CompileChoice", "measure_compile", "resolve_compile", "verdict"]

PAYS = 1.03  # compiled must be this much faster (geometric mean of the passes) to be kept
# ... and its graphs must build within this many seconds: every process compiles them again (on a
# 2-core AVX2 EPYC SmolLM2's took 338 s cold and 368 s with inductor's on-disk cache warm), a
# price a short command never earns back.
MAX_COMPILE_SECONDS = 120.0
_CONTEXT = 64
PASSES = {"decode-1": (1, 1), "decode-8": (8, 1), "verify-8": (1, 8)}  # name -> (requests, tokens each)
_METHOD = {"passes": PASSES, "context": _CONTEXT, "pays": PAYS, "max_compile_s": MAX_COMPILE_SECONDS, "version": 1}


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    speedup: Mapping[str, float] = field(default_factory=dict)  # pass -> eager seconds / compiled seconds
    compile_seconds: float = 0.0  # building the graphs, when it was measured
    why: str = ""

    def describe(self) -> str:
        if not self.speedup:
            return f"target compile (auto): eager ({self.why})"
        ratios = ", ".join(f"{name} {s:.2f}x" for name, s in self.speedup.items())
        verdict = "compiled" if self.compile else "eager"
        return (f"target compile (auto, measured on this machine): {verdict} — compiled ÷ eager speed {ratios}; "
                f"{self.why} (kept at ≥ {PAYS}x within {MAX_COMPILE_SECONDS:.0f} s of compiling)")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "specforge.compile", "version": 1, "compile": self.compile,
                "speedup": {k: round(v, 4) for k, v in self.speedup.items()},
                "compile_seconds": round(self.compile_seconds, 1), "why": self.why}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileChoice:
        try:
            return cls(bool(data["compile"]), {str(k): float(v) for k, v in data.get("speedup", {}).items()},
                       float(data.get("compile_seconds", 0.0)), str(data.get("why", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a compile record: {exc}") from None


@torch.inference_mode()
def measure_compile(target: Any, reps: int = 12) -> CompileChoice:
    """Compile ``target`` (the torch backend, :class:`~specforge.runtime.torch.backend.TorchBackend`), time :data:`PASSES` eager
    and compiled, and say which to keep; the target is left compiled exactly when it pays."""
    if not target.compile():
        return CompileChoice(False, why="torch.compile cannot build CPU kernels here (no C++ compiler)")
    trunks = target.trunks
    gen = torch.Generator().manual_seed(0)
    vocab, most = target.vocab_size, max(r for r, _ in PASSES.values())
    cache = target.new_cache(most, _CONTEXT + max(n for _, n in PASSES.values()))
    slots = [cache.allocate() for _ in range(most)]
    context = [torch.randint(0, vocab, (_CONTEXT,), generator=gen) for _ in slots]
    target.forward(VarlenBatch.build(context, slots, [0] * most), cache)
    for s in slots:
        cache.advance(s, _CONTEXT)
    batches = {name: VarlenBatch.build([torch.randint(0, vocab, (n,), generator=gen) for _ in range(r)],
                                       slots[:r], [_CONTEXT] * r) for name, (r, n) in PASSES.items()}

    def arm(name: str, compiled: bool) -> Callable[[], object]:
        batch = batches[name]
        rows = torch.arange(batch.num_tokens)

        def run() -> object:
            target.use_trunks(trunks if compiled else None)
            return target.forward(batch, cache, rows)
        return run

    start = time.perf_counter()
    for name in batches:  # build the graphs (sizes become symbolic after the first passes)
        for _ in range(2):
            arm(name, True)()
    compile_seconds = time.perf_counter() - start
    speedup = {}
    for name in batches:
        t = interleaved_seconds({"eager": arm(name, False), "compiled": arm(name, True)}, reps, warmup=1)
        speedup[name] = t["eager"] / t["compiled"]
    choice = verdict(speedup, compile_seconds)
    target.use_trunks(trunks if choice.compile else None)
    return choice


def verdict(speedup: Mapping[str, float], compile_seconds: float = 0.0) -> CompileChoice:
    """Compiled when its speed over eager, geometric mean over the passes, reaches :data:`PAYS`
    and its graphs built within :data:`MAX_COMPILE_SECONDS`."""
    mean = math.exp(sum(math.log(s) for s in speedup.values()) / len(speedup))
    why = f"compiled ÷ eager {mean:.2f}x on the geometric mean of the decoding passes"
    if compile_seconds > MAX_COMPILE_SECONDS:
        why += (f", but its graphs took {compile_seconds:.0f} s to build, paid again by every process "
                f"(more than {MAX_COMPILE_SECONDS:.0f} s; compile: true for a long-running server)")
    return CompileChoice(mean >= PAYS and compile_seconds <= MAX_COMPILE_SECONDS, dict(speedup), compile_seconds, why)


def resolve_compile(target: Any, name: str, key: str, log: Callable[[str], None] | None = None) -> CompileChoice:
    """``target.compile: auto``: the cached verdict for this machine (compiling only when it says
    compiled pays), else measured now (:func:`measure_compile`) and cached under ``key``.  The
    target is left compiled exactly when the returned choice says so."""
    from specforge.caches import profile_file
    from specforge.measured import cached_choice

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path = profile_file(name, key, "compile")

    def measure() -> CompileChoice:
        say(f"measuring whether the compiled forward pays for {name} on this machine, once "
            f"(compiles it: a minute or more; cached in {path})")
        return measure_compile(target)

    choice, cached = cached_choice(path, measure, CompileChoice.from_dict, CompileChoice.to_dict)
    if cached and choice.compile and not target.compile():
        choice = CompileChoice(False, choice.speedup, choice.compile_seconds, "no C++ compiler here any more")
    say(choice.describe() + (f" [cached: {path}]" if cached else ""))
    return choice


def method_key() -> dict[str, Any]:
    return dict(_METHOD)

"""Which backend computes a target's passes: decided here, once per loaded target, and said once.

``target.backend`` is ``torch``, ``llama.cpp`` or ``auto``.  A named backend is the user's word: a
``llama.cpp`` that lacks what the caller needs (:class:`~specforge.runtime.contract.Needs`: a tap of
the last layer, every row's final hidden state) is a :class:`~specforge.errors.ConfigError`.
``auto`` takes torch where llama.cpp cannot run (not a GGUF, a CUDA device, no binding) or lacks a
need, and otherwise times the passes a decoding engine runs most — one request's decode step, eight
requests' decode step, one request's verify pass of eight tokens, each over a 256-token context — on
both backends, interleaved, and keeps the faster on the passes of the load the caller serves
(``Needs.requests``: a single user's decode and verify passes — only the decode step where the
caller decodes plainly, ``Needs.drafts`` False — a batched server's decode step, all three where
the load is not given; geometric mean).  The timings are cached per machine, target,
torch precision plan and binding, beside the precision plan; the verdict is printed with them.
docs: docs/backends.md#choosing-a-backend-on-this-machine
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.errors import ConfigError
from specforge.passes import VarlenBatch
from specforge.runtime.contract import Needs, TargetBackend
from specforge.runtime.timing import interleaved_seconds

__all__ = ["BackendChoice", "choose_backend", "measure_backends", "where_llamacpp_cannot_run"]

_CONTEXT = 256
PASSES = {"decode-1": (1, 1), "decode-8": (8, 1), "verify-8": (1, 8)}  # name -> (requests, tokens each)
_METHOD = {"passes": PASSES, "context": _CONTEXT, "version": 1}


def passes_for(requests: int | None, drafts: bool | None = None) -> tuple[str, ...]:
    """The measured passes that decide for a load of ``requests`` decoded together: one request's
    decode step and (where it ``drafts``) verify pass for a single user, the eight-request decode
    step for a batched server, all three where the load is not known.  Plain decoding
    (``drafts`` False) never runs a verify pass."""
    if requests is None:
        return tuple(PASSES) if drafts is not False else ("decode-1", "decode-8")
    if requests <= 1:
        return ("decode-1",) if drafts is False else ("decode-1", "verify-8")
    return ("decode-8",)


def _load(requests: int | None, drafts: bool | None = None) -> str:
    what = "" if drafts is None else (", drafting" if drafts else ", plain decoding")
    if requests is None:
        return f"load not given{what}"
    return ("1 request at a time" if requests <= 1 else f"{requests} requests at a time") + what


@dataclass(frozen=True)
class BackendChoice:
    """The timings of :data:`PASSES` on both backends; the verdict for a load is :meth:`for_load`."""

    seconds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # backend -> pass -> seconds

    def speedup(self, passes: tuple[str, ...] = tuple(PASSES)) -> float:
        """llama.cpp's speed over torch's, geometric mean over ``passes``."""
        ratios = [self.seconds["torch"][p] / self.seconds["llama.cpp"][p] for p in passes]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    def for_load(self, requests: int | None, drafts: bool | None = None) -> str:
        """The faster backend on the passes a load of ``requests`` runs (:func:`passes_for`)."""
        return "llama.cpp" if self.speedup(passes_for(requests, drafts)) >= 1 else "torch"

    def describe(self, requests: int | None = None, drafts: bool | None = None) -> str:
        passes = ", ".join(f"{p} {1e3 * self.seconds['llama.cpp'][p]:.1f} vs {1e3 * self.seconds['torch'][p]:.1f} ms"
                           for p in PASSES)
        chosen = passes_for(requests, drafts)
        return (f"target.backend: auto → {self.for_load(requests, drafts)} for {_load(requests, drafts)} "
                f"(measured on this machine: "
                f"llama.cpp vs torch {passes}; on {', '.join(chosen)} llama.cpp runs at "
                f"{self.speedup(chosen):.2f}x torch's speed)")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "specforge.backend", "version": 1, "backend": self.for_load(None),
                "seconds": {b: {p: round(s, 6) for p, s in by.items()} for b, by in self.seconds.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendChoice:
        try:
            seconds = {str(b): {str(p): float(s) for p, s in by.items()} for b, by in data["seconds"].items()}
            choice = cls(seconds)
            choice.speedup()
            return choice
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            raise ValueError(f"not a backend record: {exc}") from None


@torch.inference_mode()
def measure_backends(backends: Mapping[str, Any], vocab: int, reps: int = 10) -> BackendChoice:
    """Time :data:`PASSES` on each of ``backends`` (``{"torch": …, "llama.cpp": …}``, objects with
    ``new_cache`` and ``forward``), interleaved."""
    gen = torch.Generator().manual_seed(0)
    most = max(r for r, _ in PASSES.values())
    context = [torch.randint(0, vocab, (_CONTEXT,), generator=gen) for _ in range(most)]
    runs = {name: [torch.randint(0, vocab, (n,), generator=gen) for _ in range(r)] for name, (r, n) in PASSES.items()}
    arms: dict[tuple[str, str], Callable[[], object]] = {}
    for label, backend in backends.items():
        cache = backend.new_cache(most, _CONTEXT + max(n for _, n in PASSES.values()))
        slots = [cache.allocate() for _ in range(most)]
        backend.forward(VarlenBatch.build(context, slots, [0] * most), cache, torch.tensor([_CONTEXT - 1]))
        for s in slots:
            cache.advance(s, _CONTEXT)
        for name, tokens in runs.items():
            batch = VarlenBatch.build(tokens, slots[:len(tokens)], [_CONTEXT] * len(tokens))
            rows = torch.arange(batch.num_tokens)
            arms[(label, name)] = (lambda b=backend, c=cache, x=batch, r=rows: b.forward(x, c, r))
    times = {}
    for name in PASSES:  # one pass kind at a time, its arms interleaved
        times.update(interleaved_seconds({k: f for k, f in arms.items() if k[1] == name}, reps))
    return BackendChoice({label: {name: times[(label, name)] for name in PASSES} for label in backends})


def resolve_backend(name: str, backends: Mapping[str, TargetBackend], vocab: int, key: str,
                    say: Callable[[str], None], requests: int | None = None,
                    drafts: bool | None = None) -> BackendChoice:
    """The cached timings for this machine, else measured now on the two ``backends`` and cached
    under ``key``; the verdict for a load of ``requests`` (drafting or not) is said once, with them."""
    from specforge.caches import profile_file
    from specforge.measured import cached_choice

    path = profile_file(name, key, "backend")

    def measure() -> BackendChoice:
        say(f"measuring which backend decodes {name} fastest on this machine, once (cached in {path})")
        return measure_backends(backends, vocab)

    choice, cached = cached_choice(path, measure, BackendChoice.from_dict, BackendChoice.to_dict)
    say(choice.describe(requests, drafts) + (f" [cached: {path}]" if cached else ""))
    return choice


def where_llamacpp_cannot_run(gguf: Path | None) -> str | None:
    """Why the llama.cpp backend cannot run this target here, or None when it can."""
    if gguf is None:
        return "the target is a safetensors directory (llama.cpp runs GGUF files)"
    if torch.cuda.is_available():
        return "a CUDA device is present (the llama.cpp binding specforge builds is CPU-only)"
    from specforge.runtime.llamacpp.libllama import BindingError, load

    try:
        load()
    except BindingError as exc:
        return str(exc)
    return None


def choose_backend(request: str, torch_backend: TargetBackend, open_llamacpp: Callable[[], TargetBackend],
                   gguf: Path | None, needs: Needs, *, name: str, vocab: int, key: Callable[[], str],
                   log: Callable[[str], None] | None = None) -> TargetBackend:
    """The backend a target's passes run on: ``request`` (``target.backend``, one of
    :data:`~specforge.config.BACKENDS` — :func:`~specforge.runtime.load.load_target` refuses any
    other before the slow load) decided with what the caller ``needs``, said once through ``log``
    when ``auto`` decided it.  ``open_llamacpp`` opens
    the GGUF in libllama (only called where llama.cpp may run); ``key`` names the measurement's cache
    entry."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if request == "torch":
        return torch_backend
    if request == "llama.cpp":
        backend = open_llamacpp()
        why = backend.lacks(needs)
        if why:
            raise ConfigError([f"target.backend: {why}; use target.backend=torch"])
        return backend
    why = where_llamacpp_cannot_run(gguf)
    backend = None if why else open_llamacpp()
    why = why or backend.lacks(needs)
    if why:
        say(f"target.backend: auto → torch ({why})")
        return torch_backend
    choice = resolve_backend(name, {"torch": torch_backend, "llama.cpp": backend}, vocab, key(), say, needs.requests,
                             needs.drafts)
    return backend if choice.for_load(needs.requests, needs.drafts) == "llama.cpp" else torch_backend


def method_key() -> dict[str, Any]:
    return dict(_METHOD)

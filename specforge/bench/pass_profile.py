"""``specforge bench pass``: where a plain decoding step spends its time, at each concurrency.

A serving engine at c = 64 loses to another for one of a few reasons: its matmuls (the kernels and
precision of the projections), its attention over 64 contexts, its LM head, or the engine's own
Python around the pass (sampling, commit, building the batch).  This bench decodes c requests
plainly (greedy, fixed-length answers to fixed-length random prompts: a step's cost does not
depend on the text) and splits the wall time of each step:

* the engine's round: the target pass, the verifier (sampling), the commit, and the rest of the
  step (the engine's bookkeeping, building the batch);
* inside the pass, when the torch runtime computes it: the four projections of every layer
  (q/k/v, output, gate/up, down), attention with its cache write, the LM head, and the rest of
  the pass (embedding, norms, RoPE, residuals, the attention plan).

The pass is timed by wrapping those callables (a ``perf_counter`` pair per call: a few µs per
pass); the compiled trunk is switched off for it, since wrappers cannot sit inside a graph.
Outputs: ``pass.json``, a table (ms per step and shares) and ``pass.png`` (stacked bars).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from specforge.bench.runner import Report, add_output_arguments, aligned, bench_command
from specforge.config import load_pipeline
from specforge.engine import Engine, GenerationRequest
from specforge.errors import ConfigError
from specforge.machine import machine

__all__ = ["COMMAND", "PASS_PARTS", "ROUND_PARTS", "REPORT", "profile_plain_steps", "table"]

# The engine's step, and inside its target pass (torch runtime only), in the order they run.
ROUND_PARTS = ("pass", "verifier", "commit", "engine other")
PASS_PARTS = ("qkv", "attention", "o", "gate/up", "down", "lm head", "pass other")
_LAYER_PROJECTIONS = {"qkv_proj": "qkv", "o_proj": "o", "up_proj": "gate/up", "down_proj": "down"}
_TIMED = PASS_PARTS[:-1]  # "pass other" is what the timed parts leave of the pass


class _Clock:
    """Seconds per part, accumulated by :class:`_Timed` wrappers."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(_TIMED, 0.0)

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        return call


@contextmanager
def _instrumented(runtimes: list[Any], clock: _Clock) -> Iterator[None]:
    """Wrap every runtime's projections, attention and LM head with ``clock``; undone on exit."""
    from specforge.runtime.torch import model as torch_model

    undo: list[Callable[[], None]] = []
    for runtime in runtimes:
        for layer in runtime.layers:
            for attr, part in _LAYER_PROJECTIONS.items():
                original = getattr(layer, attr)
                setattr(layer, attr, clock.timed(part, original))
                undo.append(lambda layer=layer, attr=attr, original=original: setattr(layer, attr, original))
        head = runtime.head_projection
        runtime.head_projection = clock.timed("lm head", head)
        undo.append(lambda runtime=runtime, head=head: setattr(runtime, "head_projection", head))
    attention = torch_model._PassAttention.__call__
    torch_model._PassAttention.__call__ = clock.timed("attention", attention)
    undo.append(lambda: setattr(torch_model._PassAttention, "__call__", attention))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _requests(c: int, context: int, steps: int, vocab: int, seed: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [GenerationRequest(prompt_ids=torch.randint(0, vocab, (context,), generator=gen).tolist(),
                              max_new_tokens=steps + 2, ignore_eos=True, request_id=i, chat=False)
            for i in range(c)]


def _profile_one(engine: Engine, c: int, context: int, steps: int, split_pass: bool) -> dict[str, Any]:
    requests = _requests(c, context, steps, engine.target.vocab_size, seed=c)
    for r in requests:
        engine.submit(r)
    while len(engine.active) < c:  # prefill every request (a round may decode some of them too)
        engine.step()
    engine.step()  # one decoding step of all c before the clocks start
    engine.reset_clocks()
    clock = _Clock()
    walls = []
    with _instrumented(list(engine.target.torch.runtimes.values()), clock) if split_pass else nullcontext():
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    while engine.busy:
        engine.step()
    for r in requests:
        engine.take_output(r.request_id)
    wall = sum(walls)
    ph = engine.phase_seconds
    per = 1e3 / steps
    row: dict[str, Any] = {
        "concurrency": c, "steps": steps, "context": context,
        "step_ms": wall * per, "tok_per_s": c * steps / wall,
        "round_ms": {"pass": ph["target"] * per, "verifier": ph["verify"] * per, "commit": ph["commit"] * per,
                     "engine other": (wall - ph["target"] - ph["verify"] - ph["commit"]) * per},
    }
    if split_pass:
        inside = {p: s * per for p, s in clock.seconds.items()}
        inside["pass other"] = row["round_ms"]["pass"] - sum(inside.values())
        row["pass_ms"] = inside
    return row


def profile_plain_steps(configs: list[str], overrides: list[str], concurrency: list[int], context: int,
                        steps: int, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """The plain decoding step of ``configs`` (a pipeline without a drafter) at each concurrency,
    split by :data:`ROUND_PARTS` and, on the torch backend, :data:`PASS_PARTS`."""
    most = max(concurrency)
    pipeline = load_pipeline(configs, [*overrides, f"engine.max_batch={most}",
                                       f"engine.max_context={context + steps + 8}"])
    if pipeline.component("drafter") is not None:
        raise ConfigError(["drafter: bench pass profiles plain decoding; give a pipeline without a drafter "
                           "(e.g. --config greedy)"])
    engine = Engine.from_pipeline(pipeline, requests=most)
    target = engine.target
    split_pass = target.backend is target.torch
    if split_pass and any(t is not None for t in target.trunks.values()):
        target.compile(False)  # wrappers cannot sit inside a compiled graph
    rows = []
    for c in concurrency:
        progress(f"bench pass: c = {c}, {steps} steps over {context}-token contexts")
        rows.append(_profile_one(engine, c, context, steps, split_pass))
    return {"machine": machine(), "backend": target.backend.name, "precision": target.precision_label,
            "config": configs, "overrides": list(overrides), "rows": rows}


def table(result: dict[str, Any]) -> str:
    """ms per step, each part, and its share of the step."""
    parts = [*ROUND_PARTS, *(p for p in PASS_PARTS if "pass_ms" in result["rows"][0])]
    head = ["c", "tok/s", "step ms", *parts]
    lines = [head]
    for r in result["rows"]:
        cells = {**r["round_ms"], **r.get("pass_ms", {})}
        lines.append([str(r["concurrency"]), f"{r['tok_per_s']:.1f}", f"{r['step_ms']:.1f}",
                      *(f"{cells[p]:.1f} ({cells[p] / r['step_ms']:.0%})" for p in parts)])
    inside = " (the pass split into its parts after 'engine other')" if len(parts) > len(ROUND_PARTS) else ""
    return (f"plain decoding step on {result['backend']} ({result['precision']}), ms (share of the step){inside}\n"
            + aligned(lines))


def plot(result: dict[str, Any], path: Any) -> Any:
    """Stacked bars per concurrency: ms per generated token, split into the step's parts."""
    from specforge.plots import new_figure, save_figure

    rows = result["rows"]
    split = "pass_ms" in rows[0]
    parts = [p for p in ROUND_PARTS if not (split and p == "pass")] + (list(PASS_PARTS) if split else [])
    fig = new_figure(max(5.0, 1.2 * len(rows) + 3.0), 4.6)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"c={r['concurrency']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in parts:
        heights = [{**r["round_ms"], **r.get("pass_ms", {})}[part] / r["concurrency"] for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"a plain decoding step, part by part: {result['backend']} ({result['machine']['cpu']})", fontsize=9)
    ax.legend(fontsize=7, ncols=2)
    return save_figure(fig, path, dpi=120)


REPORT = Report("pass.json", table, files=lambda result, out: [plot(result, out / "pass.png")])


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", metavar="PRESET|FILE", help="pipeline without a drafter (default: greedy)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=16, help="decoding steps timed per concurrency")
    add_output_arguments(p, "runs/bench-pass")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """where a plain decoding step spends its time at each concurrency

    Greedy plain decoding of c requests with fixed-length random prompts; each step split into
    the target pass, sampling, commit and the engine's rest, and — on the torch backend — the pass
    into q/k/v, attention (with its cache write), output, gate/up and down projections, LM head
    and the rest (JSON, table, stacked bars).
    """
    return profile_plain_steps(args.config or ["greedy"], args.overrides, args.concurrency, args.context,
                               args.steps, progress=lambda line: print(line, file=sys.stderr, flush=True))


COMMAND = bench_command("pass", _arguments, _measure, REPORT)

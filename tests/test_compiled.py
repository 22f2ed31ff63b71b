"""The compiled forward (``target.compile``) against the eager one and the HF oracle.

One tiny Llama and one tiny Qwen3 (q/k norms) in float32, compiled once per module: inductor
fuses the elementwise work and reorders float reductions, so agreement is to float rounding, the
same tolerance as the eager runtime against Hugging Face.  Skipped where inductor has no C++
compiler (the compiled path then refuses to turn on, tested below).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import specforge.toolkit.compiled as compiled
from specforge.runtime.torch import compile_choice
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.passes import VarlenBatch
from specforge.runtime import TargetModel, load_target
from tiny_models import save_tiny

TOL = 1e-4

needs_compiler = pytest.mark.skipif(not compiled.compile_available(), reason="no C++ compiler for inductor")


_PAIRS: dict[str, tuple[TargetModel, TargetModel]] = {}


def make_pair(family: str, tmp_path_factory) -> tuple[TargetModel, TargetModel]:
    """(eager, compiled) targets of one tiny checkpoint, made once per module: every compiled
    graph costs seconds, so the tests share them."""
    if family not in _PAIRS:
        path = str(save_tiny(family, tmp_path_factory.mktemp(family)))
        _PAIRS[family] = load_target(path, dtype="float32", backend="torch"), load_target(path, dtype="float32", compile=True, backend="torch")
    return _PAIRS[family]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    return make_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_pair("llama", tmp_path_factory)


def run(target: TargetModel, pieces: list[list[list[int]]], slots: list[int], taps=()) -> list:
    """Feed successive varlen passes (one list of runs per pass) and collect every pass's output."""
    cache = target.new_cache(4, 128)
    starts = [0] * len(slots)
    outs = []
    for runs in pieces:
        batch = VarlenBatch.build(runs, slots, starts)
        outs.append(target.forward(batch, cache, logits_rows=torch.arange(batch.num_tokens), taps=taps))
        starts = [s + len(r) for s, r in zip(starts, runs)]
        for slot, s in zip(slots, starts):
            cache.advance(slot, s)
    return outs


@needs_compiler
def test_compiled_passes_match_eager_and_the_oracle(pair):
    eager, fast = pair
    assert fast.runtime.compiled is not None
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, eager.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 5)]
    # a prefill of three requests, then single tokens (the specialised N = 1 graph for one
    # request), then verify-sized runs of different lengths (the dynamic graph)
    passes = [[ids[0][:6], ids[1][:10], ids[2][:3]], [ids[0][6:7], ids[1][10:11], ids[2][3:4]],
              [ids[0][7:], ids[1][11:], ids[2][4:]]]
    for a, b in zip(run(eager, passes, [2, 0, 3], taps=(1,)), run(fast, passes, [2, 0, 3], taps=(1,))):
        assert torch.allclose(a.logits, b.logits, atol=TOL, rtol=1e-5), (a.logits - b.logits).abs().max()
        assert torch.allclose(a.taps[1], b.taps[1], atol=TOL) and set(b.taps) == {1}
    single = [[ids[0][:8]]] + [[[t]] for t in ids[0][8:]]
    logits = torch.cat([o.logits for o in run(fast, single, [1])])
    assert torch.allclose(logits, fast.reference_logits(ids[0]), atol=TOL, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_compiled_engine_greedy_parity(llama, drafter):
    eager, fast = llama
    host = PluginHost(autoload=False).load()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, eager.vocab_size, (5 + i,), generator=gen).tolist() * 3 for i in range(5)]

    parts = {} if drafter is None else dict(
        drafter=host.create_drafter(drafter, {"gamma": 4}), confidence=host.create_confidence("constant", {}),
        calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler("fixed", {}))

    def outputs(target):
        engine = Engine(target, host.create_verifier("greedy"), **parts,
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=20),
                        engine=EngineConfig(max_batch=3, max_context=128))
        return [o.token_ids for o in engine.generate(
            [GenerationRequest(prompt_ids=p, ignore_eos=True) for p in prompts])]

    assert outputs(fast) == outputs(eager)


@needs_compiler
def test_the_benchmark_labels_compiled_runs(llama):
    from specforge.bench.engine_bench import add_ratios, bench_engine_variant

    eager, fast = llama
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11]]
    recs = [bench_engine_variant(t, prompts, "plain", 2, 10, progress=False) for t in (eager, fast)]
    assert [r["system"] for r in recs] == ["specforge", "specforge-compiled"]
    add_ratios(recs)  # the compiled run divides by the eager plain run of the same concurrency
    assert recs[1]["vs_engine_ar"] == round(recs[1]["tok_s"] / recs[0]["tok_s"], 3)


@needs_compiler
def test_compiled_bfloat16_uses_the_packed_projections(tmp_path):
    # bf16 on CPU: the projections are oneDNN-packed and reached through specforge::linear,
    # which the compiler must not look into; same kernels, so the logits agree to bf16 rounding
    # of the fused elementwise work.
    path = str(save_tiny("llama", tmp_path / "m"))
    eager = load_target(path, dtype="bfloat16", backend="torch")
    if eager.runtime.layers[0].qkv_proj.packed is None:
        pytest.skip("no oneDNN packing in this torch build")
    fast = load_target(path, dtype="bfloat16", compile=True, backend="torch")
    ids = [torch.arange(3, 20).tolist(), [7], [9, 4, 4]]
    a = run(eager, [[ids[0]], [ids[1]], [ids[2]]], [0])
    b = run(fast, [[ids[0]], [ids[1]], [ids[2]]], [0])
    # several requests with short runs: the padded single-SDPA layout, traced into the graph
    runs = [[[3, 4, 5, 6], [8, 9], [10, 11, 12]], [[7], [1, 2], [4]], [[5], [6], [7]]]
    a += run(eager, runs, [2, 0, 1])
    b += run(fast, runs, [2, 0, 1])
    for x, y in zip(a, b):
        assert y.logits.dtype == torch.float32
        # inductor keeps the fused norms/rotary in float32 where eager rounds each op to bf16:
        # a few bf16 ulps of the logits apart
        assert (x.logits - y.logits).abs().max() <= 0.05 * x.logits.abs().max()
        assert (x.logits.argmax(-1) == y.logits.argmax(-1)).float().mean() >= 0.75


def test_no_compiler_keeps_the_eager_forward(tmp_path, monkeypatch):
    monkeypatch.setattr("specforge.runtime.torch.model.compile_available", lambda: False)
    path = str(save_tiny("llama", tmp_path / "m"))
    with pytest.warns(RuntimeWarning, match="C\\+\\+ compiler"):
        target = load_target(path, dtype="float32", compile=True, backend="torch")
    assert target.runtime.compiled is None
    ids = list(range(3, 20))
    out = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, 64), logits_rows=torch.arange(len(ids)))
    assert torch.allclose(out.logits, target.reference_logits(ids), atol=TOL, rtol=1e-5)


def test_a_compiler_failure_falls_back_to_eager_with_one_warning(tmp_path, monkeypatch):
    path = str(save_tiny("llama", tmp_path / "m"))
    target = load_target(path, dtype="float32", backend="torch")
    trunk = compiled.CompiledTrunk(target.runtime)
    error = compiled._COMPILE_ERRORS[0]

    def broken(*args):
        raise error.__new__(error)  # the compiler's own exception type, as inductor raises it

    trunk._compiled = lambda traced, taps: broken
    target.runtime.compiled = trunk
    ids = list(range(3, 20))
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, 64),
                             logits_rows=torch.arange(len(ids)))
    assert torch.allclose(out.logits, target.reference_logits(ids), atol=TOL, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second pass goes straight to eager, silently
        target.forward(VarlenBatch.build([ids[:4]], [0], [0]), target.new_cache(1, 64))


def test_the_pipeline_config_has_the_switch():
    from specforge.config import TargetConfig

    assert TargetConfig().compile is False
    assert TargetConfig(compile=True).compile is True
    assert TargetConfig(compile="auto").compile == "auto"
    with pytest.raises(ValueError, match="compile"):
        TargetConfig(compile="sometimes")


def _fake_clock(monkeypatch, compiled_seconds: float) -> list[str]:
    """Timings where eager takes 1 s and compiled ``compiled_seconds`` (the passes still run)."""
    timed = []

    def seconds(arms, reps, warmup):
        for arm in arms.values():
            arm()
        timed.append(sorted(arms))
        return {"eager": 1.0, "compiled": compiled_seconds}

    monkeypatch.setattr(compile_choice, "interleaved_seconds", seconds)
    return timed


@needs_compiler
@pytest.mark.slow  # compiles three pass shapes of the tiny model (~90 s on 2 cores)
def test_compile_auto_keeps_the_compiled_forward_only_where_it_measured_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(save_tiny("llama", tmp_path / "m"))
    timed = _fake_clock(monkeypatch, 0.8)
    monkeypatch.setattr(compile_choice, "MAX_COMPILE_SECONDS", float("inf"))  # a slow machine's build time
    lines = []
    target = load_target(path, dtype="float32", compile="auto", log=lines.append, backend="torch")
    assert len(timed) == len(compile_choice.PASSES)  # each decoding pass, eager against compiled
    assert target.compile_choice.compile and target.runtime.compiled is not None
    assert target.compile_choice.speedup == {name: 1.25 for name in compile_choice.PASSES}
    assert any(line.startswith("target compile (auto, measured") and "compiled" in line for line in lines)
    ids = list(range(3, 20))
    out = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, 64), logits_rows=torch.arange(len(ids)))
    assert torch.allclose(out.logits, target.reference_logits(ids), atol=TOL, rtol=1e-5)
    # the next load reads the verdict: no measurement, compiled straight away
    again = load_target(path, dtype="float32", compile="auto", log=lines.append, backend="torch")
    assert len(timed) == len(compile_choice.PASSES) and again.runtime.compiled is not None
    assert "[cached:" in lines[-1]


def test_compile_auto_keeps_compiled_only_at_a_measured_gain():
    assert compile_choice.verdict({"decode-1": 1.10, "decode-8": 1.02, "verify-8": 1.00}).compile  # mean 1.04
    slower = compile_choice.verdict({"decode-1": 1.06, "decode-8": 0.97, "verify-8": 1.0})  # mean 1.01
    assert not slower.compile and "1.01x" in slower.why
    # faster, but its graphs take longer to build than a command can earn back
    costly = compile_choice.verdict({"decode-1": 1.43, "decode-8": 1.14, "verify-8": 1.19}, compile_seconds=338)
    assert not costly.compile and "338 s" in costly.why


def test_compile_auto_without_a_compiler_runs_eagerly_and_never_tries_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("specforge.runtime.torch.model.compile_available", lambda: False)
    path = str(save_tiny("llama", tmp_path / "m"))
    lines = []
    with pytest.warns(RuntimeWarning, match="C\\+\\+ compiler"):
        target = load_target(path, dtype="float32", compile="auto", log=lines.append, backend="torch")
    assert target.runtime.compiled is None and not target.compile_choice.compile
    assert "no C++ compiler" in lines[-1]
    # the verdict is cached: the next load does not even try to compile
    calls = []
    monkeypatch.setattr(TargetModel, "compile", lambda self, enabled=True: calls.append(enabled) or False)
    again = load_target(path, dtype="float32", compile="auto", log=lines.append, backend="torch")
    assert calls == [] and again.runtime.compiled is None and "[cached:" in lines[-1]

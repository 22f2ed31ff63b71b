"""vLLM as a real client of what specforge trains (docs/interop.md): an EAGLE-3 drafter trained
here for the embedded SmolLM2, exported with ``specforge export --to vllm`` and served by vLLM's
CPU build as its speculative model.  Slow tier, and only where vLLM is installed (``make vllm``);
without it the bench refuses by name before writing anything."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specforge.peers.vllm_client import VllmNotInstalled, find_vllm_python
from specforge.bench.peer_drafter import passed, run_vllm_drafter, table
from specforge.peers.vllm_drafter import VllmDrafterSettings
from specforge.config import EngineConfig, load_pipeline
from specforge.engine import Engine, GenerationRequest
from specforge.errors import ConfigError
from specforge.evalsets import apply_chat_template, select_prompts
from specforge.features import compute_features
from specforge.runtime import TargetModel, load_target
from specforge.training.config import TrainConfig
from specforge.training.data import MemorySource
from specforge.training.trainer import Trainer
from specforge_plugins.drafters.eagle3 import eagle3_layers

PROMPTS, NEW = 2, 48


def _vllm_installed() -> bool:
    try:
        find_vllm_python()
    except VllmNotInstalled:
        return False
    return True


def test_the_bench_refuses_a_method_vllm_does_not_serve_and_a_missing_vllm_before_writing(tmp_path, monkeypatch):
    ngram = tmp_path / "ngram"
    ngram.mkdir()
    (ngram / "config.json").write_text('{"method": "ngram"}')
    with pytest.raises(ConfigError, match=r"a 'ngram' drafter; vLLM serves eagle3, medusa"):
        run_vllm_drafter(ngram, VllmDrafterSettings(), tmp_path / "out")
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text('{"method": "eagle3"}')
    monkeypatch.setenv("SPECFORGE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(VllmNotInstalled):
        run_vllm_drafter(eagle, VllmDrafterSettings(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _memorising_drafter(target: TargetModel, prompt_ids: list[list[int]], out: Path) -> Path:
    """An eagle3 drafter trained on the target's own greedy answers to the prompts it will serve,
    so that it is accepted often — the acceptance lengths compared are then far from 1."""
    plain = Engine.from_pipeline(replace(load_pipeline(["default"], ["target.dtype=float32"]),
                                         engine=EngineConfig(max_batch=1)), target)
    outs = plain.generate([GenerationRequest(prompt_ids=p, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
                           for p in prompt_ids])
    sequences = [(torch.tensor(p + o.token_ids), torch.tensor([0] * len(p) + [1] * len(o.token_ids)))
                 for p, o in zip(prompt_ids, outs)]
    layers = list(eagle3_layers(target.args.n_layers))
    source = MemorySource(compute_features(target, sequences * 4, layers), layers)
    config = TrainConfig.model_validate({
        "target": {"model": "smollm2", "dtype": "float32"},
        "drafter": {"name": "eagle3", "steps": 4},
        "optimizer": {"lr": 3e-3},
        "schedule": {"total_steps": 120, "warmup_steps": 5, "min_lr": 3e-4},
        "batch": {"sequences": 4, "anchors": 4},
        "device": "cpu",
        "output": {"dir": str(out), "checkpoint_interval": 1000, "progress": False},
    })
    trainer = Trainer(config, target=target, source=source, log=lambda _: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    return out / "drafter"


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_installed(), reason="vLLM's CPU build is not installed (make vllm)")
def test_vllm_serves_an_eagle3_drafter_trained_here_losslessly_and_accepts_as_much_as_we_do(tmp_path):
    target = load_target("smollm2", dtype="float32", backend="torch")
    prompt_ids = [apply_chat_template(target.tokenizer, p.text) for p in select_prompts("gsm8k", PROMPTS)]
    drafter = _memorising_drafter(target, prompt_ids, tmp_path / "train")
    settings = VllmDrafterSettings(datasets=("gsm8k",), prompts=PROMPTS, max_new_tokens=NEW, trials=1)
    result = run_vllm_drafter(drafter, settings, tmp_path / "out")
    print(table(result))  # pytest -s shows both systems side by side
    assert "peer_failed" not in result["checks"], result["checks"]
    assert result["specforge"]["acceptance_length"] > 1.5  # the drafter is accepted: the comparison means something
    assert passed(result), result["checks"]
    assert (tmp_path / "out" / "eagle3-vllm" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_installed(), reason="vLLM's CPU build is not installed (make vllm)")
def test_the_serving_benchmark_runs_vllm_plain_and_ngram_in_a_closed_loop_beside_plain_decoding():
    """`specforge bench serving`'s vLLM arms: at each R one vLLM engine with max_num_seqs = R decodes
    the same prompts as specforge's plain arm, every request to its full length, with per-request
    latencies from vLLM's timestamps and the ratio to specforge's plain decoding at that R."""
    from specforge.bench.serving import run_serving_benchmark, table

    result = run_serving_benchmark(["plain"], ("default",), concurrency=(1, 2), datasets=("gsm8k", "mbpp"), per_set=2,
                                   sharegpt=2, max_new_tokens=8, progress=lambda line: None)
    assert result["peers"] == {"vllm-ngram": "ok", "vllm-plain": "ok"} and result["peers_missing"] == {}
    for arm in ("vllm-plain", "vllm-ngram"):
        for r in (1, 2):
            rec = next(x for x in result["records"] if x["arm"] == arm and x["concurrency"] == r)
            assert rec["requests"] == result["prompts"] and rec["new_tokens"] == 8 * result["prompts"]
            assert rec["tok_s"] > 0 and rec["vs_plain"] > 0
            assert rec["ttft_s"]["p50"] > 0 and rec["itl_s"]["p90"] >= rec["itl_s"]["p50"] > 0
    assert "specforge plain ÷ vLLM CPU plain: R=1" in table(result)

"""Slow tier: the embedded SmolLM2-135M-Instruct, end to end, against HF transformers.

Greedy parity (fp32) on 20 prompts of the eval sets, at concurrency 1 and 8, with the ``ngram``
drafter and with a random drafter that makes rejections happen at every position.
"""

from __future__ import annotations

import pytest
import torch

import specforge_conformance.drafters as test_drafters
from specforge.evalsets import select_prompts
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel, load_target

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
SETS = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]


@pytest.fixture(scope="module")
def target():
    return load_target("smollm2", dtype="float32", backend="torch")


@pytest.fixture(scope="module")
def prompt_ids(target):
    return [target.encode(p.text) for p in select_prompts(SETS, 20)]


@pytest.fixture(scope="module")
def hf_outputs(target, prompt_ids):
    outs = []
    for ids in prompt_ids:
        # Plain greedy generate, stopping at EOS like the engine does (EOS kept in both).
        out = target.hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("drafter", [("ngram", {"gamma": 5}), ("random", {"gamma": 4})], ids=["ngram", "random"])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_parity_with_hf_generate(target, prompt_ids, hf_outputs, drafter, concurrency):
    host = PluginHost(autoload=False).load()
    host.add_plugin(test_drafters, "test-drafters")
    engine = Engine(
        target, host.create_verifier("rejection"),
        drafter=host.create_drafter(*drafter),
        confidence=host.create_confidence("constant", {}),
        calibrator=host.create_calibrator("identity", {}),
        scheduler=host.create_scheduler("fixed", {}),
        sampling=SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS),
        engine=EngineConfig(max_batch=concurrency, max_context=2048),
    )
    outs = engine.generate([GenerationRequest(prompt_ids=ids) for ids in prompt_ids])
    mismatches = [i for i, (o, ref) in enumerate(zip(outs, hf_outputs)) if o.token_ids != ref]
    assert not mismatches, f"prompts {mismatches} differ from HF generate"
    if drafter[0] == "random":
        assert sum(o.stats.verified - o.stats.accepted for o in outs) > 50


def test_generate_cli_streams_and_reports(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "specforge", "generate", "--prompt", "What is 2+2?",
         "sampling.temperature=0", "sampling.max_new_tokens=16", "drafter.name=ngram"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[stats] requests=1 failed=0" in result.stderr


def test_the_cached_gguf_conversion_is_the_same_checkpoint(tmp_path, monkeypatch):
    # The first float32 load writes the converted GGUF as safetensors + tokenizer; a later load
    # reads that instead of converting again.  It must be the same model, byte for byte, with the
    # same tokenizer, chat template and end-of-sequence ids.
    from specforge.model_files import _load, load_hf, resolve_model

    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path))
    direct, tok_direct = _load(*resolve_model("smollm2"), torch.float32)
    load_hf("smollm2")  # converts, writes the cache
    cached, tok_cached = load_hf("smollm2")  # reads it
    a, b = direct.state_dict(), cached.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    messages = [{"role": "user", "content": "Write a haiku about caches, in French. ∑ 🙂"}]
    assert tok_cached.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == \
        tok_direct.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert TargetModel(cached, tok_cached).eos_ids == TargetModel(direct, tok_direct).eos_ids

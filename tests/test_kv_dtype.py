"""The KV cache's dtype: chosen by measuring this CPU ("auto"), or forced; a float32 cache under a
bf16 model decodes what the bf16 cache does, to bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from specforge.config import load_pipeline
from specforge.errors import ConfigError
from specforge.passes import VarlenBatch
from specforge.runtime import TargetModel, load_target
from specforge.runtime.torch import kv_dtype as kv
from tiny_models import save_tiny


def test_forced_and_fixed_choices():
    shape = (4, 2, 16)
    assert kv.resolve_kv_dtype("model", torch.bfloat16, "cpu", *shape) == torch.bfloat16
    assert kv.resolve_kv_dtype("float32", torch.bfloat16, "cpu", *shape) == torch.float32
    # a float32 model's cache is float32 whatever is asked; CUDA keeps the model's dtype for the kernel
    assert kv.resolve_kv_dtype("model", torch.float32, "cpu", *shape) == torch.float32
    assert kv.resolve_kv_dtype("auto", torch.bfloat16, "cuda", *shape) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, model, float32; got 'fp8'"):
        kv.resolve_kv_dtype("fp8", torch.bfloat16, "cpu", *shape)


def test_auto_follows_the_measurement(monkeypatch):
    """float32 only for a clear win: a near tie keeps the model's dtype (half the bytes)."""
    def fake(seconds):
        return lambda dtype, *a, **k: {dtype: seconds, torch.float32: 1.0}

    for bf16_seconds, expected in ((5.0, torch.float32), (1.2, torch.bfloat16), (0.5, torch.bfloat16)):
        kv._measured_choice.cache_clear()
        monkeypatch.setattr(kv, "decode_attention_seconds", fake(bf16_seconds))
        assert kv.resolve_kv_dtype("auto", torch.bfloat16, "cpu", 4, 2, 16) == expected
    kv._measured_choice.cache_clear()


def test_the_measurement_times_both_dtypes():
    seconds = kv.decode_attention_seconds(torch.bfloat16, 4, 2, 16, keys=64, reps=4)
    assert set(seconds) == {torch.bfloat16, torch.float32} and all(s > 0 for s in seconds.values())


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("kv")))


def _decode(target: TargetModel, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill ``prompts`` in one pass, then ``steps`` decode passes of all of them together, each
    feeding a fixed token (teacher forcing: every cache dtype sees the same tokens); returns the
    logits of every decode pass ``[steps, R, V]``."""
    cache = target.new_cache(len(prompts), 128)
    slots = list(range(len(prompts)))
    target.forward(VarlenBatch.build(prompts, slots, [0] * len(prompts)), cache)
    lengths = [len(p) for p in prompts]
    for s, n in zip(slots, lengths):
        cache.advance(s, n)
    out = []
    for step in range(steps):
        batch = VarlenBatch.build([[5 + (7 * step + i) % 80] for i in range(len(prompts))], slots, lengths)
        out.append(target.forward(batch, cache, logits_rows=torch.arange(len(prompts))).logits)
        lengths = [n + 1 for n in lengths]
        for s, n in zip(slots, lengths):
            cache.advance(s, n)
    return torch.stack(out)


def test_a_float32_cache_under_a_bf16_model_decodes_alike(tiny_path):
    target = load_target(tiny_path, dtype="bfloat16", kv_dtype="model", backend="torch")
    assert target.new_cache(1, 8).k[0].dtype == torch.bfloat16
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 30)]
    bf16_logits = _decode(target, prompts, 6)
    target.runtime.kv_dtype = "float32"
    assert target.new_cache(1, 8).k[0].dtype == torch.float32
    f32_logits = _decode(target, prompts, 6)
    reference = load_target(tiny_path, dtype="float32", backend="torch")
    ref_logits = _decode(reference, prompts, 6)
    # the attention in float32 is the more precise one: no farther from the float32 model than bf16's
    err = lambda x: (x.softmax(-1) - ref_logits.softmax(-1)).abs().max().item()  # noqa: E731
    assert err(f32_logits) <= err(bf16_logits) + 0.02
    torch.testing.assert_close(f32_logits.softmax(-1), bf16_logits.softmax(-1), atol=0.05, rtol=0)


def test_the_pipeline_names_a_wrong_choice():
    with pytest.raises(ConfigError, match="target.kv_dtype"):
        load_pipeline([], sections={"target": {"kv_dtype": "float64"}})
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        load_target("smollm2", dtype="bfloat16", kv_dtype="float64", backend="torch")

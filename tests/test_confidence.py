"""Confidence estimators (pre-token) and the identity correction head."""

from __future__ import annotations

import math

import pytest
import torch

from specforge.components import ConfidenceEstimator, CorrectionHead, DraftBlock
from specforge.plugins import PluginHost
from specforge_plugins.confidence import (
    ConstantConfidence,
    ConstantConfig,
    EntropyConfidence,
    EntropyConfig,
)
from specforge_plugins.correction_heads import NoCorrection

R, G, V = 3, 4, 11


def block(seed: int = 0, **overrides) -> DraftBlock:
    gen = torch.Generator().manual_seed(seed)
    fields = {
        "tokens": torch.randint(0, V, (R, G), generator=gen),
        "lengths": torch.full((R,), G),
        "logits": 2 * torch.randn(R, G, V, generator=gen),
    }
    fields.update(overrides)
    return DraftBlock(**fields)


def test_entropy_never_reads_the_token_at_k():
    est = EntropyConfidence()
    base = block()
    c = est.estimate(base)
    for k in range(G):
        # Replace x_k and every later token: c_k (indeed every c) must not move.
        tokens = base.tokens.clone()
        tokens[:, k:] = (tokens[:, k:] + 1 + torch.arange(G - k)) % V
        assert torch.equal(est.estimate(block(tokens=tokens, logits=base.logits)), c)


def test_entropy_follows_the_distribution_at_its_own_slot():
    est = EntropyConfidence()
    base = block()
    c = est.estimate(base)
    for k in range(G):
        logits = base.logits.clone()
        logits[:, k] = torch.linspace(-3, 3, V)  # a different distribution at slot k only
        changed = est.estimate(block(tokens=base.tokens, logits=logits))
        assert not torch.equal(changed[:, k], c[:, k])
        others = [j for j in range(G) if j != k]
        assert torch.equal(changed[:, others], c[:, others])


def test_entropy_values_and_extremes():
    est = EntropyConfidence()
    c = est.estimate(block())
    assert c.shape == (R, G) and ((c > 0) & (c < 1)).all()
    uniform = est.estimate(block(logits=torch.zeros(R, G, V)))
    assert torch.allclose(uniform, torch.full((R, G), 1 / V))  # exp(−log V)
    one_hot = torch.full((R, G, V), -1e4)
    one_hot[..., 2] = 1e4
    peaked = est.estimate(block(logits=one_hot))
    assert (peaked > 0.99).all() and (peaked < 1).all()
    assert (uniform < c).all() and (c < peaked).all()


def test_entropy_scale_and_masked_vocabulary():
    logits = torch.zeros(R, G, V)
    logits[..., 5:] = -math.inf  # reduced vocabulary: 5 live entries
    c = EntropyConfidence(EntropyConfig(scale=2.0)).estimate(block(logits=logits))
    assert torch.allclose(c, torch.full((R, G), 5 ** -0.5))


def test_entropy_falls_back_to_probs():
    probs = torch.zeros(R, G, V)
    probs[..., 0] = 0.5
    probs[..., 1] = 0.5  # H = log 2 → c = ½
    c = EntropyConfidence().estimate(block(logits=None, probs=probs))
    assert torch.allclose(c, torch.full((R, G), 0.5))
    # logits win when both are present
    both = EntropyConfidence().estimate(block(logits=torch.zeros(R, G, V), probs=probs))
    assert torch.allclose(both, torch.full((R, G), 1 / V))


def test_entropy_without_a_distribution_is_an_error():
    with pytest.raises(ValueError, match="logits or block.probs"):
        EntropyConfidence().estimate(block(logits=None))


def test_constant():
    c = ConstantConfidence(ConstantConfig(value=0.3)).estimate(block())
    assert c.shape == (R, G) and (c == 0.3).all()
    assert (ConstantConfidence().estimate(block()) == 0.8).all()
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError):
            ConstantConfig(value=bad)
    with pytest.raises(ValueError):
        EntropyConfig(scale=0)


def test_none_head_is_the_identity():
    head = NoCorrection()
    state = head.init_state(R)
    assert state is None
    logits = torch.randn(R, V)
    out, state = head.step(logits, torch.zeros(R, dtype=torch.long), None, state)
    assert out is logits and state is None
    assert isinstance(head, CorrectionHead)


def test_registration_through_the_host():
    host = PluginHost().load()
    assert {"constant", "entropy"} <= set(host.names("confidence"))
    for name in ("constant", "entropy"):
        meta = host.get("confidence", name).metadata
        assert meta.pre_token is True and meta.trainable is False and meta.description
    est = host.create_confidence("entropy", {"scale": 0.5})
    assert isinstance(est, EntropyConfidence) and isinstance(est, ConfidenceEstimator)
    assert (host.create_confidence("constant", {"value": 0.6}).estimate(block()) == 0.6).all()
    with pytest.raises(ValueError):
        host.create_confidence("constant", {"valu": 0.6})
    assert "none" in host.names("correction_head")
    assert host.get("correction_head", "none").metadata.trainable is False
    assert isinstance(host.create_correction_head("none"), NoCorrection)

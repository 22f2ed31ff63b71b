"""The exact reference: an independent warp and the enumerated sequence law."""

from __future__ import annotations

import itertools

import pytest
import torch

from specforge.sampling import SamplingParams, warp
from specforge_conformance.exact import ReferenceSpec, exact_law, reference_target, reference_warp


@pytest.mark.parametrize(("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.6), (0.0, 0, 1.0)])
def test_reference_warp_agrees_with_the_engine_warp(t, k, p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 12, generator=gen, dtype=torch.float64) * 3
    logits[0, :4] = 2.0  # a tie: both sides must keep the lower ids first
    ours, margin = reference_warp(logits, t, k, p)
    theirs = warp(logits, SamplingParams.uniform(64, t, k, p))
    well = margin > 1e-9
    assert torch.allclose(ours[well], theirs[well], atol=1e-12)
    assert torch.allclose(ours.sum(-1), torch.ones(64, dtype=torch.float64))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_exact_law_is_the_product_of_next_token_laws(family):
    spec = ReferenceSpec(family, vocab=8, seed=3)
    prompt, t = (1, 2, 3), 0.9
    law = exact_law(spec, prompt, 2, t, top_k=5)
    assert law.probs.sum().item() == pytest.approx(1.0, abs=1e-12)
    target = reference_target(spec)
    for a, b in itertools.islice(itertools.product(range(8), repeat=2), 0, 64, 7):
        logits = target.reference_logits([*prompt, a]).double()
        p1, _ = reference_warp(logits[-2:-1], t, 5, 1.0)
        p2, _ = reference_warp(logits[-1:], t, 5, 1.0)
        expected = float(p1[0, a] * p2[0, b])
        assert law.probs[a * 8 + b].item() == pytest.approx(expected, rel=1e-4, abs=1e-9)


def test_cells_outside_top_k_are_impossible_and_cell_index_is_base_v():
    law = exact_law(ReferenceSpec("llama", 8, 0), (0, 1), 2, 1.0, top_k=2)
    assert int((law.probs > 0).sum()) <= 4
    assert law.index(torch.tensor([[3, 5], [0, 1]])).tolist() == [29, 1]


def test_reference_spec_refuses_what_it_cannot_enumerate():
    with pytest.raises(ValueError, match="8–32"):
        ReferenceSpec("llama", vocab=64)
    with pytest.raises(ValueError, match="unknown family"):
        ReferenceSpec("gpt2")
    with pytest.raises(ValueError, match="horizon"):
        exact_law(ReferenceSpec(), (1,), 5, 1.0)

"""specforge.sampling: warp against an independent reference, inverse-CDF sampling, uniforms."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specforge.sampling import (
    NonFiniteError,
    SamplingParams,
    check_logits,
    check_probs,
    draw_uniforms,
    sample_with_uniform,
    warp,
)

F64 = torch.float64


def reference_warp_row(logits: list[float], t: float, k: int, top_p: float) -> list[float]:
    """Straightforward warp of one row: temperature, top-k, top-p; ties to the lower id."""
    v = len(logits)
    if t == 0:
        best = min(range(v), key=lambda i: (-logits[i], i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    z = [x / t for x in logits]
    order = sorted(range(v), key=lambda i: (-z[i], i))
    if k > 0:
        order = order[:k]
    m = z[order[0]]
    weights = {i: math.exp(z[i] - m) for i in order}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1:
        kept, mass = [], 0.0
        for i in order:
            if kept and mass >= top_p:
                break
            kept.append(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(v)]


def _random_logits(gen: torch.Generator, rows: int, v: int) -> torch.Tensor:
    logits = torch.randn(rows, v, generator=gen, dtype=F64) * 2.0
    # A third of the rows get exact ties (half-integer grid), a few entries are masked (-inf).
    ties = torch.rand(rows, generator=gen) < 1 / 3
    logits[ties] = torch.round(logits[ties] * 2) / 2
    masked = torch.rand(rows, v, generator=gen) < 0.1
    masked[:, 0] = False  # keep a finite entry in every row
    return logits.masked_fill(masked, float("-inf"))


def test_warp_matches_reference_over_many_settings():
    gen = torch.Generator().manual_seed(1234)
    v = 9
    temperatures = [0.0, 0.25, 0.7, 1.0, 1.6, 4.0]
    top_ks = [0, 1, 2, 4, v - 1, v, v + 7]
    top_ps = [1.0, 0.99, 0.9, 0.6, 0.3, 1e-9]
    rows = list(itertools.product(temperatures, top_ks, top_ps))
    per_setting = 3  # a middle dimension: settings broadcast over positions
    logits = _random_logits(gen, len(rows) * per_setting, v).view(len(rows), per_setting, v)
    probs = warp(logits, SamplingParams.stack(rows))
    assert probs.dtype == F64
    for r, (t, k, top_p) in enumerate(rows):
        for j in range(per_setting):
            ref = torch.tensor(reference_warp_row(logits[r, j].tolist(), t, k, top_p), dtype=F64)
            assert torch.allclose(probs[r, j], ref, atol=1e-12, rtol=0), (t, k, top_p, j)


def test_warp_ties_go_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]], dtype=F64)
    assert warp(logits, SamplingParams.uniform(1, 0.0)).tolist() == [[0, 1, 0, 0, 0]]
    two = warp(logits, SamplingParams.uniform(1, 1.0, top_k=2))
    assert (two > 0).tolist() == [[False, True, True, False, False]]
    assert torch.allclose(two[0, 1], torch.tensor(0.5, dtype=F64))


def test_warp_edge_settings():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 6, generator=gen, dtype=F64)
    plain = warp(logits, SamplingParams.uniform(4, 1.0))
    assert torch.allclose(plain, torch.softmax(logits, -1), atol=1e-15)
    assert torch.equal(warp(logits, SamplingParams.uniform(4, 1.0, top_k=6)), plain)
    assert torch.equal(warp(logits, SamplingParams.uniform(4, 1.0, top_k=60)), plain)
    tiny = warp(logits, SamplingParams.uniform(4, 1.0, top_p=1e-12))
    assert torch.equal(tiny, torch.nn.functional.one_hot(logits.argmax(-1), 6).to(F64))


def test_top_p_one_keeps_the_far_tail():
    # The running sum before the tail rounds to exactly 1.0; top_p = 1 must still keep it.
    logits = torch.tensor([[50.0, 0.0, 0.0]], dtype=F64)
    probs = warp(logits, SamplingParams.uniform(1, 1.0, top_p=1.0))
    assert bool((probs > 0).all())


def test_warp_rejects_wrong_batch_size():
    with pytest.raises(ValueError, match="2 requests"):
        warp(torch.zeros(3, 4), SamplingParams.uniform(2))


def test_warp_garbage_row_stays_in_its_row():
    logits = torch.randn(2, 3, 5, dtype=F64)
    clean = warp(logits, SamplingParams.uniform(2, 0.8, top_k=3, top_p=0.9))
    logits[1, 2] = float("nan")
    dirty = warp(logits, SamplingParams.uniform(2, 0.8, top_k=3, top_p=0.9))
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1, :2], clean[1, :2])


def test_sample_never_returns_a_zero_probability_id():
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(500, 8, generator=gen, dtype=F64)
    probs[torch.rand(500, 8, generator=gen) < 0.5] = 0.0
    probs[torch.arange(500), torch.randint(0, 8, (500,), generator=gen)] = 0.3  # some mass
    cdf = torch.cumsum(probs, -1) / probs.sum(-1, keepdim=True)
    extremes = torch.tensor([0.0, 1e-300, 0.5, 1 - 2**-53], dtype=F64)
    # Uniforms landing exactly on CDF steps are where off-by-one errors would show.
    for u in [*extremes, *cdf.T]:
        ids = sample_with_uniform(probs, torch.as_tensor(u, dtype=F64).expand(500))
        assert bool((probs.gather(-1, ids.unsqueeze(-1)) > 0).all())
    low = sample_with_uniform(probs.float(), torch.full((500,), 1 - 2**-53, dtype=F64))
    assert bool((probs.gather(-1, low.unsqueeze(-1)) > 0).all())


def test_sample_stratified_grid_reproduces_probs():
    gen = torch.Generator().manual_seed(11)
    probs = torch.rand(5, 7, generator=gen, dtype=F64) ** 3
    probs[:, 2] = 0.0
    probs[0, -1] = 0.0
    probs[1] *= 3.7  # unnormalised rows are sampled in proportion
    n = 20000
    u = (torch.arange(n, dtype=F64) + 0.5) / n
    ids = sample_with_uniform(probs.expand(n, 5, 7), u.unsqueeze(1).expand(n, 5))
    counts = torch.nn.functional.one_hot(ids, 7).sum(0).to(F64) / n
    expected = probs / probs.sum(-1, keepdim=True)
    assert (counts - expected).abs().max() <= 1 / n + 1e-12


def test_sample_uses_the_full_precision_of_the_uniform():
    probs = torch.full((1, 4), 0.25, dtype=torch.float32)
    # In float32 this uniform would round to 0.25 and land on id 1.
    u = torch.tensor([0.25 - 1e-12], dtype=F64)
    assert sample_with_uniform(probs, u).tolist() == [0]


def test_draw_uniforms_per_request_streams():
    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    batch = gens([5, 6, 7])
    first, second = draw_uniforms(batch, 4), draw_uniforms(batch, 4)
    assert first.shape == (3, 4, 2) and first.dtype == F64
    assert bool(((first >= 0) & (first < 1)).all())
    alone = gens([6])
    assert torch.equal(draw_uniforms(alone, 4)[0], first[1])
    assert torch.equal(draw_uniforms(alone, 4)[0], second[1])
    other = gens([99, 6])  # different batch-mates, different order
    assert torch.equal(draw_uniforms(other, 4)[1], first[1])
    assert not torch.equal(first[0], first[1])
    assert draw_uniforms([], 3).shape == (0, 3, 2)


def test_check_logits_names_request_and_position():
    logits = torch.zeros(3, 4, 5)
    logits[:, :, 1] = float("-inf")  # masked tokens are fine
    check_logits(logits)
    logits[2, 1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="request 2, position 1"):
        check_logits(logits)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[2, 1] = False
    check_logits(logits, valid)
    logits[0, 3] = float("-inf")
    with pytest.raises(NonFiniteError, match="request 0, position 3"):
        check_logits(logits, valid)
    logits[0, 3] = 0.0
    logits[1, 0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="request 1, position 0"):
        check_logits(logits, valid)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_check_probs_names_request_and_position(bad):
    probs = torch.full((2, 3, 4), 0.25, dtype=F64)
    probs[1, 2, 0] = bad
    with pytest.raises(NonFiniteError, match="request 1, position 2"):
        check_probs(probs, what="draft probabilities")
    valid = torch.ones(2, 3, dtype=torch.bool)
    valid[1, 2] = False
    check_probs(probs, valid)


def test_sampling_params_validate_names_request():
    SamplingParams.stack([(0.0, 0, 1.0), (1.0, 5, 0.5)]).validate()
    for rows, field in [
        ([(1.0, 0, 1.0), (-1.0, 0, 1.0)], "temperature"),
        ([(1.0, -2, 1.0), (1.0, 0, 1.0)], "top_k"),
        ([(1.0, 0, 1.0), (1.0, 0, 0.0)], "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams.stack(rows).validate()


def test_half_precision_logits_are_warped_in_float32():
    logits = torch.randn(2, 3, 50).to(torch.bfloat16)
    params = SamplingParams.uniform(2, temperature=0.7, top_p=0.9)
    probs = warp(logits, params)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, warp(logits.float(), params))

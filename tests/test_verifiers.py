"""The shipped verifiers: exact per-position laws, the batched verify path, and the edge cases of
docs/design/verification.md."""

from __future__ import annotations

import pytest
import torch

from specforge.components import Verifier
from specforge.plugins import PluginHost
from specforge.sampling import NonFiniteError, SamplingParams, sample_with_uniform, warp
from specforge_plugins.verifiers import (
    GreedyVerifier,
    MatchVerifier,
    RejectionVerifier,
    TypicalConfig,
    TypicalVerifier,
)

F64 = torch.float64
LOSSLESS = {"rejection": RejectionVerifier(), "match": MatchVerifier()}
ALL = {**LOSSLESS, "typical": TypicalVerifier(), "greedy": GreedyVerifier()}
# (temperature, top_k, top_p) settings, one per request of a batch.
SETTINGS = [
    (1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0),
    (1.0, 0, 0.8), (0.8, 4, 0.9), (2.5, 2, 0.6), (1.0, 1, 1.0), (0.0, 0, 1.0),
]


def randn(gen: torch.Generator, *shape: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


def mixture(verifier, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_x q(x)·[a(x)·e_x + (1 − a(x))·r_x]: the exact law of the emitted token, ``[..., V]``."""
    v = p.shape[-1]
    rows = p.shape[:-1]
    pp = p.unsqueeze(-2).expand(*rows, v, v)  # one copy per candidate draft x
    qq = q.unsqueeze(-2).expand(*rows, v, v)
    x = torch.arange(v).expand(*rows, v)
    a = verifier.accept_probability(pp, qq, x).unsqueeze(-1)
    r = verifier.residual(pp, qq, x)
    law = a * torch.eye(v, dtype=p.dtype) + (1 - a) * r
    return (q.unsqueeze(-1) * law).sum(-2)


def sampling_for(name: str, r: int) -> SamplingParams:
    """Per-request settings cycling through SETTINGS; temperature 0 for the greedy verifier."""
    rows = [SETTINGS[i % len(SETTINGS)] for i in range(r)]
    if name == "greedy":
        rows = [(0.0, k, p) for _, k, p in rows]
    return SamplingParams.stack(rows)


# --- exact enumeration of the per-position law ---------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSLESS))
@pytest.mark.parametrize("v", [6, 9, 12])
def test_lossless_identity_at_every_position_and_setting(name, v):
    verifier = LOSSLESS[name]
    gen = torch.Generator().manual_seed(v)
    sampling = SamplingParams.stack(SETTINGS)
    r, g = len(SETTINGS), 4
    p = warp(randn(gen, r, g, v), sampling)
    drafts = {
        "same settings": warp(randn(gen, r, g, v), sampling),
        "other temperature": warp(randn(gen, r, g, v), SamplingParams.uniform(r, 1.3, top_k=5)),
        "random with holes": (torch.rand(r, g, v, generator=gen, dtype=F64) ** 4)
        .masked_fill(torch.rand(r, g, v, generator=gen) < 0.3, 0.0),
    }
    for what, q in drafts.items():
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-300)
        q[q.sum(-1) == 0] = 1.0 / v
        assert (mixture(verifier, p, q) - p).abs().max() < 1e-9, what
    if name == "rejection":  # the residual does not depend on x: q·a + (1 − Σ q·a)·r = p
        q = drafts["same settings"]
        x = torch.zeros(r, g, dtype=torch.long)
        qa = q * verifier.accept_probability(p.unsqueeze(-2), q.unsqueeze(-2),
                                             torch.arange(v).expand(r, g, v))
        r_law = verifier.residual(p, q, x)
        assert (qa + (1 - qa.sum(-1, keepdim=True)) * r_law - p).abs().max() < 1e-9


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_one_hot_draft_is_exact_for_every_token(name):
    # Deterministic drafters pass q = None: each x on its own must reproduce p.
    verifier = LOSSLESS[name]
    gen = torch.Generator().manual_seed(5)
    p = warp(randn(gen, len(SETTINGS), 8), SamplingParams.stack(SETTINGS))
    for x in range(8):
        xs = torch.full((len(SETTINGS),), x)
        a = verifier.accept_probability(p, None, xs).unsqueeze(-1)
        e_x = torch.nn.functional.one_hot(xs, 8).to(F64)
        law = a * e_x + (1 - a) * verifier.residual(p, None, xs)
        assert (law - p).abs().max() < 1e-12


def test_greedy_identity_at_temperature_zero():
    gen = torch.Generator().manual_seed(8)
    p = warp(randn(gen, 5, 3, 7), SamplingParams.uniform(5, 0.0))
    q = torch.softmax(randn(gen, 5, 3, 7), -1)
    assert (mixture(GreedyVerifier(), p, q) - p).abs().max() < 1e-12


def test_typical_is_lossy():
    verifier = TypicalVerifier()
    gen = torch.Generator().manual_seed(9)
    sampling = SamplingParams.stack(SETTINGS[:-1])
    p = warp(randn(gen, len(SETTINGS) - 1, 3, 8), sampling)
    q = warp(randn(gen, len(SETTINGS) - 1, 3, 8), sampling)
    assert (mixture(verifier, p, q) - p).abs().sum(-1).max() > 0.2
    # Hand-made case: the draft always proposes a plausible minority token and it always sticks.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.0, 0.0, 1.0], dtype=F64)
    assert torch.allclose(mixture(verifier, p, q), q)


def test_typical_threshold():
    verifier = TypicalVerifier(TypicalConfig())
    uniform4 = torch.full((4,), 0.25, dtype=F64)  # H = ln 4: threshold = 0.3 / 4 = 0.075
    assert torch.allclose(verifier.threshold(uniform4), torch.tensor(0.075, dtype=F64))
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01], dtype=F64)  # low entropy: ε = 0.09 binds
    assert torch.allclose(verifier.threshold(peaked), torch.tensor(0.09, dtype=F64))
    x = torch.tensor(1)
    assert verifier.accept_probability(peaked, None, x) == 0
    assert verifier.accept_probability(uniform4, None, x) == 1
    strict = TypicalVerifier(TypicalConfig(epsilon=0.5, delta=2.0))
    assert strict.accept_probability(uniform4, None, x) == 0


def _three_token_law(verifier, p1, p2, p3, q1, q2):
    """Exact law of the first three tokens after one γ=2 round, then plain target sampling.

    p2[t1], p3[t1, t2] are the target's conditionals; q2[x1] the drafter's.  Rejecting at the
    first position emits t1 ~ r1 and the next rounds sample the target; rejecting at the second
    emits t2 ~ r2; accepting both emits the bonus t3 ~ p3[x1, x2] (row ℓ = 2).
    """
    v = p1.shape[0]
    e = torch.eye(v, dtype=F64)
    law = torch.zeros(v, v, v, dtype=F64)
    after_t1 = p2.unsqueeze(-1) * p3  # [t1, t2, t3] law of (t2, t3) given t1
    for x1 in range(v):
        a1 = verifier.accept_probability(p1, q1, torch.tensor(x1))
        r1 = verifier.residual(p1, q1, torch.tensor(x1))
        law += q1[x1] * (1 - a1) * r1.view(v, 1, 1) * after_t1
        for x2 in range(v):
            a2 = verifier.accept_probability(p2[x1], q2[x1], torch.tensor(x2))
            r2 = verifier.residual(p2[x1], q2[x1], torch.tensor(x2))
            w = q1[x1] * a1 * q2[x1, x2]
            law[x1] += w * a2 * e[x2].unsqueeze(-1) * p3[x1, x2]
            law[x1] += w * (1 - a2) * r2.unsqueeze(-1) * p3[x1]
    return law


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 3, 0.9), (1.5, 0, 0.7)])
def test_two_position_block_joint_law(setting):
    gen = torch.Generator().manual_seed(21)
    v = 6
    s = SamplingParams.uniform(1, *setting)

    def w(*shape):
        return warp(randn(gen, *shape).unsqueeze(0), s).squeeze(0)

    p1, p2, p3 = w(v), w(v, v), w(v, v, v)  # the target's law depends on the earlier tokens
    q1, q2 = w(v), w(v, v)
    target = p1.view(v, 1, 1) * p2.unsqueeze(-1) * p3
    for name, verifier in LOSSLESS.items():
        got = _three_token_law(verifier, p1, p2, p3, q1, q2)
        assert (got - target).abs().max() < 1e-9, name
    lossy = _three_token_law(TypicalVerifier(), p1, p2, p3, q1, q2)
    assert (lossy - target).abs().sum() > 0.05


# --- the batched verify path realises the white-box law ------------------------------------


def _grid_uniforms(name: str, m: int) -> torch.Tensor:
    """``[m·m, 2, 2]`` uniforms of a ℓ = 1 block laid out on a stratified m×m grid (s, w).

    Only one sampling uniform is ever used by rejection/typical/greedy, so rows 0 and 1 share w;
    match draws y at both rows, so s drives row 0 and w the bonus row.
    """
    axis = (torch.arange(m, dtype=F64) + 0.5) / m
    s, w = (t.reshape(-1) for t in torch.meshgrid(axis, axis, indexing="ij"))
    u = torch.empty(m * m, 2, 2, dtype=F64)
    u[:, 0, 0], u[:, 1, 0] = s, 0.5
    u[:, 0, 1], u[:, 1, 1] = (s, w) if name == "match" else (w, w)
    return u


@pytest.mark.parametrize("name", sorted(ALL))
def test_verify_grid_law_matches_primitives(name):
    verifier, v, m = ALL[name], 6, 100
    gen = torch.Generator().manual_seed(31)
    setting = (0.0, 0, 1.0) if name == "greedy" else (0.9, 5, 0.95)
    logits = randn(gen, 1, 2, v)
    logits[0, 1] = randn(gen, v, scale=3.0)  # a bonus row clearly unlike row 0
    one = SamplingParams.uniform(1, *setting)
    p = warp(logits, one)[0]
    q = warp(randn(gen, 1, 1, v), one)[0, 0]
    q = torch.where(q > 0, q, torch.full_like(q, 1e-3))  # every x has a chance to be proposed
    q = q / q.sum()
    u = _grid_uniforms(name, m)
    n_grid = u.shape[0]
    # One batch for all V draft ids: request i·n_grid + j has draft id i and grid point j.
    xs = torch.arange(v).repeat_interleave(n_grid).unsqueeze(1)
    out = verifier.verify(logits.expand(v * n_grid, 2, v), xs, q.expand(v * n_grid, 1, v),
                          torch.ones(v * n_grid, dtype=torch.long),
                          SamplingParams.uniform(v * n_grid, *setting), u.repeat(v, 1, 1))
    assert out.num_accepted.dtype == torch.long and out.next_token.dtype == torch.long
    cell = (xs.squeeze(1) * 2 + out.num_accepted) * v + out.next_token
    empirical = torch.bincount(cell, minlength=2 * v * v).to(F64).view(v, 2, v) / n_grid
    for x in range(v):
        a = verifier.accept_probability(p[0], q, torch.tensor(x))
        exact = torch.stack([(1 - a) * verifier.residual(p[0], q, torch.tensor(x)), a * p[1]])
        assert (empirical[x] - exact).abs().max() <= 2 / m + 1 / m**2, (name, x)


def _loop_reference(name, verifier, p, q, x, lengths, u):
    """Request by request, position by position, straight from docs/design/verification.md."""
    out = []
    for r in range(p.shape[0]):
        result = None
        for k in range(int(lengths[r])):
            qk = None if q is None else q[r, k]
            if name == "match":
                y = int(sample_with_uniform(p[r, k], u[r, k, 1]))
                if y != int(x[r, k]):
                    result = (k, y)
            else:
                px = p[r, k, x[r, k]]
                qx = 1.0 if qk is None else q[r, k, x[r, k]]
                accept = (u[r, k, 0] * qx < px) if name == "rejection" else (
                    u[r, k, 0] < verifier.accept_probability(p[r, k], qk, x[r, k]))
                if not accept:
                    law = verifier.residual(p[r, k], qk, x[r, k])
                    result = (k, int(sample_with_uniform(law, u[r, k, 1])))
            if result is not None:
                break
        if result is None:
            ell = int(lengths[r])
            result = (ell, int(sample_with_uniform(p[r, ell], u[r, ell, 1])))
        out.append(result)
    return out


def _random_round(seed: int, r: int = 9, g: int = 5, v: int = 10, one_hot: bool = False,
                  name: str = "rejection"):
    gen = torch.Generator().manual_seed(seed)
    sampling = sampling_for(name, r)
    logits = randn(gen, r, g + 1, v)
    q = warp(randn(gen, r, g, v) + logits[:, :g], sampling)  # a drafter close to the target
    x = sample_with_uniform(q, torch.rand(r, g, generator=gen, dtype=F64))
    lengths = torch.randint(0, g + 1, (r,), generator=gen)
    lengths[:2] = torch.tensor([0, g])
    u = torch.rand(r, g + 1, 2, generator=gen, dtype=F64)
    return logits, x, (None if one_hot else q), lengths, sampling, u


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_equals_the_loop_reference(name, one_hot):
    verifier = ALL[name]
    for seed in range(6):
        logits, x, q, lengths, sampling, u = _random_round(seed, one_hot=one_hot, name=name)
        out = verifier.verify(logits, x, q, lengths, sampling, u)
        ref = _loop_reference(name, verifier, warp(logits, sampling), q, x, lengths, u)
        assert list(zip(out.num_accepted.tolist(), out.next_token.tolist())) == ref, seed
        assert bool((out.num_accepted <= lengths).all())


def test_rejection_decides_with_u_times_q_below_p():
    # A uniform a hair below / above the acceptance probability flips the decision.
    gen = torch.Generator().manual_seed(40)
    v, g = 6, 3
    logits = randn(gen, 1, g + 1, v, scale=1.0)
    sampling = SamplingParams.uniform(1, 1.0)
    p = warp(logits, sampling)
    q = torch.softmax(randn(gen, 1, g, v, scale=1.0), -1)
    verifier = RejectionVerifier()
    a = verifier.accept_probability(p[:, 1].expand(v, v), q[:, 1].expand(v, v), torch.arange(v))
    x1 = int(((a - 0.5).abs()).argmin())
    assert 0.05 < float(a[x1]) < 0.95
    x = torch.tensor([[0, x1, 0]])
    u = torch.zeros(1, g + 1, 2, dtype=F64)  # u = 0 accepts wherever p(x) > 0
    for delta, expected in [(-1e-9, 3), (1e-9, 1)]:
        u[0, 1, 0] = a[x1] + delta
        out = verifier.verify(logits, x, q, torch.tensor([g]), sampling, u)
        assert int(out.num_accepted) == expected
        assert bool(u[0, 1, 0] * q[0, 1, x1] < p[0, 1, x1]) == (expected == 3)


@pytest.mark.parametrize("name", sorted(ALL))
def test_bonus_token_comes_from_row_ell(name):
    verifier, v, g, m = ALL[name], 7, 3, 1000
    gen = torch.Generator().manual_seed(50)
    temperature = 0.0 if name == "greedy" else 1.0
    x = torch.tensor([1, 4, 2])
    # Row j ≠ ℓ is one-hot on x_j (certain acceptance); every row's law is far from the others.
    rows = randn(gen, g + 1, v, scale=1.0)
    rows[torch.arange(g + 1), torch.tensor([5, 6, 0, 3])] += 4.0
    forced = torch.full((g, v), float("-inf"), dtype=F64)
    forced[torch.arange(g), x] = 0.0
    grid = (torch.arange(m, dtype=F64) + 0.5) / m
    for ell in range(g + 1):
        logits = rows.clone()
        logits[:ell] = forced[:ell]
        laws = warp(logits.unsqueeze(0), SamplingParams.uniform(1, temperature))[0]
        u = grid.view(m, 1, 1).expand(m, g + 1, 2).contiguous()
        out = verifier.verify(logits.expand(m, g + 1, v), x.expand(m, g), None,
                              torch.full((m,), ell), SamplingParams.uniform(m, temperature), u)
        assert bool((out.num_accepted == ell).all())
        freq = torch.bincount(out.next_token, minlength=v).to(F64) / m
        assert (freq - laws[ell]).abs().max() <= 1 / m + 1e-12
        for j in range(g + 1):
            if j != ell:  # a wrong row would be caught
                assert (laws[j] - laws[ell]).abs().max() > 10 / m


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("one_hot", [False, True])
def test_batch_equals_each_request_alone(name, one_hot):
    verifier = ALL[name]
    logits, x, q, lengths, sampling, u = _random_round(60, one_hot=one_hot, name=name)
    clean = verifier.verify(logits, x, q, lengths, sampling, u)
    # Garbage past ℓ_r: NaN logits and draft probs, ids outside the vocabulary.
    g = x.shape[1]
    unused_rows = torch.arange(g + 1) > lengths.unsqueeze(1)
    unused_slots = torch.arange(g) >= lengths.unsqueeze(1)
    logits = logits.masked_fill(unused_rows.unsqueeze(-1), float("nan"))
    x = x.masked_fill(unused_slots, -7)
    if q is not None:
        q = q.masked_fill(unused_slots.unsqueeze(-1), float("nan"))
    out = verifier.verify(logits, x, q, lengths, sampling, u)
    assert torch.equal(out.num_accepted, clean.num_accepted)
    assert torch.equal(out.next_token, clean.next_token)
    for r in range(x.shape[0]):
        ell = int(lengths[r])
        alone = verifier.verify(
            logits[r : r + 1, : ell + 1], x[r : r + 1, :ell],
            None if q is None else q[r : r + 1, :ell], lengths[r : r + 1],
            SamplingParams(sampling.temperature[r : r + 1], sampling.top_k[r : r + 1],
                           sampling.top_p[r : r + 1]),
            u[r : r + 1, : ell + 1])
        assert int(alone.num_accepted) == int(out.num_accepted[r])
        assert int(alone.next_token) == int(out.next_token[r])


# --- edge cases (docs/design/verification.md) ----------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_q_equal_p_accepts_everything(dtype):
    gen = torch.Generator().manual_seed(70)
    r, g, v = 4, 4, 8
    sampling = SamplingParams.uniform(r, 0.9, top_k=6)
    logits = randn(gen, r, g + 1, v).to(dtype)
    p = warp(logits, sampling)
    x = sample_with_uniform(p[:, :g], torch.rand(r, g, generator=gen, dtype=F64))
    u = torch.full((r, g + 1, 2), 1 - 2**-53, dtype=F64)  # the largest uniform below 1
    out = RejectionVerifier().verify(logits, x, p[:, :g], torch.full((r,), g), sampling, u)
    assert bool((out.num_accepted == g).all())
    residual = RejectionVerifier().residual(p, p, torch.zeros(r, g + 1, dtype=torch.long))
    assert torch.equal(residual, p)  # zero mass falls back to p, finite


def test_one_hot_target():
    v = 6
    logits = torch.full((2, 3, v), float("-inf"), dtype=F64)
    logits[..., 4] = 0.0  # p = e_4 at every row
    gen = torch.Generator().manual_seed(75)
    q = torch.softmax(randn(gen, 2, 2, v), -1)
    x = torch.tensor([[4, 4], [4, 1]])
    u = torch.rand(2, 3, 2, generator=gen, dtype=F64)
    for name, verifier in LOSSLESS.items():
        out = verifier.verify(logits, x, q, torch.tensor([2, 2]), SamplingParams.uniform(2), u)
        assert out.num_accepted.tolist() == [2, 1], name
        assert out.next_token.tolist() == [4, 4], name


def test_disjoint_supports():
    v = 6
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0], dtype=F64)
    q = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5], dtype=F64)
    verifier = RejectionVerifier()
    for x in (3, 4, 5):
        assert verifier.accept_probability(p, q, torch.tensor(x)) == 0
        assert torch.allclose(verifier.residual(p, q, torch.tensor(x)), p)
    m = 1000
    logits = p.log().expand(m, 2, v).contiguous()
    u = ((torch.arange(m, dtype=F64) + 0.5) / m).view(m, 1, 1).expand(m, 2, 2).contiguous()
    out = verifier.verify(logits, torch.full((m, 1), 5), q.expand(m, 1, v),
                          torch.ones(m, dtype=torch.long), SamplingParams.uniform(m), u)
    assert bool((out.num_accepted == 0).all())
    freq = torch.bincount(out.next_token, minlength=v).to(F64) / m
    assert (freq - p).abs().max() <= 1 / m + 1e-12


@pytest.mark.parametrize("name", ["rejection", "match", "typical"])
def test_temperature_zero_reduces_to_greedy(name):
    for seed in range(5):
        logits, x, q, lengths, _, u = _random_round(80 + seed)
        sampling = SamplingParams.uniform(x.shape[0], 0.0)
        # Let the draft often agree with the arg-max so that long prefixes are exercised.
        agree = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < 0.7
        x = torch.where(agree, logits[:, :-1].argmax(-1), x)
        got = ALL[name].verify(logits, x, q, lengths, sampling, u)
        want = GreedyVerifier().verify(logits, x, q, lengths, sampling, u)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.next_token, want.next_token)
        if name == "rejection":  # its T = 0 shortcut against its own laws, built and sampled
            from specforge.toolkit.verification import BaseVerifier, prepare

            laws = BaseVerifier._verify(ALL[name], prepare(logits, x, q, lengths, sampling, u), sampling)
            assert torch.equal(laws.num_accepted, want.num_accepted) and torch.equal(laws.next_token, want.next_token)


def test_greedy_on_crafted_inputs():
    logits = torch.tensor([
        [[0, 5, 1, 0], [2, 0, 0, 9], [1, 1, 1, 0], [0, 0, 7, 0]],  # arg-max 1, 3, 0 (tie), 2
    ], dtype=F64).expand(5, 4, 4)
    x = torch.tensor([[1, 3, 0], [1, 3, 0], [1, 2, 0], [2, 3, 0], [1, 3, 1]])
    lengths = torch.tensor([3, 2, 3, 3, 0])
    out = GreedyVerifier().verify(logits, x, None, lengths, SamplingParams.uniform(5, 0.0),
                                  torch.full((5, 4, 2), 0.5, dtype=F64))
    assert out.num_accepted.tolist() == [3, 2, 1, 0, 0]
    assert out.next_token.tolist() == [2, 0, 3, 1, 1]


def test_greedy_refuses_a_positive_temperature():
    sampling = SamplingParams.stack([(0.0, 0, 1.0), (0.7, 0, 1.0)])
    with pytest.raises(ValueError, match="request 1.*temperature 0"):
        GreedyVerifier().verify(torch.zeros(2, 2, 5), torch.zeros(2, 1, dtype=torch.long), None,
                                torch.ones(2, dtype=torch.long), sampling,
                                torch.rand(2, 2, 2, dtype=F64))


def test_per_request_settings_in_one_batch():
    # Same logits, drafts and uniforms in every request; only the settings differ.  top_k = 1,
    # T = 0 and a tiny top_p are all greedy; T = 1 next to them must not be.
    gen = torch.Generator().manual_seed(90)
    v, g = 8, 3
    logits = randn(gen, 1, g + 1, v, scale=0.5).expand(4, g + 1, v)
    x = torch.tensor([[1, 2, 3]]).expand(4, g)
    u = torch.rand(1, g + 1, 2, generator=gen, dtype=F64).expand(4, g + 1, 2)
    lengths = torch.full((4,), g)
    sampling = SamplingParams.stack([(1.0, 1, 1.0), (0.0, 0, 1.0), (1.0, 0, 1e-9), (1.0, 0, 1.0)])
    greedy = GreedyVerifier().verify(logits[:1], x[:1], None, lengths[:1],
                                     SamplingParams.uniform(1, 0.0), u[:1])
    for name, verifier in LOSSLESS.items():
        out = verifier.verify(logits, x, None, lengths, sampling, u)
        assert out.num_accepted[:3].tolist() == greedy.num_accepted.tolist() * 3, name
        assert out.next_token[:3].tolist() == greedy.next_token.tolist() * 3, name
        hot = verifier.verify(logits[:1], x[:1], None, lengths[:1], SamplingParams.uniform(1),
                              u[:1])
        assert (int(out.num_accepted[3]), int(out.next_token[3])) == (
            int(hot.num_accepted), int(hot.next_token))


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_used_rows_raise(name, bad):
    verifier = ALL[name]
    logits, x, q, _, sampling, u = _random_round(100, name=name)
    lengths = torch.tensor([2, 5, 1, 3, 0, 4, 2, 1, 5])
    broken = logits.clone()
    broken[3, 3, 2] = bad  # row ℓ = 3 of request 3: the bonus row is used
    with pytest.raises(NonFiniteError, match="request 3, position 3"):
        verifier.verify(broken, x, q, lengths, sampling, u)
    broken = logits.clone()
    broken[3, 4] = bad  # past ℓ: ignored
    broken[4, 1:] = bad
    verifier.verify(broken, x, q, lengths, sampling, u)
    for entry in (bad, -0.5):
        probs = q.clone()
        probs[5, 2, 0] = entry
        with pytest.raises(NonFiniteError, match="request 5, position 2"):
            verifier.verify(logits, x, probs, lengths, sampling, u)


def test_bad_draft_ids_and_lengths_are_named():
    logits, x, q, _, sampling, u = _random_round(110)
    lengths = torch.full((9,), 5)
    bad = x.clone()
    bad[1, 2] = 10  # V = 10
    for name, verifier in ALL.items():
        with pytest.raises(ValueError, match="request 1, position 2: draft token 10"):
            verifier.verify(logits, bad, q, lengths, sampling_for(name, 9), u)
    with pytest.raises(ValueError, match="request 0: length 6"):
        RejectionVerifier().verify(logits, x, q, torch.tensor([6] + [1] * 8), sampling, u)
    with pytest.raises(ValueError, match="uniforms"):
        RejectionVerifier().verify(logits, x, q, lengths, sampling, u[:, :3])


def test_empty_block_emits_from_row_zero():
    gen = torch.Generator().manual_seed(120)
    logits = randn(gen, 3, 1, 5)
    u = torch.rand(3, 1, 2, generator=gen, dtype=F64)
    for name, verifier in ALL.items():
        sampling = sampling_for(name, 3)
        out = verifier.verify(logits, torch.zeros(3, 0, dtype=torch.long), None,
                              torch.zeros(3, dtype=torch.long), sampling, u)
        assert out.num_accepted.tolist() == [0, 0, 0]
        want = sample_with_uniform(warp(logits, sampling)[:, 0], u[:, 0, 1])
        assert torch.equal(out.next_token, want), name


# --- registration --------------------------------------------------------------------------


def test_registered_through_the_entry_point():
    host = PluginHost(autoload=False, strict=False).load()
    expected = {"rejection": True, "match": True, "greedy": True, "typical": False}
    for name, lossless in expected.items():
        reg = host.get("verifier", name)
        assert reg.metadata.lossless is lossless
        assert reg.metadata.greedy_only is (name == "greedy")
        assert reg.metadata.description
        verifier = host.create_verifier(name)
        assert isinstance(verifier, Verifier)
        assert type(verifier) is type(ALL[name])
    typical = host.create_verifier("typical", {"epsilon": 0.05})
    assert typical.config.epsilon == 0.05 and typical.config.delta == 0.3
    with pytest.raises(ValueError, match="epslion"):
        host.create_verifier("typical", {"epslion": 0.05})

"""The conformance suite's statistics inside a token tree (docs/conformance.md#what-each-statistic-sees):
the walk replayed under the verifier's declared rule, node by node, on hand-built laws whose
values are known exactly."""

from __future__ import annotations

from dataclasses import replace

import torch

from specforge.components import VerifyOutput
from specforge.sampling import SamplingParams
from specforge.toolkit.trees import verify_tree
from specforge_conformance.rounds import RoundRecorder
from specforge_conformance.stats import square_fit
from specforge_plugins.verifiers.rejection import RejectionVerifier

# One anchor, three root children (rows 1–3 of the target after them), V = 4.
P0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q = torch.tensor([[0.4, 0.3, 0.2, 0.1],  # sibling 1 draws token 0: a = 0.1/0.4, residual ∝ (0, 0, .1, .3)
                  [0.1, 0.1, 0.5, 0.3],  # sibling 2 draws token 2: a = 0.25/0.5, residual ∝ (0, 0, 0, .45)
                  [0.25, 0.25, 0.25, 0.25]])  # sibling 3 draws token 3: a = 1
TOKENS = torch.tensor([0, 2, 3])
PARENTS = torch.tensor([-1, -1, -1])
EXACT = torch.tensor([0.25, 0.5, 1.0])  # each sibling's acceptance on the residual its elders left


def _round(rows: int, seed: int = 0):
    """``rows`` requests with the tree above; target rows after each child are fixed laws."""
    after = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    p = torch.cat([P0[None], after])[None].expand(rows, 4, 4).clone()
    logits = p.log()
    tokens = TOKENS.expand(rows, 3).clone()
    probs = Q[None].expand(rows, 3, 4).clone()
    parents = PARENTS.expand(rows, 3).clone()
    lengths = torch.full((rows,), 3)
    uniforms = torch.rand(rows, 4, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return logits, tokens, probs, parents, lengths, uniforms


def _observe(verifier, walk, rows: int, seed: int = 0) -> RoundRecorder:
    logits, tokens, probs, parents, lengths, uniforms = _round(rows, seed)
    recorder = RoundRecorder(seed)
    recorder.law_declared = True
    out = walk(logits.softmax(-1), tokens, probs, parents, lengths, uniforms)
    recorder.on_verify(verifier, logits, tokens, probs, lengths, SamplingParams.uniform(len(lengths)), out,
                       parents=parents)
    return recorder


def _shipped_walk(verifier):
    def walk(p, tokens, probs, parents, lengths, uniforms):
        return verify_tree(verifier.accept_probability, verifier.residual, p, tokens, probs, parents, lengths,
                           uniforms)
    return walk


def test_each_sibling_is_declared_against_the_residual_its_elders_left():
    """A round whose first two root children were rejected and the third accepted: the replay
    records the three declared probabilities exactly, in order, with their sibling indices."""
    verifier = RejectionVerifier()
    logits, tokens, probs, parents, lengths, _ = _round(1)
    out = VerifyOutput(num_accepted=torch.tensor([1]), next_token=torch.tensor([1]), path=torch.tensor([[2, -1, -1]]))
    recorder = RoundRecorder(0)
    recorder.law_declared = True
    recorder.on_verify(verifier, logits, tokens, probs, lengths, SamplingParams.uniform(len(lengths)), out, parents=parents)
    torch.testing.assert_close(torch.cat(recorder.accept_prob), EXACT.double(), rtol=0, atol=1e-6)
    assert torch.cat(recorder.accepted).tolist() == [False, False, True]
    assert torch.cat(recorder.sibling).tolist() == [0, 1, 2]  # (a fourth would share stratum 2)
    assert recorder.emission.impossible == 0
    # Emitted after the third child, a bonus token at depth 1: its stratum says so.
    assert recorder.emission.strata[0].tolist() == [1000 + 1]


def test_a_path_the_walk_cannot_take_is_an_impossible_draw():
    """Rejecting the third child (declared acceptance 1) and emitting from the root is a path the
    declared rule never takes."""
    verifier = RejectionVerifier()
    logits, tokens, probs, parents, lengths, _ = _round(1)
    out = VerifyOutput(num_accepted=torch.tensor([0]), next_token=torch.tensor([3]), path=torch.full((1, 3), -1))
    recorder = RoundRecorder(0)
    recorder.law_declared = True
    recorder.on_verify(verifier, logits, tokens, probs, lengths, SamplingParams.uniform(len(lengths)), out, parents=parents)
    fits = recorder.fits()
    assert fits["acceptance"].impossible == 1
    # Reported as accepting node 1 at depth 0 although node 0 was accepted first by the walk's
    # rule: node 1 is never tried after node 0 is accepted, so the path leaves the walk.
    out = VerifyOutput(num_accepted=torch.tensor([1]), next_token=torch.tensor([0]), path=torch.tensor([[5, -1, -1]]))
    recorder = RoundRecorder(0)
    recorder.law_declared = True
    recorder.on_verify(verifier, logits, tokens, probs, lengths, SamplingParams.uniform(len(lengths)), out, parents=parents)
    # Once for the path (the walk ends at depth 0, the verifier says 1), once for the token (0
    # has no mass in the residual left after all three children are rejected).
    assert recorder.fits()["emission"].impossible == 2


def test_the_shipped_walk_passes_every_tree_statistic():
    verifier = RejectionVerifier()
    fits = _observe(verifier, _shipped_walk(verifier), 40_000).fits()
    for name in ("acceptance", "emission", "walk pairs"):
        assert fits[name].n > 0 and fits[name].p_value > 1e-4 and fits[name].impossible == 0, (name, fits[name])


def test_a_sibling_decided_with_its_elders_uniform_is_caught():
    """The second sibling reuses the first one's uniform: it is reached only when u ≥ 0.25, then
    accepted when u < 0.5 — 1/3 of the time instead of 1/2."""
    verifier = RejectionVerifier()

    def walk(p, tokens, probs, parents, lengths, uniforms):
        shared = uniforms.clone()
        shared[:, 1, 0] = shared[:, 0, 0]
        return _shipped_walk(verifier)(p, tokens, probs, parents, lengths, shared)
    fits = _observe(verifier, walk, 40_000).fits()
    assert fits["acceptance"].p_value < 1e-12
    assert fits["walk pairs"].p_value < 1e-12


def test_the_acceptance_test_keeps_sibling_strata_apart():
    """A shift confined to one sibling index is tested in that stratum (not diluted by the
    others), and the information is the weakest stratum's."""
    g = torch.Generator().manual_seed(3)
    a = torch.full((30_000,), 0.5, dtype=torch.float64)
    strata = torch.arange(30_000) % 3
    u = torch.rand(30_000, generator=g, dtype=torch.float64)
    hit = u < torch.where(strata == 2, a + 0.05, a)
    from specforge_conformance.stats import bernoulli_fit

    assert bernoulli_fit(a, u < a, strata=strata).p_value > 1e-3
    stratified = bernoulli_fit(a, hit, strata=strata)
    assert stratified.p_value < 1e-6
    # one stratum of 10,000 events at a = 0.5: Σ n²/V = 10,000² / 2,500
    assert stratified.info == torch.tensor(10_000 ** 2 / 2_500.0).item()


def test_square_fit_sees_a_dependence_that_leaves_the_distance_uniform():
    g = torch.Generator().manual_seed(5)
    v = torch.rand(20_000, 2, generator=g, dtype=torch.float64)
    none = torch.zeros(20_000, dtype=torch.long)
    assert square_fit(v, none).p_value > 1e-3
    # v₂ = v₁ + ½ (mod 1): the pair is always half a unit apart on the circle, uniform on the
    # square's two bands; the grid sees the empty cells.
    shifted = torch.stack([v[:, 0], (v[:, 0] + 0.5) % 1.0], 1)
    assert square_fit(shifted, none).p_value < 1e-12
    # The transform: (⌊4·v₁⌋ + v₂)/4, so the four columns of v₁ are four quarters of [0, 1).
    fit = square_fit(torch.tensor([[0.1, 0.5], [0.9, 0.5]], dtype=torch.float64).repeat(40, 1),
                     torch.zeros(80, dtype=torch.long))
    assert fit.n == 80 and fit.cells == 16


# --- informative cases ---------------------------------------------------------------------------


def _case(scheduler: tuple[str, dict]):
    from specforge_conformance.harness import Case

    return Case(pipeline={"drafter": ("shadow", {"gamma": 3}), "correction_head": ("none", {}),
                          "confidence": ("constant", {"value": 0.5}), "calibrator": ("identity", {}),
                          "scheduler": scheduler, "verifier": ("rejection", {})}, vocab=8, horizon=4, n=2000, seed=11)


def test_a_case_that_verifies_nothing_is_passed_over_for_one_that_verifies():
    from specforge_conformance.harness import IDLE_SHARE, exercised, informative, pilot, shares
    from specforge_conformance.strategies import informative_cases
    from specforge_conformance.suite import suite_host

    host = suite_host()
    idle, busy = _case(("threshold", {"theta": 0.9})), _case(("fixed", {}))
    idle_run, busy_run = pilot(idle, host), pilot(busy, host)
    assert shares(idle_run) == (0.0, 0.0) and idle_run.drafted > 0 and not informative(idle_run)
    assert not exercised(idle_run) and idle_run.tau == 1.0
    assert shares(busy_run)[0] == 1.0 and informative(busy_run) and exercised(busy_run)
    assert informative_cases([idle, busy], 1, host) == [busy]
    # none informative: the one that verified most, in draw order among equals, at a share of its N
    # (it tests little beyond plain decoding; its samples pay for the mixed cases)
    assert informative_cases([idle, idle], 1, host) == [replace(idle, n=int(idle.n * IDLE_SHARE))]


def test_the_round_observers_satisfy_the_optional_protocols_statically():
    """Python ≥ 3.12 checks runtime protocols with ``inspect.getattr_static``: an observer that
    only forwards through ``__getattr__`` would hide ``bind`` from the engine."""
    import inspect

    from specforge.protocols import Binds
    from specforge_conformance.drafters import RandomDrafter

    drafter, verifier = RoundRecorder(0).wrap(RandomDrafter(), RejectionVerifier())
    assert isinstance(drafter, Binds)
    assert inspect.getattr_static(drafter, "bind") and inspect.getattr_static(drafter, "release")
    assert inspect.getattr_static(verifier, "accept_probability")
    assert drafter.gamma == RandomDrafter().gamma  # plain attributes still come from the plug-in

    class Lazy(RandomDrafter):
        @property
        def table_size(self) -> int:
            raise RuntimeError("bind() first")

    RoundRecorder(0).wrap(Lazy(), RejectionVerifier())  # a property is not evaluated by the wrapper

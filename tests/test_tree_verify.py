"""Recursive rejection over token trees (specforge/toolkit/trees.py): on a chain it is the chain
rule uniform for uniform; on trees of several shapes, with i.i.d., distinct-law and deterministic
children, the emitted tokens have the target's law; bad parent lists are refused."""

from __future__ import annotations

import pytest
import torch

from specforge.sampling import SamplingParams, sample_with_uniform
from specforge_conformance.stats import goodness_of_fit
from specforge.toolkit.trees import check_parents, verify_tree
from specforge_plugins.verifiers import RejectionVerifier
from specforge_plugins.verifiers.rejection import RejectionConfig

V = 5
LEVEL = 1e-6  # per test statistic: the tests below make a handful of fits


def rejection():
    return RejectionVerifier(RejectionConfig())


def test_on_a_chain_it_is_the_chain_rule_uniform_for_uniform():
    gen = torch.Generator().manual_seed(0)
    r, g = 4000, 4
    logits = torch.randn(r, g + 1, V, generator=gen)
    q = torch.softmax(torch.randn(r, g, V, generator=gen), -1)
    u = torch.rand(r, g, generator=gen, dtype=torch.float64)
    tokens = sample_with_uniform(q.reshape(-1, V), u.reshape(-1)).view(r, g)
    lengths = torch.randint(0, g + 1, (r,), generator=gen)
    uniforms = torch.rand(r, g + 1, 2, generator=gen, dtype=torch.float64)
    sampling = SamplingParams.uniform(r, 1.0)
    v = rejection()
    chain = v.verify(logits, tokens, q, lengths, sampling, uniforms)
    p = torch.softmax(logits, -1)
    parents = torch.arange(g).expand(r, g) - 1
    tree = verify_tree(v.accept_probability, v.residual, p, tokens, q, parents, lengths, uniforms)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.next_token, chain.next_token)
    expected = torch.where(torch.arange(g)[None] < chain.num_accepted[:, None], torch.arange(g)[None], -1)
    assert torch.equal(tree.path, expected)


# Trees as parent lists (−1: a child of the anchor).  How each node is drawn: "iid" — from its
# parent's children law, independently; "det" — the arg-max of that law not yet taken by an earlier
# deterministic sibling (q one-hot); "own" — from a law of its own.
TREES = {
    "three iid children, one with two": ([-1, -1, -1, 0, 0], ["iid", "iid", "iid", "iid", "iid"]),
    "deterministic top-3 then a chain": ([-1, -1, -1, 0, 3], ["det", "det", "det", "own", "own"]),
    "mixed laws under one node": ([-1, -1, 1, 1, 1], ["own", "own", "iid", "det", "own"]),
}


def _simulate(parents: list[int], kinds: list[str], n: int, seed: int):
    """n independent rounds on a target whose law depends on the path's tokens only."""
    gen = torch.Generator().manual_seed(seed)
    g = len(parents)
    p0 = torch.softmax(torch.randn(V, generator=gen), -1)
    p1 = torch.softmax(1.5 * torch.randn(V, V, generator=gen), -1)  # after token t: p1[t]
    p2 = torch.softmax(1.5 * torch.randn(V, V, V, generator=gen), -1)
    children_law = torch.softmax(torch.randn(g + 1, V, generator=gen), -1)  # per parent node (row)
    own_law = torch.softmax(2 * torch.randn(g, V, generator=gen), -1)
    tokens = torch.zeros(n, g, dtype=torch.long)
    probs = torch.zeros(n, g, V)
    taken = torch.zeros(n, g + 1, V, dtype=torch.bool)
    for j, (parent, kind) in enumerate(zip(parents, kinds)):
        base = children_law[parent + 1].expand(n, V)
        if kind == "det":
            scores = torch.where(taken[:, parent + 1], -1.0, base)
            x = scores.argmax(-1)
            law = torch.nn.functional.one_hot(x, V).float()
            taken[torch.arange(n), parent + 1, x] = True
        else:
            law = base if kind == "iid" else own_law[j].expand(n, V)
            x = torch.multinomial(law, 1, generator=gen)[:, 0]
        tokens[:, j], probs[:, j] = x, law
    # row j+1: the target after node j's path (depth ≤ 2 here)
    rows = torch.zeros(n, g + 1, V)
    rows[:, 0] = p0
    path_tokens: list[list[int]] = [[] for _ in range(g)]
    for j, parent in enumerate(parents):
        depth = 1 if parent < 0 else 2
        if depth == 1:
            rows[:, j + 1] = p1[tokens[:, j]]
        else:
            rows[:, j + 1] = p2[tokens[:, parent], tokens[:, j]]
    uniforms = torch.rand(n, g + 1, 2, generator=gen, dtype=torch.float64)
    return p0, p1, rows, tokens, probs, uniforms


@pytest.mark.parametrize("name", list(TREES))
def test_the_emitted_tokens_have_the_target_law(name):
    parents, kinds = TREES[name]
    n, g = 200_000, len(parents)
    p0, p1, rows, tokens, probs, uniforms = _simulate(parents, kinds, n, seed=len(name))
    v = rejection()
    out = verify_tree(v.accept_probability, v.residual, rows, tokens, probs,
                      torch.tensor(parents).expand(n, g), torch.full((n,), g), uniforms)
    r = torch.arange(n)
    first = torch.where(out.num_accepted > 0, tokens[r, out.path[:, 0].clamp_min(0)], out.next_token)
    fit = goodness_of_fit(torch.bincount(first, minlength=V), p0)
    assert fit.p_value > LEVEL, fit
    # the second output token of rounds that accepted one node, given the first
    two = out.num_accepted >= 1
    second = torch.where(out.num_accepted >= 2, tokens[r, out.path[:, 1].clamp_min(0)], out.next_token)
    for t in range(V):
        rows_t = two & (first == t)
        if int(rows_t.sum()) < 500:
            continue
        fit = goodness_of_fit(torch.bincount(second[rows_t], minlength=V), p1[t])
        assert fit.p_value > LEVEL, (t, fit)
    assert bool((out.num_accepted >= 1).any()) and bool((out.num_accepted == 0).any())


def test_a_sibling_rejection_without_the_residual_update_is_caught():
    """The power of the check above: forgetting to update p after a rejected sibling (each
    sibling tested against the fresh target law) changes the law of the first token."""
    parents, kinds = TREES["three iid children, one with two"]
    n, g = 200_000, len(parents)
    p0, _, rows, tokens, probs, uniforms = _simulate(parents, kinds, n, seed=3)
    v = rejection()
    out = verify_tree(v.accept_probability, lambda p, q, x: p, rows, tokens, probs,
                      torch.tensor(parents).expand(n, g), torch.full((n,), g), uniforms)
    r = torch.arange(n)
    first = torch.where(out.num_accepted > 0, tokens[r, out.path[:, 0].clamp_min(0)], out.next_token)
    assert goodness_of_fit(torch.bincount(first, minlength=V), p0).p_value < LEVEL


def test_a_parent_after_its_child_is_refused():
    check_parents(torch.tensor([[-1, 0, 1]]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"request 0, node 1: parent 2 is not an earlier node"):
        check_parents(torch.tensor([[-1, 2, 0]]), torch.tensor([3]))
    check_parents(torch.tensor([[-1, 2, 0]]), torch.tensor([1]))  # nodes past the length are ignored

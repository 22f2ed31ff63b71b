"""Acceptance statistics (specforge.acceptance): the per-round rule, in its two forms, by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specforge.acceptance import AcceptanceCounts, position_masks, rates, survival, tau, verify_waste
from specforge.engine import RequestStats


def counts(rounds: list[tuple[int, int]]) -> AcceptanceCounts:
    c = AcceptanceCounts()
    for verified, accepted in rounds:
        c.record_round(verified, accepted, drafted=verified)
    return c


def test_a_round_by_hand():
    c = counts([(3, 1), (2, 2)])  # x_1 accepted, x_2 rejected (x_3 moot); then a full block of 2
    assert (c.rounds, c.verified, c.accepted) == (2, 5, 3)
    assert c.verified_per_position == [2, 2, 1]
    assert c.reached_per_position == [2, 2, 0]  # position 3 of round 1 came after a rejection
    assert c.accepted_per_position == [2, 1, 0]
    assert c.tau == (3 + 2) / 2
    assert c.conditional_acceptance()[:2] == [1.0, 0.5] and math.isnan(c.conditional_acceptance()[2])
    assert c.survival()[:2] == [1.0, 0.5]
    assert c.verify_waste == 2 / 5


def test_nothing_counted_is_nan_and_plain_rounds_have_tau_one():
    empty = AcceptanceCounts()
    assert math.isnan(empty.tau) and math.isnan(empty.verify_waste)
    assert empty.conditional_acceptance() == [] and empty.survival() == []
    assert counts([(0, 0)] * 4).tau == 1.0
    assert math.isnan(tau(0, 0)) and math.isnan(verify_waste(0, 0))
    assert rates([1, 0], [2, 0])[0] == 0.5 and math.isnan(rates([1, 0], [2, 0])[1])
    assert survival([0.5, 0.5, math.nan])[:2] == [0.5, 0.25]


def test_the_tensor_rule_counts_what_record_round_counts():
    rng = random.Random(0)
    g = 5
    rounds = [(v, rng.randint(0, v)) for v in (rng.randint(0, g) for _ in range(200))]
    c = counts(rounds)
    verified, reached, accepted = position_masks(torch.tensor([v for v, _ in rounds]),
                                                 torch.tensor([a for _, a in rounds]), g)
    n = len(c.verified_per_position)
    assert verified.sum(0).tolist()[:n] == c.verified_per_position
    assert reached.sum(0).tolist()[:n] == c.reached_per_position
    assert accepted.sum(0).tolist()[:n] == c.accepted_per_position


def test_pooling_adds_rounds_and_a_requests_tokens():
    a, b = RequestStats(emitted=4, prompt_tokens=2), RequestStats(emitted=3, prompt_tokens=5)
    a.record_round(3, 2, 3)
    b.record_round(1, 0, 1)
    pooled = RequestStats.pooled([a, b])
    assert (pooled.rounds, pooled.accepted, pooled.emitted, pooled.prompt_tokens) == (2, 2, 7, 7)
    assert pooled.verified_per_position == [2, 1, 1]
    plain = AcceptanceCounts.pooled([a, b])
    assert type(plain) is AcceptanceCounts and plain.accepted_per_position == pooled.accepted_per_position
    assert RequestStats().to_dict()["tau"] == 0.0  # a request without rounds, as the engine reports it
    assert pooled.tau == pytest.approx(2.0)

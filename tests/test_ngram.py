"""The ``ngram`` drafter (prompt lookup): exact proposals, batching, registration, config checks."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specforge.components import DraftContext, Drafter
from specforge.plugins import PluginHost
from specforge.sampling import SamplingParams
from specforge_plugins.drafters import NgramConfig, NgramDrafter


def reference(history, gamma, max_tokens, max_ngram=3, min_ngram=1, window=None):
    """The definition, one position at a time: longest n first, then the latest occurrence."""
    h = list(history)[-window:] if window else list(history)
    size = len(h)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = h[size - n:]
        # Start positions whose match ends at i + n - 1 ≤ size - 2, newest first.
        for i in range(size - n - 1, -1, -1):
            if h[i:i + n] == suffix:
                return h[i + n:i + n + max(0, min(gamma, max_tokens))]
    return []


def context(histories, max_tokens):
    r = len(histories)
    return DraftContext(
        request_ids=list(range(r)),
        histories=[torch.tensor(h, dtype=torch.long) for h in histories],
        max_tokens=torch.tensor(max_tokens, dtype=torch.long).reshape(r),
        sampling=SamplingParams.uniform(r),
        generators=[torch.Generator().manual_seed(i) for i in range(r)],
    )


def propose(histories, max_tokens=None, **config):
    """Each request's proposal as a list, after checking the block's shape and padding."""
    drafter = NgramDrafter(NgramConfig(**config))
    if max_tokens is None:
        max_tokens = [drafter.gamma] * len(histories)
    block = drafter.draft(context(histories, max_tokens))
    lengths = block.lengths.tolist()
    assert block.probs is None
    assert block.tokens.dtype == torch.long and block.lengths.dtype == torch.long
    assert block.tokens.shape == (len(histories), max(lengths, default=0))
    for row, n in zip(block.tokens.tolist(), lengths):
        assert all(t == 0 for t in row[n:]), "unused slots are padded with 0"
    assert block.anchor.tolist() == [h[-1] for h in histories]
    return [row[:n] for row, n in zip(block.tokens.tolist(), lengths)]


def one(history, max_tokens=None, **config):
    return propose([history], None if max_tokens is None else [max_tokens], **config)[0]


# --- exact behaviour on hand-made histories ---------------------------------------------------


def test_most_recent_occurrence_wins():
    assert one([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2]


def test_longer_ngram_preferred_over_more_recent_shorter_one():
    history = [1, 2, 3, 7, 9, 3, 6, 1, 2, 3]
    assert one(history) == [7, 9, 3, 6, 1]  # the 3-gram "1 2 3" at the start
    assert one(history, max_ngram=1) == [6, 1, 2, 3]  # the latest "3" alone


def test_min_ngram_rejects_shorter_matches():
    assert one([4, 1, 5, 6, 2, 1]) == [5, 6, 2, 1]
    assert one([4, 1, 5, 6, 2, 1], min_ngram=2) == []


def test_match_at_the_very_start():
    assert one([4, 5, 6, 4]) == [5, 6, 4]
    assert one([4, 5, 6, 7, 4, 5], max_ngram=2) == [6, 7, 4, 5]


def test_continuation_truncated_at_end_of_history():
    assert one([1, 2, 1]) == [2, 1]
    # A self-overlapping match: "5 5 5" ends one before the anchor, only the anchor follows it.
    assert one([5, 5, 5, 5]) == [5]


def test_max_tokens_caps_and_gamma_caps():
    history = [1, 2, 3, 4, 5, 6, 7, 1]
    assert one(history) == [2, 3, 4, 5, 6]
    assert one(history, max_tokens=2) == [2, 3]
    assert one(history, max_tokens=50) == [2, 3, 4, 5, 6]  # never more than γ
    assert one(history, gamma=7) == [2, 3, 4, 5, 6, 7, 1]


def test_no_match_or_nothing_allowed_proposes_nothing():
    assert one([1, 2, 3, 4]) == []
    assert one([7]) == []
    assert one([1, 2, 1], max_tokens=0) == []
    assert propose([[1, 2, 3], [9]]) == [[], []]


def test_ngram_longer_than_a_byte():
    # The match-length counter widens past uint8; a 300-gram must still be found and preferred.
    block = [1, 2] * 150
    history = block + [7, 9] + [3] + block
    assert one(history, max_ngram=300, gamma=3) == [7, 9, 3]
    assert one(history, max_ngram=3, gamma=3) == [1, 2]  # "2 1 2" recurs just before the end


def test_search_window_limits_the_search():
    history = [3, 8, 8, 8, 8, 8, 3]
    assert one(history) == [8, 8, 8, 8, 8]
    assert one(history, search_window=6) == []
    assert one(history, search_window=7) == [8, 8, 8, 8, 8]


def test_batch_of_mixed_requests_equals_each_alone():
    histories = [
        [1, 2, 9, 1, 2, 8, 1, 2],
        [1, 2, 3, 4],
        [5],
        [4, 5, 6, 4],
        [1, 2, 3, 7, 9, 3, 6, 1, 2, 3],
        [1, 2, 3, 4, 5, 6, 7, 1],
    ]
    caps = [5, 5, 5, 2, 0, 3]
    batch = propose(histories, caps)
    assert batch == [one(h, c) for h, c in zip(histories, caps)]
    assert batch == [reference(h, 5, c) for h, c in zip(histories, caps)]


def test_empty_batch():
    block = NgramDrafter().draft(context([], []))
    assert block.tokens.shape == (0, 0) and block.lengths.shape == (0,)


# --- the vectorised search against the plain loop ---------------------------------------------


@st.composite
def cases(draw):
    max_ngram = draw(st.integers(1, 4))
    config = dict(
        gamma=draw(st.integers(1, 7)),
        max_ngram=max_ngram,
        min_ngram=draw(st.integers(1, max_ngram)),
        search_window=draw(st.one_of(st.none(), st.integers(2, 30))),
    )
    vocab = draw(st.integers(2, 5))  # small, so that matches of every length happen
    r = draw(st.integers(1, 6))
    token = st.integers(0, vocab - 1)
    histories = [draw(st.lists(token, min_size=1, max_size=40)) for _ in range(r)]
    caps = [draw(st.integers(0, 9)) for _ in range(r)]
    return config, histories, caps


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases())
def test_vectorised_search_matches_reference_loop(case):
    config, histories, caps = case
    args = config["gamma"], config["max_ngram"], config["min_ngram"], config["search_window"]
    expected = [reference(h, args[0], c, *args[1:]) for h, c in zip(histories, caps)]
    assert propose(histories, caps, **config) == expected


def test_long_histories_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(2000, 4000, (32,), generator=gen).tolist()
    histories = [torch.randint(0, 50, (n,), generator=gen) for n in sizes]
    ctx = DraftContext(list(range(32)), histories, torch.full((32,), 5),
                       SamplingParams.uniform(32), [torch.Generator() for _ in range(32)])
    block = NgramDrafter().draft(ctx)
    for r in (0, 7, 31):
        n = int(block.lengths[r])
        assert block.tokens[r, :n].tolist() == reference(histories[r].tolist(), 5, 5)


# --- registration and config ------------------------------------------------------------------


def test_registered_through_entry_point():
    host = PluginHost().load()
    reg = host.get("drafter", "ngram")
    assert reg.metadata.deterministic is True
    assert reg.metadata.parallel is False
    assert reg.metadata.description
    drafter = host.create_drafter("ngram", {"gamma": 3, "max_ngram": 2, "search_window": 100})
    assert isinstance(drafter, Drafter)
    assert drafter.gamma == 3 and drafter.feature_layers == ()
    drafter.bind(object())
    drafter.release(0)
    assert drafter.draft(context([[1, 2, 3, 4, 1]], [5])).tokens.tolist() == [[2, 3, 4]]


def test_defaults():
    config = NgramConfig()
    assert (config.gamma, config.max_ngram, config.min_ngram) == (5, 3, 1)
    assert config.search_window is None


@pytest.mark.parametrize(
    "params, match",
    [
        ({"gamma": 0}, "gamma"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 4, "max_ngram": 3}, "min_ngram"),
        ({"search_window": 1}, "search_window"),
        ({"gama": 4}, "gama"),
    ],
)
def test_config_validation(params, match):
    with pytest.raises(ValidationError, match=match):
        NgramConfig.model_validate(params)
    with pytest.raises(ValidationError, match=match):
        PluginHost().load().create_drafter("ngram", params)

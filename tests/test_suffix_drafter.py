"""The ``suffix`` drafter: its index against a brute-force definition, the corpus it reads, what
it learns from finished requests, and greedy parity in the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specforge.components import DraftContext
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.errors import SpecforgeError
from specforge.plugins import PluginHost
from specforge.protocols import Learns
from specforge.sampling import SamplingParams
from specforge.runtime import TargetModel
from specforge.toolkit.corpus import answer_documents
from specforge_plugins.drafters import SuffixConfig, SuffixDrafter
from specforge_plugins.drafters.suffix.index import SuffixIndex
from tiny_models import tiny_model


def reference(documents, context, depth, min_prob):
    """The definition, one occurrence at a time: every position where ``context`` occurs, then
    the most frequent next token (the smallest id among equals) while the path's probability
    stays ≥ min_prob and the documents go on."""
    n = len(context)
    rows = [d[i:] for d in documents for i in range(len(d) - n + 1) if d[i:i + n] == context]
    if not rows:
        return None
    count, prob, tokens, shares = len(rows), 1.0, [], []
    for k in range(n, n + depth):
        nxt = [r[k] if k < len(r) else None for r in rows]
        counts: dict = {}
        for t in nxt:
            counts[t] = counts.get(t, 0) + 1
        best = min(counts, key=lambda t: (-counts[t], -1 if t is None else t))
        share = counts[best] / len(rows)
        if best is None or prob * share < min_prob:
            break
        prob *= share
        tokens.append(best)
        shares.append(share)
        rows = [r for r, t in zip(rows, nxt) if t == best]
    return tokens, shares, count


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=12), min_size=1, max_size=6),
       st.lists(st.integers(0, 4), min_size=1, max_size=3), st.integers(1, 5),
       st.sampled_from([0.0, 0.2, 0.5]))
def test_the_index_proposes_what_the_definition_does(documents, context, depth, min_prob):
    index = SuffixIndex(documents, width=len(context) + depth)
    got = index.propose(context, depth, min_prob)
    want = reference(documents, context, depth, min_prob)
    if want is None:
        assert got is None
    else:
        assert (got.tokens, got.count, got.context) == (want[0], want[2], len(context))
        assert got.shares == pytest.approx(want[1])


def test_ids_of_a_large_vocabulary_and_the_end_of_a_document():
    big = 200_000  # beyond 16 bits: a Gemma- or Llama-3-sized vocabulary
    index = SuffixIndex([[big, 5, big, 5, 7], [3, big]], width=6)
    p = index.propose([big], 4, 0.0)
    # [big] occurs 3 times: followed by 5 twice and by the end of a document once
    assert p.tokens == [5, 7] and p.shares == pytest.approx([2 / 3, 1 / 2]) and p.count == 3
    with pytest.raises(ValueError, match="20-bit"):
        SuffixIndex([[1 << 20]], width=3)


def context(histories, request_ids=None, max_tokens=8):
    r = len(histories)
    return DraftContext(request_ids=request_ids or list(range(r)),
                        histories=[torch.tensor(h, dtype=torch.long) for h in histories],
                        max_tokens=torch.full((r,), max_tokens, dtype=torch.long),
                        sampling=SamplingParams.uniform(r), generators=[torch.Generator() for _ in range(r)])


class _Target:
    """What ``bind`` reads: the vocabulary size and a tokenizer (one id per word here)."""

    vocab_size = 1000

    @staticmethod
    def encode(text, chat=True):
        assert not chat, "answers are tokenised as plain text, not as a chat prompt"
        return [int(w) for w in text.split()]


def _write_corpus(path, answers, bad_line=False):
    lines = [json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]})
             for a in answers]
    if bad_line:
        lines.insert(1, "{not json")
    path.write_text("\n".join(lines) + "\n")


def test_the_corpus_is_the_assistant_turns_and_a_bad_line_is_named(tmp_path):
    _write_corpus(tmp_path / "a.jsonl", ["1 2 3 4", "1 2 3 5"], bad_line=True)
    _write_corpus(tmp_path / "b.jsonl", ["1 2 3 4 9"])
    with pytest.warns(UserWarning, match="line 2: invalid JSON"):
        docs = answer_documents([str(tmp_path)], lambda text: _Target.encode(text, chat=False))
    assert docs == [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 9]]
    with pytest.raises(SpecforgeError, match=r"drafter.corpus.1: no such file or directory"):
        answer_documents([str(tmp_path), str(tmp_path / "missing")], list, key="drafter.corpus")


def test_it_proposes_from_the_corpus_with_its_shares_as_confidence(tmp_path):
    _write_corpus(tmp_path / "a.jsonl", ["7 1 2 3 4", "8 1 2 3 4", "1 2 3 5"])
    drafter = SuffixDrafter(SuffixConfig(corpus=[str(tmp_path / "a.jsonl")], gamma=3, min_prob=0.0))
    drafter.bind(_Target())
    block = drafter.draft(context([[9, 9, 2, 3], [9, 8, 1, 2], [9, 9, 9, 6]]))
    assert block.probs is None and block.anchor.tolist() == [3, 2, 6]
    # [2, 3] occurs 3 times (then 4, 4, 5; then each document ends); [8, 1, 2] once; [9, 6] never
    assert block.lengths.tolist() == [1, 2, 0]
    assert block.tokens.tolist() == [[4, 0], [3, 4], [0, 0]]
    assert torch.allclose(block.confidence, torch.tensor([[2 / 3, 0], [1, 1], [0, 0]]))


def test_a_finished_request_s_output_is_learned_and_the_oldest_go_first():
    drafter = SuffixDrafter(SuffixConfig(gamma=4, learn_tokens=6, min_context=1))
    drafter.bind(_Target())
    prompt = [50, 51]
    # request 1 decodes 10 11 12 13 after its prompt; nothing is known yet
    for n in range(1, 5):
        assert drafter.draft(context([prompt + [10, 11, 12, 13][:n]], [1])).lengths.tolist() == [0]
    drafter.release(1)
    # a new request that reaches 10 11 is offered what followed there — not the prompt's tokens
    block = drafter.draft(context([[7, 10, 11]], [2]))
    assert block.tokens[0, :block.lengths[0]].tolist() == [12, 13]
    drafter.release(2)
    for rid, output in ((3, [20, 21, 22]), (4, [30, 31, 32])):
        drafter.draft(context([[60, output[0]]], [rid]))
        drafter.draft(context([[60, *output]], [rid]))
        drafter.release(rid)
    # 6 learned tokens at most: request 1's 4 (and 2's 1) went first
    assert drafter.draft(context([[10, 11]], [5])).lengths.tolist() == [0]
    assert drafter.draft(context([[9, 20]], [6])).tokens[0].tolist()[:2] == [21, 22]


def test_forget_drops_the_learned_outputs_and_keeps_the_corpus(tmp_path):
    _write_corpus(tmp_path / "a.jsonl", ["7 8"])
    drafter = SuffixDrafter(SuffixConfig(corpus=[str(tmp_path)], min_context=1))
    drafter.bind(_Target())
    drafter.draft(context([[1, 2]], [1]))
    drafter.draft(context([[1, 2, 3, 4]], [1]))
    drafter.release(1)
    assert isinstance(drafter, Learns)
    assert drafter.draft(context([[2]], [2])).tokens[0, 0].item() == 3
    drafter.forget()
    assert drafter.draft(context([[2]], [3])).lengths.tolist() == [0]
    assert drafter.draft(context([[7]], [4])).tokens[0].tolist() == [8]


def test_learning_off_learns_nothing():
    drafter = SuffixDrafter(SuffixConfig(learn=False, min_context=1))
    drafter.bind(_Target())
    drafter.draft(context([[1, 2, 3]], [1]))
    drafter.release(1)
    assert drafter.draft(context([[2]], [2])).lengths.tolist() == [0]


@pytest.mark.parametrize("params, match", [
    ({"min_context": 4, "max_context": 3}, "min_context"),
    ({"min_prob": 1.5}, "min_prob"),
    ({"gamma": 0}, "gamma"),
    ({"corpora": []}, "corpora"),
])
def test_config_errors_name_the_key(params, match):
    with pytest.raises(ValidationError, match=match):
        SuffixConfig(**params)


def test_greedy_parity_in_the_engine_and_a_repeated_prompt_is_drafted_from_the_first_answer():
    host = PluginHost(autoload=False).load()
    target = TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None), None, torch.float32)
    engine = Engine(target, host.create_verifier("rejection"), drafter=host.create_drafter("suffix", {"gamma": 4}),
                    confidence=host.create_confidence("reported", {}), calibrator=host.create_calibrator("identity", {}),
                    scheduler=host.create_scheduler("fixed", {}),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=24), engine=EngineConfig(max_batch=4))
    plain = Engine(target, host.create_verifier("rejection"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=24),
                   engine=EngineConfig(max_batch=4))
    prompt = GenerationRequest(prompt_ids=[5, 17, 33, 2, 40], ignore_eos=True)
    want = plain.generate([prompt])[0].token_ids
    first = engine.generate([prompt])[0]
    second = engine.generate([prompt])[0]
    assert first.token_ids == want and second.token_ids == want
    # the second answer is the first one again: drafted from it, and accepted
    assert second.stats.accepted >= len(want) // 2 > first.stats.accepted


def test_a_shipped_corpus_is_named_and_an_unknown_one_lists_the_shipped():
    from specforge_plugins.drafters.suffix.corpora import resolve_corpus, shipped_corpora

    shipped = shipped_corpora()
    assert "smollm2-135m-instruct" in shipped
    path = resolve_corpus("shipped:smollm2-135m-instruct", "drafter.corpus.0")
    assert sorted(p.name for p in Path(path).glob("regen-*.jsonl"))  # a regenerated-data directory
    assert resolve_corpus("runs/answers", "drafter.corpus.0") == "runs/answers"
    with pytest.raises(SpecforgeError, match=r"drafter.corpus.1: 'shipped:nope' is no shipped corpus; "
                                             r"shipped: shipped:smollm2-135m-instruct"):
        resolve_corpus("shipped:nope", "drafter.corpus.1")

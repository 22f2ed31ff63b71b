"""The engine end to end on a tiny real checkpoint: parity with HF greedy, stops, isolation."""

from __future__ import annotations

import functools

import pytest
import torch

import specforge_conformance.drafters as test_drafters
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, FinishReason, GenerationRequest
from specforge.engine.stops import stop_prefix_length
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel
from tiny_models import tiny_model

VOCAB = 96


@pytest.fixture(scope="module")
def host():
    host = PluginHost(autoload=False).load()
    host.add_plugin(test_drafters, "test-drafters")
    return host


@pytest.fixture(scope="module")
def target():
    # No EOS id: generations run to their limit (tests that need one set it explicitly).
    return TargetModel(tiny_model("llama", seed=7, vocab=VOCAB, eos=None), None, torch.float32)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(2, VOCAB, (4 + i % 5,), generator=gen).tolist()
        out.append(base * 3)  # repetition gives the n-gram drafter something to find
    return out


def make_engine(target, host, drafter=None, verifier="rejection", batch=8, temperature=0.0, **kw):
    parts = {}
    if drafter is not None:
        name, cfg = drafter
        parts = dict(
            drafter=host.create_drafter(name, cfg),
            confidence=host.create_confidence("constant", {}),
            calibrator=host.create_calibrator("identity", {}),
            scheduler=host.create_scheduler("fixed", {}),
        )
    return Engine(target, host.create_verifier(verifier), **parts,
                  sampling=SamplingConfig(temperature=temperature, max_new_tokens=24),
                  engine=EngineConfig(max_batch=batch, max_context=kw.get("context", 256),
                                      prefill_chunk=kw.get("chunk", "auto")))


def hf_greedy(target, ids, n):
    """Hugging Face greedy ``generate`` of exactly n tokens (the tiny model has no EOS, so
    nothing stops it early; ``min_new_tokens`` would instead forbid EOS and change the argmax)."""
    return list(_hf_greedy(target.hf_model, tuple(ids), n))


@functools.lru_cache(maxsize=None)
def _hf_greedy(model, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(ids) + n
    return tuple(out[0, len(ids):].tolist())


DRAFTERS = [None, ("ngram", {"gamma": 4}), ("random", {"gamma": 3}), ("random", {"gamma": 5, "deterministic": True})]


@pytest.mark.parametrize("drafter", DRAFTERS, ids=["plain", "ngram", "random", "random-onehot"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_parity_with_hf_generate(target, host, drafter, batch):
    ps = prompts(6)
    engine = make_engine(target, host, drafter, batch=batch)
    outs = engine.generate([GenerationRequest(prompt_ids=p, ignore_eos=True) for p in ps])
    for p, out in zip(ps, outs):
        assert out.token_ids == hf_greedy(target, p, 24)
        assert out.finish_reason == FinishReason.LENGTH
    if drafter is not None and drafter[0] == "random":
        assert sum(o.stats.verified - o.stats.accepted for o in outs) > 0  # rejections happened


@pytest.mark.parametrize("verifier", ["greedy", "match"])
def test_other_lossless_verifiers_at_temperature_zero(target, host, verifier):
    ps = prompts(3, seed=5)
    outs = make_engine(target, host, ("ngram", {}), verifier=verifier).generate(
        [GenerationRequest(prompt_ids=p, ignore_eos=True) for p in ps])
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 24) for p in ps]


def test_stats_are_consistent(target, host):
    outs = make_engine(target, host, ("random", {"gamma": 3})).generate(
        [GenerationRequest(prompt_ids=p, ignore_eos=True) for p in prompts(4)])
    for o in outs:
        s = o.stats
        assert s.emitted == len(o.token_ids) == 24
        assert s.accepted <= s.verified <= s.drafted
        assert len(s.accepted_per_position) == len(s.verified_per_position)
        assert all(a <= v for a, v in zip(s.accepted_per_position, s.verified_per_position))
        assert s.verified == sum(s.verified_per_position) and s.accepted == sum(s.accepted_per_position)
        assert s.verified_per_position[0] <= s.rounds
        # position k is reached when every earlier draft was accepted; k+1 only after k was accepted
        assert all(r <= v for r, v in zip(s.reached_per_position, s.verified_per_position))
        assert all(a <= r for a, r in zip(s.accepted_per_position, s.reached_per_position))
        assert all(nxt <= a for nxt, a in zip(s.reached_per_position[1:], s.accepted_per_position))
        assert abs(s.tau - (s.accepted + s.rounds) / s.rounds) < 1e-12


def test_seeded_sampling_does_not_depend_on_batch_mates(target, host):
    p = prompts(1, seed=11)[0]
    alone = make_engine(target, host, ("random", {"gamma": 3}), temperature=1.0).generate(
        [GenerationRequest(prompt_ids=p, seed=42, ignore_eos=True)])[0]
    crowd = make_engine(target, host, ("random", {"gamma": 3}), temperature=1.0).generate(
        [GenerationRequest(prompt_ids=q, seed=i, ignore_eos=True) for i, q in enumerate(prompts(3, 2))]
        + [GenerationRequest(prompt_ids=p, seed=42, ignore_eos=True)])[-1]
    assert alone.token_ids == crowd.token_ids


def test_streamed_events_add_up_to_the_output(target, host):
    engine = make_engine(target, host, ("ngram", {}))
    reqs = [GenerationRequest(prompt_ids=p, ignore_eos=True, request_id=10 + i) for i, p in enumerate(prompts(3))]
    seen: dict[int, list[int]] = {}
    finished = set()
    for ev in engine.stream(reqs):
        assert ev.request_id not in finished
        seen.setdefault(ev.request_id, []).extend(ev.token_ids)
        if ev.finished:
            finished.add(ev.request_id)
    assert finished == {10, 11, 12}
    for rid, tokens in seen.items():
        assert engine.output(rid).token_ids == tokens


def greedy_tokens(target, host, p, n=24):
    return make_engine(target, host).generate([GenerationRequest(prompt_ids=p, ignore_eos=True,
                                                                 max_new_tokens=n)])[0].token_ids


def test_eos_inside_an_accepted_block_truncates_there(target, host):
    p = prompts(1, seed=3)[0]
    full = greedy_tokens(target, host, p)
    eos = full[5]
    cut = full.index(eos)
    target_eos = TargetModel(target.hf_model, None, torch.float32)
    target_eos.eos_ids = frozenset({eos})
    for drafter in (None, ("ngram", {"gamma": 8}), ("random", {"gamma": 8})):
        out = make_engine(target_eos, host, drafter).generate([GenerationRequest(prompt_ids=p)])[0]
        assert out.token_ids == full[: cut + 1] and out.finish_reason == FinishReason.EOS


def test_max_new_tokens_inside_a_block(target, host):
    p = prompts(1, seed=4)[0]
    full = greedy_tokens(target, host, p)
    for n in (1, 2, 7):
        out = make_engine(target, host, ("random", {"gamma": 5})).generate(
            [GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)])[0]
        assert out.token_ids == full[:n] and out.finish_reason == FinishReason.LENGTH


def test_stop_string_truncates_tokens_and_text(target, host):
    p = prompts(1, seed=6)[0]
    full = greedy_tokens(target, host, p)
    # Without a tokenizer the engine's text is the ids joined by spaces.
    stop = f"{full[3]} {full[4]}"
    out = make_engine(target, host, ("ngram", {})).generate(
        [GenerationRequest(prompt_ids=p, stop=[stop], ignore_eos=True)])[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == full[:5]
    assert out.text == " ".join(map(str, full[:3])) + " "


def test_generate_gives_the_text_streaming_shows(target, host):
    """``generate`` decodes each output once, at the end; ``stream`` sends deltas every round —
    the same text either way (deltas joined), and the same cut at a stop string."""
    reqs = [GenerationRequest(prompt_ids=p, seed=i, ignore_eos=True) for i, p in enumerate(prompts(4, seed=9))]
    full = greedy_tokens(target, host, reqs[0].prompt_ids)
    reqs.append(GenerationRequest(prompt_ids=reqs[0].prompt_ids, stop=[f"{full[5]} {full[6]}"], ignore_eos=True))
    outs = make_engine(target, host, ("random", {"gamma": 3})).generate(reqs)
    engine = make_engine(target, host, ("random", {"gamma": 3}))
    streamed: dict[int, str] = {}
    ids = [engine.submit(r) for r in reqs]
    for event in engine.stream(()):
        streamed[event.request_id] = streamed.get(event.request_id, "") + event.text
    assert [o.text for o in outs] == [engine.output(i).text for i in ids]
    # The stream holds back a tail that may begin the stop string, so it never sends text the
    # stop then cuts off (one token a round, mostly: the stop's first half arrives a round early).
    assert [o.text for o in outs] == [streamed[i] for i in ids]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].text.endswith(f"{full[4]} ")


def test_context_limit_stops_a_request(target, host):
    p = prompts(1)[0]
    out = make_engine(target, host, ("ngram", {"gamma": 6}), context=len(p) + 5).generate(
        [GenerationRequest(prompt_ids=p, ignore_eos=True)])[0]
    assert out.finish_reason == FinishReason.CONTEXT and len(out.token_ids) == 5


def test_a_failing_request_does_not_stop_the_others(target, host):
    ps = prompts(3)
    engine = make_engine(target, host, ("ngram", {}), context=64)
    reqs = [GenerationRequest(prompt_ids=ps[0], ignore_eos=True),
            GenerationRequest(prompt_ids=list(range(2, 80)), ignore_eos=True),  # longer than the context
            GenerationRequest(prompt_ids=[VOCAB + 5], ignore_eos=True),  # not in the vocabulary
            GenerationRequest(prompt_ids=ps[2], ignore_eos=True),
            GenerationRequest(prompt_ids=ps[1], top_p=0.0),  # an out-of-range setting
            GenerationRequest(prompt_ids=ps[1], temperature=float("nan"))]
    outs = engine.generate(reqs)
    assert "context limit is 64" in outs[1].error and outs[1].finish_reason == FinishReason.ERROR
    assert "outside the vocabulary" in outs[2].error
    assert outs[4].error == "request 4: top_p=0.0 is out of range"
    assert outs[5].error == "request 5: temperature=nan is out of range"
    assert outs[0].token_ids == hf_greedy(target, ps[0], 24)
    assert outs[3].token_ids == hf_greedy(target, ps[2], 24)


class _NaNDrafter(test_drafters.RandomDrafter):
    """Reports a NaN law for request id 1 only."""

    def draft(self, ctx):
        block = super().draft(ctx)
        probs = block.probs.clone()
        for r, rid in enumerate(ctx.request_ids):
            if rid == 1:
                probs[r, 0, 0] = float("nan")
        return type(block)(tokens=block.tokens, lengths=block.lengths, probs=probs)


def test_non_finite_draft_law_fails_only_its_request(target, host):
    ps = prompts(3)
    engine = Engine(target, host.create_verifier("rejection"), drafter=_NaNDrafter(),
                    confidence=host.create_confidence("constant", {}),
                    calibrator=host.create_calibrator("identity", {}),
                    scheduler=host.create_scheduler("fixed", {}),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=24))
    outs = engine.generate([GenerationRequest(prompt_ids=p, ignore_eos=True, request_id=i)
                            for i, p in enumerate(ps)])
    assert outs[1].finish_reason == FinishReason.ERROR and "must be finite" in outs[1].error
    assert outs[0].token_ids == hf_greedy(target, ps[0], 24)
    assert outs[2].token_ids == hf_greedy(target, ps[2], 24)


def test_more_requests_than_slots_are_queued(target, host):
    ps = prompts(7)
    outs = make_engine(target, host, ("ngram", {}), batch=2).generate(
        [GenerationRequest(prompt_ids=p, ignore_eos=True) for p in ps])
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 24) for p in ps]


def _passes_per_step(engine, monkeypatch) -> list[tuple[int, dict[int, int], set[int]]]:
    """Run ``engine`` to the end; per step: its target passes, how far each prefilling request's
    prompt advanced, and which decoding requests emitted tokens."""
    calls = []
    forward = engine.target.forward
    monkeypatch.setattr(engine.target, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    steps = []
    while engine.busy:
        before = {rid: 0 for rid, _ in engine._queue} | {s.request_id: s.prefilled for s in engine._prefilling}
        n = len(calls)
        events = engine.step()
        after = {s.request_id: s.prefilled for s in (*engine._prefilling, *engine._active)}
        steps.append((len(calls) - n, {rid: after[rid] - p for rid, p in before.items() if after.get(rid, p) > p},
                      {e.request_id for e in events if e.token_ids}))
    return steps


@pytest.mark.parametrize("drafter", [None, ("ngram", {"gamma": 4})], ids=["plain", "ngram"])
def test_chunked_prefill_rides_in_the_decoding_pass(target, host, drafter, monkeypatch):
    # 2 slots, 6 requests: every later prompt is prefilled, 5 tokens a round, while others decode
    ps = [p * 2 for p in prompts(6)]  # 24-48 tokens: several chunks each
    engine = make_engine(target, host, drafter, batch=2, chunk=5)
    new = [8 + 5 * (i % 3) for i in range(len(ps))]  # requests finish at different rounds
    for p, n in zip(ps, new):
        engine.submit(GenerationRequest(prompt_ids=p, ignore_eos=True, max_new_tokens=n))
    steps = _passes_per_step(engine, monkeypatch)
    # steps where a prompt advanced while another request decoded
    mixed = [(passes, advanced) for passes, advanced, emitted in steps if advanced and emitted - set(advanced)]
    assert mixed, "no prompt chunk shared a pass with decoding requests"
    for passes, advanced in mixed:
        assert passes == 1  # the chunk rode in the decoding requests' pass
        assert max(advanced.values()) <= 5
    outs = [engine.take_output(i) for i in range(len(ps))]
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, n) for p, n in zip(ps, new)]


def test_every_waiting_prompt_prefills_its_own_chunk_each_round(target, host, monkeypatch):
    # 4 slots: one long request decodes while three short ones finish together; the three prompts
    # admitted into their slots then advance a chunk each per round, not one chunk between them
    ps = [p * 2 for p in prompts(7)]
    engine = make_engine(target, host, batch=4, chunk=5)
    for i, p in enumerate(ps):
        engine.submit(GenerationRequest(prompt_ids=p, ignore_eos=True, max_new_tokens=40 if i == 0 else 6))
    steps = _passes_per_step(engine, monkeypatch)
    mixed = [advanced for passes, advanced, emitted in steps if advanced and emitted - set(advanced)]
    assert any(len(advanced) == 3 for advanced in mixed), "the three freed slots' prompts did not prefill together"
    for advanced in mixed:
        assert max(advanced.values()) <= 5 and len(advanced) <= 3
    assert [engine.take_output(i).token_ids for i in range(len(ps))] == [
        hf_greedy(target, p, 40 if i == 0 else 6) for i, p in enumerate(ps)]


def test_prefill_off_runs_each_admitted_prompt_whole_in_its_own_pass(target, host, monkeypatch):
    ps = [p * 2 for p in prompts(4)]
    engine = make_engine(target, host, batch=2, chunk="off")
    for i, p in enumerate(ps):
        engine.submit(GenerationRequest(prompt_ids=p, ignore_eos=True, max_new_tokens=24 - 6 * i))
    steps = _passes_per_step(engine, monkeypatch)
    prefills = [(passes, advanced) for passes, advanced, _ in steps if advanced]
    assert len(prefills) == 3  # the first two together, then each later one when a slot frees
    assert all(passes == 2 for passes, _ in prefills)  # the prefill pass, then the round's
    # each prompt went in whole (all but its anchor)
    assert sorted(n for _, advanced in prefills for n in advanced.values()) == sorted(len(p) - 1 for p in ps)
    assert [engine.take_output(i).token_ids for i in range(4)] == [hf_greedy(target, p, 24 - 6 * i)
                                                                  for i, p in enumerate(ps)]


def test_seeded_sampling_does_not_depend_on_the_prefill_chunk(target, host):
    ps = [p * 2 for p in prompts(5)]
    runs = []
    for chunk in ("off", 4, 11):
        engine = make_engine(target, host, ("ngram", {"gamma": 3}), batch=2, temperature=1.0, chunk=chunk)
        runs.append([o.token_ids for o in engine.generate(
            [GenerationRequest(prompt_ids=p, ignore_eos=True, seed=i, max_new_tokens=6 + 5 * i)
             for i, p in enumerate(ps)])])
    assert runs[0] == runs[1] == runs[2]


def test_take_output_hands_over_and_forgets(target, host):
    engine = make_engine(target, host, ("ngram", {}))
    rid = engine.submit(GenerationRequest(prompt_ids=prompts(1)[0], ignore_eos=True, max_new_tokens=5))
    for _ in engine.stream(()):
        pass
    out = engine.take_output(rid)
    assert len(out.token_ids) == 5
    with pytest.raises(KeyError):
        engine.output(rid)


def test_a_stream_holds_back_the_longest_tail_that_begins_a_stop_string():
    assert stop_prefix_length("the end is ne", ["near", "end."]) == 2  # "ne" begins "near"
    assert stop_prefix_length("the end", ["end.", "d"]) == 3  # "end" begins "end."; "d" is whole
    assert stop_prefix_length("abc", ["xyz"]) == 0 and stop_prefix_length("", ["a"]) == 0
    assert stop_prefix_length("aaa", ["aaab"]) == 3 and stop_prefix_length("ab", ["b", "bc"]) == 1


def test_a_cache_that_could_outgrow_the_memory_is_refused_naming_max_batch(host, monkeypatch):
    """A torch cache's pages are touched as it fills: too big a one would be killed mid-run with no
    message, so the engine refuses it up front, naming the keys and the largest max_batch that fits."""
    from specforge.engine import engine as engine_mod
    from specforge.errors import ConfigError

    target = TargetModel(tiny_model("llama", seed=0), None, torch.float32)
    per_slot = target.cache_bytes(1, 64)
    a = target.runtime.args
    assert per_slot == 2 * a.n_layers * a.n_kv_heads * 64 * a.head_dim * target.runtime.cache_dtype().itemsize
    monkeypatch.setattr(engine_mod, "memory_available", lambda: 5 * per_slot)  # a machine with room for 5 slots
    with pytest.raises(ConfigError) as err:
        Engine(target, host.create_verifier("greedy"), engine=EngineConfig(max_batch=8, max_context=64))
    assert "engine.max_batch=8" in str(err.value) and "≤ 5 fits" in str(err.value), err.value
    assert "engine.max_context" in str(err.value)
    Engine(target, host.create_verifier("greedy"), engine=EngineConfig(max_batch=5, max_context=64))

"""The ``dspark`` drafter in the engine: feature plumbing, greedy parity, its reported law, state.

A random-init drafter on a tiny target (3 layers, d = 64, V = 96) drafts badly, which is what
these tests want: rejections at every position exercise the feature hand-over after rollbacks.
"""

from __future__ import annotations

import pytest
import torch

from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.sampling import warp
from specforge.passes import VarlenBatch
from specforge.runtime import TargetModel
from specforge_plugins.drafters.block.checkpoint import save_drafter
from specforge_plugins.drafters.dspark import DSparkConfig, DSparkDrafter
from tiny_models import tiny_model
from tolerances import order_tolerance

VOCAB = 96
HEADS = ("none", "markov", "gated", "rnn")
CONFIDENCES = ("dspark-head", "entropy")
PROMPTS = ([5], [5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 15, 16, 17])


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=7, vocab=VOCAB, eos=None), None, torch.float32)


def head_config(name: str) -> dict:
    # zero_init off: a real, non-zero bias, so the head's effect on the law is tested.
    return {} if name == "none" else {"rank": 8, "zero_init": False, "seed": 3}


# hw-prefix whose drafting costs three plain steps: drafting never pays, so after each drafted
# round the gate runs two plain rounds (features pile up between drafts).
GATED = ("hw-prefix", {"sps": [1.0, 0.5, 0.45], "draft_cost": 3.0, "probe_every": 2})


def make_engine(target, host, drafter=None, head="markov", confidence="dspark-head", batch=3,
                temperature=0.0, top_k=0, new=12, verifier="rejection", scheduler=("fixed", {}), chunk="auto"):
    drafter = drafter if drafter is not None else host.create_drafter("dspark", {"gamma": 4, "layers": 2})
    return Engine(target, host.create_verifier(verifier), drafter=drafter,
                  correction_head=host.create_correction_head(head, head_config(head)),
                  confidence=host.create_confidence(confidence, {"rank": 8} if confidence == "dspark-head" else {}),
                  calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler(*scheduler),
                  sampling=SamplingConfig(temperature=temperature, top_k=top_k, max_new_tokens=new),
                  engine=EngineConfig(max_batch=batch, max_context=96, prefill_chunk=chunk))


def requests(new: int = 12) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=p, max_new_tokens=new, seed=i) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def greedy(target, host):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                   engine=EngineConfig(max_batch=4, max_context=96))
    return [o.token_ids for o in plain.generate(requests())]


class Recorder(DSparkDrafter):
    """Keeps every context and block the engine exchanges with the drafter."""

    def __init__(self, config=None):
        super().__init__(config)
        self.calls = []

    def draft(self, ctx):
        block = super().draft(ctx)
        self.calls.append((ctx, block))
        return block


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("confidence", CONFIDENCES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_equals_plain_decoding(target, host, greedy, head, confidence, batch):
    engine = make_engine(target, host, head=head, confidence=confidence, batch=batch)
    outs = engine.generate(requests())
    assert [o.token_ids for o in outs] == greedy
    assert all(o.error is None for o in outs)
    assert sum(o.stats.verified for o in outs) > 0  # drafts were really verified


def test_gated_rounds_keep_greedy_parity(target, host, greedy):
    engine = make_engine(target, host, batch=3, scheduler=GATED)
    outs = engine.generate(requests())
    assert [o.token_ids for o in outs] == greedy
    assert engine.plain_rounds > 0 and sum(o.stats.drafted for o in outs) > 0  # both kinds of round ran


@pytest.mark.parametrize(("scheduler", "chunk"), [(("fixed", {}), "auto"), (GATED, "auto"), (("fixed", {}), 3)],
                         ids=["every-round", "gated", "every-round-chunked-prefill"])
def test_features_are_the_targets_taps_of_exactly_the_committed_positions(target, host, scheduler, chunk):
    # batch 3 < the prompts: the later ones are prefilled (in 3-token chunks: inside the decoding
    # requests' passes) while the first ones decode
    drafter = Recorder(host.get("drafter", "dspark").config(gamma=3, layers=1, target_layers=(2, 0)))
    engine = make_engine(target, host, drafter=drafter, temperature=1.0, batch=3, scheduler=scheduler, chunk=chunk)
    assert engine.taps == (2, 0)
    outs = engine.generate(requests())
    got: dict[int, list] = {}
    for ctx, _ in drafter.calls:
        f = ctx.features
        assert f.layers == (2, 0) and f.states.shape[1:] == (2, target.args.dim)
        for r, rid in enumerate(ctx.request_ids):
            pos, states = f.request(r)
            got.setdefault(rid, []).append((pos, states))
            # Everything handed over so far is exactly the committed tokens before the anchor.
            seen = torch.cat([p for p, _ in got[rid]])
            assert torch.equal(seen, torch.arange(len(ctx.histories[r]) - 1))
    worst, tolerance = 0.0, 0.0
    for rid, out in enumerate(outs):
        ids = [*out.prompt_ids, *out.token_ids]
        cache = target.new_cache(1, 96)
        ref = target.forward(VarlenBatch.build([ids], [0], [0]), cache, taps=(0, 2)).taps
        pos = torch.cat([p for p, _ in got[rid]])
        states = torch.cat([s for _, s in got[rid]])
        worst = max(worst, float((states[:, 0] - ref[2][pos]).abs().max()),
                    float((states[:, 1] - ref[0][pos]).abs().max()))
        # fp32 taps of incremental (cached) passes vs one full prefill: the same maths over other
        # matmul shapes, so they differ by rounding alone (a wrong position would differ by O(1))
        scale = max(float(ref[2][pos].abs().max()), float(ref[0][pos].abs().max()))
        tolerance = max(tolerance, order_tolerance(torch.float32, target.args.intermediate_size, scale,
                                                   depth=target.args.n_layers))
    assert worst <= tolerance, (worst, tolerance)
    assert (engine.plain_rounds > 0) == (scheduler is GATED)


def test_no_taps_for_plain_decoding_or_model_free_drafters(target, host, monkeypatch):
    asked = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **kw: asked.append(kw.get("taps", ())) or forward(*a, **kw))
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))
    plain.generate(requests(4))
    ngram = make_engine(target, host, drafter=host.create_drafter("ngram", {}), head="none", confidence="constant")
    ngram.generate(requests(4))
    assert asked and all(t == () for t in asked)


def test_release_frees_each_finished_requests_context(target, host):
    engine = make_engine(target, host, batch=4)
    for i, p in enumerate(PROMPTS):
        engine.submit(GenerationRequest(prompt_ids=p, max_new_tokens=2 + 6 * i, seed=i))
    contexts = engine.drafter._contexts
    while engine.busy:
        engine.step()
        live = {s.request_id for s in engine._active}
        assert {rid for rid in range(len(PROMPTS)) if rid in contexts} <= live
    assert len(contexts) == 0


@pytest.mark.parametrize("head", HEADS)
def test_reported_law_is_the_warp_of_the_head_corrected_logits(target, host, head):
    drafter = Recorder(host.get("drafter", "dspark").config(gamma=4, layers=2))
    engine = make_engine(target, host, drafter=drafter, head=head, temperature=0.8, top_k=20)
    engine.generate(requests())
    correction = engine.correction_head
    with torch.inference_mode():  # the block's tensors are inference tensors, as in the engine
        check_laws(drafter.calls, drafter.backbone, correction)


def check_laws(calls, backbone, correction):
    for ctx, block in calls:
        g = block.tokens.shape[1]
        if g == 0:
            continue
        base = backbone.logits(block.hidden)
        state, prev = correction.init_state(len(ctx)), block.anchor
        for k in range(g):
            expected, state = correction.step(base[:, k], prev, block.hidden[:, k], state)
            torch.testing.assert_close(block.logits[:, k], expected, rtol=0, atol=1e-6)
            prev = block.tokens[:, k]
        torch.testing.assert_close(block.probs, warp(block.logits, ctx.sampling), rtol=0, atol=1e-7)
        drawn = block.probs.gather(-1, block.tokens[..., None])
        assert bool((drawn > 0).all())  # every token lies in the support of its reported law
        assert int((block.probs > 0).sum(-1).max()) <= 20  # top-k applied to the reported law


@pytest.mark.parametrize("head", HEADS)
def test_the_restricted_sequential_stage_reports_the_law_it_samples(target, host, head):
    """With ``candidates=K`` the head's bias is computed on the top-K of U_k only; q_k is the warp
    of the corrected logits on those K tokens — exactly what x_k is drawn from — and zero
    elsewhere.  The bias on the candidates equals the full-vocabulary head's there."""
    k_top = 6
    drafter = Recorder(host.get("drafter", "dspark").config(gamma=4, layers=2, candidates=k_top))
    engine = make_engine(target, host, drafter=drafter, head=head, temperature=0.9, top_k=4)
    engine.generate(requests())
    correction = engine.correction_head
    with torch.inference_mode():
        for ctx, block in drafter.calls:
            g = block.tokens.shape[1]
            if g == 0:
                continue
            base = drafter.backbone.logits(block.hidden)
            support = base.topk(k_top, dim=-1).indices
            inside = torch.zeros_like(block.probs, dtype=torch.bool).scatter(-1, support, True)
            assert bool((block.probs[~inside] == 0).all()) and bool(torch.isinf(block.logits[~inside]).all())
            torch.testing.assert_close(block.probs.sum(-1), torch.ones(block.probs.shape[:2]), rtol=0, atol=1e-6)
            state, prev = correction.init_state(len(ctx)), block.anchor
            for k in range(g):
                full, state = correction.step(base[:, k], prev, block.hidden[:, k], state)
                torch.testing.assert_close(block.logits[:, k].gather(1, support[:, k]), full.gather(1, support[:, k]),
                                           rtol=0, atol=1e-5)
                prev = block.tokens[:, k]
            # The reported law is the warp (T = 0.9, top-4) of the logits on the candidates.
            restricted = block.logits.gather(-1, support)
            torch.testing.assert_close(block.probs.gather(-1, support), warp(restricted, ctx.sampling), rtol=0, atol=1e-7)
            drawn = block.probs.gather(-1, block.tokens[..., None])
            assert bool((drawn > 0).all()) and int((block.probs > 0).sum(-1).max()) <= 4


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("candidates", [None, 5])
def test_a_random_init_over_a_draft_vocabulary_proposes_only_inside_it(target, host, head, candidates, greedy):
    """``draft_vocab=N`` on a random init: a seeded set of N target ids; the engine restricts the
    untrained heads to it; every proposed token lies inside, q is zero outside, and greedy
    decoding still equals plain decoding."""
    drafter = Recorder(host.get("drafter", "dspark").config(gamma=4, layers=1, draft_vocab=12, seed=5,
                                                             candidates=candidates))
    engine = make_engine(target, host, drafter=drafter, head=head, temperature=1.0)
    outs = engine.generate(requests())
    assert all(o.error is None for o in outs)
    inside = drafter.draft_vocab.t2d
    assert drafter.draft_vocab.size == 12 and int(inside.sum()) == 12
    for _, block in drafter.calls:
        if block.tokens.shape[1]:
            assert bool(inside[block.tokens].all()) and bool((block.probs[..., ~inside] == 0).all())
            torch.testing.assert_close(block.probs.sum(-1), torch.ones(block.probs.shape[:2]), rtol=0, atol=1e-5)
    greedy_engine = make_engine(target, host, drafter=host.create_drafter(
        "dspark", {"gamma": 4, "layers": 1, "draft_vocab": 12, "seed": 5, "candidates": candidates}), head=head)
    assert [o.token_ids for o in greedy_engine.generate(requests())] == greedy


def test_greedy_law_is_one_hot_argmax(target, host):
    drafter = Recorder(host.get("drafter", "dspark").config(gamma=3, layers=1))
    make_engine(target, host, drafter=drafter).generate(requests(6))
    for _, block in drafter.calls:
        if block.tokens.shape[1]:
            assert torch.equal(block.tokens, block.logits.argmax(-1))
            assert torch.equal(block.probs, torch.nn.functional.one_hot(block.tokens, VOCAB).float())


def test_checkpoint_drafts_exactly_like_the_model_it_saved(target, host, tmp_path):
    fresh = make_engine(target, host, drafter=host.create_drafter("dspark", {"gamma": 4, "layers": 2, "seed": 5}))
    save_drafter(tmp_path, fresh.drafter.backbone, fresh.correction_head)
    reference = [o.token_ids for o in fresh.generate(requests())]
    # A pipeline head with other random weights: the checkpoint's trained weights replace them.
    loaded = Engine(target, host.create_verifier("rejection"),
                    drafter=host.create_drafter("dspark", {"checkpoint": str(tmp_path)}),
                    correction_head=host.create_correction_head("markov", {"rank": 8, "seed": 99}),
                    confidence=host.create_confidence("entropy", {}),
                    calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler("fixed", {}),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                    engine=EngineConfig(max_batch=3, max_context=96))
    assert loaded.drafter.gamma == 4
    assert torch.equal(loaded.correction_head.w2, fresh.correction_head.w2)
    assert [o.token_ids for o in loaded.generate(requests())] == reference
    with pytest.raises(ValueError, match="MarkovHead.*GatedHead"):
        make_engine(target, host, drafter=host.create_drafter("dspark", {"checkpoint": str(tmp_path)}), head="gated")


def test_a_bf16_checkpoint_runs_in_float32_with_the_same_greedy_output(target, host, tmp_path, greedy):
    """A drafter stored in bf16 (as the shipped one is) serving a float32 target — what
    ``target.dtype: auto`` picks where float32 is faster — computes in float32 on the stored
    values widened exactly: it drafts as a float32 checkpoint of those values does, and greedy
    speculation still gives plain greedy decoding's tokens."""
    from specforge.toolkit.checkpoints import read_checkpoint, write_checkpoint
    from specforge_plugins.drafters.block.checkpoint import FORMAT, VERSION

    fresh = make_engine(target, host, drafter=host.create_drafter("dspark", {"gamma": 4, "layers": 2, "seed": 5}))
    save_drafter(tmp_path / "f32", fresh.drafter.backbone, fresh.correction_head)
    meta, tensors = read_checkpoint(tmp_path / "f32", FORMAT, VERSION, "dspark")
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}
    write_checkpoint(tmp_path / "bf16", meta, half)
    write_checkpoint(tmp_path / "widened", meta, {k: v.float() if v.is_floating_point() else v for k, v in half.items()})

    def engine(name):
        return Engine(target, host.create_verifier("rejection"),
                      drafter=host.create_drafter("dspark", {"checkpoint": str(tmp_path / name)}),
                      correction_head=host.create_correction_head("markov", {"rank": 8}),
                      confidence=host.create_confidence("entropy", {}), calibrator=host.create_calibrator("identity", {}),
                      scheduler=host.create_scheduler("fixed", {}),
                      sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                      engine=EngineConfig(max_batch=3, max_context=96))

    stored, widened = engine("bf16"), engine("widened")
    assert {p.dtype for p in stored.drafter.backbone.parameters()} == {torch.float32}
    outs, ref = stored.generate(requests()), widened.generate(requests())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref] == greedy
    assert [(o.stats.drafted, o.stats.accepted) for o in outs] == [(o.stats.drafted, o.stats.accepted) for o in ref]
    assert sum(o.stats.drafted for o in outs) > 0


def test_the_engine_owns_the_round_components(target, host, tmp_path):
    """Lifecycle of specforge.components: the engine binds, loads the checkpoint's companion
    weights, lets the confidence head share the correction head's table, and hands the head to
    the drafter per round; the drafter keeps no reference to it."""
    fresh = make_engine(target, host, drafter=host.create_drafter("dspark", {"gamma": 3, "layers": 1, "seed": 2}))
    save_drafter(tmp_path, fresh.drafter.backbone, fresh.correction_head, fresh.confidence)
    tied = host.create_confidence("dspark-head", {"rank": 8, "embedding": "head"})
    engine = make_engine(target, host, drafter=Recorder(DSparkConfig(checkpoint=str(tmp_path))))
    assert torch.equal(engine.confidence.proj.weight, fresh.confidence.proj.weight)
    engine.generate(requests(4))
    assert engine.drafter.calls and all(ctx.correction_head is engine.correction_head
                                        for ctx, _ in engine.drafter.calls)
    assert not any(v is engine.correction_head for v in vars(engine.drafter).values())
    assert not hasattr(engine.drafter, "attach")

    # embedding='head' reads the pipeline head's token embedding, after its weights were loaded.
    shared = Engine(target, host.create_verifier("rejection"), drafter=host.create_drafter("dspark", {"gamma": 3}),
                    correction_head=host.create_correction_head("markov", {"rank": 8}), confidence=tied,
                    calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler("fixed", {}))
    assert shared.confidence.table is shared.correction_head.w1
    with pytest.raises(ValueError, match=r"confidence.embedding: 'head' reads the correction head's token embedding"):
        Engine(target, host.create_verifier("rejection"), drafter=host.create_drafter("dspark", {"gamma": 3}),
               correction_head=host.create_correction_head("none", {}),
               confidence=host.create_confidence("dspark-head", {"rank": 8, "embedding": "head"}),
               calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler("fixed", {}))
    # A trained head of another rank is one error naming the key to change.
    with pytest.raises(ValueError, match=r"correction_head.rank: .* \(trained with rank 8; set correction_head.rank=8\)"):
        Engine(target, host.create_verifier("rejection"), drafter=host.create_drafter("dspark", {"checkpoint": str(tmp_path)}),
               correction_head=host.create_correction_head("markov", {"rank": 4}),
               confidence=host.create_confidence("entropy", {}), calibrator=host.create_calibrator("identity", {}),
               scheduler=host.create_scheduler("fixed", {}))


def test_layer_ids_are_checked_against_the_targets_depth(target, host):
    with pytest.raises(ValueError, match="layer 3 is outside the target's 3 layers"):
        make_engine(target, host, drafter=host.create_drafter("dspark", {"target_layers": [1, 3]}))
    with pytest.raises(ValueError, match="come from the checkpoint"):
        host.create_drafter("dspark", {"checkpoint": "x", "layers": 2})
    # The default spreads its taps inside whatever depth the target has.
    engine = make_engine(target, host)
    assert engine.taps and max(engine.taps) < target.args.n_layers


def test_dflash_layout_runs_losslessly_at_t0(target, host, greedy):
    engine = make_engine(target, host, drafter=host.create_drafter("dflash", {"gamma": 3, "layers": 1}))
    assert [o.token_ids for o in engine.generate(requests())] == greedy

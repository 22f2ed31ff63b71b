"""DSpark model pieces (paper §3; docs/design/drafters.md): block backbone, correction heads,
confidence head, losses and checkpoints — pure modules on tiny dimensions (d=32, V=40, γ=4)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from specforge.components import ConfidenceEstimator, CorrectionHead, DraftBlock
from specforge.plugins import PluginHost
from specforge.toolkit.checkpoints import DrafterCheckpointError
from specforge.toolkit.confidence_head import DSparkConfidence, DSparkHeadConfig
from specforge.toolkit.heads import HEADS, HeadConfig
from specforge.toolkit.layers import SharedWeights
from specforge.toolkit.losses import dspark_loss, position_weights, teacher_probs, valid_prefix
from specforge_plugins.drafters.block import (
    MASK,
    BlockBackbone,
    BlockDrafterConfig,
    block_attention_mask,
    default_tap_layers,
)
from specforge_plugins.drafters.block.checkpoint import load_drafter, save_drafter

D, V, GAMMA, L = 32, 40, 4, 8
R = 3  # blocks


def config(**overrides) -> BlockDrafterConfig:
    base = dict(vocab_size=V, dim=D, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                n_target_layers=L, draft_layers=2, gamma=GAMMA)
    return BlockDrafterConfig(**{**base, **overrides})


def shared(seed: int = 0) -> SharedWeights:
    gen = torch.Generator().manual_seed(seed)
    frozen = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731  (as the target holds them)
    return SharedWeights(embed=frozen(torch.randn(V, D, generator=gen)),
                         lm_head=frozen(torch.randn(V, D, generator=gen)))


def context(n: int = R, c: int = 10, seed: int = 1) -> torch.Tensor:
    m = len(config().tap_layers)
    return torch.randn(n, c, m * D, generator=torch.Generator().manual_seed(seed))


# --- backbone --------------------------------------------------------------------------------


def test_default_tapped_layers_spread_from_1_to_L_minus_3():
    assert default_tap_layers(30) == (1, 8, 14, 20, 27)
    assert default_tap_layers(8) == (1, 2, 3, 4, 5)
    assert default_tap_layers(2) == (1,) and default_tap_layers(1) == (0,)
    assert config().tap_layers == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="outside the target"):
        config(target_layers=(1, 8))
    with pytest.raises(ValueError):
        config(unknown=1)


def test_block_mask_equals_a_dense_loop_reference():
    gen = torch.Generator().manual_seed(0)
    c, s = 9, GAMMA
    anchor = torch.tensor([0, 4, 12])
    positions = torch.randint(0, 14, (R, c), generator=gen)  # unsorted, repeated: the rule is by value
    valid = torch.rand(R, c, generator=gen) > 0.3
    mask = block_attention_mask(anchor, s, positions, valid)
    ref = torch.zeros(R, s, c + s, dtype=torch.bool)
    for b in range(R):
        for i in range(s):
            for j in range(c + s):
                if j < c:
                    ref[b, i, j] = bool(valid[b, j]) and int(positions[b, j]) < int(anchor[b])
                else:
                    ref[b, i, j] = True  # bidirectional inside the block
    assert torch.equal(mask, ref)
    assert torch.equal(block_attention_mask(anchor, s, positions), block_attention_mask(
        anchor, s, positions, torch.ones(R, c, dtype=torch.bool)))


def test_backbone_sees_context_strictly_before_its_anchor_and_its_whole_block():
    model = BlockBackbone(config(), shared()).eval()
    feats = context()
    anchor_pos = torch.tensor([3, 6, 10])
    ids = model.make_block(torch.tensor([5, 6, 7]))
    assert ids.shape == (R, GAMMA) and (ids[:, 1:] == MASK).all()
    hidden, logits = model(ids, feats, anchor_pos)
    assert hidden.shape == (R, GAMMA, D) and logits.shape == (R, GAMMA, V) and logits.dtype == torch.float32
    assert torch.allclose(logits, hidden @ model.shared.lm_head.t(), atol=1e-5)  # the shared LM head
    # Features at or after the anchor's position must not matter; those before must.
    later = feats.clone()
    for b, a in enumerate(anchor_pos.tolist()):
        later[b, a:] = torch.randn_like(later[b, a:])
    assert torch.allclose(model(ids, later, anchor_pos)[0], hidden, atol=1e-6)
    earlier = feats.clone()
    earlier[:, 0] += 1.0
    assert not torch.allclose(model(ids, earlier, anchor_pos)[0], hidden, atol=1e-4)
    # Bidirectional block: changing the anchor token moves every slot.
    other = ids.clone()
    other[:, 0] = 0
    moved = (model(other, feats, anchor_pos)[0] - hidden).abs().amax(-1)
    assert (moved > 1e-4).all()


def test_ctx_index_shares_one_sequence_among_many_anchors():
    model = BlockBackbone(config(), shared()).eval()
    feats = context(n=1, c=12)
    anchor_pos = torch.tensor([2, 5, 11])
    ids = model.make_block(torch.tensor([1, 2, 3]))
    shared_run = model(ids, feats, anchor_pos, ctx_index=torch.zeros(R, dtype=torch.long))[0]
    repeated = model(ids, feats.expand(R, -1, -1), anchor_pos)[0]
    assert torch.allclose(shared_run, repeated, atol=1e-6)


def test_dflash_layout_predicts_the_gamma_mask_slots():
    model = BlockBackbone(config(predict_anchor=False, mask_token_id=39), shared()).eval()
    ids = model.make_block(torch.tensor([5, 6, 7]))
    assert ids.shape == (R, GAMMA + 1) and (ids[:, 1:] == 39).all()
    hidden, logits = model(ids, context(), torch.tensor([3, 6, 10]))
    assert hidden.shape == (R, GAMMA, D) and logits.shape == (R, GAMMA, V)
    assert model.mask_embed is None


def test_shared_embedding_and_lm_head_are_frozen_references_not_parameters():
    sh = shared()
    model = BlockBackbone(config(), sh)
    assert all(p is not sh.embed and p is not sh.lm_head for p in model.parameters())
    assert not any("embed" in k and k != "mask_embed" for k in model.state_dict())
    assert "mask_embed" in model.state_dict()
    _, logits = model(model.make_block(torch.tensor([1, 2, 3])), context(), torch.tensor([3, 6, 10]))
    logits.sum().backward()
    assert sh.embed.grad is None and sh.lm_head.grad is None
    assert model.fc.weight.grad is not None and model.mask_embed.grad is not None
    # Seeded init, independent of the global RNG.
    torch.manual_seed(123)
    again = BlockBackbone(config(), sh)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


# --- correction heads ------------------------------------------------------------------------


def make_head(name: str, **cfg):
    return HEADS[name](HeadConfig(rank=8, vocab_size=V, dim=D, zero_init=False, **cfg))


@pytest.mark.parametrize("name", ["markov", "gated", "rnn"])
def test_step_by_step_sampling_equals_teacher_forced_training(name):
    head = make_head(name)
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(R, GAMMA, V, generator=gen)
    hidden = torch.randn(R, GAMMA, D, generator=gen)
    anchor = torch.randint(0, V, (R,), generator=gen)
    # Sample left to right with the head, then replay the sampled tokens teacher-forced.
    state, prev, tokens, stepped = head.init_state(R), anchor, [], []
    for k in range(GAMMA):
        logits, state = head.step(base[:, k], prev, hidden[:, k], state)
        prev = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
        stepped.append(logits)
        tokens.append(prev)
    prev_tokens = torch.stack([anchor] + tokens[:-1], dim=1)
    trained = head.forward_train(base, prev_tokens, hidden)
    assert torch.allclose(trained, torch.stack(stepped, 1), atol=1e-5)
    assert not torch.allclose(trained, base)  # a real bias


def test_head_formulas():
    gen = torch.Generator().manual_seed(3)
    prev = torch.randint(0, V, (R,), generator=gen)
    h = torch.randn(R, D, generator=gen)
    zeros = torch.zeros(R, V)
    markov = make_head("markov")
    assert torch.allclose(markov.step(zeros, prev, None, None)[0], markov.w1[prev] @ markov.w2)
    gated = make_head("gated")
    e = gated.w1[prev]
    expect = (torch.sigmoid(gated.gate(torch.cat([h, e], -1))) * e) @ gated.w2
    assert torch.allclose(gated.step(zeros, prev, h, None)[0], expect)
    rnn = make_head("rnn")
    e = rnn.w1[prev]
    s0 = rnn.init_state(R)
    assert torch.equal(s0, torch.zeros(R, 8))  # s_0 = 0
    g, c, o = rnn.cell(torch.cat([s0, e, h], -1)).chunk(3, -1)
    bias, s1 = rnn.step(zeros, prev, h, s0)
    assert torch.allclose(bias, torch.tanh(o) @ rnn.w2)
    assert torch.allclose(s1, (1 - torch.sigmoid(g)) * torch.tanh(c))
    # Default init: W2 = 0, the head starts as the identity.
    fresh = HEADS["markov"](HeadConfig(rank=8, vocab_size=V))
    assert torch.equal(fresh.step(zeros, prev, None, None)[0], zeros)
    with pytest.raises(ValueError, match="hidden"):
        gated.step(zeros, prev, None, None)


def test_head_weights_load_from_a_safetensors_path(tmp_path):
    head = make_head("rnn", seed=5)
    head.save(str(tmp_path / "rnn.safetensors"))
    other = HEADS["rnn"](HeadConfig(rank=8, vocab_size=V, dim=D, weights=str(tmp_path / "rnn.safetensors")))
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), other.state_dict().values()))
    lazy = HEADS["rnn"](HeadConfig(rank=8, seed=5, zero_init=False))
    assert not lazy.built
    lazy.bind(type("Target", (), {"args": config()})())  # sizes from the target's args
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), lazy.state_dict().values()))


# --- confidence head -------------------------------------------------------------------------


def draft_block(seed: int = 4, **overrides) -> DraftBlock:
    gen = torch.Generator().manual_seed(seed)
    fields = dict(tokens=torch.randint(0, V, (R, GAMMA), generator=gen), lengths=torch.full((R,), GAMMA),
                  hidden=torch.randn(R, GAMMA, D, generator=gen), anchor=torch.randint(0, V, (R,), generator=gen))
    return DraftBlock(**{**fields, **overrides})


@pytest.mark.parametrize("embedding", ["own", "head"])
def test_dspark_head_never_reads_the_token_at_k(embedding):
    conf = DSparkConfidence(DSparkHeadConfig(rank=8, vocab_size=V, dim=D, embedding=embedding))
    if embedding == "head":
        conf.tie(make_head("markov"))
    base = draft_block()
    c = conf.estimate(base)
    assert c.shape == (R, GAMMA) and ((c > 0) & (c < 1)).all()
    for k in range(GAMMA):
        tokens = base.tokens.clone()
        tokens[:, k:] = (tokens[:, k:] + 1 + torch.arange(GAMMA - k)) % V  # x_k and later change
        changed = conf.estimate(draft_block(tokens=tokens))
        assert torch.equal(changed[:, : k + 1], c[:, : k + 1])  # c_1..c_{k+1} (0-based ≤ k) fixed
        if k + 1 < GAMMA:
            assert not torch.equal(changed[:, k + 1], c[:, k + 1])  # but c_{k+2} reads x_{k+1}
    anchored = conf.estimate(draft_block(anchor=(base.anchor + 1) % V))
    assert not torch.equal(anchored[:, 0], c[:, 0])  # x_0 = the anchor feeds c_1
    # The formula: σ(w·[h_k ; E[x_{k−1}]] + b).
    prev = torch.cat([base.anchor[:, None], base.tokens[:, :-1]], 1)
    x = torch.cat([base.hidden, conf.table[prev]], -1)
    assert torch.allclose(c, torch.sigmoid(x @ conf.proj.weight[0] + conf.proj.bias[0]), atol=1e-6)


def test_tied_confidence_uses_and_trains_the_heads_W1():
    head = make_head("markov")
    conf = DSparkConfidence(DSparkHeadConfig(rank=8, vocab_size=V, dim=D, embedding="head"))
    with pytest.raises(RuntimeError, match="tie"):
        conf.estimate(draft_block())
    conf.tie(head)
    assert conf.table is head.w1 and "embed" not in conf.state_dict()
    b = draft_block()
    conf.logits(b.hidden, b.tokens).sum().backward()
    assert head.w1.grad is not None and head.w1.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="rank"):
        DSparkConfidence(DSparkHeadConfig(rank=4, vocab_size=V, dim=D, embedding="head")).tie(head)


# --- losses ----------------------------------------------------------------------------------


def test_position_weights_and_teacher():
    assert torch.allclose(position_weights(3, 4), torch.tensor([1.0, 0.7788007830714049, 0.6065306597126334]))
    ln2 = math.log(2)
    lm_head = torch.tensor([[ln2, 0.0], [0.0, ln2], [0.0, 0.0]])
    p = teacher_probs(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]), lm_head.to(torch.bfloat16))
    assert p.dtype == torch.float32
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]), atol=2e-3)
    assert torch.equal(valid_prefix(torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]]).bool()),
                       torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]).bool())


def test_each_loss_term_against_hand_computed_values():
    nan, lg = float("nan"), math.log
    # Block 0: slot 1 draft (½, ¼, ¼) vs target (¼, ½, ¼), label 0, c = σ(ln 3) = ¾;
    #          slot 2 draft = target = (.2, .3, .5), label 2, c = ¾.
    # Block 1: slot 1 draft uniform vs target (½, ¼, ¼), label 1, c = ½; slot 2 outside the sequence.
    # Block 2: a hole at slot 1, so nothing of it is supervised (slot 2 is valid but after the hole).
    draft = torch.tensor([[[lg(.5), lg(.25), lg(.25)], [lg(.2), lg(.3), lg(.5)]],
                          [[0.0, 0.0, 0.0], [nan, nan, nan]],
                          [[nan, nan, nan], [nan, nan, nan]]], requires_grad=True)
    target = torch.tensor([[[.25, .5, .25], [.2, .3, .5]],
                           [[.5, .25, .25], [nan, nan, nan]],
                           [[nan, nan, nan], [nan, nan, nan]]])
    labels = torch.tensor([[0, 2], [1, -100], [-100, 3]])
    valid = torch.tensor([[True, True], [True, False], [False, True]])
    conf = torch.tensor([[lg(3), lg(3)], [0.0, nan], [nan, nan]], requires_grad=True)
    out = dspark_loss(draft, labels, target, valid, conf, gamma=GAMMA)
    # w = (1, e^{-1/4} = 0.7788007830714049); two supervised blocks.
    # CE  = [ln2 + w2·ln2 + ln3] / 2
    # TV  = [(¼+¼+0) + w2·0 + (1/6+1/12+1/12)] / 2 = (0.5 + 1/3) / 2
    # c*  = block 0: (1 − ½·½, 1 − 0) = (0.75, 1);  block 1: 1 − ½·⅓ = 5/6
    # BCE = [H(¾,¾) = 0.5623351446188083 + w2·(−ln ¾ = 0.2876820724517809) + ln2] / 2
    assert out.ce.item() == pytest.approx(1.1657915181159386, abs=1e-6)
    assert out.tv.item() == pytest.approx(0.41666666666666663, abs=1e-6)
    assert out.conf.item() == pytest.approx(0.7397646742399027, abs=1e-6)
    assert out.total.item() == pytest.approx(0.1 * 1.1657915181159386 + 0.9 * 0.41666666666666663
                                             + 0.7397646742399027, abs=1e-6)
    assert out.total.item() == pytest.approx(1.2313438260514964, abs=1e-6)
    assert torch.allclose(out.c_star, torch.tensor([[0.75, 1.0], [5 / 6, 0.0], [0.0, 0.0]]))
    # accept_rate@1 = (¾ + ⅚)/2, @2 = 1 (block 0 only); τ̂ = mean(1+¾+¾·1, 1+⅚) = (2.5 + 11/6)/2.
    assert torch.allclose(out.accept_rate, torch.tensor([0.7916666666666666, 1.0]))
    assert out.tau.item() == pytest.approx(2.1666666666666665, abs=1e-6)
    m = out.metrics()
    assert m["accept_rate@2"] == pytest.approx(1.0) and m["tau"] == pytest.approx(2.1666666666666665, abs=1e-6)
    out.total.backward()
    assert torch.isfinite(draft.grad).all() and torch.isfinite(conf.grad).all()
    assert (draft.grad[2] == 0).all() and (draft.grad[1, 1] == 0).all()  # unsupervised: no gradient
    # c* is a label: the confidence term sends nothing into the drafter.
    draft.grad = conf.grad = None
    dspark_loss(draft, labels, target, valid, conf, gamma=GAMMA).conf.backward()
    assert draft.grad is None and conf.grad is not None


# --- checkpoints and registration ------------------------------------------------------------


@pytest.mark.parametrize("head_name,embedding", [("markov", "head"), ("rnn", "own")])
def test_checkpoint_round_trip(tmp_path, head_name, embedding):
    backbone = BlockBackbone(config(), shared(), seed=7)
    head = make_head(head_name, seed=3)
    conf = DSparkConfidence(DSparkHeadConfig(rank=8, vocab_size=V, dim=D, embedding=embedding, seed=4))
    if embedding == "head":
        conf.tie(head)
    save_drafter(tmp_path / "ck", backbone, head, conf, {"name": "dspark", "gamma": GAMMA})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "model.safetensors"]
    b2, h2, c2, meta = load_drafter(tmp_path / "ck")
    assert meta == {"name": "dspark", "gamma": GAMMA}
    for a, b in ((backbone, b2), (head, h2), (conf, c2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    b2.bind(backbone.shared)
    ids, feats, pos = backbone.make_block(torch.tensor([1, 2, 3])), context(), torch.tensor([3, 6, 10])
    hidden, logits = backbone(ids, feats, pos)
    hidden2, logits2 = b2(ids, feats, pos)
    assert torch.equal(hidden, hidden2) and torch.equal(logits, logits2)
    prev = torch.cat([ids[:, :1], logits.argmax(-1)[:, :-1]], 1)
    assert torch.equal(head.forward_train(logits, prev, hidden), h2.forward_train(logits2, prev, hidden2))
    blk = DraftBlock(tokens=logits.argmax(-1), lengths=torch.full((R,), GAMMA), hidden=hidden, anchor=ids[:, 0])
    assert torch.equal(conf.estimate(blk), c2.estimate(blk))
    if embedding == "head":
        assert c2.table is h2.w1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, damage):
    save_drafter(tmp_path / "ck", BlockBackbone(config(), shared(), seed=7))
    weights = tmp_path / "ck" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:  # one bit inside a tensor: safetensors alone would load it silently
        data[-5] ^= 0x10
        weights.write_bytes(bytes(data))
    word = "truncated" if damage == "truncate" else "corrupt"
    with pytest.raises(DrafterCheckpointError, match=rf"{re.escape(str(weights))} is {word}"):
        load_drafter(tmp_path / "ck")


def test_shipped_names_resolve_inside_the_package_and_unknown_ones_list_the_shipped():
    from specforge.toolkit.checkpoints import resolve_checkpoint
    from specforge_plugins.drafters.shipped import shipped_drafters

    assert resolve_checkpoint("runs/quick/drafter") == Path("runs/quick/drafter")
    for name, path in shipped_drafters().items():
        assert resolve_checkpoint(f"shipped:{name}") == path and (path / "MODEL_CARD.md").is_file()
    with pytest.raises(DrafterCheckpointError, match=r"shipped:nope: no such shipped drafter; shipped: "):
        load_drafter("shipped:nope")


def test_dspark_components_are_registered_through_the_shipped_plugins():
    host = PluginHost(autoload=False).load()
    for name in ("markov", "gated", "rnn"):
        reg = host.get("correction_head", name)
        assert reg.metadata.trainable and not reg.metadata.identity
        head = host.create_correction_head(name, {"rank": 8, "vocab_size": V, "dim": D})
        assert isinstance(head, HEADS[name]) and head.built and isinstance(head, CorrectionHead)
    reg = host.get("confidence", "dspark-head")
    assert reg.metadata.pre_token and reg.metadata.trainable and reg.metadata.needs_any == ("hidden",)
    conf = host.create_confidence("dspark-head", {"rank": 8})
    assert isinstance(conf, DSparkConfidence) and isinstance(conf, ConfidenceEstimator)
    with pytest.raises(Exception, match="rnak"):
        host.create_correction_head("markov", {"rnak": 8})


def test_packed_backbone_matches_the_unpacked_one_in_bf16():
    """Inference packs every projection as the target's are (oneDNN blocked bf16 on CPU); the
    outputs stay those of the plain bf16 module to bf16 rounding."""
    import copy

    model = BlockBackbone(config(), shared()).to(torch.bfloat16).eval()
    packed = copy.deepcopy(model).pack()
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    ids = torch.tensor([[3, MASK, MASK, MASK]])
    feats = torch.randn(1, 6, len(config().tap_layers) * config().dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = model(ids, feats.to(torch.bfloat16), torch.tensor([6]), with_logits=False)
        got, _ = packed(ids, feats.to(torch.bfloat16), torch.tensor([6]), with_logits=False)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    assert set(packed.state_dict()) == set(model.state_dict())


def test_the_context_cache_appends_many_requests_at_once_and_reuses_slots():
    from specforge.toolkit.context_cache import ContextCache

    cache = ContextCache(n_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)

    def rows(n, base):
        k = torch.arange(n * 2, dtype=torch.float32).view(n, 1, 2) + base
        return [(k, -k), (2 * k, -2 * k)]

    def cat(*parts):
        return [tuple(torch.cat([p[i][j] for p in parts]) for j in range(2)) for i in range(2)]

    # Requests 7 and 9 get 3 and 70 positions in one call (70 > the initial capacity: it grows).
    cache.extend_many([7, 9, 11], torch.tensor([0, 0, 0]), torch.tensor([3, 70, 0]), cat(rows(3, 100), rows(70, 0)))
    assert (cache.length(7), cache.length(9), cache.length(11)) == (3, 70, 0) and 11 not in cache
    kv, positions, valid = cache.gather([9, 7])
    assert kv[0][0].shape == (2, 70, 1, 2) and valid.sum(1).tolist() == [70, 3]
    assert torch.equal(kv[1][0][1, :3], rows(3, 100)[1][0]) and torch.equal(kv[0][1][0], rows(70, 0)[0][1])
    cache.extend_many([7], torch.tensor([3]), torch.tensor([2]), rows(2, 500))
    assert torch.equal(cache.gather([7])[0][0][0][0, 3:5], rows(2, 500)[0][0])
    with pytest.raises(RuntimeError, match="request 7: target features start at position 9"):
        cache.extend_many([7], torch.tensor([9]), torch.tensor([1]), rows(1, 0))
    cache.release(7)
    assert 7 not in cache and cache.length(7) == 0
    cache.extend_many([12], torch.tensor([0]), torch.tensor([1]), rows(1, 0))  # takes 7's freed slot
    assert len(cache) == 2 and cache.gather([12])[2].tolist() == [[True]]


def test_the_shipped_drafter_loads_and_a_damaged_copy_is_one_error_naming_its_file(tmp_path):
    """What `specforge generate --config dspark` loads: the 2-layer DSpark drafter for SmolLM2 with
    its draft vocabulary, Markov head and tied confidence head; a truncated copy is refused."""
    import shutil

    from specforge_plugins.drafters.shipped import shipped_drafters

    from specforge.config import load_pipeline

    assert load_pipeline(["dspark"]).to_dict()["drafter"]["checkpoint"] == "shipped:smollm2-135m-instruct"
    directory = shipped_drafters()["smollm2-135m-instruct"]
    backbone, head, confidence, _ = load_drafter("shipped:smollm2-135m-instruct")
    c = backbone.config
    assert (c.vocab_size, c.dim, c.draft_layers, c.gamma, c.draft_vocab_size) == (49152, 576, 2, 7, 8192)
    assert backbone.vocab.size == 8192 and head is not None and confidence.table is head.w1
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(DrafterCheckpointError, match=rf"{re.escape(str(weights))} is truncated"):
        load_drafter(copy)

"""Training as a plug-in contract: the shipped block drafters train through it exactly as they did
before (losses to float noise, checkpoints written before still load), and the trainer reaches
them only through their registration."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge.errors import SpecforgeError
from specforge.plugins import get_host
from specforge.training.config import TrainConfig, TrainConfigError, load_train_config
from specforge.training.trainer import Trainer

from train_fixtures import one_thread, target, tiny_config, tiny_source  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "training-golden"
# Same code path, same seeds: only float summation order may differ between CPUs (AMX or not).
RTOL = 1e-4


def _config(tmp_path: Path, drafter: dict, steps: int) -> TrainConfig:
    base = tiny_config(tmp_path, steps=steps).to_dict()
    return TrainConfig.model_validate({**base, "drafter": {**base["drafter"], **drafter}})


@pytest.mark.parametrize("run", ["markov", "gated"])
def test_losses_and_weights_match_the_trainer_before_the_contract(run, target, tmp_path):
    golden = json.loads((GOLDEN / "golden.json").read_text())
    spec = golden["runs"][run]
    # The golden runs were trained before block drafters had q/k norm by default (none on this Llama).
    trainer = Trainer(_config(tmp_path, {**spec["drafter"], "qk_norm": False}, golden["steps"]), target=target,
                      source=tiny_source(target), log=lambda _: None)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert len(history) == len(spec["history"])
    for new, old in zip(history, spec["history"]):
        assert set(old) <= set(new), set(old) - set(new)
        for key, value in old.items():
            if isinstance(value, float):
                assert new[key] == pytest.approx(value, rel=RTOL, abs=1e-7), (run, new["step"], key)
            else:
                assert new[key] == value, (run, key)
    # The exported drafter holds the same weights as the one the old trainer exported.
    from safetensors.torch import load_file

    mine = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    theirs = load_file(str(GOLDEN / f"drafter-{run}" / "model.safetensors"))
    assert set(mine) == set(theirs)
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-3, atol=1e-5)
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert meta["method"] == "dspark" and meta["target"] == "tiny"


@pytest.mark.parametrize("run", ["markov", "gated"])
def test_a_drafter_exported_before_the_contract_still_loads(run, target):
    """The old checkpoints (no method/target at the top of config.json) serve in the engine and
    resume through the method's load."""
    from specforge.config import load_pipeline
    from specforge.engine import Engine, GenerationRequest

    golden = json.loads((GOLDEN / "golden.json").read_text())
    spec = golden["runs"][run]["drafter"]
    directory = GOLDEN / f"drafter-{run}"
    method_cls, options = _config(Path("unused"), {**spec, "qk_norm": False}, 1).training_method()  # as trained
    method = method_cls(options, target, "cpu")
    method.load(directory)
    sections = method.pipeline(directory)
    assert sections["drafter"] == {"name": "dspark", "checkpoint": str(directory)}
    pipeline = load_pipeline(["default"], sections=sections)
    engine = Engine.from_pipeline(pipeline, target)
    (out,) = engine.generate([GenerationRequest(prompt_ids=[3, 5, 7, 9], max_new_tokens=6, temperature=0)])
    assert out.error is None and len(out.token_ids) == 6


def test_dflash_trains_through_the_same_contract(target, tmp_path):
    trainer = Trainer(_config(tmp_path, {"name": "dflash", "gamma": 3}, steps=3), target=target,
                      source=tiny_source(target), log=lambda _: None)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert [r["step"] for r in history] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in history)
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert meta["method"] == "dflash" and meta["backbone"]["predict_anchor"] is False
    assert {"accept_rate@1", "accept_rate@3"} <= set(history[-1])


def test_every_shipped_trainable_drafter_is_registered_with_a_method():
    drafters = get_host().registry.of_kind("drafter")
    assert {n for n, r in drafters.items() if r.metadata.trainable} >= {"dspark", "dflash"}
    assert not drafters["ngram"].metadata.trainable
    described = {c["name"]: c["metadata"] for c in get_host().describe()["components"] if c["kind"] == "drafter"}
    assert described["dspark"]["trainable"] is True and "training" not in described["dspark"]


def test_config_errors_name_the_method_and_its_keys():
    with pytest.raises(TrainConfigError, match=r"drafter.name: 'ngram' is a drafter without a training method; "
                                               r"trainable drafters: .*dflash.*dspark"):
        load_train_config("quick", ["drafter.name=ngram"])
    with pytest.raises(TrainConfigError, match=r"drafter.lyers: unknown key; valid keys: name, layers, gamma"):
        load_train_config("quick", ["drafter.lyers=3"])
    with pytest.raises(TrainConfigError, match=r"'ngram' is not a trainable correction head"):
        load_train_config("quick", ["drafter.head.name=ngram"])
    # A config written before the contract (loss weights at the top) still loads.
    old = TrainConfig.model_validate({"loss": {"ce_weight": 0.5}, "schedule": {"total_steps": 2}})
    assert old.drafter.options()["loss"] == {"ce_weight": 0.5}
    assert old.training_method()[1].loss.ce_weight == 0.5


def test_the_trainer_sees_only_the_contract():
    """specforge/ imports no shipped plug-in (they register through the entry point like any
    third party's)."""
    hits = subprocess.run(["grep", "-rn", "specforge_plugins", str(REPO / "specforge")],
                          capture_output=True, text=True).stdout.splitlines()
    assert hits == [], hits


def test_a_draft_vocabulary_is_chosen_from_the_data_trained_saved_and_served(target, tmp_path):
    """``draft_vocab=N``: the N most frequent supervised tokens become the vocabulary (d2t/t2d in
    the checkpoint); the drafter never proposes a token outside it and reports q = 0 there."""
    from specforge.config import load_pipeline
    from specforge.engine import Engine, GenerationRequest
    from specforge.vocab import DraftVocab
    from safetensors.torch import load_file

    source = tiny_source(target)
    drafter = {"draft_vocab": 24, "head": {"name": "markov", "rank": 8},
               "confidence": {"name": "dspark-head", "rank": 8, "embedding": "head"}}
    trainer = Trainer(_config(tmp_path, drafter, steps=3), target=target, source=source, log=lambda _: None)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert all(r["loss"] == r["loss"] for r in history)
    counts = trainer._token_counts()
    vocab = trainer.method.vocab
    assert vocab.size == 24 and torch.equal(vocab.ids, DraftVocab.most_frequent(counts, 24).ids)
    tensors = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert torch.equal(DraftVocab.from_maps(tensors["vocab.d2t"], tensors["vocab.t2d"]).ids, vocab.ids)
    assert tensors["head.w1"].shape == (25, 8) and tensors["head.w2"].shape == (8, 24)
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert meta["backbone"]["draft_vocab_size"] == 24 and 0 < meta["drafter"]["train_coverage"] <= 1

    sections = trainer.method.pipeline(tmp_path / "drafter")
    engine = Engine.from_pipeline(load_pipeline(["default"], ["sampling.temperature=1.0"], sections=sections), target)
    blocks = []
    draft = engine.drafter.draft
    engine.drafter.draft = lambda ctx: blocks.append(draft(ctx)) or blocks[-1]
    outs = engine.generate([GenerationRequest(prompt_ids=[3, 5, 7, 9], max_new_tokens=12, seed=s) for s in range(3)])
    assert all(o.error is None for o in outs)
    inside = vocab.t2d
    for block in blocks:
        if block.tokens.shape[1]:
            assert bool(inside[block.tokens].all())
            assert bool((block.probs[..., ~inside] == 0).all())
            torch.testing.assert_close(block.probs.sum(-1), torch.ones(block.probs.shape[:2]), rtol=0, atol=1e-5)


def test_the_draft_vocabulary_maps_round_trip_and_refuse_bad_input():
    from specforge.vocab import DraftVocab, DraftVocabError

    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    vocab = DraftVocab.most_frequent(counts, 4)
    assert vocab.ids.tolist() == [0, 2, 3, 5]  # ties keep the smaller id
    assert vocab.d2t.tolist() == [0, 1, 1, 2] and vocab.t2d.tolist() == [1, 0, 1, 1, 0, 1, 0, 0]
    again = DraftVocab.from_maps(vocab.d2t, vocab.t2d)
    assert torch.equal(again.ids, vocab.ids)
    ids = torch.tensor([[5, 1], [0, 3]])
    assert vocab.to_draft(ids).tolist() == [[3, -1], [0, 2]]
    assert torch.equal(vocab.to_target(vocab.to_draft(torch.tensor([0, 2, 3, 5]))), torch.tensor([0, 2, 3, 5]))
    assert vocab.token_rows().tolist() == [0, 4, 1, 2, 4, 3, 4, 4]
    assert vocab.coverage(torch.tensor([0, 1, 2, 3])) == 0.75
    with pytest.raises(DraftVocabError, match="larger than the target's 8"):
        DraftVocab(torch.arange(9), 8)
    with pytest.raises(DraftVocabError, match="disagree"):
        DraftVocab.from_maps(vocab.d2t, torch.zeros(8, dtype=torch.bool))
    with pytest.raises(DraftVocabError, match="the bound target has 96"):
        vocab.check_target(96, "x")
    with pytest.raises(TrainConfigError, match="drafter.draft_vocab: Input should be greater than or equal to 1"):
        load_train_config("quick", ["drafter.draft_vocab=0"])


def test_a_vocabulary_too_large_or_for_another_target_is_one_clear_error(target, tmp_path):
    from specforge.config import load_pipeline
    from specforge.engine import Engine
    from specforge.errors import SpecforgeError
    from specforge.vocab import DraftVocabError
    from tiny_models import tiny_model
    from specforge.runtime.target import TargetModel

    with pytest.raises(DraftVocabError, match="drafter.draft_vocab: 96 is not smaller than the target's 96"):
        Trainer(_config(tmp_path / "big", {"draft_vocab": 96}, steps=1), target=target,
                source=tiny_source(target), log=lambda _: None)
    trainer = Trainer(_config(tmp_path / "ok", {"draft_vocab": 16}, steps=1), target=target,
                      source=tiny_source(target), log=lambda _: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    other = TargetModel(tiny_model("llama", vocab=128), None, torch.float32, name="other")
    sections = trainer.method.pipeline(tmp_path / "ok" / "drafter")
    with pytest.raises(SpecforgeError, match="trained for a target with vocab_size=96; the bound target has "
                                             "vocab_size=128"):
        Engine.from_pipeline(load_pipeline(["default"], sections=sections), other)


def test_dflash_trains_on_its_own_position_weighted_cross_entropy(target):
    """DFlash's objective (its paper, §4): Σ_k exp(−(k−1)/γ_w)·CE_k per block, γ_w from its table
    (7 at γ = 16, 5 at 10, 4 at 8), no TV or confidence term, no heads — by default."""
    from specforge.toolkit.training import TrainBatch
    from specforge_plugins.drafters.block.training import DFlashTrainConfig, DFlashTraining, dflash_decay

    assert (dflash_decay(16), dflash_decay(10), dflash_decay(8), dflash_decay(7)) == (7, 5, 4, 3.5)
    config = DFlashTrainConfig(gamma=4, layers=1)
    assert config.loss.decay == 2 and DFlashTrainConfig().layers == 5 and DFlashTrainConfig().loss.decay == 7
    method = DFlashTraining(config, target)
    assert method.module.head is None and method.module.confidence is None
    gen = torch.Generator().manual_seed(0)
    b, s, v = 2, 4, target.args.vocab_size
    logits = torch.randn(b, s, v, generator=gen)
    labels = torch.randint(0, v, (b, s), generator=gen)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)  # a hole ends the prefix
    p_t = torch.softmax(torch.randn(b, s, v, generator=gen), -1)
    none = torch.zeros(b, 1)
    batch = TrainBatch(block_ids=none, anchor_pos=none, anchor_ids=none, labels=labels, prev_ids=labels, valid=valid,
                       ctx=none, ctx_valid=none, ctx_index=none, p_t=p_t)
    out = method.loss((logits, None), batch)
    nll = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    w = torch.exp(-torch.arange(4.0) / 2)
    by_hand = ((w * nll[0]).sum() + (w[:2] * nll[1, :2]).sum()) / 2
    torch.testing.assert_close(out.total, by_hand)


def test_draft_layers_start_from_the_named_target_layers(target, tmp_path):
    method_cls, options = _config(tmp_path, {"layers": 2, "init_from_target": [2, 1]}, 1).training_method()
    method = method_cls(options, target, "cpu")
    rt = target.runtime
    q = method.module.backbone.layers[0].wq.weight.shape[0]
    for draft, lid in zip(method.module.backbone.layers, [2, 1]):
        theirs = rt.layers[lid]
        torch.testing.assert_close(torch.cat([draft.wq.weight, draft.wkv.weight]), theirs.wqkv.float())
        assert draft.wq.weight.shape[0] == q
        for mine, other in ((draft.wo.weight, theirs.wo), (draft.w13.weight, theirs.w13), (draft.w2.weight, theirs.w2),
                            (draft.attn_norm.weight, theirs.attn_norm), (draft.mlp_norm.weight, theirs.mlp_norm)):
            torch.testing.assert_close(mine, other.float())
    # The start is a copy: training the draft layer leaves the target untouched.
    before = rt.layers[2].wo.clone()
    with torch.no_grad():
        method.module.backbone.layers[0].wo.weight.add_(1.0)
    torch.testing.assert_close(rt.layers[2].wo, before)


def test_init_from_target_errors_name_the_key(target, tmp_path):
    with pytest.raises(TrainConfigError, match=r"drafter\.init_from_target.*one each"):
        _config(tmp_path, {"layers": 2, "init_from_target": [1]}, 1).training_method()
    method_cls, options = _config(tmp_path, {"layers": 1, "init_from_target": [99]}, 1).training_method()
    with pytest.raises(SpecforgeError, match=r"drafter\.init_from_target\.0: target layer 99 is outside"):
        method_cls(options, target, "cpu")


def test_a_run_starts_from_a_saved_drafter_adding_the_q_k_norms_it_lacks(target, tmp_path):
    """``drafter.init_from``: a drafter saved without q/k norm starts a q/k-norm run — every tensor
    it has copied, the norms at ones, its draft vocabulary kept — and a drafter of another shape is
    refused naming what differs, before any step."""
    from specforge.toolkit.checkpoints import DrafterCheckpointError

    source = tiny_source(target)
    heads = {"head": {"name": "markov", "rank": 8}, "confidence": {"name": "dspark-head", "rank": 8, "embedding": "head"}}
    old = Trainer(_config(tmp_path / "old", {"draft_vocab": 24, "qk_norm": False, **heads}, steps=2),
                  target=target, source=source, log=lambda _: None)
    try:
        old.train()
    finally:
        old.close()
    saved = tmp_path / "old" / "drafter"
    new = Trainer(_config(tmp_path / "new", {"draft_vocab": 24, "qk_norm": True, "init_from": str(saved), **heads}, 1),
                  target=target, source=source, log=lambda _: None)
    try:
        theirs, mine = old.module.state_dict(), new.module.state_dict()
        assert torch.equal(new.method.vocab.ids, old.method.vocab.ids)
        norms = [k for k in mine if k.endswith(("q_norm.weight", "k_norm.weight"))]
        assert norms and all(bool((mine[k] == 1).all()) for k in norms)
        assert set(mine) - set(norms) == set(theirs)
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), key
        assert new.module.backbone.config.qk_norm
    finally:
        new.close()
    with pytest.raises(DrafterCheckpointError, match=r"drafter\.init_from: .*does not fit.*head\.w1"):
        Trainer(_config(tmp_path / "bad", {"draft_vocab": 24, "init_from": str(saved), "head": {"name": "markov", "rank": 4},
                                           "confidence": {"name": "dspark-head", "rank": 4, "embedding": "head"}}, 1),
                target=target, source=source, log=lambda _: None)
    with pytest.raises(DrafterCheckpointError, match=r"draft vocabulary of 24 tokens.*draft_vocab is 16"):
        Trainer(_config(tmp_path / "vocab", {"draft_vocab": 16, "init_from": str(saved), **heads}, 1),
                target=target, source=source, log=lambda _: None)

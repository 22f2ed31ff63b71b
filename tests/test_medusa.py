"""The ``medusa`` drafter: heads as in the paper, its place in the engine, its reported law, its
training through the contract and its checkpoint (wrong method, wrong target, damage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specforge.config import EngineConfig, SamplingConfig, load_pipeline
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel
from specforge.toolkit.checkpoints import DrafterCheckpointError
from specforge.toolkit.training import DataSummary
from specforge.training.config import TrainConfig
from specforge.training.data import MemorySource
from specforge.training.trainer import Trainer
from specforge.features import compute_features
from specforge_plugins.drafters.block.checkpoint import load_drafter
from specforge_plugins.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads, MedusaShape, save_medusa
from tiny_models import tiny_model

from train_fixtures import one_thread, tiny_config, tiny_sequences, tiny_target  # noqa: F401 - fixtures

VOCAB = 96
PROMPTS = ([5], [5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 15, 16, 17])


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


@pytest.fixture(scope="module")
def train_target():
    return tiny_target()


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=7, vocab=VOCAB, eos=None), None, torch.float32)


def engine(target, host, drafter, head="none", temperature=0.0, new=12, batch=3):
    return Engine(target, host.create_verifier("rejection"), drafter=drafter,
                  correction_head=host.create_correction_head(head, {} if head == "none" else {"rank": 8, "zero_init": False}),
                  confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                  scheduler=host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=temperature, max_new_tokens=new),
                  engine=EngineConfig(max_batch=batch, max_context=96),
                  trees=host.get("verifier", "rejection").metadata.trees)


def requests(new=12):
    return [GenerationRequest(prompt_ids=p, max_new_tokens=new, seed=i) for i, p in enumerate(PROMPTS)]


def test_heads_start_as_the_identity_on_the_target_lm_head():
    """Zero-initialised residual blocks and output layers copied from the LM head: every untrained
    head predicts what the target's LM head predicts from the same state."""
    shape = MedusaShape(vocab_size=32, dim=16, n_target_layers=2, heads=3, res_layers=2)
    heads = MedusaHeads(shape, seed=0)
    norm, lm_head = torch.rand(16) + 0.5, torch.randn(32, 16)
    heads.bind(norm, lm_head, init_output=True)
    x = torch.randn(5, 16)
    expected = torch.nn.functional.rms_norm(x, (16,), norm, shape.norm_eps) @ lm_head.T
    out = heads(x)
    assert out.shape == (5, 3, 32)
    for k in range(3):
        torch.testing.assert_close(out[:, k], expected)
    # distinct modules per head and per block, each with its own output layer
    params = {id(p) for p in heads.parameters()}
    assert len(params) == 3 * 2 * 2 + 3


@pytest.mark.parametrize("head", ["none", "markov"])
def test_greedy_output_is_the_target_greedy_output(target, host, head):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                   engine=EngineConfig(max_batch=3, max_context=96)).generate(requests())
    drafter = MedusaDrafter(MedusaConfig(heads=4, seed=1))
    outs = engine(target, host, drafter, head=head).generate(requests())
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.stats.rounds < len(o.token_ids) + 1 for o in outs)
    assert sum(o.stats.drafted for o in outs) > 0


def test_the_reported_law_is_the_sampled_law_on_the_draft_vocabulary(target, host):
    drafter = MedusaDrafter(MedusaConfig(heads=3, seed=2, draft_vocab=20))
    drafter.bind(target)
    e = engine(target, host, drafter, temperature=1.0)
    seen = []
    original = drafter.draft

    def spy(ctx):
        block = original(ctx)
        seen.append(block)
        return block
    drafter.draft = spy
    outs = e.generate(requests(new=8))
    assert all(o.error is None for o in outs)
    inside = drafter.draft_vocab.t2d
    for block in seen:
        if block.tokens.shape[1] == 0:
            continue
        torch.testing.assert_close(block.probs.sum(-1), torch.ones(block.probs.shape[:2]))
        assert float(block.probs[..., ~inside].abs().max()) == 0.0
        assert bool(inside[block.tokens].all())
        # every drafted token has positive probability under the law it reports
        picked = block.probs.gather(2, block.tokens[..., None])[..., 0]
        assert bool((picked > 0).all())


def test_a_one_token_prompt_drafts_nothing_until_the_target_has_run(target, host):
    drafter = MedusaDrafter(MedusaConfig(heads=3, seed=1))
    (out,) = engine(target, host, drafter).generate([GenerationRequest(prompt_ids=[5], max_new_tokens=6)])
    assert out.error is None and len(out.token_ids) == 6 and out.stats.rounds >= 2


def _train_config(tmp_path: Path, steps: int, **drafter) -> TrainConfig:
    base = tiny_config(tmp_path, steps=steps).to_dict()
    return TrainConfig.model_validate({**base, "drafter": {"name": "medusa", "heads": 3, **drafter}})


def test_medusa_trains_through_the_contract_and_serves(train_target, tmp_path):
    last = [train_target.args.n_layers - 1]  # Medusa reads the last layer's output
    source = MemorySource(compute_features(train_target, tiny_sequences(), last), last)
    trainer = Trainer(_train_config(tmp_path, 30, draft_vocab=40), target=train_target, source=source,
                      log=lambda _: None)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert history[-1]["ce"] < history[0]["ce"]
    assert {"top1@1", "top1@3", "tau"} <= set(history[-1])
    directory = tmp_path / "drafter"
    meta = json.loads((directory / "config.json").read_text())
    assert meta["method"] == "medusa" and meta["medusa"]["draft_vocab_size"] == 40
    sections = trainer.method.pipeline(directory)
    engine_ = Engine.from_pipeline(load_pipeline(["default"], sections=sections), train_target)
    (out,) = engine_.generate([GenerationRequest(prompt_ids=[3, 5, 7, 9], max_new_tokens=6, temperature=0)])
    assert out.error is None and len(out.token_ids) == 6
    # resuming reads the same weights back
    again = type(trainer.method)(trainer.method.settings, train_target)
    again.prepare(DataSummary(sequences=1, token_counts=_counts(trainer)))
    again.load(directory)
    for a, b in zip(again.module.parameters(), trainer.method.module.parameters()):
        torch.testing.assert_close(a, b)


def _counts(trainer) -> torch.Tensor:
    """Token counts that choose the trained run's draft vocabulary again."""
    counts = torch.zeros(trainer.method.target.args.vocab_size)
    counts[trainer.method.vocab.ids] = 1.0
    return counts


def test_a_checkpoint_of_another_method_or_target_is_one_clear_error(target, tmp_path):
    shape = MedusaShape(vocab_size=VOCAB, dim=target.args.dim, n_target_layers=target.args.n_layers, heads=2)
    save_medusa(tmp_path / "m", MedusaHeads(shape), target="tiny")
    with pytest.raises(DrafterCheckpointError, match=r"a 'medusa' checkpoint .*the dspark/dflash drafter reads "
                                                     r"specforge-block-drafter checkpoints \(serve it with "
                                                     r"drafter.name=medusa\)"):
        load_drafter(tmp_path / "m")
    other = MedusaShape(vocab_size=VOCAB + 1, dim=target.args.dim, n_target_layers=target.args.n_layers, heads=2)
    save_medusa(tmp_path / "other", MedusaHeads(other), target="elsewhere")
    drafter = MedusaDrafter(MedusaConfig(checkpoint=str(tmp_path / "other")))
    with pytest.raises(DrafterCheckpointError, match=r"trained for a target with vocab_size=97; the bound target "
                                                     r"has vocab_size=96"):
        drafter.bind(target)
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(DrafterCheckpointError, match=r"model.safetensors is truncated"):
        MedusaDrafter(MedusaConfig(checkpoint=str(tmp_path / "m")))
    with pytest.raises(ValueError, match="heads and draft_vocab come from the checkpoint"):
        MedusaConfig(checkpoint="x", heads=3)


@pytest.mark.parametrize("head", ["none", "markov"])
def test_a_static_candidate_tree_keeps_greedy_parity_and_accepts_off_the_top_path(target, host, head):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                   engine=EngineConfig(max_batch=3, max_context=96)).generate(requests())
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = MedusaDrafter(MedusaConfig(heads=3, seed=1, tree=tree))
    outs = engine(target, host, drafter, head=head).generate(requests())
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in outs) > 0
    with pytest.raises(ValueError, match=r"the path \[1\] is missing"):
        MedusaConfig(tree=[[0], [1, 0]])


def test_the_medusa_1_loss_is_the_weighted_sum_of_head_cross_entropies(train_target):
    """Σ_k 0.8^k·CE_k per block (k = 1 … K), averaged over the blocks whose first head is
    supervised; an anchor at position 0 has no hidden state before it; over a draft vocabulary a
    label outside it is unsupervised and the rest are draft ids — by hand on tiny tensors."""
    from specforge.toolkit.training import TrainBatch
    from specforge_plugins.drafters.medusa.training import MedusaTrainConfig, MedusaTraining

    v = train_target.args.vocab_size
    gen = torch.Generator().manual_seed(3)
    b, k = 3, 3
    labels = torch.randint(0, v, (b, k), generator=gen)
    valid = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    anchor = torch.tensor([4, 2, 0])  # the third block has no hidden state before its anchor
    none = torch.zeros(b, 1)
    batch = TrainBatch(block_ids=none, anchor_pos=anchor, anchor_ids=none, labels=labels, prev_ids=labels,
                       valid=valid, ctx=none, ctx_valid=none, ctx_index=none)
    method = MedusaTraining(MedusaTrainConfig(heads=k), train_target)
    logits = torch.randn(b, k, v, generator=gen)
    out = method.loss(logits, batch)
    nll = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    lam = torch.tensor([0.8, 0.64, 0.512])
    by_hand = ((lam * nll[0]).sum() + lam[0] * nll[1, 0] + lam[2] * nll[1, 2]) / 2  # heads are independent: block 1 keeps head 3
    torch.testing.assert_close(out.total, by_hand)

    # over a draft vocabulary: the labels of the first block made the vocabulary, minus its last one
    counts = torch.zeros(v, dtype=torch.long)
    counts[labels[0, :2]] = 10
    counts[labels[1, 0]] = 10
    small = MedusaTraining(MedusaTrainConfig(heads=k, draft_vocab=3), train_target)
    small.prepare(DataSummary(sequences=1, token_counts=counts))
    ids = small.vocab.ids
    drafted = torch.randn(b, k, 3, generator=gen)
    out = small.loss(drafted, batch)
    terms = []
    for i in range(2):
        for j in range(k):
            tok = int(labels[i, j])
            if valid[i, j] and bool((ids == tok).any()):
                d = int((ids == tok).nonzero())
                terms.append(lam[j] * -torch.log_softmax(drafted[i, j], -1)[d])
    torch.testing.assert_close(out.total, sum(terms) / 2)

"""The ``eagle3`` drafter: drafting agrees with training-time test, greedy parity in the engine,
its reported law, training through the contract and its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specforge.config import EngineConfig, SamplingConfig, load_pipeline
from specforge.engine import Engine, GenerationRequest
from specforge.features import compute_features
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel
from specforge.toolkit.checkpoints import DrafterCheckpointError
from specforge.toolkit.training import TrainBatch
from specforge.training.config import TrainConfig
from specforge.training.data import MemorySource
from specforge.training.trainer import Trainer
from specforge_plugins.drafters.eagle3 import Eagle3Config, Eagle3Drafter, eagle3_layers
from specforge_plugins.drafters.eagle3.training import _Module
from tiny_models import tiny_model

from train_fixtures import one_thread, tiny_config, tiny_sequences, tiny_target  # noqa: F401 - fixtures

VOCAB = 96
PROMPTS = ([5], [5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 15, 16, 17])


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=7, vocab=VOCAB, eos=None), None, torch.float32)


def engine(target, host, drafter, temperature=0.0, new=12, batch=3, verifier="rejection"):
    return Engine(target, host.create_verifier(verifier), drafter=drafter,
                  correction_head=host.create_correction_head("none", {}),
                  confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                  scheduler=host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=temperature, max_new_tokens=new),
                  engine=EngineConfig(max_batch=batch, max_context=96),
                  trees=host.get("verifier", verifier).metadata.trees)


def requests(new=12):
    return [GenerationRequest(prompt_ids=p, max_new_tokens=new, seed=i) for i, p in enumerate(PROMPTS)]


def test_fused_layers_follow_eagle3_and_stay_distinct_on_shallow_targets():
    assert eagle3_layers(30) == (1, 14, 26)  # SmolLM2-135M: outputs of layers 1, L/2−1, L−4
    assert eagle3_layers(32) == (1, 15, 28)
    assert eagle3_layers(3) == (0, 1) and eagle3_layers(1) == (0,)


def spy(drafter):
    seen = []
    original = drafter.draft

    def draft(ctx):
        block = original(ctx)
        seen.append((ctx, block))
        return block
    drafter.draft = draft
    return seen


def test_drafting_computes_what_training_time_test_computes(target, host):
    """Every round's chain logits (incremental KV cache over committed rows, own hidden states fed
    back) equal the training module's on the same sequence with the drafted tokens as labels."""
    drafter = Eagle3Drafter(Eagle3Config(gamma=4, seed=1))
    drafter.bind(target)
    seen = spy(drafter)
    outs = engine(target, host, drafter, batch=2).generate(requests())
    assert all(o.error is None for o in outs)
    module = _Module(drafter.model, steps=4)
    layers = list(drafter.feature_layers)
    checked = 0
    for ctx, block in seen:
        for r, history in enumerate(ctx.histories):
            n = int(block.lengths[r])
            if n == 0:
                continue
            ids = history.clone()  # committed tokens; the anchor is the last
            (feats,) = compute_features(target, [(ids, torch.ones_like(ids))], layers)
            a = len(ids) - 1
            labels = torch.zeros(1, 4, dtype=torch.long)
            labels[0, :n] = block.tokens[r, :n]
            batch = TrainBatch(block_ids=ids[a:a + 1][None], anchor_pos=torch.tensor([a]), anchor_ids=ids[a:a + 1],
                               labels=labels, prev_ids=labels, valid=torch.ones(1, 4, dtype=torch.bool),
                               ctx=feats.taps.flatten(1)[None], ctx_valid=torch.ones(1, len(ids), dtype=torch.bool),
                               ctx_index=torch.tensor([0]), ctx_ids=ids[None])
            with torch.no_grad():
                logits = module(batch)[0, :n]
            mine = block.logits[r, :n]
            torch.testing.assert_close(mine, logits, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 8


def test_greedy_output_is_the_target_greedy_output(target, host):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                   engine=EngineConfig(max_batch=3, max_context=96)).generate(requests())
    outs = engine(target, host, Eagle3Drafter(Eagle3Config(gamma=3, seed=2))).generate(requests())
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.drafted for o in outs) > 0


def test_the_reported_law_is_the_sampled_law_on_the_draft_vocabulary(target, host):
    drafter = Eagle3Drafter(Eagle3Config(gamma=3, seed=2, draft_vocab=20))
    drafter.bind(target)
    seen = spy(drafter)
    outs = engine(target, host, drafter, temperature=1.0, new=8).generate(requests(new=8))
    assert all(o.error is None for o in outs)
    inside = drafter.draft_vocab.t2d
    for _, block in seen:
        if block.tokens.shape[1] == 0:
            continue
        torch.testing.assert_close(block.probs.sum(-1), torch.ones(block.probs.shape[:2]))
        assert float(block.probs[..., ~inside].abs().max()) == 0.0
        used = torch.arange(block.tokens.shape[1])[None] < block.lengths[:, None]
        assert bool(inside[block.tokens[used]].all())
        assert bool((block.probs.gather(2, block.tokens[..., None])[..., 0][used] > 0).all())


def _train_config(tmp_path: Path, steps: int, **drafter) -> TrainConfig:
    base = tiny_config(tmp_path, steps=steps).to_dict()
    return TrainConfig.model_validate({**base, "drafter": {"name": "eagle3", "steps": 3, **drafter}})


def test_eagle3_trains_through_the_contract_and_serves(tmp_path):
    target = tiny_target()
    config = _train_config(tmp_path, 30, draft_vocab=40)
    layers = list(eagle3_layers(target.args.n_layers))
    source = MemorySource(compute_features(target, tiny_sequences(), layers), layers)
    trainer = Trainer(config, target=target, source=source, log=lambda _: None)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    assert history[-1]["ce"] < history[0]["ce"]
    assert {"top1@1", "top1@3", "tau"} <= set(history[-1])
    directory = tmp_path / "drafter"
    meta = json.loads((directory / "config.json").read_text())
    assert meta["method"] == "eagle3" and meta["eagle3"]["draft_vocab_size"] == 40
    sections = trainer.method.pipeline(directory)
    served = Engine.from_pipeline(load_pipeline(["default"], sections=sections), target)
    (out,) = served.generate([GenerationRequest(prompt_ids=[3, 5, 7, 9], max_new_tokens=6, temperature=0)])
    assert out.error is None and len(out.token_ids) == 6
    # a medusa drafter refuses it by name; so does a target of another shape
    from specforge_plugins.drafters.medusa import MedusaConfig, MedusaDrafter

    with pytest.raises(DrafterCheckpointError, match=r"a 'eagle3' checkpoint .* \(serve it with drafter.name=eagle3\)"):
        MedusaDrafter(MedusaConfig(checkpoint=str(directory)))
    other = TargetModel(tiny_model("llama", seed=7, vocab=80, eos=None), None, torch.float32)
    with pytest.raises(DrafterCheckpointError, match=r"trained for a target with vocab_size=96; the bound target "
                                                     r"has vocab_size=80"):
        Eagle3Drafter(Eagle3Config(checkpoint=str(directory))).bind(other)


def _path(parents: list[int], j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


@pytest.mark.parametrize("draft_vocab", [None, 24])
@torch.no_grad()
def test_the_dynamic_tree_is_eagle2s_and_each_node_sees_only_its_path(target, host, draft_vocab):
    """Every node's logits equal a chain teacher-forced along its own path (the tree's attention
    mask hides the rest of the tree); nodes are breadth first, siblings distinct, and the kept set
    is the best by path log-probability among EAGLE-2's candidates (closed under ancestors)."""
    tree = {"topk": 3, "nodes": 10}
    drafter = Eagle3Drafter(Eagle3Config(gamma=4, seed=1, draft_vocab=draft_vocab, tree=tree))
    drafter.bind(target)
    seen = spy(drafter)
    outs = engine(target, host, drafter, temperature=1.0, batch=3).generate(requests())
    assert all(o.error is None for o in outs)
    model, vocab = drafter.model, drafter.draft_vocab
    checked = 0
    for ctx, block in seen:
        if block.parents is None or block.tokens.shape[1] == 0:
            continue
        assert block.probs is None  # deterministic nodes: one-hot draft laws
        for r, history in enumerate(ctx.histories):
            n = int(block.lengths[r])
            if n == 0:
                continue
            parents = block.parents[r].tolist()
            assert all(p < j for j, p in enumerate(parents))
            assert len(block.tokens[r]) <= 10
            for j in range(len(parents)):  # siblings distinct
                sib = [i for i, p in enumerate(parents) if p == parents[j]]
                assert len({int(block.tokens[r, i]) for i in sib}) == len(sib)
            ids = history.clone()
            (feats,) = compute_features(target, [(ids, torch.ones_like(ids))], list(drafter.feature_layers))
            a = len(ids) - 1
            k, v, g = model.context_kv(feats.taps.flatten(1)[None, :a], ids[None, 1:a + 1], torch.arange(a)[None])
            ok = torch.ones(1, a, dtype=torch.bool)
            for j in range(len(parents)):
                path = _path(parents, j)
                toks = block.tokens[r, path]
                _, logits = model.chain(model.embed(ids[a:a + 1]), g[:, a - 1], torch.tensor([a - 1]), k, v, ok,
                                        len(path), lambda i, _l: model.embed(toks[i:i + 1]))
                full = logits[0, -1]
                mine = block.logits[r, j]
                if vocab is not None:
                    mine = mine[vocab.ids]
                torch.testing.assert_close(mine, full, rtol=1e-4, atol=1e-4)
            depth = [len(_path(parents, j)) for j in range(len(parents))]
            assert depth == sorted(depth)
            # the kept paths are those of a plain re-implementation of EAGLE-2 on teacher-forced chains
            def logp_after(path: tuple[int, ...]) -> torch.Tensor:
                toks = torch.tensor(path, dtype=torch.long)
                toks = toks if vocab is None else vocab.ids[toks]
                _, logits = model.chain(model.embed(ids[a:a + 1]), g[:, a - 1], torch.tensor([a - 1]), k, v, ok,
                                        len(path) + 1, lambda i, _l: model.embed(toks[i:i + 1]))
                return torch.log_softmax(logits[0, -1], -1).double()

            depth_r = max(depth)
            root = logp_after(())
            top = root.topk(3)
            cands = {(int(t),): float(sc) for sc, t in zip(top.values, top.indices)}
            frontier = list(cands)
            for level in range(1, depth_r):
                children = {}
                for node in frontier:
                    lp = logp_after(node).topk(3)
                    children.update({node + (int(t),): cands[node] + float(sc) for sc, t in zip(lp.values, lp.indices)})
                cands.update(children)
                frontier = sorted(children, key=children.get, reverse=True)[:3]
            want = set(sorted(cands, key=cands.get, reverse=True)[:len(parents)])
            got = {tuple(int(x) for x in (block.tokens[r, _path(parents, j)] if vocab is None
                                          else vocab.to_draft(block.tokens[r, _path(parents, j)])))
                   for j in range(len(parents))}
            assert got == want
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
def test_a_dynamic_tree_keeps_greedy_parity(target, host, verifier):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12),
                   engine=EngineConfig(max_batch=3, max_context=96)).generate(requests())
    tree = engine(target, host, Eagle3Drafter(Eagle3Config(gamma=3, seed=2, tree={"topk": 4, "nodes": 12})),
                  verifier=verifier).generate(requests())
    assert [o.token_ids for o in tree] == [o.token_ids for o in plain]
    assert sum(o.stats.drafted for o in tree) > 0


def test_the_ttt_loss_is_soft_cross_entropy_against_the_target_law_weighted_by_step(tmp_path):
    """Σ_k 0.8^(k−1)·(−Σ_x p_t,k(x)·log q_k(x)) per block, averaged over the blocks whose first
    step is supervised (an anchor at position 0 has no row before it) — by hand on tiny tensors."""
    from specforge_plugins.drafters.eagle3.training import Eagle3TrainConfig, Eagle3Training

    target = tiny_target()
    v = target.args.vocab_size
    gen = torch.Generator().manual_seed(5)
    b, k = 3, 3
    labels = torch.randint(0, v, (b, k), generator=gen)
    valid = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    anchor = torch.tensor([3, 5, 0])
    p_t = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    none = torch.zeros(b, 1)
    batch = TrainBatch(block_ids=none, anchor_pos=anchor, anchor_ids=none, labels=labels, prev_ids=labels,
                       valid=valid, ctx=none, ctx_valid=none, ctx_index=none, p_t=p_t)
    method = Eagle3Training(Eagle3TrainConfig(steps=k), target)
    logits = torch.randn(b, k, v, generator=gen)
    out = method.loss(logits, batch)
    soft = -(p_t * torch.log_softmax(logits, -1)).sum(-1)
    w = torch.tensor([1.0, 0.8, 0.64])
    torch.testing.assert_close(out.total, ((w * soft[0]).sum() + (w[:2] * soft[1, :2]).sum()) / 2)

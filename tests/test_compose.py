"""The ``compose`` drafter: what each slot reports is what its member drew it from (both modes,
a member proposing nothing, members of different γ), greedy parity with plain decoding, members
released, and the config errors a composition can make.  Its output law is the conformance
suite's (``specforge conformance --plugin compose``; tests/test_compositions.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specforge.components import DraftContext
from specforge.config import EngineConfig, SamplingConfig, load_pipeline
from specforge.engine import Engine, GenerationRequest
from specforge.errors import ConfigError
from specforge.sampling import SamplingParams
from specforge.runtime import TargetModel
from specforge_conformance.suite import suite_host
from tiny_models import tiny_model

VOCAB = 32
# The first prompt has no earlier occurrence of its last token, so ngram proposes nothing for it.
PROMPTS = ([5], [5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 11, 12, 13])
# ngram (deterministic, γ = 3, its own confidence) and the suite's sampling `random` drafter (γ = 4).
MEMBERS = [{"name": "ngram", "gamma": 3}, {"name": "random", "gamma": 4, "seed": 3, "confidence": "entropy"}]


@pytest.fixture(scope="module")
def host():
    return suite_host()


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=7, vocab=VOCAB, eos=None), None, torch.float32)


def compose(host, target, mode, members=MEMBERS):
    drafter = host.create_drafter("compose", {"mode": mode, "members": members})
    drafter.bind(target)
    return drafter


def context(seed: int, temperature: float = 1.0) -> DraftContext:
    histories = [torch.tensor(p) for p in PROMPTS]
    return DraftContext(request_ids=list(range(len(PROMPTS))), histories=histories,
                        max_tokens=torch.full((len(PROMPTS),), 4), sampling=SamplingParams.uniform(len(PROMPTS),
                                                                                                  temperature),
                        generators=[torch.Generator().manual_seed(seed * 100 + r) for r in range(len(PROMPTS))])


def member_blocks(host, target, seed):
    """Each member alone on the same context (the same per-request generators)."""
    blocks = []
    for m in MEMBERS:
        params = {k: v for k, v in m.items() if k not in ("name", "confidence")}
        d = host.create_drafter(m["name"], params)
        d.bind(target)
        blocks.append(d.draft(context(seed)))
    return blocks


def slots(block, r):
    """Request r's nodes as (parent, token, law row) triples."""
    n = int(block.lengths[r])
    parents = block.parents[r, :n].tolist() if block.parents is not None else list(range(-1, n - 1))
    return [(parents[k], int(block.tokens[r, k]), block.probs[r, k]) for k in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_cascade_slot_reports_the_law_its_member_drew_it_from(host, target, seed):
    block = compose(host, target, "cascade").draft(context(seed))
    ngram, rnd = member_blocks(host, target, seed)
    for r in range(len(PROMPTS)):
        mine = slots(block, r)
        # ngram's proposal is taken where it has one; the random drafter drafts the rest
        source = ngram if int(ngram.lengths[r]) > 0 else rnd
        n = int(source.lengths[r])
        assert len(mine) == n and block.parents is None
        for k, (_, token, law) in enumerate(mine):
            assert token == int(source.tokens[r, k])
            expected = torch.nn.functional.one_hot(source.tokens[r, k], VOCAB).to(law.dtype) \
                if source.probs is None else source.probs[r, k].to(law.dtype)
            torch.testing.assert_close(law, expected, rtol=0, atol=0)
    assert int(ngram.lengths[0]) == 0 and int(block.lengths[0]) == 4  # a member proposing nothing


@pytest.mark.parametrize("seed", [0, 1])
def test_a_tree_node_reports_its_members_law_given_its_path(host, target, seed):
    block = compose(host, target, "tree").draft(context(seed))
    ngram, rnd = member_blocks(host, target, seed)
    for r in range(len(PROMPTS)):
        nodes = slots(block, r)
        assert len(nodes) == int(ngram.lengths[r]) + int(rnd.lengths[r])
        # every root-to-leaf chain under the anchor is one member's proposal, in order
        branches = []
        for j, (parent, token, law) in enumerate(nodes):
            assert parent < j
            if parent == -1:
                branches.append([j])
            else:
                chain = next(b for b in branches if b[-1] == parent)  # a chain: one child per node
                chain.append(j)
        drawn = {tuple(int(block.tokens[r, j]) for j in b): b for b in branches}
        for source in (ngram, rnd):
            n = int(source.lengths[r])
            if n == 0:
                continue
            chain = drawn[tuple(source.tokens[r, :n].tolist())]
            for k, j in enumerate(chain):
                law = nodes[j][2]
                expected = torch.nn.functional.one_hot(source.tokens[r, k], VOCAB).to(law.dtype) \
                    if source.probs is None else source.probs[r, k].to(law.dtype)
                torch.testing.assert_close(law, expected, rtol=0, atol=0)
        depths = [0] * len(nodes)  # depth first, then member: the shallow nodes of every branch come first
        for j, (parent, _, _) in enumerate(nodes):
            depths[j] = 1 if parent == -1 else depths[parent] + 1
        assert depths == sorted(depths)


def test_the_reported_law_is_the_sampling_law(host, target):
    """Over many rounds, the tokens the composition puts at the random member's root follow the
    law it reports there."""
    drafter = compose(host, target, "tree")
    counts, law, n = torch.zeros(VOCAB), None, 4000
    for seed in range(n):
        ctx = context(seed)
        ctx = DraftContext(request_ids=[0], histories=ctx.histories[:1], max_tokens=ctx.max_tokens[:1],
                           sampling=ctx.sampling.rows([0]), generators=ctx.generators[:1])
        block = drafter.draft(ctx)  # the first prompt: ngram proposes nothing, the random branch is the tree
        counts[int(block.tokens[0, 0])] += 1
        law = block.probs[0, 0] if law is None else law
        torch.testing.assert_close(block.probs[0, 0], law)
    freq = counts / n
    tolerance = 5 * (law * (1 - law) / n).sqrt() + 1e-3
    assert ((freq - law).abs() <= tolerance).all(), (freq - law).abs().max()


def test_ngram_reports_its_match_length_as_confidence(host, target):
    d = host.create_drafter("ngram", {"gamma": 3, "max_ngram": 3})
    block = d.draft(context(0))
    # [5, 6, 7]: no match (0); [9, 3, 9, 3, 9]: "9 3 9" (3); [11 12 13 14 11 12 13]: "11 12 13" (3)
    assert block.lengths.tolist() == [0, 0, 2, 3]
    torch.testing.assert_close(block.confidence[2:, 0], torch.tensor([0.75, 0.75]))


def engine(host, target, drafter, temperature=0.0, verifier="greedy", new=20):
    return Engine(target, host.create_verifier(verifier), drafter=drafter,
                  correction_head=host.create_correction_head("none", {}),
                  confidence=host.create_confidence("reported", {}), calibrator=host.create_calibrator("identity", {}),
                  scheduler=host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=temperature, max_new_tokens=new),
                  engine=EngineConfig(max_batch=3, max_context=96), trees=True)


def requests(new=20):
    return [GenerationRequest(prompt_ids=list(p), max_new_tokens=new, seed=i) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("mode", ["cascade", "tree"])
def test_a_deterministic_and_a_sampling_member_keep_greedy_parity(host, target, mode):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=20),
                   engine=EngineConfig(max_batch=3, max_context=96)).generate(requests())
    # a block drafter with features and the pipeline's correction head, behind prompt lookup
    members = [{"name": "ngram", "gamma": 3},
               {"name": "dspark", "gamma": 3, "layers": 1, "confidence": "entropy"}]
    outs = engine(host, target, host.create_drafter("compose", {"mode": mode, "members": members})).generate(requests())
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in outs) > 0


def test_members_release_every_request(host, target):
    drafter = host.create_drafter("compose", {"mode": "cascade", "members": [
        {"name": "ngram", "gamma": 3}, {"name": "dspark", "gamma": 3, "layers": 1, "confidence": "entropy"}]})
    released = {m.name: [] for m in drafter.members}
    for m in drafter.members:
        inner = m.drafter.release
        m.drafter.release = lambda rid, _name=m.name, _inner=inner: (released[_name].append(rid), _inner(rid))
    engine(host, target, drafter, temperature=1.0, verifier="rejection").generate(requests())
    assert {k: sorted(v) for k, v in released.items()} == {"ngram": [0, 1, 2, 3], "dspark": [0, 1, 2, 3]}
    dspark = drafter.members[1]
    assert not dspark.backlog._held and not dspark.drafter._contexts.length(0)


@pytest.mark.parametrize("members, mode, problem", [
    ([{"name": "ngram"}, {"name": "nope"}], "cascade",
     "drafter.members.1.name: unknown drafter 'nope'; registered drafters: "),
    ([{"name": "ngram"}, {"name": "compose", "members": [{"name": "ngram"}]}], "cascade",
     "drafter.members.1.name: 'compose' composes drafters itself: a composition cannot be a member of one"),
    ([{"name": "ngram"}, {"name": "eagle3", "confidence": "entropy", "tree": {"topk": 2, "nodes": 4}}], "tree",
     "drafter.members.1.tree: drafter 'eagle3' is set to propose a token tree; the branches of a composed tree"),
    ([{"name": "ngram"}, {"name": "dspark", "layers": 1}], "cascade",
     "drafter.members.1.confidence: drafter 'dspark' reports no confidence of its own"),
    ([{"name": "ngram", "gamma": 0}, {"name": "ngram"}], "cascade",
     "drafter.members.0.gamma: Input should be greater than or equal to 1"),
    ([{"name": "ngram"}, {"name": "ngram", "threshold": 0.5}], "cascade",
     "drafter.members.1.threshold: the last member's proposal is always taken"),
])
def test_a_bad_member_is_one_config_error_naming_its_key(members, mode, problem):
    overrides = ["drafter.name=compose", f"drafter.mode={mode}",
                 "drafter.members=" + str(members).replace("'", "").replace("True", "true")]
    with pytest.raises(ConfigError) as err:
        load_pipeline("ngram", overrides)
    assert problem in str(err.value)
    assert len(err.value.problems) == 1


def test_a_composition_trains_its_one_trainable_member_and_serves_as_the_composition(tmp_path):
    """``specforge train drafter.name=compose``: the member's own method trains it (its
    checkpoint is a plain dspark one), and the pipeline that serves it is the composition."""
    from specforge.training.config import TrainConfig, TrainConfigError, validate_train_config
    from specforge.training.trainer import Trainer
    from train_fixtures import tiny_config, tiny_source, tiny_target

    tiny = tiny_target()
    base = tiny_config(tmp_path, steps=3)
    dspark = {"name": "dspark", **base.drafter.options()}
    raw = base.model_dump(mode="json")
    raw["drafter"] = {"name": "compose", "mode": "cascade", "members": [{"name": "ngram", "gamma": 3}, dspark]}
    config = TrainConfig.model_validate(raw)
    trainer = Trainer(config, target=tiny, source=tiny_source(tiny), log=lambda _: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["method"] == "dspark"
    sections = trainer.method.pipeline(tmp_path / "drafter")
    members = sections["drafter"]["members"]
    assert sections["drafter"]["name"] == "compose" and members[0] == {"name": "ngram", "gamma": 3}
    assert members[1]["checkpoint"] == str(tmp_path / "drafter") and members[1]["confidence"]["name"] == "dspark-head"
    assert sections["confidence"] == {"name": "reported"} and sections["correction_head"]["name"] == "markov"
    host = suite_host()
    drafter = host.create_drafter("compose", {k: v for k, v in sections["drafter"].items() if k != "name"})
    drafter.bind(tiny)  # the member loads the trained checkpoint, its estimator the trained head
    assert drafter.members[1].estimator.__class__.__name__ == "DSparkConfidence"
    # two trainable members, or none, is one error naming the key
    raw["drafter"]["members"] = [dspark, dspark]
    with pytest.raises(TrainConfigError, match=r"drafter.members: a composition trains exactly one trainable member; "
                                                r"found members.0 \(dspark\), members.1 \(dspark\)"):
        validate_train_config(raw)


def test_a_training_preset_s_dspark_keys_do_not_reach_another_drafter():
    """Naming another drafter over a preset starts the drafter section afresh, as in a pipeline."""
    from specforge.training.config import load_train_config

    members = "drafter.members=[{name: ngram, gamma: 5}, {name: dspark, layers: 2, gamma: 7}]"
    config = load_train_config(["cpu"], ["drafter.name=compose", members])
    assert config.drafter.options() == {"mode": "cascade", "members": [{"name": "ngram", "gamma": 5},
                                                                       {"name": "dspark", "layers": 2, "gamma": 7}]}
    assert load_train_config(["cpu"], ["drafter.name=eagle3"]).drafter.name == "eagle3"
    assert load_train_config(["cpu"], ["drafter.layers=3"]).drafter.options()["draft_vocab"] == 8192

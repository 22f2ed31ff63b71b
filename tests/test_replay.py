"""The replay of a drafter (block or EAGLE-3) on the training path (``specforge bench probe --drafter``,
docs/reference-run.md#replay) walks exactly the greedy rounds the engine runs on the same text:
the check that serving hands the drafter the features, positions and context training does.  A
random-init drafter on a tiny target drafts badly but not never, so rounds of every length occur."""

from __future__ import annotations

import torch

from specforge.bench.probe import replayable_drafter
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.features import compute_features
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel
from specforge_plugins.drafters.block.checkpoint import save_drafter
from tiny_models import tiny_model

PROMPTS = ([5], [5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 15, 16, 17], [40, 41], [70, 3, 8])


def test_the_replay_on_the_training_path_walks_the_engines_rounds(tmp_path):
    host = PluginHost().load()
    target = TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None), None, torch.float32)
    drafter = host.create_drafter("dspark", {"gamma": 4, "layers": 2, "seed": 5})
    head = host.create_correction_head("markov", {"rank": 8, "zero_init": False, "seed": 3})
    engine = Engine(target, host.create_verifier("greedy"), drafter=drafter, correction_head=head,
                    confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                    scheduler=host.create_scheduler("fixed", {}), sampling=SamplingConfig(temperature=0.0),
                    engine=EngineConfig(max_batch=1, max_context=96))
    outputs = engine.generate([GenerationRequest(prompt_ids=list(p), max_new_tokens=24, seed=i)
                               for i, p in enumerate(PROMPTS)])
    save_drafter(tmp_path, drafter.backbone, head, method="dspark")
    pairs = [(torch.tensor(list(p) + o.token_ids), torch.tensor([0] * len(p) + [1] * len(o.token_ids)))
             for p, o in zip(PROMPTS, outputs)]
    replaying = replayable_drafter(str(tmp_path), target)  # found by the method its checkpoint records
    replay = replaying.replay(compute_features(target, pairs, replaying.feature_layers), target)
    accepted = sum(sum(o.stats.accepted_per_position) for o in outputs)
    assert accepted > 0  # some drafts were right: the walk is tested on rounds of several lengths
    assert replay["rounds"] == sum(o.stats.rounds for o in outputs)
    assert replay["replay_tau"] == sum(len(o.token_ids) for o in outputs) / replay["rounds"]


def test_eagle3s_replay_walks_the_engines_rounds(tmp_path):
    from specforge_plugins.drafters.eagle3.model import save_eagle3

    host = PluginHost().load()
    target = TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None), None, torch.float32)
    drafter = host.create_drafter("eagle3", {"seed": 5})  # γ 7: what the replayed checkpoint serves with
    engine = Engine(target, host.create_verifier("greedy"), drafter=drafter,
                    correction_head=host.create_correction_head("none", {}),
                    confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                    scheduler=host.create_scheduler("fixed", {}), sampling=SamplingConfig(temperature=0.0),
                    engine=EngineConfig(max_batch=1, max_context=96))
    outputs = engine.generate([GenerationRequest(prompt_ids=list(p), max_new_tokens=24, seed=i)
                               for i, p in enumerate(PROMPTS)])
    save_eagle3(tmp_path, drafter.model, {"kind": "eagle3", "gamma": 7})
    pairs = [(torch.tensor(list(p) + o.token_ids), torch.tensor([0] * len(p) + [1] * len(o.token_ids)))
             for p, o in zip(PROMPTS, outputs)]
    replaying = replayable_drafter(str(tmp_path), target)
    replay = replaying.replay(compute_features(target, pairs, replaying.feature_layers), target)
    assert sum(sum(o.stats.accepted_per_position) for o in outputs) > 0
    assert replay["rounds"] == sum(o.stats.rounds for o in outputs)
    assert replay["replay_tau"] == sum(len(o.token_ids) for o in outputs) / replay["rounds"]

"""Token trees in the engine: one tree pass (ancestor mask, RoPE at anchor + depth), the verifier's
walk, and the rollback that keeps only the accepted path's K/V.  Greedy parity over many rounds
checks the cache after compaction; the conformance harness checks the output law at T = 1 for
every shipped tree-capable verifier and sibling scheme."""

from __future__ import annotations

import pytest
import torch

from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.errors import ConfigError
from specforge.registry import ComponentKind
from specforge.passes import VarlenBatch
from specforge.runtime import TargetModel
from specforge_conformance import probes
from specforge_conformance.drafters import RandomTreeConfig, RandomTreeDrafter
from specforge_conformance.harness import Case, check_case
from specforge_conformance.suite import suite_host
from tiny_models import tiny_model

VOCAB = 32
PROMPTS = ([5], [5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 15, 16, 17])


@pytest.fixture(scope="module")
def host():
    return suite_host()


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=7, vocab=VOCAB, eos=None), None, torch.float32)


def engine(target, host, drafter, verifier="greedy", temperature=0.0, new=16, batch=3):
    return Engine(target, host.create_verifier(verifier), drafter=drafter,
                  correction_head=host.create_correction_head("none", {}),
                  confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                  scheduler=host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=temperature, max_new_tokens=new),
                  engine=EngineConfig(max_batch=batch, max_context=96),
                  trees=host.get(ComponentKind.VERIFIER, verifier).metadata.trees)


def requests(new=16):
    return [GenerationRequest(prompt_ids=p, max_new_tokens=new, seed=i) for i, p in enumerate(PROMPTS)]


def test_a_tree_pass_lays_out_depths_and_ancestors():
    batch = VarlenBatch.build([[7, 1, 2, 3, 4], [9]], [0, 1], [10, 3], parents=[[-1, 0, 0, 1, 3], [-1]])
    assert batch.positions.tolist() == [10, 11, 12, 13, 14, 3]
    assert batch.rope_positions.tolist() == [10, 11, 11, 12, 13, 3]
    assert batch.tree.tolist() == [0b1, 0b11, 0b101, 0b1011, 0b11011, 0b1]
    with pytest.raises(ValueError, match=r"request 0, token 2: parent 3"):
        VarlenBatch.build([[7, 1, 2, 3]], [0], [0], parents=[[-1, 0, 3, 1]])


@pytest.mark.parametrize("children", ["iid", "distinct", "top"])
def test_greedy_tree_decoding_is_the_target_greedy_output(target, host, children):
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=16),
                   engine=EngineConfig(max_batch=3, max_context=96)).generate(requests())
    drafter = RandomTreeDrafter(RandomTreeConfig(branching=(4, 2, 1), children=children, sharpness=1.0))
    outs = engine(target, host, drafter).generate(requests())
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # the walk left the first child at least once (a path no chain would have taken)
    assert sum(o.stats.accepted for o in outs) > 0


def test_a_verifier_not_registered_for_trees_is_refused_with_a_tree_drafter(target, host):
    """Tree support is what the verifier's registration declares, whatever its ``verify`` takes."""
    e = engine(target, host, RandomTreeDrafter(RandomTreeConfig(branching=(2,))))
    e.trees = False
    with pytest.raises(ConfigError, match="proposes token trees; the verifier GreedyVerifier verifies chains only "
                                          r"\(it is not registered with trees=True\)"):
        e.generate(requests()[:1])


@pytest.mark.parametrize("verifier, example", [("rejection", 1), ("match", 2)])
def test_tree_rounds_keep_the_target_law(host, verifier, example):
    drafter = host.get(ComponentKind.DRAFTER, "random-tree").metadata.examples[example]
    case = Case(pipeline={"drafter": ("random-tree", dict(drafter)), "correction_head": ("none", {}),
                          "confidence": ("constant", {}), "calibrator": ("identity", {}), "scheduler": ("fixed", {}),
                          "verifier": (verifier, {})}, batch=64)
    case = probes._finish(case, 10_000, example, "tree")
    result = check_case(case, host, 1e-6 / 7)
    assert not result.failed, {k: t.p_value for k, t in result.tests.items()}
    assert result.accepted > 0

"""The shipped drafters.

``ngram`` (prompt lookup) and ``suffix`` (lookup in the target's own answers) need no trained
model; ``dspark`` and ``dflash`` are the parallel block drafters, ``medusa`` the heads on the
target's last hidden state and ``eagle3`` EAGLE-3's one-layer autoregressive drafter
(docs/design/drafters.md), each from a checkpoint or a seeded random initialisation.  Importing
this package makes the drafters shipped in it nameable as ``shipped:<name>`` checkpoints.
"""

from __future__ import annotations

from specforge import hookimpl
from specforge.toolkit.checkpoints import ship
from specforge_plugins.drafters.block.formats import DFLASH_FORMATS, DSPARK_FORMATS
from specforge_plugins.drafters.block.training import BlockTraining, DFlashTraining
from specforge_plugins.drafters.compose import ComposeConfig, ComposeDrafter, ComposeTraining
from specforge_plugins.drafters.dflash import DFlashConfig, DFlashDrafter
from specforge_plugins.drafters.dspark import DSparkConfig, DSparkDrafter
from specforge_plugins.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Training
from specforge_plugins.drafters.eagle3.formats import EAGLE3_FORMATS
from specforge_plugins.drafters.medusa.formats import MEDUSA_FORMATS
from specforge_plugins.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaTraining
from specforge_plugins.drafters.ngram import NgramConfig, NgramDrafter
from specforge_plugins.drafters.suffix import SuffixConfig, SuffixDrafter
from specforge_plugins.drafters.shipped import shipped_drafters

__all__ = ["ComposeConfig", "ComposeDrafter", "DFlashConfig", "DFlashDrafter", "DSparkConfig", "DSparkDrafter", "Eagle3Config", "Eagle3Drafter",
           "MedusaConfig", "MedusaDrafter", "NgramConfig", "NgramDrafter",
           "SuffixConfig", "SuffixDrafter"]

# Here rather than in the hook: a checkpoint is loaded without the host too (scripts, tests), and
# any import of a drafter module runs this package first.
ship(shipped_drafters())

# Small enough for the conformance suite's reference targets (2 layers, d = 32, V = 8–32).
# The third restricts the sequential stage to the top-4 tokens of U_k (q is zero elsewhere); the
# last two propose from a draft vocabulary of 5 or 6 target ids (q is zero outside it), the
# last one with the sequential stage on the top 3 of those too.
_BLOCK_EXAMPLES = ({"gamma": 3, "layers": 1}, {"gamma": 4, "layers": 2, "seed": 1},
                   {"gamma": 3, "layers": 1, "candidates": 4}, {"gamma": 4, "layers": 1, "draft_vocab": 6, "seed": 2},
                   {"gamma": 3, "layers": 1, "draft_vocab": 5, "candidates": 3})
# Medusa's random inits: plain, two residual blocks over a draft vocabulary, the target's LM head
# with the sequential stage on the top 3, and a static candidate tree of 7 nodes.
_MEDUSA_EXAMPLES = ({"gamma": 3, "seed": 1}, {"gamma": 4, "res_layers": 2, "draft_vocab": 6, "seed": 2},
                    {"gamma": 3, "output": "shared", "candidates": 3, "seed": 3},
                    {"gamma": 3, "seed": 4, "tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]})
# Eagle3's: chains, one over a draft vocabulary, and EAGLE-2's dynamic tree (2 children per node, 6 kept).
_EAGLE3_EXAMPLES = ({"gamma": 3, "seed": 1}, {"gamma": 4, "draft_vocab": 6, "seed": 2}, {"gamma": 2, "seed": 3},
                    {"gamma": 3, "seed": 4, "tree": {"topk": 2, "nodes": 6}})
# A composition's, both modes: prompt lookup in front of a sampling block drafter (cascade, the
# first with a threshold on ngram's confidence), and the two as sibling branches of a tree.
_COMPOSE_EXAMPLES = (
    {"mode": "cascade", "members": [{"name": "ngram", "gamma": 3, "threshold": 0.6},
                                    {"name": "dspark", "gamma": 3, "layers": 1, "confidence": "entropy"}]},
    {"mode": "tree", "members": [{"name": "ngram", "gamma": 2},
                                 {"name": "dspark", "gamma": 3, "layers": 1, "seed": 1, "confidence": "entropy"}]},
    {"mode": "cascade", "members": [{"name": "ngram", "gamma": 2, "max_ngram": 2},
                                    {"name": "eagle3", "gamma": 3, "seed": 1, "confidence": "entropy"}]},
)


@hookimpl
def specforge_register_drafters(register):
    register("ngram", NgramDrafter, config=NgramConfig, deterministic=True, parallel=False, provides=("confidence",),
             examples=({}, {"gamma": 2, "max_ngram": 2}, {"gamma": 7, "min_ngram": 2}),
             description="prompt lookup: propose what followed the most recent earlier "
                         "occurrence of the last n tokens (no model)")
    # No corpus in the examples: what it learns from the requests it sees finish is enough on a
    # tiny vocabulary, and a case's later requests then draw on its earlier ones.
    register("suffix", SuffixDrafter, config=SuffixConfig, deterministic=True, parallel=False,
             provides=("confidence",), examples=({"gamma": 4, "min_context": 1}, {"gamma": 2, "max_context": 2}),
             description="suffix lookup: propose the most frequent continuation of the last tokens in the "
                         "target's own answers (a corpus, and the outputs it has seen finish)")
    register("dspark", DSparkDrafter, config=DSparkConfig, parallel=True, uses_correction_head=True,
             provides=("probs", "logits", "hidden"), examples=_BLOCK_EXAMPLES, training=BlockTraining,
             formats=DSPARK_FORMATS,
             description="DSpark: parallel block [anchor, MASK x (gamma-1)] over fused target features, "
                         "then the correction head left to right")
    register("dflash", DFlashDrafter, config=DFlashConfig, parallel=True, uses_correction_head=True,
             provides=("probs", "logits", "hidden"), examples=_BLOCK_EXAMPLES, training=DFlashTraining,
             formats=DFLASH_FORMATS,
             description="DFlash: parallel block [anchor, MASK x gamma] over fused target features")
    register("medusa", MedusaDrafter, config=MedusaConfig, parallel=True, uses_correction_head=True, trees=True,
             formats=MEDUSA_FORMATS,
             provides=("probs", "logits", "hidden"), examples=_MEDUSA_EXAMPLES, training=MedusaTraining,
             description="Medusa: K heads on the target's last hidden state, then the correction head "
                         "left to right (none: plain Medusa)")
    register("eagle3", Eagle3Drafter, config=Eagle3Config, parallel=False, trees=True,
             provides=("probs", "logits", "hidden"), formats=EAGLE3_FORMATS,
             examples=_EAGLE3_EXAMPLES, training=Eagle3Training,
             description="EAGLE-3: one decoder layer over three fused target layers, drafting a chain step by "
                         "step on its own hidden states")
    register("compose", ComposeDrafter, config=ComposeConfig, uses_correction_head=True, trees=True,
             provides=("confidence",), examples=_COMPOSE_EXAMPLES, training=ComposeTraining,
             description="registered drafters composed by name: a cascade (the first member whose proposal "
                         "clears its confidence) or the branches of one token tree")

"""``eagle3`` checkpoints in other projects' layouts (docs/interop.md), one module per layout:

* :mod:`.serving` — the layouts vLLM and SGLang serve (``vllm``, ``sglang``);
* :mod:`.eagle_repo` — the original EAGLE repository's (``eagle``): the same keys, another config;
* :mod:`.deepspec` — DeepSpec's ``Qwen3Eagle3Model`` (``deepspec``).

:data:`EAGLE3_FORMATS` is what the ``eagle3`` registration lists.
"""

from __future__ import annotations

from specforge_plugins.drafters.eagle3.formats.deepspec import DeepSpecEagle3Format
from specforge_plugins.drafters.eagle3.formats.eagle_repo import EagleRepoFormat
from specforge_plugins.drafters.eagle3.formats.serving import Eagle3Format

__all__ = ["EAGLE3_FORMATS"]

# vLLM's Eagle3LlamaForCausalLM has a d2t parameter only for a draft vocabulary smaller than the
# target's (loading one otherwise fails: "no module or parameter named 'draft_id_to_target_id'");
# SGLang reads identity maps as the whole vocabulary.
EAGLE3_FORMATS = (Eagle3Format("vllm", "vLLM", 1, full_vocab_maps=False),
                  Eagle3Format("sglang", "SGLang", 0, full_vocab_maps=True), DeepSpecEagle3Format(), EagleRepoFormat())

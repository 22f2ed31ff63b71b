"""The parallel block drafter of DSpark and DFlash (docs/design/drafters.md): config, backbone, checkpoints.

Engine-facing drafter plug-ins (``dspark``, ``dflash``) build on these pieces; this package
registers nothing itself.
"""

from __future__ import annotations

from specforge_plugins.drafters.block.config import BlockDrafterConfig, default_tap_layers
from specforge_plugins.drafters.block.model import (
    MASK,
    BlockBackbone,
    DraftLayer,
    SharedWeights,
    block_attention_mask,
)

__all__ = ["MASK", "BlockBackbone", "BlockDrafterConfig", "DraftLayer", "SharedWeights",
           "block_attention_mask", "default_tap_layers"]

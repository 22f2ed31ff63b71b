"""The parallel block drafter of DSpark and DFlash (docs/design/drafters.md): config, backbone,
engine-facing drafter, checkpoints and training.

The ``dspark`` and ``dflash`` modules of the drafters package are its two layouts; this package
registers nothing itself.
"""

from __future__ import annotations

from specforge_plugins.drafters.block.config import BlockDrafterConfig, default_tap_layers
from specforge_plugins.drafters.block.model import MASK, BlockBackbone, DraftLayer, block_attention_mask

__all__ = ["MASK", "BlockBackbone", "BlockDrafterConfig", "DraftLayer", "block_attention_mask", "default_tap_layers"]

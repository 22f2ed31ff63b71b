"""``dflash``: DFlash's block drafter (Chen et al., 2026; docs/design/drafters.md): the block
``[x_0, MASK × γ]``, whose γ mask slots predict x_1 … x_γ in place
(:class:`~specforge_plugins.drafters.block.drafter.BlockDrafter`).
"""

from __future__ import annotations

from specforge_plugins.drafters.block.drafter import BlockConfig, BlockDrafter

__all__ = ["DFlashConfig", "DFlashDrafter"]


class DFlashConfig(BlockConfig):
    """``dflash``: the block drafters' knobs; defaults of the DFlash paper (γ = 16, 5 layers)."""


class DFlashDrafter(BlockDrafter):
    """DFlash: ``[x_0, MASK × γ]``, the γ mask slots predict x_1 … x_γ."""

    predict_anchor = False
    default_gamma = 16

    def __init__(self, config: DFlashConfig | None = None) -> None:
        super().__init__(config or DFlashConfig())

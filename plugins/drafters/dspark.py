"""``dspark``: DSpark's block drafter (paper §3; docs/design/drafters.md): the block
``[x_0, MASK × (γ−1)]``, whose anchor slot is the first prediction, then the pipeline's correction
head left to right (:class:`~specforge_plugins.drafters.block.drafter.BlockDrafter`).
"""

from __future__ import annotations

from specforge_plugins.drafters.block.drafter import BlockConfig, BlockDrafter

__all__ = ["DSparkConfig", "DSparkDrafter"]


class DSparkConfig(BlockConfig):
    """Parameters of the ``dspark`` drafter; defaults of the DSpark paper (γ = 7, 5 layers)."""


class DSparkDrafter(BlockDrafter):
    """DSpark: ``[x_0, MASK × (γ−1)]``, the anchor slot predicts x_1 (paper §3)."""

    def __init__(self, config: DSparkConfig | None = None) -> None:
        super().__init__(config or DSparkConfig())

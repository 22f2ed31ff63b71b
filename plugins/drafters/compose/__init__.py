"""``compose``: registered drafters composed by name, as a cascade or as the branches of a token
tree (docs/composition.md)."""

from specforge_plugins.drafters.compose.config import ComposeConfig
from specforge_plugins.drafters.compose.drafter import ComposeDrafter
from specforge_plugins.drafters.compose.training import ComposeTraining, ComposeTrainingConfig

__all__ = ["ComposeConfig", "ComposeDrafter", "ComposeTraining", "ComposeTrainingConfig"]

"""Medusa (Cai et al., 2024): K heads on the target's last hidden state (docs/design/drafters.md#medusa).

``model`` holds the heads and their checkpoint, ``drafter`` the engine-facing drafter and
``training`` the Medusa-1 training method (heads only, Σ λ_k CE_k).
"""

from __future__ import annotations

from specforge_plugins.drafters.medusa.drafter import MedusaConfig, MedusaDrafter
from specforge_plugins.drafters.medusa.model import MedusaHeads, MedusaShape, load_medusa, save_medusa
from specforge_plugins.drafters.medusa.training import MedusaTraining

__all__ = ["MedusaConfig", "MedusaDrafter", "MedusaHeads", "MedusaShape", "MedusaTraining", "load_medusa", "save_medusa"]

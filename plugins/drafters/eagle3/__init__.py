"""EAGLE-3 (Li et al., 2025): one decoder layer over fused target features, drafting
autoregressively (docs/design/drafters.md#eagle3).

``model`` holds the network and its checkpoint, ``drafter`` the engine-facing chain drafter and
``training`` the training-time-test method.
"""

from __future__ import annotations

from specforge_plugins.drafters.eagle3.drafter import Eagle3Config, Eagle3Drafter
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, eagle3_layers, load_eagle3, save_eagle3
from specforge_plugins.drafters.eagle3.training import Eagle3Training

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Model", "Eagle3Shape", "Eagle3Training", "eagle3_layers",
           "load_eagle3", "save_eagle3"]

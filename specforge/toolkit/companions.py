"""Giving components the weights a drafter's checkpoint trained for them (lifecycle step 2 of
:mod:`specforge.components`): the engine does it for the pipeline's slots, and a composed drafter
for the estimators of its members, the same way.
"""

from __future__ import annotations

from typing import Any

from specforge.components import ComponentWeights
from specforge.errors import ConfigError
from specforge.protocols import CompanionWeights, LoadsWeights, Restricts

__all__ = ["attach_companions", "companions_of", "load_companion"]


def companions_of(drafter: Any) -> dict[str, ComponentWeights]:
    """The weights ``drafter``'s checkpoint trained for other slots (none without the protocol)."""
    return drafter.companion_weights() if isinstance(drafter, CompanionWeights) else {}


def attach_companions(drafter: Any, parts: dict[str, Any], companions: dict[str, ComponentWeights],
                      where: dict[str, str] | None = None) -> None:
    """Load ``companions`` into the components ``parts`` (by slot); a component that came without
    trained weights is restricted to the drafter's draft vocabulary, when it proposes from one —
    its tables are then read by draft id.  ``where`` names each slot's config key in messages."""
    for slot, part in parts.items():
        if slot in companions:
            load_companion((where or {}).get(slot, slot), part, companions[slot])
    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is not None:
        for slot, part in parts.items():
            if slot not in companions and isinstance(part, Restricts):
                part.restrict(vocab.token_rows())


def load_companion(key: str, part: Any, weights: ComponentWeights) -> None:
    """Give ``part`` (configured at ``key``) the weights a drafter's checkpoint trained for it."""
    if part is None:
        return
    if type(part) is not weights.kind:
        if isinstance(part, LoadsWeights):  # trained weights of another kind exist
            raise ConfigError([f"{key}.name: the drafter checkpoint {weights.source} trained a "
                               f"{weights.kind.__name__} for this slot; the pipeline's is a {type(part).__name__} "
                               "(choose the same kind, or one without weights such as 'none' to run without it)"])
        return
    part.load_weights(weights)

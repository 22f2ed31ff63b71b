"""The shipped drafters.

``ngram`` (prompt lookup) needs no trained model; the model drafters register here as they land.
"""

from __future__ import annotations

from specforge import hookimpl
from specforge_plugins.drafters.ngram import NgramConfig, NgramDrafter

__all__ = ["NgramConfig", "NgramDrafter"]


@hookimpl
def specforge_register_drafters(register):
    register("ngram", NgramDrafter, config=NgramConfig, deterministic=True, parallel=False,
             examples=({}, {"gamma": 2, "max_ngram": 2}, {"gamma": 7, "min_ngram": 2}),
             description="prompt lookup: propose what followed the most recent earlier "
                         "occurrence of the last n tokens (no model)")

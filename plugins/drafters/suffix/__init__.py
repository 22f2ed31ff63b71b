"""``suffix``: continuations of the request's last tokens looked up in the target's own answers
(a corpus, and the outputs it has seen finish); see :mod:`.drafter`."""

from specforge_plugins.drafters.suffix.drafter import SuffixConfig, SuffixDrafter

__all__ = ["SuffixConfig", "SuffixDrafter"]

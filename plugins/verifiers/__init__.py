"""The shipped verifiers: ``rejection``, ``match``, ``greedy`` (lossless) and ``typical`` (lossy).

Every verifier exposes its per-position law — ``accept_probability(p, q, x)`` and
``residual(p, q, x)`` — next to the batched ``verify``, so exactness can be checked by enumeration.

The building blocks of the generic ``verify`` (``BaseVerifier``, ``prepare``, ``VerifyInputs``,
``accepted_prefix``, ``gather_at``) and the tree walk are the toolkit's
(:mod:`specforge.toolkit.verification`, :mod:`specforge.toolkit.trees`), for verifiers outside this
package too, such as the conformance suite's negative controls, which re-assemble them with one
step broken.
"""

from __future__ import annotations

from specforge import hookimpl
from specforge_plugins.verifiers.greedy import GreedyConfig, GreedyVerifier
from specforge_plugins.verifiers.match import MatchConfig, MatchVerifier
from specforge_plugins.verifiers.rejection import RejectionConfig, RejectionVerifier
from specforge_plugins.verifiers.typical import TypicalConfig, TypicalVerifier

__all__ = [
    "GreedyConfig",
    "GreedyVerifier",
    "MatchConfig",
    "MatchVerifier",
    "RejectionConfig",
    "RejectionVerifier",
    "TypicalConfig",
    "TypicalVerifier",
]


@hookimpl
def specforge_register_verifiers(register):
    # Every shipped verifier verifies token trees too: the recursive walk of tree.py under its own
    # per-position law (for rejection, SpecInfer's multi-candidate rule).
    register("rejection", RejectionVerifier, config=RejectionConfig, lossless=True, trees=True,
             description="speculative rejection sampling: accept if u·q(x) < p(x), "
                         "else sample norm(max(p − q, 0))")
    register("match", MatchVerifier, config=MatchConfig, lossless=True, trees=True,
             description="sample-and-match (DFlash): draw y ~ p, accept iff y == x, else emit y")
    register("greedy", GreedyVerifier, config=GreedyConfig, lossless=True, greedy_only=True, trees=True,
             description="temperature 0: accept while x == argmax p, emit the arg-max")
    register("typical", TypicalVerifier, config=TypicalConfig, lossless=False, trees=True,
             description="Medusa typical acceptance, p(x) > min(ε, δ·exp(−H(p))) — lossy")

"""Which pipelines exist: combinations of registered components, their compatibility, coverage.

Compatibility is what the plug-ins declare in their registration metadata, never a list kept
here, so a component from a package the suite has never seen enters with no edit to the suite:

* a drafter that does not run a correction head (``uses_correction_head=False``) combines only
  with identity heads (``identity=True``, i.e. ``none``);
* a confidence estimator that ``needs_any`` of the DraftBlock fields combines only with drafters
  that ``provides`` one of them;
* a ``greedy_only`` verifier is only tried at temperature 0;
* a drafter that may propose token trees (``trees=True``) combines only with verifiers that
  verify them (``trees=True``).

Certification is refused, not tested, for what declares itself unfit: a lossy verifier
(``lossless=False``) and a confidence estimator that is not pre-token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from specforge.plugins import PluginHost
from specforge.registry import ComponentKind

__all__ = ["SLOTS", "Combination", "certification_blocker", "combinations", "covering_set", "incompatibility"]

SLOTS = tuple(kind.value for kind in ComponentKind)  # the pipeline slots, in round order


@dataclass(frozen=True, order=True)
class Combination:
    """One pipeline: a registered name per slot; ``drafter=None`` is plain decoding (the other
    speculative slots are then ``None`` too)."""

    drafter: str | None
    correction_head: str | None
    confidence: str | None
    calibrator: str | None
    scheduler: str | None
    verifier: str

    @property
    def plain(self) -> bool:
        return self.drafter is None

    def items(self) -> list[tuple[str, str]]:
        """(slot, name) of every filled slot."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def label(self) -> str:
        if self.plain:
            return f"plain / {self.verifier}"
        return " + ".join(name for _, name in self.items()[:-1]) + f" / {self.verifier}"

    def involves(self, names: set[str]) -> bool:
        return any(name in names for _, name in self.items())

    def to_dict(self) -> dict[str, str | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def incompatibility(host: PluginHost, combo: Combination) -> str | None:
    """Why the declared metadata rules ``combo`` out, or ``None`` when it is a valid pipeline."""
    if combo.plain:
        return None
    drafter = host.get(ComponentKind.DRAFTER, combo.drafter).metadata
    head = host.get(ComponentKind.CORRECTION_HEAD, combo.correction_head).metadata
    if not (drafter.uses_correction_head or head.identity):
        return f"drafter {combo.drafter!r} runs no correction head, so only identity heads apply"
    if drafter.trees and not host.get(ComponentKind.VERIFIER, combo.verifier).metadata.trees:
        return f"drafter {combo.drafter!r} proposes token trees; verifier {combo.verifier!r} verifies chains only"
    confidence = host.get(ComponentKind.CONFIDENCE, combo.confidence).metadata
    if confidence.needs_any and not set(confidence.needs_any) & set(drafter.provides):
        return (f"confidence {combo.confidence!r} needs one of {list(confidence.needs_any)}; "
                f"drafter {combo.drafter!r} provides {list(drafter.provides)}")
    return None


def certification_blocker(host: PluginHost, combo: Combination) -> str | None:
    """Why ``combo`` can never be certified lossless by its own declaration, or ``None``."""
    verifier = host.get(ComponentKind.VERIFIER, combo.verifier).metadata
    if not verifier.lossless:
        return f"verifier {combo.verifier!r} declares itself lossy"
    if not combo.plain:
        confidence = host.get(ComponentKind.CONFIDENCE, combo.confidence).metadata
        if not confidence.pre_token:
            return f"confidence {combo.confidence!r} is not pre-token (it may read x_k)"
    return None


def combinations(host: PluginHost, names: dict[str, list[str]] | None = None) -> list[Combination]:
    """Every compatible combination of the registered components (optionally of ``names`` per
    slot only), plain decoding included, in a stable order."""
    host.load()
    pools = {slot: list(names[slot]) if names and slot in names else host.names(ComponentKind(slot))
             for slot in SLOTS}
    out = [Combination(None, None, None, None, None, v) for v in pools["verifier"]]
    for parts in itertools.product(*(pools[s] for s in SLOTS)):
        combo = Combination(*parts)
        if incompatibility(host, combo) is None:
            out.append(combo)
    return out


def covering_set(combos: list[Combination]) -> list[Combination]:
    """A small subset in which every pair of (slot, name) choices that occurs together in
    ``combos`` occurs at least once (greedy pairwise covering; plain pipelines always kept).

    A bug that needs two components to interact shows up in the fast tier; interactions of three
    or more are left to the full tier, which runs every combination.
    """
    def pairs(c: Combination) -> set[tuple]:
        return set(itertools.combinations(c.items(), 2)) | {(item,) for item in c.items()}

    chosen = [c for c in combos if c.plain]
    missing = set().union(*(pairs(c) for c in combos)) if combos else set()
    for c in chosen:
        missing -= pairs(c)
    rest = [c for c in combos if not c.plain]
    while missing:
        best = max(rest, key=lambda c: len(pairs(c) & missing))  # first of equals: stable order
        chosen.append(best)
        missing -= pairs(best)
        rest.remove(best)
    return chosen

"""The optional methods of components, one small protocol each (docs/reference/contracts.md).

A component implements its kind's contract (:mod:`specforge.components`) and, where it needs a
lifecycle step or a round hook the contract leaves optional, one of the protocols below.  The
engine finds them with ``isinstance`` — they are runtime-checkable — and :func:`check_optional`
checks each one a component *has* once, when the engine binds it: a method that is there but is
not callable, or that cannot take the arguments the engine passes, is a
:class:`ComponentContractError` naming the component, the method and the signature it needs,
instead of a ``TypeError`` in the middle of a round.

Which kinds may have which (the engine calls nothing else):

========================  ==========================================  ============================
protocol                  method                                      kinds
========================  ==========================================  ============================
:class:`Binds`            ``bind(target)``                            any but the verifier
:class:`Taps`             ``taps_for(args) -> layers``                drafter
:class:`CompanionWeights` ``companion_weights() -> {slot: weights}``  drafter
:class:`Learns`           ``forget()``                                drafter, scheduler
:class:`LoadsWeights`     ``load_weights(weights)``                   correction head, confidence
:class:`Restricts`        ``restrict(token_rows)``                    correction head, confidence
:class:`SharesHead`       ``share(correction_head)``                  confidence
:class:`DraftGate`        ``draft_gate(num_requests) -> bool``        scheduler
:class:`DraftCostAware`   ``bind_draft_cost(measure)``                scheduler
:class:`ObservesRounds`   ``observe(outcome)``                        calibrator, scheduler
========================  ==========================================  ============================

One more is called by a bench, not the engine: :class:`Replays` (a drafter that can walk its greedy
rounds over cached features on its training path, for ``specforge bench probe --drafter``).

Whether a verifier takes token trees is not a method: it is declared when it registers
(``trees=True``, :class:`specforge.registry.VerifierMeta`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from specforge.components import ComponentWeights, RoundOutcome
from specforge.errors import SpecforgeError
from specforge.hardware import DraftCost

__all__ = ["OPTIONAL", "Binds", "CompanionWeights", "ComponentContractError", "DraftCostAware", "DraftGate",
           "Learns", "LoadsWeights", "ObservesRounds", "Replays", "Restricts", "SharesHead", "Taps",
           "check_optional"]


class ComponentContractError(SpecforgeError, TypeError):
    """A component whose optional method cannot be called the way the engine calls it."""


@runtime_checkable
class Binds(Protocol):
    """Lifecycle step 1: sized from the target, takes the frozen tensors it reads."""

    def bind(self, target: Any) -> None: ...


@runtime_checkable
class Taps(Protocol):
    """Before it binds: the target layers a drafter will read (its ``feature_layers`` after
    ``bind``) on a target of shape ``args`` (:class:`~specforge.model_args.ModelArgs`), so the
    target is loaded with a backend that can tap them (:class:`specforge.runtime.contract.Needs`).
    A drafter that taps layers and lacks it still runs; a backend that cannot serve its taps then
    says so when the engine is built."""

    def taps_for(self, args: Any) -> tuple[int, ...]: ...


@runtime_checkable
class CompanionWeights(Protocol):
    """A drafter whose checkpoint trained other components of the round: their weights, by slot."""

    def companion_weights(self) -> dict[str, ComponentWeights]: ...


@runtime_checkable
class LoadsWeights(Protocol):
    """A component with trained weights of its own (given by the drafter's checkpoint)."""

    def load_weights(self, weights: ComponentWeights) -> None: ...


@runtime_checkable
class Restricts(Protocol):
    """A head that came without trained weights, restricted to a drafter's draft vocabulary
    (``token_rows``: the target ids of the draft ids, in draft-id order)."""

    def restrict(self, token_rows: Tensor) -> None: ...


@runtime_checkable
class SharesHead(Protocol):
    """A confidence estimator that reads tables of the pipeline's (loaded) correction head."""

    def share(self, correction_head: Any) -> None: ...


@runtime_checkable
class DraftGate(Protocol):
    """A scheduler that may decide, before anything is drafted, that a round runs plain."""

    def draft_gate(self, num_requests: int) -> bool: ...


@runtime_checkable
class DraftCostAware(Protocol):
    """A scheduler offered what drafting costs this pipeline on this machine: ``measure()``
    returns the :class:`~specforge.hardware.DraftCost` (measured once on an engine of its own and
    cached); call it only if you need it."""

    def bind_draft_cost(self, measure: Callable[[], DraftCost]) -> None: ...


@runtime_checkable
class Learns(Protocol):
    """A drafter or scheduler that learns from what it serves (``suffix`` indexes finished outputs,
    a hardware-aware scheduler's draft gate weighs the rounds it saw).  ``forget()`` returns it to
    its configured state: a measurement calls it before each prompt set and temperature, so that
    no set is drafted from answers to its own prompts, nor gated by another set's rounds
    (docs/evaluation.md)."""

    def forget(self) -> None: ...


@runtime_checkable
class ObservesRounds(Protocol):
    """A calibrator or scheduler told, after each verified chain round, what the round showed
    (never before its own round is scheduled)."""

    def observe(self, outcome: RoundOutcome) -> None: ...


@runtime_checkable
class Replays(Protocol):
    """A drafter (loaded from a checkpoint and bound) that replays, over cached features of
    finished text, the greedy rounds it would run there, the way training sees it: returns
    ``{"top1": [agreement per slot, teacher-forced], "replay_tau", "rounds"}``."""

    def replay(self, features: list[Any], target: Any) -> dict[str, Any]: ...


# Per pipeline slot, the optional protocols the engine calls (and so checks).
OPTIONAL: dict[str, tuple[type, ...]] = {
    "drafter": (Binds, Taps, CompanionWeights, Learns),
    "correction_head": (Binds, LoadsWeights, Restricts),
    "confidence": (Binds, LoadsWeights, Restricts, SharesHead),
    "calibrator": (Binds, ObservesRounds),
    "scheduler": (Binds, DraftGate, DraftCostAware, ObservesRounds, Learns),
    "verifier": (),
}


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def check_optional(slot: str, component: Any) -> None:
    """Raise :class:`ComponentContractError` for an optional method of ``component`` (the
    pipeline's ``slot``) that is present but cannot be called as its protocol says."""
    for protocol in OPTIONAL.get(slot, ()):
        for name in _methods(protocol):
            if not hasattr(component, name):
                continue
            method = getattr(component, name)
            wanted = inspect.signature(getattr(protocol, name))
            params = [p for p in wanted.parameters.values() if p.name != "self"]
            shown = f"{name}({', '.join(p.name for p in params)})"
            where = f"{slot} {type(component).__module__}.{type(component).__qualname__}"
            if not callable(method):
                raise ComponentContractError(f"{where}: `{name}` is not a method; {protocol.__name__} needs "
                                             f"{shown} (docs/reference/contracts.md)")
            try:
                signature = inspect.signature(method)
            except (TypeError, ValueError):  # a builtin without a signature: nothing to check
                continue
            try:
                signature.bind(*params)
            except TypeError as exc:
                raise ComponentContractError(f"{where}: `{name}` cannot be called as {shown} ({exc}); "
                                             f"see {protocol.__name__} in docs/reference/contracts.md") from None

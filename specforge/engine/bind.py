"""Binding a pipeline's components to the target: lifecycle steps 1–2 of :mod:`specforge.components`.

The engine calls :func:`bind_components` once, when it is built; a calibrator fitted on another
drafter's rounds is refused before that (:func:`check_calibrator`).  Before the target exists, what
its drafter will tap is asked of the drafter (:func:`drafter_needs`), so the target loads with a
backend that serves it (:func:`load_pipeline_target`).  Everything here runs before
the first round, so the round loop (:mod:`specforge.engine.engine`) never looks at a component's
optional methods except through its protocol.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

from specforge.config import PipelineConfig
from specforge.errors import ConfigError
from specforge.model_args import ModelArgs
from specforge.protocols import Binds, SharesHead, Taps, check_optional
from specforge.registry import ComponentKind
from specforge.runtime import Needs, TargetModel, load_target
from specforge.toolkit.companions import attach_companions, companions_of

__all__ = ["bind_components", "check_calibrator", "drafter_identity", "drafter_needs", "feature_taps",
           "load_pipeline_target"]


def drafter_needs(drafter: Any, requests: int | None = None) -> Callable[[ModelArgs], Needs]:
    """What ``drafter`` will read from the target's passes, given the target's shape: the layers it
    declares (:class:`~specforge.protocols.Taps`), so the target loads with a backend that taps them;
    ``requests``, the load the caller serves, and whether it drafts at all (``drafter`` None: plain
    decoding) pick the measured passes ``auto`` decides on."""

    def needs(args: ModelArgs) -> Needs:
        taps = tuple(int(i) for i in drafter.taps_for(args)) if isinstance(drafter, Taps) else ()
        return Needs(taps, requests=requests, drafts=drafter is not None)

    return needs


def load_pipeline_target(pipeline: PipelineConfig, *others: PipelineConfig, requests: int | None = None,
                         log: Callable[[str], None] | None = None) -> TargetModel:
    """The target ``pipeline.target`` names, its backend decided with what the drafters of
    ``pipeline`` and ``others`` (pipelines that share it) will tap and the load the job serves
    (``requests`` decoded together) — for a job that loads the target before it builds the engines."""
    drafters = [p.components.get(ComponentKind.DRAFTER) for p in (pipeline, *others)]
    wanted = [drafter_needs(spec.create()) for spec in drafters if spec is not None]

    def needs(args: ModelArgs) -> Needs:
        return functools.reduce(operator.or_, (n(args) for n in wanted), Needs(requests=requests, drafts=False))

    return load_target(pipeline.target, needs=needs, log=log)


def bind_components(target: Any, parts: dict[str, Any]) -> tuple[int, ...]:
    """Lifecycle steps 1–2 (:mod:`specforge.components`) for the pipeline's ``parts`` (by slot):
    check every component's optional methods (:mod:`specforge.protocols`), bind each that has
    ``bind`` to the target, then give each the weights the drafter's checkpoint trained for it.
    Returns the target layers the drafter reads (:func:`feature_taps`)."""
    drafter, correction_head, confidence = parts["drafter"], parts["correction_head"], parts["confidence"]
    for slot, part in parts.items():
        if part is not None:
            check_optional(slot, part)
    # Heads and estimators sized from the target (vocabulary, hidden size) build here; a
    # hardware-aware scheduler reads the target's step curve on this machine.
    for slot, part in parts.items():
        if slot != "verifier" and isinstance(part, Binds):
            part.bind(target)
    attach_companions(drafter, {"correction_head": correction_head, "confidence": confidence}, companions_of(drafter))
    if isinstance(confidence, SharesHead):
        confidence.share(correction_head)
    return feature_taps(drafter, target)


def feature_taps(drafter: Any, target: Any) -> tuple[int, ...]:
    """The target layers ``drafter`` reads (``feature_layers``, read after ``bind``: a drafter may
    pick them from the target's depth), checked against the target's depth."""
    taps = tuple(int(i) for i in (getattr(drafter, "feature_layers", ()) or ()))
    depth = target.args.n_layers
    bad = [i for i in taps if not 0 <= i < depth]
    if bad:
        raise ValueError(f"the drafter taps target layer {bad[0]}, but the target has {depth} layers (0..{depth - 1})")
    return taps


def drafter_identity(pipeline: PipelineConfig, drafter: Any) -> dict[str, Any]:
    """What identifies the drafter a calibrator's rounds came from: its name, checkpoint and γ."""
    spec = pipeline.components[ComponentKind.DRAFTER]
    return {"drafter": spec.name, "checkpoint": getattr(spec.params, "checkpoint", None),
            "gamma": getattr(drafter, "gamma", None)}


def check_calibrator(calibrator: Any, pipeline: PipelineConfig, drafter: Any) -> None:
    """A calibrator fitted on another drafter's rounds (``fitted_for``) is one clear error."""
    fitted = getattr(calibrator, "fitted_for", None)
    if not fitted:
        return
    mine = drafter_identity(pipeline, drafter)
    wrong = [f"{k} {fitted.get(k)!r} (this pipeline: {v!r})" for k, v in mine.items() if k in fitted and fitted[k] != v]
    if wrong:
        raise ConfigError([f"calibrator: fitted on the rounds of another drafter — {', '.join(wrong)}; run "
                           "`specforge calibrate` for this pipeline"])

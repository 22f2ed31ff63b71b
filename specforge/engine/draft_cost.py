"""What drafting costs a pipeline on this machine, ρ(R), measured on an engine of its own.

A hardware-aware scheduler weighs a round's expected gain against its price, and on a CPU the
drafter runs between target passes, so the price includes drafting (docs/design/
calibration-scheduling.md#what-drafting-costs-and-the-draft-gate).  ρ(R) is the median seconds of
a round's drafting side (drafter, correction head, confidence, calibrator) over the median seconds
of its plain target pass, at R requests.

The measurement never touches the engine it is for: :func:`measure_draft_cost` builds a second
engine over the same target and the same bound components (``Engine(..., bound=True)``), with a
cache of its own and a scheduler that verifies nothing, and drops it afterwards.  The calibrator
reaches it only through its ``apply`` — what a round pays for — so an online calibrator learns
nothing from these synthetic rounds.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specforge.config import EngineConfig
from specforge.engine.request import GenerationRequest
from specforge.hardware import DraftCost
from specforge.machine import machine
from specforge.caches import profile_file
from specforge.toolkit.step_curve import profile_key

__all__ = ["DRAFT_COST_REQUESTS", "machine_draft_cost", "measure_draft_cost"]

DRAFT_COST_REQUESTS = (1, 2, 4, 8, 16, 32, 64)
_METHOD = {"requests": DRAFT_COST_REQUESTS, "context": 256, "rounds": 8}


class _VerifyNothing:
    """The measurement's scheduler: every round drafts, none verifies."""

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        return torch.zeros_like(available, dtype=torch.long)


class _ApplyOnly:
    """The calibrator as the measurement sees it: what a round runs (``apply``), nothing it
    learns from (``observe``)."""

    def __init__(self, calibrator: Any) -> None:
        self.apply = calibrator.apply


def measure_draft_cost(engine: Any, requests: Sequence[int] = DRAFT_COST_REQUESTS,
                       context: int = _METHOD["context"], rounds: int = _METHOD["rounds"]) -> DraftCost:
    """ρ(R) of ``engine``'s drafting side: for each R, R synthetic requests of ``context`` tokens
    (the step curve's, at most what the target takes; a ratio measured at far shorter contexts than
    served overstates ρ, since the target's pass grows with the context and a drafter's much less)
    run ``rounds`` rounds that draft a full block and verify none of it; the first two rounds are
    left out (first-call allocations).  Runs on an engine of its own; ``engine`` is only read."""
    target = engine.target
    new_tokens = rounds + int(getattr(engine.drafter, "gamma", 0) or 0) + 2
    context = max(1, min(context, target.max_positions - new_tokens - 8))
    # Enough new tokens that every measured round drafts a whole block (verifying nothing, each
    # round commits one token).
    limits = EngineConfig(max_batch=max(requests), max_context=context + new_tokens + 8,
                          prefill_chunk=engine.config.prefill_chunk)
    probe = type(engine)(target, engine.verifier, drafter=engine.drafter, correction_head=engine.correction_head,
                         confidence=engine.confidence, calibrator=_ApplyOnly(engine.calibrator),
                         scheduler=_VerifyNothing(), engine=limits, bound=True)
    ids = torch.randint(3, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    points = {}
    for r in requests:
        rids = [probe.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens, temperature=0.0,
                                               ignore_eos=True)) for _ in range(r)]
        draft, passes = [], []
        while probe.busy:
            before = sum(probe.draft_seconds.values()), probe.phase_seconds["target"]
            probe.step()
            draft.append(sum(probe.draft_seconds.values()) - before[0])
            passes.append(probe.phase_seconds["target"] - before[1])
        for rid in rids:
            probe.take_output(rid)
        draft, passes = draft[2:rounds], passes[2:rounds]
        points[r] = statistics.median(draft) / max(statistics.median(passes), 1e-9)
    return DraftCost(points, device=machine()["cpu"], target=str(target.name))


def _drafting_key(engine: Any) -> str:
    """What a drafting cost depends on: the target and machine (as a step curve), and every
    drafting-side component with its settings."""
    parts = []
    for slot in ("drafter", "correction_head", "confidence", "calibrator"):
        part = getattr(engine, slot)
        config = getattr(part, "config", None)
        settings = config.model_dump_json() if hasattr(config, "model_dump_json") else repr(config)
        parts.append([slot, f"{type(part).__module__}.{type(part).__qualname__}", settings,
                      getattr(part, "gamma", None)])
    # The measurement's own settings too: a file measured another way is not this measurement.
    key = json.dumps([profile_key(engine.target), parts, _METHOD], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def machine_draft_cost(engine: Any, log: Any = None) -> DraftCost:
    """This machine's ρ(R) for ``engine``'s drafting side: measured once (seconds) and cached
    under ``$SPECFORGE_CACHE_DIR/profiles`` beside the step curve — what ``draft_cost: auto``
    of the hardware-aware schedulers reads (the engine offers it as ``bind_draft_cost``)."""
    from specforge.measured import cached_choice

    path = profile_file(engine.target.name, _drafting_key(engine), "draft")

    def measure() -> DraftCost:
        (log or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
            f"measuring what drafting costs on this machine once (cached in {path})")
        return measure_draft_cost(engine)

    return cached_choice(path, measure, DraftCost.from_dict, DraftCost.to_dict)[0]

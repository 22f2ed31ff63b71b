"""Run one conformance case through the real engine and test it against the exact law.

A :class:`Case` is everything needed to reproduce a check: the pipeline (registered names and
their parameters), the reference target, the prompt, the sampling settings, the batch size, N and
the seed.  :func:`run_case` builds the components through the plug-in host and the
:class:`~specforge.engine.Engine` exactly as a user's pipeline would be built, submits N
identical requests (request i seeded with ``seed + i``, so samples are independent), and counts
the generated sequences.  :func:`check_case` adds the policy: a rejection at N is re-run at 10·N
with fresh seeds before it is reported.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from specforge import acceptance
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance.combos import SLOTS, Combination
from specforge_conformance.exact import ExactLaw, ReferenceSpec, exact_law, reference_target
from specforge_conformance.stats import FitResult, goodness_of_fit

__all__ = ["Case", "CaseResult", "check_case", "run_case"]

RERUN_FACTOR = 10


@dataclass(frozen=True)
class Case:
    """One reproducible check (JSON round-trips through :meth:`to_json` / :meth:`from_json`)."""

    pipeline: dict[str, tuple[str, dict[str, Any]] | None]  # slot -> (name, params) or None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch: int = 64
    family: str = "llama"
    vocab: int = 16
    target_seed: int = 0
    prompt: tuple[int, ...] = (3, 5, 7, 3, 5)
    horizon: int = 3
    n: int = 20_000
    seed: int = 0

    @property
    def combination(self) -> Combination:
        return Combination(*(None if self.pipeline.get(s) is None else self.pipeline[s][0] for s in SLOTS))

    @property
    def reference(self) -> ReferenceSpec:
        return ReferenceSpec(self.family, self.vocab, self.target_seed)

    def law(self) -> ExactLaw:
        return exact_law(self.reference, self.prompt, self.horizon, self.temperature, self.top_k, self.top_p)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pipeline"] = {s: (None if v is None else [v[0], v[1]]) for s, v in self.pipeline.items()}
        d["prompt"] = list(self.prompt)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        d = dict(d)
        d["pipeline"] = {s: (None if v is None else (v[0], dict(v[1]))) for s, v in d["pipeline"].items()}
        d["prompt"] = tuple(d["prompt"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Case:
        return cls.from_dict(json.loads(text))


@dataclass
class CaseResult:
    """What one run of a case measured."""

    case: Case
    fit: FitResult
    alpha: float
    seconds: float
    rounds: int
    drafted: int
    verified: int
    accepted: int
    rerun: CaseResult | None = None
    counts: torch.Tensor | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        """Rejected at N and, when it was re-run, at 10·N too."""
        first = self.fit.rejects(self.alpha)
        return first and (self.rerun is None or self.rerun.fit.rejects(self.alpha))

    @property
    def tau(self) -> float:
        return acceptance.tau(self.accepted, self.rounds) if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "combination": self.case.combination.label(),
            "case": self.case.to_dict(),
            "passed": not self.failed,
            "alpha": self.alpha,
            "fit": self.fit.to_dict(),
            "tau": round(self.tau, 4),
            "acceptance": round(self.accepted / self.verified, 4) if self.verified else None,
            "seconds": round(self.seconds, 2),
            "rerun": None if self.rerun is None else self.rerun.to_dict(),
        }


def build_engine(case: Case, host: PluginHost, target=None, max_new_tokens: int | None = None) -> Engine:
    """The components of ``case.pipeline`` created through ``host``, in the real engine."""
    parts = {slot: (None if spec is None else host.create(ComponentKind(slot), spec[0], spec[1]))
             for slot, spec in case.pipeline.items()}
    target = target or reference_target(case.reference)
    new = case.horizon if max_new_tokens is None else max_new_tokens
    gamma = getattr(parts.get("drafter"), "gamma", 0) or 0
    return Engine(
        target, parts["verifier"],
        drafter=parts.get("drafter"), correction_head=parts.get("correction_head"),
        confidence=parts.get("confidence"), calibrator=parts.get("calibrator"), scheduler=parts.get("scheduler"),
        sampling=SamplingConfig(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                                max_new_tokens=new),
        engine=EngineConfig(max_batch=case.batch, max_context=32 + new + gamma),
    )


def run_case(case: Case, host: PluginHost, law: ExactLaw | None = None, alpha: float = 1e-6) -> CaseResult:
    """Generate ``case.n`` sequences with the real engine and test them against the exact law."""
    law = law or case.law()
    engine = build_engine(case, host)
    start = time.perf_counter()
    requests = [GenerationRequest(prompt_ids=case.prompt, max_new_tokens=case.horizon, ignore_eos=True,
                                  seed=case.seed + i) for i in range(case.n)]
    outputs = engine.generate(requests)
    seconds = time.perf_counter() - start
    bad = [o for o in outputs if o.error is not None or len(o.token_ids) != case.horizon]
    if bad:
        o = bad[0]
        raise RuntimeError(f"request {o.request_id} produced {len(o.token_ids)} tokens "
                           f"(expected {case.horizon}): {o.error or o.finish_reason}")
    tokens = torch.tensor([o.token_ids for o in outputs], dtype=torch.long)
    counts = torch.bincount(law.index(tokens), minlength=law.probs.numel())
    stats = [o.stats for o in outputs]
    return CaseResult(
        case, goodness_of_fit(counts, law.probs), alpha, seconds,
        rounds=sum(s.rounds for s in stats), drafted=sum(s.drafted for s in stats),
        verified=sum(s.verified for s in stats), accepted=sum(s.accepted for s in stats), counts=counts,
    )


def check_case(case: Case, host: PluginHost, alpha: float, law: ExactLaw | None = None) -> CaseResult:
    """:func:`run_case`; if the test rejects, run again at 10·N with seeds no sample has used."""
    law = law or case.law()
    result = run_case(case, host, law, alpha)
    if result.fit.rejects(alpha):
        again = replace(case, n=case.n * RERUN_FACTOR, seed=case.seed + case.n)
        result.rerun = run_case(again, host, law, alpha)
    return result

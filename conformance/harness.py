"""Run one conformance case through the real engine and test it against the exact law.

A :class:`Case` is everything needed to reproduce a check: the pipeline (registered names and
their parameters), the reference target, the prompt, the sampling settings, the batch size, N and
the seed.  The settings are one (temperature, top-k, top-p) for every request, or — a *mixed*
case — a menu from which each request draws its own (:attr:`Case.mix`), as the batches of a
server are: each request is then tested against its own setting's exact law.  :func:`run_case`
builds the components through the plug-in host and the
:class:`~specforge.engine.Engine` exactly as a user's pipeline would be built, submits N
identical requests (request i seeded with ``seed + i``, so samples are independent), and counts
the generated sequences.  :func:`check_case` adds the policy: a case whose smallest p-value is
*suspicious* (below :data:`SCREEN`) is run again at 10·N with seeds no sample has used, and it
fails only if a statistic rejects there — so the level stays α while the power is that of 10·N
for any case that already looked wrong at N (sequential testing).

Each run yields several statistics (:data:`STATISTICS`): the law of the whole sequence, the
independence of requests that share a batch, and the round-level ones of
:mod:`specforge_conformance.rounds`.  A case runs with a fixed number of torch threads (recorded
in it), so that ``--case`` reproduces its p-values bit for bit: float reductions, and therefore
near-tie decisions of a scheduler, depend on the thread count.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from specforge import acceptance
from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance.combos import SLOTS, Combination
from specforge_conformance.exact import ExactLaw, ReferenceSpec, exact_law, reference_target, sampling_target
from specforge_conformance.rounds import RoundRecorder
from specforge_conformance.stats import (Band, FitResult, band_detectable, conditional_fit, detectable_tv,
                                         goodness_of_fit, impossible_detectable, merge_cells)

__all__ = ["CASE_THREADS", "IDLE_SHARE", "MIN_TAU", "MIN_VERIFIED", "MIXED_SHARE", "STATISTICS", "Case", "CaseResult",
           "Setting", "check_case", "exercised", "informative", "pilot", "run_case", "setting_label", "shares", "torch_threads"]

RERUN_FACTOR = 10
# Torch threads of every case the suite draws.  Its targets are tiny (hidden size 32, V ≤ 32), so
# a second intra-op thread buys little and burns a core: a token-tree probe case measured 28.5 s
# wall / 49 CPU-s at 2 threads, 31 s / 30 CPU-s at 1 (AMD EPYC, 2 cores).  Several cores are
# better spent on several seeds (``--seed/--seeds/--out``) or shards of one (``--shard``).
CASE_THREADS = 1
# A combination's mixed case runs at this share of its (homogeneous) case's N: it is there for the
# per-row statistics (draft law, acceptance, emission, draws a row's own law rules out), which need
# no more; and a case no pilot found informative at this share (IDLE_SHARE) — the two keep the
# fast tier's cost where it was (docs/conformance.md, "Cost").
MIXED_SHARE = 0.5
IDLE_SHARE = 0.25
SCREEN = 1e-3  # a statistic with p below this at N is measured again at 10·N
# Every statistic a case can produce; the per-case level is shared among all of them (Bonferroni).
STATISTICS = ("sequence", "independence", "cross-request", "draft law", "selection", "acceptance", "emission",
              "walk pairs")
PAIR_BUCKETS = 8  # independence: the most likely sequences, each its own bucket, and the rest

Setting = tuple[float, int, float]  # (temperature, top-k, top-p) of a request


def setting_label(setting: Setting) -> str:
    t, k, p = setting
    return "greedy" if t == 0 else f"T={t:g}" + (f" k={k}" if k else "") + (f" p={p:g}" if p < 1 else "")


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
    threads: int | None = None  # torch threads the case runs with (None: the process's setting)
    # A mixed case: the settings its requests draw from, each request its own (:meth:`setting_index`;
    # temperature, top_k and top_p are then the first of them, the engine's default that no request
    # uses).  Empty: a homogeneous case, every request at temperature, top_k and top_p.
    mix: tuple[Setting, ...] = ()

    @property
    def combination(self) -> Combination:
        return Combination(*(None if self.pipeline.get(s) is None else self.pipeline[s][0] for s in SLOTS))

    @property
    def reference(self) -> ReferenceSpec:
        return ReferenceSpec(self.family, self.vocab, self.target_seed)

    @property
    def settings(self) -> tuple[Setting, ...]:
        """The settings of the case's requests: the mix, or the one setting of a homogeneous case."""
        return self.mix or ((self.temperature, self.top_k, self.top_p),)

    def setting_index(self, ids: Sequence[int]) -> torch.Tensor:
        """``[len(ids)]`` which of :attr:`settings` each of requests ``ids`` uses.  Drawn at random
        per request (seeded by the case), not in a cycle: a component that hands row r another
        row's settings must not find the same setting there by the batch's layout (in a cycle of
        m settings, every row m apart shares one)."""
        ids = list(ids)
        if not self.mix or not ids:
            return torch.zeros(len(ids), dtype=torch.long)
        draw = torch.randint(len(self.mix), (max(ids) + 1,), generator=torch.Generator().manual_seed(self.seed))
        return draw[ids]

    def laws(self) -> tuple[ExactLaw, ...]:
        """The exact law of a request at each of :attr:`settings`."""
        return tuple(exact_law(self.reference, self.prompt, self.horizon, *s) for s in self.settings)

    def law(self) -> ExactLaw:
        """The exact law of every request of a homogeneous case."""
        if self.mix:
            raise ValueError("a mixed case has one law per setting: use laws()")
        return self.laws()[0]

    @property
    def well_conditioned(self) -> bool:
        return all(law.well_conditioned for law in self.laws())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pipeline"] = {s: (None if v is None else [v[0], v[1]]) for s, v in self.pipeline.items()}
        d["prompt"] = list(self.prompt)
        if self.mix:
            d["mix"] = [list(s) for s in self.mix]
        else:  # a homogeneous case's JSON (and its `--case` line) is what it was before mixed cases
            del d["mix"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        d = dict(d)
        d["pipeline"] = {s: (None if v is None else (v[0], dict(v[1]))) for s, v in d["pipeline"].items()}
        d["prompt"] = tuple(d["prompt"])
        d["mix"] = tuple((float(t), int(k), float(p)) for t, k, p in d.get("mix", ()))
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
    counts: torch.Tensor | None = field(default=None, repr=False)  # [C] sequences; a mixed case's [S, C] per setting
    tests: dict[str, FitResult] = field(default_factory=dict)  # every statistic, "sequence" included
    trees: bool = False  # some round verified a token tree

    @property
    def level(self) -> float:
        """The level each statistic is tested at: the case's α shared by :data:`STATISTICS`."""
        return self.alpha / len(STATISTICS)

    @property
    def min_p(self) -> float:
        return min(f.p_value for f in self.tests.values()) if self.tests else self.fit.p_value

    def rejected(self) -> list[str]:
        """The statistics that reject at the case's level in this run."""
        return [name for name, f in self.tests.items() if f.rejects(self.level)]

    @property
    def suspicious(self) -> bool:
        return any(f.impossible for f in self.tests.values()) or self.min_p < SCREEN

    @property
    def failed(self) -> bool:
        """A statistic rejects at 10·N after N looked suspicious (or a draw was impossible)."""
        if self.rerun is not None:
            return bool(self.rerun.rejected())
        return any(f.impossible for f in self.tests.values())

    def detectable(self) -> dict[str, float]:
        """Per statistic, the smallest deviation it detects with probability ≥ 99 % under the
        two-stage rule (TV on its cells; an acceptance-probability shift for ``acceptance``)."""
        return {name: detectable_tv(f, self.level, screen=SCREEN, factor=RERUN_FACTOR)
                for name, f in self.tests.items()}

    def detectable_bands(self) -> list[tuple[Band, float]]:
        """Each band of declared acceptance probabilities the ``acceptance`` statistic saw, with
        the smallest shift of that band's acceptance rate it detects with probability ≥ 99 %
        under the two-stage rule (``inf``: a band too light to be tested)."""
        fit = self.tests.get("acceptance")
        return [] if fit is None else [
            (band, band_detectable(fit, band, self.level, screen=SCREEN, factor=RERUN_FACTOR)) for band in fit.bands]

    def detectable_by_setting(self) -> list[tuple[Setting, int, float]]:
        """A mixed case's ``sequence`` statistic setting by setting: (setting, its requests, the
        smallest TV between that setting's law of sequences and the exact one that is detected
        with probability ≥ 99 % under the two-stage rule).  A deviation in one setting alone gives
        the summed chi-square λ ≥ 4·n_s·t²; a greedy setting's law is a point mass, where any
        deviation is a draw of probability 0 and fails at once (t with 1 − (1 − t)^n_s = 99 %); a law
        so peaked that its cells pool into one at n_s is tested for impossible draws only (``inf``).
        Empty for a homogeneous case."""
        if not self.case.mix or self.counts is None:
            return []
        fit, out = self.tests["sequence"], []
        for setting, law, row in zip(self.case.settings, self.case.laws(), self.counts):
            n = int(row.sum())
            if int((law.probs > 0).sum()) == 1:
                t = impossible_detectable(n)
            elif n == 0 or int(merge_cells(law.probs, n).max()) < 1:  # (no chi-square of its own in the sum)
                t = math.inf
            else:
                t = detectable_tv(replace(fit, information=4.0 * n), self.level, screen=SCREEN, factor=RERUN_FACTOR)
            out.append((setting, n, t))
        return out

    @property
    def tau(self) -> float:
        return acceptance.tau(self.accepted, self.rounds) if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        mde = self.detectable()
        tests = {name: {**f.to_dict(), "detectable": _finite(mde[name])} for name, f in self.tests.items()}
        if "acceptance" in tests:
            tests["acceptance"]["bands"] = [{**asdict(b), "detectable": _finite(t)} for b, t in self.detectable_bands()]
        if self.case.mix:
            tests["sequence"]["settings"] = [{"setting": list(s), "label": setting_label(s), "n": n,
                                              "detectable": _finite(t)} for s, n, t in self.detectable_by_setting()]
        return {
            "combination": self.case.combination.label(),
            "case": self.case.to_dict(),
            "passed": not self.failed,
            "alpha": self.alpha,
            "level": self.level,
            "fit": self.fit.to_dict(),
            "tests": tests,
            "tau": round(self.tau, 4),
            "trees": self.trees,
            "verified_share": round(shares(self)[0], 4),
            "accepted_share": round(shares(self)[1], 4),
            "acceptance": round(self.accepted / self.verified, 4) if self.verified else None,
            "seconds": round(self.seconds, 2),
            "rerun": None if self.rerun is None else self.rerun.to_dict(),
        }


def _finite(t: float) -> float | None:
    return None if math.isinf(t) else t


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run with ``n`` torch threads (``None``: as the process is), then restore the process's."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def case_threads(case: Case):
    """Run with the case's torch thread count, then restore the process's."""
    return torch_threads(case.threads)


def build_engine(case: Case, host: PluginHost, target=None, max_new_tokens: int | None = None,
                 recorder: RoundRecorder | None = None) -> Engine:
    """The components of ``case.pipeline`` created through ``host``, in the real engine
    (drafter and verifier observed by ``recorder`` when one is given)."""
    parts = {slot: (None if spec is None else host.create(ComponentKind(slot), spec[0], spec[1]))
             for slot, spec in case.pipeline.items()}
    if recorder is not None:
        parts["drafter"], parts["verifier"] = recorder.wrap(parts.get("drafter"), parts["verifier"])
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
        trees=host.get(ComponentKind.VERIFIER, case.pipeline["verifier"][0]).metadata.trees,
    )


def run_case(case: Case, host: PluginHost, laws: Sequence[ExactLaw] | None = None, alpha: float = 1e-6) -> CaseResult:
    """Generate ``case.n`` sequences with the real engine and test them: their law against the
    exact one (each request's against its own setting's, :meth:`Case.laws`), and every statistic
    of :data:`STATISTICS` that applies."""
    laws = laws or case.laws()
    recorder = RoundRecorder(case.seed, case.settings)
    ids = range(case.n)
    with case_threads(case):
        engine = build_engine(case, host, target=sampling_target(case.reference), recorder=recorder)
        start = time.perf_counter()
        outputs = _generate(engine, case, ids)
        seconds = time.perf_counter() - start
    setting = case.setting_index(ids)
    result = _result(case, laws, outputs, setting, alpha, seconds)
    result.tests["independence"] = independence(_sequences(outputs), laws, setting)
    result.tests.update(recorder.fits())
    result.trees = recorder.tree_rounds > 0
    return result


def _generate(engine: Engine, case: Case, ids: range) -> list:
    """Requests ``ids`` of ``case`` (request i seeded with ``case.seed + i``, at its own setting
    in a mixed case) through ``engine``; each must give ``case.horizon`` tokens."""
    own = ([dict(zip(("temperature", "top_k", "top_p"), case.settings[s])) for s in case.setting_index(ids).tolist()]
           if case.mix else [{}] * len(ids))
    outputs = engine.generate([GenerationRequest(prompt_ids=case.prompt, max_new_tokens=case.horizon, ignore_eos=True,
                                                 seed=case.seed + i, **settings) for i, settings in zip(ids, own)])
    bad = [o for o in outputs if o.error is not None or len(o.token_ids) != case.horizon]
    if bad:
        o = bad[0]
        raise RuntimeError(f"request {o.request_id} produced {len(o.token_ids)} tokens "
                           f"(expected {case.horizon}): {o.error or o.finish_reason}")
    return outputs


def _sequences(outputs: list) -> torch.Tensor:
    return torch.tensor([o.token_ids for o in outputs], dtype=torch.long)


def _result(case: Case, laws: Sequence[ExactLaw], outputs: list, setting: torch.Tensor, alpha: float,
            seconds: float) -> CaseResult:
    """The counts of ``outputs`` (request j at setting ``setting[j]``) and the sequence statistic
    (the other statistics: the caller's).  A mixed case's counts are kept per setting and tested
    each against its setting's law, the chi-squares summed (the per-request law is tested, not
    the mixture the batch would give)."""
    cells = laws[0].index(_sequences(outputs))
    size = laws[0].probs.numel()
    if case.mix:
        counts = torch.stack([torch.bincount(cells[setting == s], minlength=size) for s in range(len(laws))])
        fit = conditional_fit((c, law.probs) for c, law in zip(counts, laws) if int(c.sum()))
    else:
        counts = torch.bincount(cells, minlength=size)
        fit = goodness_of_fit(counts, laws[0].probs)
    stats = [o.stats for o in outputs]
    return CaseResult(
        case, fit, alpha, seconds,
        rounds=sum(s.rounds for s in stats), drafted=sum(s.drafted for s in stats),
        verified=sum(s.verified for s in stats), accepted=sum(s.accepted for s in stats), counts=counts,
        tests={"sequence": fit},
    )


# A case is *informative* when verification happens in it: a substantial share of its drafted
# tokens is verified and some are accepted (τ > 1) — what the suite looks for among a
# combination's draws.  A case is *exercised* at all when τ shows above 1.00: one that verifies
# (almost) nothing tests the plain path only, whatever the combination's components are.  (A
# global budget verifies few of a large batch's drafts and still exercises verification.)
MIN_VERIFIED = 0.25
MIN_TAU = 1.005
PILOT = 160


def shares(result: CaseResult) -> tuple[float, float]:
    """(verified, accepted) as shares of the drafted tokens (0 when nothing was drafted)."""
    drafted = max(result.drafted, 1)
    return result.verified / drafted, result.accepted / drafted


def informative(result: CaseResult) -> bool:
    return shares(result)[0] >= MIN_VERIFIED and result.accepted > 0


def exercised(result: CaseResult) -> bool:
    return result.verified > 0 and result.tau >= MIN_TAU


def pilot(case: Case, host: PluginHost, n: int = PILOT) -> CaseResult:
    """A short run of ``case`` to see how much it verifies once its components have settled.

    One batch of requests runs first, on the same engine: a scheduler's draft gate judges its
    load band within a few rounds, ``async-topk`` takes its capacity from two rounds back, an
    online calibrator refits — and what a case verifies over N requests is what they do then,
    not in their first rounds (a pilot of only the first 160 requests, in one batch of 256, saw
    ``async-topk`` verify every draft of its first two rounds, and chose a parameter set that
    then verified 0.3 % of them).  The counts are those of the ``n`` requests after it; the
    statistics (the sequence law only) are not used."""
    ids = range(case.batch, case.batch + n)
    with case_threads(case):
        engine = build_engine(case, host, target=sampling_target(case.reference))
        _generate(engine, case, range(case.batch))
        start = time.perf_counter()
        outputs = _generate(engine, case, ids)
        seconds = time.perf_counter() - start
    return _result(replace(case, n=n), case.laws(), outputs, case.setting_index(ids), 1e-6, seconds)


def independence(sequences: torch.Tensor, laws: Sequence[ExactLaw], setting: torch.Tensor | None = None,
                 buckets: int = PAIR_BUCKETS) -> FitResult:
    """Requests 2j and 2j+1 — submitted together, so in the same batch — must be independent.

    ``sequences`` ``[N, L]`` in request order, request j at setting ``setting[j]`` of ``laws``
    (all at the first when ``None``).  The pairs of each combination of settings are tested
    against the product of those two settings' laws (:func:`_pair_law`), the chi-squares summed."""
    cells = laws[0].index(sequences)
    setting = torch.zeros(len(cells), dtype=torch.long) if setting is None else setting
    pairs = cells.numel() // 2
    a, c = cells[0:2 * pairs:2], cells[1:2 * pairs:2]
    sa, sc = setting[0:2 * pairs:2], setting[1:2 * pairs:2]
    groups = []
    for i, j in sorted(set(zip(sa.tolist(), sc.tolist()))):
        mine = (sa == i) & (sc == j)
        index, law = _pair_law(a[mine], c[mine], laws[i].probs, laws[j].probs, buckets)
        groups.append((torch.bincount(index, minlength=law.numel()), law))
    if len(groups) == 1:  # a homogeneous case: one law for both
        return goodness_of_fit(*groups[0])
    return conditional_fit(groups)


def _pair_law(a: torch.Tensor, c: torch.Tensor, pa: torch.Tensor, pc: torch.Tensor, buckets: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cells of pairs (``a`` drawn from ``pa``, ``c`` from ``pc``) and their probabilities under
    independence, exact: "the two sequences coincide" (Σ pa·pc, the cell shared or misrouted
    random numbers inflate most), and, for pairs that differ, the joint of their buckets — the
    most likely sequences, as many as keep every joint cell's expected count ≥ 5 (at most
    ``buckets`` − 1), and one for all others."""
    pa, pc = pa.to(torch.float64), pc.to(torch.float64)
    pairs = a.numel()
    order = torch.sort(pa + pc, descending=True, stable=True).indices
    top = 0
    while top < buckets - 1 and float(pa[order[top]] * pc[order[top]]) * pairs >= 5:
        top += 1
    bucket = torch.full((pa.numel(),), top, dtype=torch.long)
    bucket[order[:top]] = torch.arange(top)
    b = top + 1
    ma = torch.zeros(b, dtype=torch.float64).index_add_(0, bucket, pa)
    mc = torch.zeros(b, dtype=torch.float64).index_add_(0, bucket, pc)
    same = torch.zeros(b, dtype=torch.float64).index_add_(0, bucket, pa * pc)  # coincidences per bucket
    joint = ma[:, None] * mc[None, :] - torch.diag(same)  # differing pairs
    law = torch.cat([same.sum().reshape(1), joint.reshape(-1)])
    return torch.where(a == c, 0, 1 + bucket[a] * b + bucket[c]), law


def check_case(case: Case, host: PluginHost, alpha: float, laws: Sequence[ExactLaw] | None = None) -> CaseResult:
    """:func:`run_case`; if a statistic looks suspicious (p < :data:`SCREEN`, or an impossible
    draw), run again at 10·N with seeds no sample has used: the case fails if that run rejects."""
    laws = laws or case.laws()
    result = run_case(case, host, laws, alpha)
    if result.suspicious and not any(f.impossible for f in result.tests.values()):
        again = replace(case, n=case.n * RERUN_FACTOR, seed=case.seed + case.n)
        result.rerun = run_case(again, host, laws, alpha)
    return result

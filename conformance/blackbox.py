"""The black-box tier: an engine we do not own, checked through its public interface only.

``specforge conformance --engine NAME`` (:mod:`specforge_conformance.engines` has the engines)
draws many short continuations (:data:`HORIZON` tokens) of a few fixed prompts with speculation
on, and tests them against the target's law of those tokens computed from the *same engine's*
logits — the white-box tier's statistics, α and minimum detectable effect, on a vocabulary of
49,152 tokens where the sequence law can no longer be enumerated:

``first token``   the law of the first emitted token of each prompt, against the reference
                  law of the prompt (:func:`~specforge_conformance.stats.goodness_of_fit`, one
                  chi-square per prompt, summed);
``position k``    the law of the k-th token given the k − 1 before it, against the reference
                  law of that prefix, per position k ≥ 2 (conditional: every prefix drawn at
                  least :data:`MIN_GROUP` times is one group of its own; summed over groups);
``engine law``    where the engine returns the law it sampled each token from (vLLM's
                  logprobs): the randomised probability integral transform of every token
                  under that law, per position (:func:`~specforge_conformance.stats.pit`,
                  :func:`~specforge_conformance.stats.uniformity_fit`);
``two-sample``    where no law is available at all: the same engine with speculation off,
                  the sequences of both tested for one law (chi-square homogeneity) — half the
                  information of a one-sample test at the same N per arm, stated as such.

Conditioning on "this prefix was drawn at least :data:`MIN_GROUP` times" looks only at the
tokens before position k, so within each group the k-th tokens are still independent draws of
the prefix's law: the test stays exact, and the report says which share of the samples it covered.

Every case runs *arms*: temperature 1, one temperature ≠ 1, and the negative control — the same
engine serving temperature 0.9 while the reference claims 1.0 — which must be rejected at the
very level the clean arms pass at.  And a *mixed* arm: the requests of each prompt at several
temperatures at once (:data:`MIX`, request j at the j-th in turn, so that requests sent together
differ), each tested against its own temperature's law — the batches a server runs, where an
engine that gives a row another row's settings shows (vLLM's n-gram path sampled its draft
positions with settings that belonged to no request, vllm#55005) — with its control: every
request served at its neighbour's temperature, tested against its own (run where there is a
reference: an engine's own laws are those of the temperatures it served).  α = 10⁻⁶ over the run:
each of the k clean arms at α/k, each of its statistics at α/(k·s) (Bonferroni over all of them).  There is no second stage at 10·N
here (an engine's samples cost too much): the stated minimum detectable effect is the single-stage
one at that level.  An arm whose engine returned fewer tokens than asked, or no law where one
was promised, is reported by the engine's name and never counts as a pass; an arm in which the
engine drafted nothing is *not exercised*, never certified.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

# conditional_fit lives with the other statistics (the white-box tier's mixed cases sum per-setting
# chi-squares with it too); it stays importable from here
from specforge_conformance.stats import (DETECT, FitResult, chi2_sf, conditional_fit, detectable_tv, merge_cells,
                                         noncentrality, pit, power, uniformity_fit)

__all__ = ["ALPHA", "HORIZON", "MIN_GROUP", "Arm", "ArmResult", "CaseReport", "EngineFault", "EngineReport",
           "Reference", "Sampled", "SamplingEngine", "check_arm", "conditional_fit", "default_arms", "run_arms",
           "sized_control",
           "run_level", "sequence_counts", "two_sample_fit"]

ALPHA = 1e-6  # over the whole run, as in the white-box tier
MIX = (0.7, 1.0, 1.3)  # the temperatures of a mixed arm's requests
HORIZON = 4  # tokens per draw: a first token, then three a draft can be verified on
MIN_GROUP = 5  # a prefix drawn fewer times carries no cell with expected count >= 5


class EngineFault(RuntimeError):
    """The engine did not do what it was asked (fewer tokens, no law where one was promised, an
    error reply); the message names the engine.  Never a pass."""


@dataclass
class Sampled:
    """What an engine returned for one prompt: ``tokens`` one list per request; ``drafted`` /
    ``accepted`` the draft tokens it says it proposed and accepted (None: it does not say);
    ``laws`` per request and position the law it says it sampled from, as (token ids, probs)
    over its top tokens (None: it returns none)."""

    tokens: list[list[int]]
    drafted: int | None = None
    accepted: int | None = None
    laws: list[list[tuple[list[int], list[float]]]] | None = None


class SamplingEngine(Protocol):
    """An engine as the black-box tier drives it (a context manager: started on enter, stopped
    on exit however the block ends)."""

    name: str
    returns_laws: bool  # its replies carry the law of every sampled token

    def sample(self, prompt: Sequence[int], n_tokens: int, temperature: float | Sequence[float],
               seeds: Sequence[int], progress: Callable[[int], None] | None = None) -> Sampled:
        """``len(seeds)`` requests of ``n_tokens`` after ``prompt``, at one temperature or each
        at its own (a sequence, one per seed), sent together."""


class Reference(Protocol):
    """The target's law as the engine computes it: ``laws(prompt, prefixes, T)`` yields
    ``(prefix, probs [V] float64)`` for every prefix asked (the law of the next token after
    prompt + prefix at temperature T, with what the engine's sampler removes — e.g. EOS under
    ``ignore_eos`` — removed)."""

    vocab: int

    def laws(self, prompt: Sequence[int], prefixes: Sequence[tuple[int, ...]],
             temperature: float) -> Iterator[tuple[tuple[int, ...], Tensor]]: ...


@dataclass(frozen=True)
class Arm:
    """One set of draws of a case: served at ``temperature``, tested against the law at
    ``claimed``; a ``control`` must be rejected.  A mixed arm (``mix``): request j of each prompt
    is tested against the law at ``mix[j mod m]`` and served at ``mix[(j + shift) mod m]`` —
    its own temperature, or (``shift`` ≠ 0, a control) a neighbour's."""

    name: str
    temperature: float
    claimed: float
    n: int  # requests over all prompts
    control: bool = False
    speculative: bool = True
    mix: tuple[float, ...] = ()
    shift: int = 0

    def claims(self, m: int) -> list[float]:
        """The temperature each of ``m`` requests of a prompt is tested at."""
        return [self.mix[j % len(self.mix)] for j in range(m)] if self.mix else [self.claimed] * m

    def serves(self, m: int) -> list[float]:
        """The temperature each of ``m`` requests of a prompt is served at."""
        return [self.mix[(j + self.shift) % len(self.mix)] for j in range(m)] if self.mix else [self.temperature] * m

    def served_for(self, claimed: float) -> float:
        """The temperature the requests tested at ``claimed`` are served at."""
        return self.mix[(self.mix.index(claimed) + self.shift) % len(self.mix)] if self.mix else self.temperature


def default_arms(n: int, control_n: int | None = None, other_temperature: float = 0.7) -> list[Arm]:
    """T = 1 at ``n``, T = ``other_temperature`` at n/2, and the control (served at 0.9, claimed
    1.0) at ``control_n`` (default n/4); then the mixed arm (:data:`MIX`) at n/2 and its control
    (each request served at its neighbour's temperature) at ``control_n``."""
    label = "/".join(f"{t:g}" for t in MIX)
    return [Arm("T=1", 1.0, 1.0, n), Arm(f"T={other_temperature:g}", other_temperature, other_temperature, n // 2),
            Arm("control: T=0.9 claimed as 1", 0.9, 1.0, control_n or n // 4, control=True),
            Arm(f"mixed T={label}", MIX[0], MIX[0], n // 2, mix=MIX),
            Arm("control: mixed, served at a neighbour's T", MIX[0], MIX[0], control_n or n // 4, control=True,
                mix=MIX, shift=1)]


# --- statistics ---------------------------------------------------------------------------------


def two_sample_fit(a: Counter, b: Counter) -> FitResult:
    """Chi-square homogeneity of two samples of sequences (``Counter`` of tuples): do speculation
    on and off draw from one law?  Cells are the pooled sequences with expected count ≥ 5 in the
    smaller sample (the rest pooled, :func:`merge_cells`).  With n_a and n_b draws a deviation of
    TV t gives λ ≥ 4·t²·n_a·n_b/(n_a + n_b) — at equal sizes 2·n_a·t², half a one-sample test's."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        raise ValueError("no samples to compare")
    ca = torch.tensor([a.get(k, 0) for k in keys], dtype=torch.float64)
    cb = torch.tensor([b.get(k, 0) for k in keys], dtype=torch.float64)
    pooled = (ca + cb) / (na + nb)
    group = merge_cells(pooled, min(na, nb))
    g = int(group.max()) + 1
    oa = torch.zeros(g, dtype=torch.float64).index_add_(0, group, ca)
    ob = torch.zeros(g, dtype=torch.float64).index_add_(0, group, cb)
    p = (oa + ob) / (na + nb)
    statistic = float((((oa - na * p) ** 2) / (na * p) + ((ob - nb * p) ** 2) / (nb * p)).sum()) if g > 1 else 0.0
    df = max(g - 1, 1)
    tv = float((ca / na - cb / nb).abs().sum() / 2)
    return FitResult(na + nb, g, statistic, df, chi2_sf(statistic, df) if g > 1 else 1.0, tv, 0,
                     4.0 * na * nb / (na + nb))


def sequence_counts(tokens: Iterable[Sequence[int]]) -> Counter:
    return Counter(tuple(t) for t in tokens)


# Draws are kept by (prompt index, the temperature they are tested at): a mixed arm's requests of
# one prompt form one group per temperature, each against its own law.
Draws = dict[tuple[int, float], list[list[int]]]


def _first_token_groups(draws: Draws, prompts: Sequence[Sequence[int]], reference: Reference
                        ) -> Iterator[tuple[Tensor, Tensor]]:
    for (i, temperature), rows in draws.items():
        (_, law), = reference.laws(prompts[i], [()], temperature)
        counts = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=law.numel())
        yield counts, law


def _position_groups(draws: Draws, prompts: Sequence[Sequence[int]], reference: Reference, k: int,
                     covered: list[int]) -> Iterator[tuple[Tensor, Tensor]]:
    """(counts of token k, law) of every prefix of k − 1 tokens drawn ≥ MIN_GROUP times."""
    for (i, temperature), rows in draws.items():
        by_prefix: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for r in rows:
            if len(r) >= k:
                by_prefix[tuple(r[:k - 1])].append(r[k - 1])
        frequent = sorted(p for p, xs in by_prefix.items() if len(xs) >= MIN_GROUP)
        for prefix, law in reference.laws(prompts[i], frequent, temperature):
            xs = by_prefix[prefix]
            covered[0] += len(xs)
            yield torch.bincount(torch.tensor(xs), minlength=law.numel()), law


def _engine_law_fit(laws: list[list[tuple[list[int], list[float]]]], tokens: list[list[int]],
                    generator: torch.Generator) -> FitResult:
    """PIT of every sampled token under the law the engine says it drew it from: cells are the
    top tokens it returned and one more for the rest of the vocabulary (a token outside them
    falls there; the order of cells is fixed by the law, not the draw, so the PIT stays exact)."""
    rows, xs, positions = [], [], []
    width = max(len(ids) for per in laws for ids, _ in per) + 1
    for per, seq in zip(laws, tokens):
        for k, ((ids, probs), x) in enumerate(zip(per, seq)):
            row = torch.zeros(width, dtype=torch.float64)
            p = torch.tensor(probs, dtype=torch.float64)
            row[:len(ids)] = p
            row[-1] = max(0.0, 1.0 - float(p.sum()))
            rows.append(row)
            xs.append(ids.index(x) if x in ids else width - 1)
            positions.append(k)
    if not rows:
        return FitResult(0, 0, 0.0, 1, 1.0, 0.0, 0, 0.0)
    values, impossible = pit(torch.stack(rows), torch.tensor(xs), torch.rand(len(xs), generator=generator,
                                                                           dtype=torch.float64))
    return uniformity_fit(values, torch.tensor(positions), int(impossible.sum()))


# --- arms and cases -----------------------------------------------------------------------------


@dataclass
class ArmResult:
    arm: Arm
    status: str  # certified | FAILED | not exercised | rejected | SURVIVED | engine fault
    tests: dict[str, FitResult] = field(default_factory=dict)
    detectable: dict[str, float] = field(default_factory=dict)
    covered: dict[str, float] = field(default_factory=dict)  # share of the draws each statistic tested
    drafted: int | None = None
    accepted: int | None = None
    fault: str | None = None
    seconds: float = 0.0
    predicted_power: float | None = None  # a control: the first-token test's chance to reject it

    @property
    def min_p(self) -> float:
        return min((f.p_value if not f.impossible else 0.0 for f in self.tests.values()), default=1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"arm": self.arm.__dict__, "status": self.status, "fault": self.fault, "seconds": self.seconds,
                "drafted": self.drafted, "accepted": self.accepted, "predicted_power": self.predicted_power,
                "tests": {k: {**f.to_dict(), "detectable": _finite(self.detectable.get(k)),
                              "covered": self.covered.get(k)} for k, f in self.tests.items()}}


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def _split(n: int, k: int) -> list[int]:
    """``n`` requests over ``k`` prompts, the first ``n mod k`` one more."""
    return [n // k + (i < n % k) for i in range(k)]


def _unstated(laws: list[list[tuple[list[int], list[float]]]] | None) -> Counter[int]:
    """Positions (1 = the first emitted token) at which a returned law has a NaN or infinite
    probability, counted over the requests."""
    return Counter(k + 1 for law in laws or [] for k, (_, probs) in enumerate(law)
                   if not all(math.isfinite(p) for p in probs))


def _draw(engine: SamplingEngine, prompts: Sequence[Sequence[int]], arm: Arm, seed: int, horizon: int,
          progress: Callable[[int], None] | None) -> tuple[Draws, Sampled]:
    """``arm.n`` requests split over the prompts; request j of prompt i seeded with
    seed + 1,000,003·i + j (distinct across prompts and arms), a mixed arm's at its own
    temperature (:meth:`Arm.serves`)."""
    per = _split(arm.n, len(prompts))
    out: Draws = {}
    total = Sampled([], 0, 0, [] if engine.returns_laws else None)
    for i, (prompt, m) in enumerate(zip(prompts, per)):
        seeds = [seed + 1_000_003 * i + j for j in range(m)]
        served, claimed = (arm.serves(m), arm.claims(m)) if arm.mix else (arm.temperature, arm.claimed)
        # an engine that returns its laws is told which temperature the arm claims (vLLM: raw or
        # processed log-probabilities)
        got = engine.sample(prompt, horizon, served, seeds, progress,
                            **({"claimed": claimed} if engine.returns_laws else {}))
        short = [len(t) for t in got.tokens if len(t) != horizon]
        if len(got.tokens) != m or short:
            raise EngineFault(f"{engine.name} returned {len(got.tokens)} completions for {m} requests"
                              + (f", {len(short)} of them with {min(short)} tokens where {horizon} were asked"
                                 if short else ""))
        if engine.returns_laws and (got.laws is None or len(got.laws) != m
                                    or any(len(x) != horizon for x in got.laws)):
            raise EngineFault(f"{engine.name} returned no law (logprobs) for some of its {m} tokens sequences "
                              "although it was asked for them")
        for t, tokens in zip(arm.claims(m), got.tokens):
            out.setdefault((i, t), []).append(tokens)
        total.tokens += got.tokens
        for name in ("drafted", "accepted"):
            value = getattr(got, name)
            setattr(total, name, None if value is None or getattr(total, name) is None else getattr(total, name) + value)
        if total.laws is not None:
            total.laws += got.laws
    return out, total


def check_arm(engine: SamplingEngine, reference: Reference | None, prompts: Sequence[Sequence[int]], arm: Arm,
              level: float, seed: int = 0, horizon: int = HORIZON, baseline: SamplingEngine | None = None,
              progress: Callable[[int], None] | None = None) -> ArmResult:
    """Draw ``arm`` from ``engine`` and test it at ``level`` per statistic.  Without a
    ``reference`` and without laws in the engine's replies, ``baseline`` (the same engine with
    speculation off) is drawn too and the two are compared."""
    start = time.perf_counter()
    result = ArmResult(arm, "FAILED")
    try:
        draws, sampled = _draw(engine, prompts, arm, seed, horizon, progress)
        result.drafted, result.accepted = sampled.drafted, sampled.accepted
        broken = _unstated(sampled.laws)
        if broken:
            # a NaN or infinite probability is a law the engine cannot state, not one to test
            fault = (f"{engine.name} returned non-finite probabilities (NaN or inf) as the law of "
                     f"{sum(broken.values())} of its {sum(map(len, sampled.tokens))} tokens at "
                     f"T = {_served(arm)} (by position: {dict(sorted(broken.items()))})")
            if reference is None and baseline is None:
                raise EngineFault(fault + ": the law it drew them from is unknown, so they cannot be tested")
            result.fault = fault + ("; its draws are tested against the reference alone" if reference is not None
                                    else "; its draws are compared with its own draws with speculation off instead")
            sampled.laws = None
        tests: dict[str, FitResult] = {}
        n = sum(len(r) for r in draws.values())
        if reference is not None:
            tests["first token"] = conditional_fit(_first_token_groups(draws, prompts, reference))
            result.covered["first token"] = 1.0
            for k in range(2, horizon + 1):
                covered = [0]
                tests[f"position {k}"] = conditional_fit(
                    _position_groups(draws, prompts, reference, k, covered))
                result.covered[f"position {k}"] = covered[0] / n
            if arm.control:
                result.predicted_power = _predicted_power({key: len(rows) for key, rows in draws.items()}, prompts,
                                                          reference, arm, level)
        if sampled.laws is not None:
            gen = torch.Generator().manual_seed(seed)
            tests["engine law"] = _engine_law_fit(sampled.laws, sampled.tokens, gen)
            result.covered["engine law"] = 1.0
        if not tests:
            if baseline is None:
                raise EngineFault(f"{engine.name} returns no logits and no baseline (speculation off) was given: "
                                  "nothing to test its draws against")
            plain, _ = _draw(baseline, prompts, arm, seed + 7_777_777, horizon, progress)
            # the first token alone (where a sequence's many cells would dilute a deviation), then
            # the whole sequences; keys carry the prompt
            for name, width in (("two-sample first token", 1), ("two-sample sequence", horizon)):
                tests[name] = two_sample_fit(
                    sequence_counts((*key, *r[:width]) for key, rows in draws.items() for r in rows),
                    sequence_counts((*key, *r[:width]) for key, rows in plain.items() for r in rows))
                result.covered[name] = 1.0
    except EngineFault as exc:
        result.status, result.fault = "engine fault", str(exc)
        result.seconds = time.perf_counter() - start
        return result
    result.tests = tests
    result.detectable = {k: detectable_tv(f, level) for k, f in tests.items()}
    rejected = any(f.rejects(level) for f in tests.values())
    if arm.control:
        result.status = "rejected" if rejected else "SURVIVED"
    elif rejected:
        result.status = "FAILED"
    elif arm.speculative and result.drafted == 0:
        result.status = "not exercised"  # the engine drafted nothing: speculation was never tested
    else:
        result.status = "certified"
    result.seconds = time.perf_counter() - start
    return result


def _predicted_power(counts: dict[tuple[int, float], int], prompts: Sequence[Sequence[int]], reference: Reference,
                     arm: Arm, level: float) -> float:
    """The first-token statistic's chance of rejecting a control drawn ``counts[i, T]`` times on
    prompt i and tested at T: the served law (at the served temperature) against the claimed
    one, the groups' non-centralities and degrees of freedom summed as the statistic sums them
    (the later positions only add to it)."""
    lam, df = 0.0, 0
    for (i, t), n in counts.items():
        (_, claimed), = reference.laws(prompts[i], [()], t)
        (_, served), = reference.laws(prompts[i], [()], arm.served_for(t))
        l, d, _ = noncentrality(served, claimed, n)
        lam, df = lam + l, df + d
    return power(df, lam, level)


CONTROL_POWER = 0.99  # the predicted chance a control is rejected that sizes it
CONTROL_MAX_FACTOR = 8  # a control grows to at most 8× its given N (its cost stays that of a few arms)


def sized_control(arm: Arm, prompts: Sequence[Sequence[int]], reference: Reference, level: float) -> Arm:
    """``arm`` (a control) at the N its first-token test needs to reject it with probability
    CONTROL_POWER — predicted from the reference's laws at the served and claimed temperatures
    before anything is drawn — at least its own N, at most CONTROL_MAX_FACTOR times it.  How far
    the served law is from the claimed one depends on the engine's model and prompts, so a fixed
    share of the clean arms' N can be far too small (measured: a draft-model case's control at
    N = 500 had a predicted power of 0.04)."""
    for factor in (1, 2, 4, CONTROL_MAX_FACTOR):
        n = arm.n * factor
        counts = Counter((i, t) for i, m in enumerate(_split(n, len(prompts))) for t in arm.claims(m))
        if factor == CONTROL_MAX_FACTOR or _predicted_power(counts, prompts, reference, arm, level) >= CONTROL_POWER:
            return replace(arm, n=n)
    return arm


@dataclass
class CaseReport:
    """One engine case: its arms, how it was started, what it cost."""

    engine: str
    description: str
    command: str
    arms: list[ArmResult] = field(default_factory=list)
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        if self.skipped:
            return True
        return bool(self.arms) and all(a.status in ("certified", "rejected", "not exercised") for a in self.arms)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "description": self.description, "command": self.command,
                "skipped": self.skipped, "notes": self.notes, "wall_seconds": self.wall_seconds,
                "cpu_seconds": self.cpu_seconds, "ok": self.ok, "arms": [a.to_dict() for a in self.arms]}


@dataclass
class EngineReport:
    cases: list[CaseReport]
    alpha: float
    level: float  # per statistic
    machine: str = ""

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.cases) and any(not c.skipped for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        return {"tier": "engines", "alpha": self.alpha, "level": self.level, "machine": self.machine,
                "detect": DETECT, "passed": self.passed, "cases": [c.to_dict() for c in self.cases]}

    def table(self) -> str:
        from specforge_conformance.suite import _columns

        rows = [("engine", "arm", "status", "N", "drafted", "accepted", "min p (statistic)", "TV 1st", "MDE 1st",
                 "MDE pos 2..", "covered pos 2..")]
        lines: list[str] = []
        for c in self.cases:
            if c.skipped:
                lines.append(f"{c.engine}: skipped — {c.skipped}")
                continue
            for a in c.arms:
                if not a.tests:
                    rows.append((c.engine, a.arm.name, a.status, f"{a.arm.n:,}", *("-",) * 7))
                    continue
                stat = min(a.tests, key=lambda k: a.tests[k].p_value)
                first = a.tests.get("first token") or next(iter(a.tests.values()))
                later = [k for k in a.tests if k.startswith("position")]
                share = ("-" if a.drafted is None else f"{a.drafted:,}",
                         "-" if a.accepted is None else (f"{a.accepted / a.drafted:.0%}" if a.drafted else "0"))
                rows.append((c.engine, a.arm.name, a.status, f"{a.arm.n:,}", *share, f"{a.min_p:.3g} ({stat})",
                             f"{first.tv:.4f}", f"{a.detectable.get('first token', a.detectable[stat]):.3f}",
                             "/".join(f"{a.detectable[k]:.3f}" for k in later) or "-",
                             "/".join(f"{a.covered[k]:.0%}" for k in later) or "-"))
        out = _columns(rows) if len(rows) > 1 else []
        for c in self.cases:
            if c.skipped:
                continue
            out.append(f"{c.engine}: {c.description}; {c.wall_seconds:.0f} s wall, {c.cpu_seconds:.0f} CPU-s")
            out.append(f"  {c.command}")
            out += [f"  {n}" for n in c.notes]
            out += [f"  {a.arm.name}: {a.fault}" for a in c.arms if a.fault]
            out += [f"  {a.arm.name}: the first-token test's predicted power against it {a.predicted_power:.3f}"
                    for a in c.arms if a.predicted_power is not None]
        out.append(f"α = {self.alpha:g} over the run, {self.level:.3g} per statistic (single stage); MDE: the "
                   f"smallest TV detected with probability ≥ {DETECT:.0%} at that level"
                   + (f"; {self.machine}" if self.machine else ""))
        return "\n".join(lines + out)


def run_arms(engine: SamplingEngine, reference: Reference | None, prompts: Sequence[Sequence[int]],
             arms: Sequence[Arm], level: float, seed: int = 0, horizon: int = HORIZON,
             baseline: SamplingEngine | None = None, progress: Callable[[str], None] | None = None) -> list[ArmResult]:
    """Every arm of a case on one started engine, with a progress bar of requests."""
    from tqdm.auto import tqdm

    # a mixed control (requests served at a neighbour's temperature) is rejected only against a
    # reference: an engine's own laws are those of the temperatures it served, and speculation off
    # serves the same ones
    arms = [a for a in arms if reference is not None or not (a.control and a.mix)]
    results = []
    with tqdm(total=sum(a.n for a in arms), desc=engine.name, unit="req", disable=progress is None,
              leave=False) as bar:
        for k, arm in enumerate(arms):
            bar.set_postfix_str(arm.name)
            if arm.control:
                # with a reference its power is predicted before drawing; without one (vLLM: only
                # the laws it returns with its tokens) it is drawn as often as the largest clean
                # arm — rejected at the N the clean arms are certified at (measured: vLLM's at
                # N/4 = 2,000 survived at p 3.7e-5)
                sized = (sized_control(arm, prompts, reference, level) if reference is not None
                         else replace(arm, n=max([arm.n] + [a.n for a in arms if not a.control])))
                bar.total += sized.n - arm.n
                arm = sized
            results.append(check_arm(engine, reference, prompts, arm, level, seed + 100_000_007 * k, horizon,
                                     baseline, bar.update))
    return results


def _served(arm: Arm) -> str:
    return "/".join(f"{t:g}" for t in arm.mix) if arm.mix else f"{arm.temperature:g}"


def run_level(clean_arms: int, statistics: int, alpha: float = ALPHA) -> float:
    """α/(k·s): the level each statistic of each of the k clean arms is tested at."""
    return alpha / max(1, clean_arms * statistics)

"""hypothesis strategies for conformance cases, and a deterministic way to draw from them.

A case's parameters come from what the plug-ins declare: each component's ``examples`` metadata
(its config defaults when it declares none), plus a γ override for drafters whose config has a
``gamma`` field.  The rest — temperature (0 included), top-k, top-p, batch size, the reference
target (family, vocabulary, weights), the prompt, the horizon and the seeds — is drawn here.

A combination whose components read the per-request sampling settings (:func:`reads_settings`)
also meets a *mixed* case (:func:`mixed_strategy`): the same pipeline, target and batch, its
requests at two or three settings of :data:`MENU` at once (greedy among them) — the batches a server runs, where a
component that mixes up rows' settings shows (vLLM's n-gram path once sampled its draft positions
with settings that belonged to no request, vllm#55005).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge_conformance.combos import Combination
from specforge_conformance.exact import FAMILIES
from specforge_conformance.harness import (CASE_THREADS, IDLE_SHARE, MIXED_SHARE, Case, Setting, informative, pilot,
                                          shares)

__all__ = ["CANDIDATES", "MENU", "case_strategy", "draw_cases", "informative_cases",
           "mix_strategy", "mixed_case", "mixed_strategy", "params_strategy", "reads_settings"]

# Drawn cases piloted per combination case, so that one in which verification happens is found
# (a scheduler's threshold above every confidence, a step curve that admits no draft at this
# batch size or temperature verify nothing, and certify nothing).
CANDIDATES = 6

# The first entry of each list is what hypothesis's simplest example uses.  T = 0 is not drawn
# (except for greedy-only verifiers): a point mass is a vacuous statistical case, and every
# speculative combination is checked at T = 0 token for token by the greedy-parity check.
TEMPERATURES = (1.0, 1.5, 0.8, 1.2)
TOP_K = (0, 3, 6)
TOP_P = (1.0, 0.8, 0.95)
# Small batches cost more per request (a round's cost is mostly per pass: a calibrator probe case
# took 15.2 s at batch 32, 9.6 s at 128, end to end on one EPYC thread); a size that is not a power
# of two stays in the draw (200) for layouts that only break there.
BATCHES = (64, 200, 128)
VOCABS = (16, 8, 24)
HORIZONS = (3, 2)
# The settings a mixed case's requests draw from: greedy, and T ∈ {0.7, 1, 1.5} × top-k ∈ {0, 3} ×
# top-p ∈ {1, 0.8} (at T = 0 top-k and top-p change nothing: one greedy setting).  A mix holds two
# or three of them — more would split N too thinly for the per-setting sequence statistic.
MENU: tuple[Setting, ...] = ((0.0, 0, 1.0), *((t, k, p) for t in (0.7, 1.0, 1.5) for k in (0, 3) for p in (1.0, 0.8)))
MIX_SIZES = (2, 3)


def params_strategy(host: PluginHost, kind: ComponentKind, name: str) -> st.SearchStrategy[dict]:
    """A component's declared parameter sets, with γ drawn too when the config has one."""
    reg = host.get(kind, name)
    examples = [dict(e) for e in reg.metadata.examples] or [{}]
    base = st.sampled_from(examples)
    if kind is ComponentKind.DRAFTER and "gamma" in reg.config.model_fields:
        return st.tuples(base, st.one_of(st.none(), st.integers(1, 6))).map(
            lambda t: t[0] if t[1] is None else {**t[0], "gamma": t[1]})
    return base


def case_strategy(host: PluginHost, combo: Combination, n: int) -> st.SearchStrategy[Case]:
    """Cases of ``combo`` at sample size ``n``, horizon, vocabulary and N then set by
    :func:`~specforge_conformance.probes.size_case` (well-conditioned ones only: see
    :data:`specforge_conformance.exact.MARGIN`)."""
    from specforge_conformance.probes import size_case

    pipeline = {slot: (st.just(None) if name is None else
                       params_strategy(host, ComponentKind(slot), name).map(lambda p, name=name: (name, p)))
                for slot, name in combo.to_dict().items()}
    greedy_only = host.get(ComponentKind.VERIFIER, combo.verifier).metadata.greedy_only
    vocab = st.sampled_from(VOCABS)
    strategy = st.builds(
        Case,
        pipeline=st.fixed_dictionaries(pipeline),
        temperature=st.just(0.0) if greedy_only else st.sampled_from(TEMPERATURES),
        top_k=st.sampled_from(TOP_K),
        top_p=st.sampled_from(TOP_P),
        batch=st.sampled_from(BATCHES),
        family=st.sampled_from(FAMILIES),
        vocab=vocab,
        target_seed=st.integers(0, 10_000),
        # Ids below 8 are valid in every vocabulary; repeating the motif gives ngram matches.
        prompt=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(lambda m: tuple((m * 4)[:7])),
        horizon=st.sampled_from(HORIZONS),
        n=st.just(n),
        seed=st.integers(0, 2**40),
        threads=st.just(CASE_THREADS),
    )
    return strategy.map(lambda case: size_case(case, n)).filter(lambda case: case.well_conditioned)


def reads_settings(host: PluginHost, combo: Combination) -> bool:
    """Whether a combination reads per-request sampling settings that can differ within a batch:
    every one whose verifier samples — it warps each row with that row's own settings, and its
    drafter (a sampling drafter warps its laws the same way) and scheduler (told each row's
    temperature after the round) run in the same batches.  A greedy-only verifier's requests are
    all at T = 0, where top-k and top-p change nothing."""
    return not host.get(ComponentKind.VERIFIER, combo.verifier).metadata.greedy_only


def mix_strategy() -> st.SearchStrategy[tuple[Setting, ...]]:
    """The greedy setting and one or two distinct sampling settings of :data:`MENU`.  Greedy rows
    beside sampling rows in one round are where a one-hot law can leak into a sampling row or the
    reverse, so every mix has them (explicitly: a draw that decided it would, for one example per
    key as the suite draws, take hypothesis's second example — the same choice every time); two
    sampling settings, where one row's temperature can reach another, in about half."""
    greedy = MENU[0]
    return st.lists(st.sampled_from(MENU[1:]), min_size=min(MIX_SIZES) - 1, max_size=max(MIX_SIZES) - 1,
                    unique=True).map(lambda drawn: (*drawn, greedy))  # (greedy last: the engine's default samples)


def mixed_strategy(case: Case, n: int) -> st.SearchStrategy[Case]:
    """``case`` (the pipeline, target, prompt and batch of a drawn, piloted case) as a mixed case
    of N = ``n``: its requests draw their settings from a mix (:func:`mix_strategy`) in which every
    setting's law is well-conditioned.  Keeping the pipeline the pilot chose keeps the case
    informative without a pilot of its own."""
    def mixed(mix: tuple[Setting, ...]) -> Case:
        return replace(case, mix=mix, temperature=mix[0][0], top_k=mix[0][1], top_p=mix[0][2], n=n)

    return mix_strategy().map(mixed).filter(lambda c: c.well_conditioned)


def mixed_case(case: Case, key: str) -> Case | None:
    """The mixed case of a combination whose kept case is ``case``, at :data:`MIXED_SHARE` of its
    N, drawn reproducibly for ``key`` (``None`` in the rare target on which no mix is
    well-conditioned)."""
    drawn = draw_cases(mixed_strategy(case, max(1, int(case.n * MIXED_SHARE))), 1, key)
    return drawn[0] if drawn else None


def draw_cases(strategy: st.SearchStrategy[Case], count: int, key: str) -> list[Case]:
    """``count`` cases from ``strategy``, the same ones every time for the same ``key``.

    Seeding hypothesis from ``key`` (rather than ``derandomize``, which seeds from the function
    and would give every combination the same draws) keeps runs reproducible while different
    combinations explore different settings.  hypothesis' first example is its simplest one (the
    first entry of every list) — the same for every combination — so it is skipped.
    """
    cases: list[Case] = []

    @seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    @settings(max_examples=count + 1, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(strategy)
    def collect(case: Case) -> None:
        cases.append(case)

    collect()
    unique: list[Case] = []
    for case in cases[1:] or cases:
        if case not in unique:
            unique.append(case)
    return unique[:count]


def informative_cases(candidates: list[Case], count: int, host: PluginHost) -> list[Case]:
    """``count`` of ``candidates`` (in draw order) in which verification happens, by a short pilot
    run each (:func:`~specforge_conformance.harness.informative`); where too few are, the rest are
    those that verified the largest share, at :data:`IDLE_SHARE` of their N — they test little
    beyond plain decoding (the run then says whether they verified anything), and their samples
    pay for the combinations' mixed cases."""
    if len(candidates) <= count:
        return candidates
    chosen, scored = [], []
    for case in candidates:
        result = pilot(case, host)
        if informative(result):
            chosen.append(case)
            if len(chosen) == count:
                return chosen
        else:
            scored.append((shares(result)[0] if result.accepted else 0.0, case))
    scored.sort(key=lambda t: -t[0])  # stable: draw order among equals
    return chosen + [replace(case, n=max(1, int(case.n * IDLE_SHARE))) for _, case in scored[:count - len(chosen)]]

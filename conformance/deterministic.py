"""Deterministic checks of one pipeline (docs/conformance.md): no statistics, exact answers.

* **greedy parity** — at T = 0 the pipeline's output equals plain autoregressive decoding of the
  same target token for token (fp32), at batch 1 and batch 3;
* **rollback** — after every round, the next-token logits read through the engine's KV cache
  equal those of a fresh prefill of the committed tokens;
* **truncation** — an EOS, or the max-token limit, that falls inside an accepted block ends the
  output exactly where plain decoding ends it;
* **non-finite rows** — a verifier given NaN/+inf logits on a row it uses raises
  :class:`~specforge.sampling.NonFiniteError` naming the request and position, and ignores the
  same garbage on rows it does not use;
* **declared law** — a verifier that states its per-position law (``accept_probability``,
  ``residual``) states a lossless one: q·a + (1 − Σ q·a)·r = p on peaked, flat, disjoint and
  one-hot laws, for every draft token;
* **causality** — a scheduler's decision to verify slot k, and a calibrator's output up to slot k,
  do not change when the confidences of later slots do (those depend on x_k for a sequential
  drafter: paper Appendix A).

Each check returns a :class:`Check`; a check that cannot apply (e.g. no drafter) says so.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specforge.engine import GenerationRequest
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge.sampling import NonFiniteError, SamplingParams
from specforge.passes import VarlenBatch
from specforge_conformance.harness import Case, build_engine

__all__ = ["Check", "calibrator_causality", "component_checks", "declared_law", "deterministic_checks", "greedy_parity", "non_finite",
           "rollback", "scheduler_causality", "truncation"]

TOLERANCE = 1e-4  # fp32 logits through the cache vs a fresh prefill (absolute, logits of O(10))
PROMPTS = ((3, 5, 7, 3, 5, 7, 2), (1, 2, 1, 2, 1), (6, 0, 4, 6, 0), (2, 2, 2, 2))
NEW_TOKENS = 12


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str = ""

    def to_dict(self) -> dict:
        return {"check": self.name, "passed": self.passed, "detail": self.detail}


def _plain(case: Case) -> Case:
    pipeline = {slot: None for slot in case.pipeline}
    pipeline["verifier"] = ("greedy", {})
    return replace(case, pipeline=pipeline)


def _generate(case: Case, host: PluginHost, prompts, n: int, target=None, ignore_eos: bool = True):
    engine = build_engine(case, host, target=target, max_new_tokens=n)
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=ignore_eos) for p in prompts]
    return engine.generate(requests)


def greedy_parity(case: Case, host: PluginHost) -> Check:
    """T = 0: the pipeline emits what plain greedy decoding emits."""
    case = replace(case, temperature=0.0, top_k=0, top_p=1.0)
    expected = [o.token_ids for o in _generate(_plain(case), host, PROMPTS, NEW_TOKENS)]
    for batch in (1, 3):
        outs = _generate(replace(case, batch=batch), host, PROMPTS, NEW_TOKENS)
        for prompt, out, want in zip(PROMPTS, outs, expected):
            if out.error or out.token_ids != want:
                return Check("greedy parity", False,
                             f"batch {batch}, prompt {list(prompt)}: got {out.token_ids} ({out.error}), "
                             f"plain decoding gives {want}")
    return Check("greedy parity", True, f"{len(PROMPTS)} prompts × {NEW_TOKENS} tokens, batch 1 and 3")


def rollback(case: Case, host: PluginHost) -> Check:
    """After each round, logits through the cache equal those of a fresh prefill."""
    engine = build_engine(replace(case, batch=len(PROMPTS)), host, max_new_tokens=NEW_TOKENS)
    for p in PROMPTS:
        engine.submit(GenerationRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    target, worst, rounds, rejected = engine.target, 0.0, 0, {}
    fresh = target.new_cache(1, engine.context_limit)
    while engine.busy:
        for event in engine.step():
            pass
        rounds += 1
        for state in engine.active:
            slot, history = state.slot, state.history
            length = engine.cache.lengths[slot]
            # The anchor at its position, read through the engine's cache; then undo the write.
            via_cache = target.forward(VarlenBatch.build([[history[-1]]], [slot], [length]), engine.cache,
                                       logits_rows=torch.tensor([0])).logits[0]
            engine.cache.crop(slot, length)
            fresh.crop(0, 0)
            again = target.forward(VarlenBatch.build([history], [0], [0]), fresh,
                                   logits_rows=torch.tensor([len(history) - 1])).logits[0]
            worst = max(worst, float((via_cache - again).abs().max()))
            rejected[state.request_id] = state.stats.verified - state.stats.accepted
    passed = worst <= TOLERANCE
    return Check("rollback", passed, f"max |Δlogit| = {worst:.2e} over {rounds} rounds "
                                     f"({sum(rejected.values())} rejected drafts; tolerance {TOLERANCE:g})")


def truncation(case: Case, host: PluginHost) -> Check:
    """EOS and the token limit inside an accepted block cut exactly where plain decoding does."""
    case = replace(case, temperature=0.0, top_k=0, top_p=1.0)
    plain = [o.token_ids for o in _generate(_plain(case), host, PROMPTS, NEW_TOKENS)]
    cut_inside = 0
    for prompt, full in zip(PROMPTS, plain):
        for limit in (1, 2, 5):
            out = _generate(case, host, [prompt], limit)[0]
            if out.token_ids != full[:limit]:
                return Check("truncation", False, f"max_new_tokens={limit}, prompt {list(prompt)}: "
                                                  f"{out.token_ids} != {full[:limit]}")
            s = out.stats
            cut_inside += s.accepted + s.rounds > s.emitted
        eos = full[NEW_TOKENS // 2]
        stop = full.index(eos) + 1
        from specforge_conformance.exact import reference_target

        target = copy.copy(reference_target(case.reference))
        target.eos_ids = frozenset({eos})
        out = _generate(case, host, [prompt], NEW_TOKENS, target=target, ignore_eos=False)[0]
        if out.token_ids != full[:stop] or out.finish_reason != "eos":
            return Check("truncation", False, f"EOS {eos}, prompt {list(prompt)}: {out.token_ids} "
                                              f"({out.finish_reason}) != {full[:stop]}")
        s = out.stats
        cut_inside += s.accepted + s.rounds > s.emitted
    return Check("truncation", True, f"token limits 1/2/5 and an EOS on {len(PROMPTS)} prompts; "
                                     f"{cut_inside} runs ended inside a verified block")


def non_finite(verifier_name: str, host: PluginHost, vocab: int = 16) -> Check:
    """NaN/+inf on a used row raises NonFiniteError at that (request, position); on an unused
    row it is ignored."""
    reg = host.get(ComponentKind.VERIFIER, verifier_name)
    verifier = reg.create()
    gen = torch.Generator().manual_seed(0)
    r, g = 3, 3
    logits = torch.randn(r, g + 1, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (r, g), generator=gen)
    probs = torch.softmax(torch.randn(r, g, vocab, generator=gen), -1)
    lengths = torch.tensor([3, 1, 2])
    uniforms = torch.rand(r, g + 1, 2, generator=gen, dtype=torch.float64)
    sampling = SamplingParams.uniform(r, 0.0 if reg.metadata.greedy_only else 1.0)
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[1, 1, 4] = bad  # row ℓ = 1 of request 1: its bonus row, used
        try:
            verifier.verify(broken, tokens, probs, lengths, sampling, uniforms)
        except NonFiniteError as exc:
            if (exc.request, exc.position) != (1, 1):
                return Check("non-finite", False, f"{bad} at (1, 1) reported at ({exc.request}, {exc.position})")
        else:
            return Check("non-finite", False, f"{bad} in a used row of request 1 did not raise")
        unused = logits.clone()
        unused[1, 3, 4] = bad  # past ℓ = 1: never read
        try:
            out = verifier.verify(unused, tokens, probs, lengths, sampling, uniforms)
        except NonFiniteError as exc:
            return Check("non-finite", False, f"{bad} in an unused row raised: {exc}")
        if bool(((out.next_token < 0) | (out.next_token >= vocab)).any()):
            return Check("non-finite", False, "an out-of-vocabulary id was emitted")
    return Check("non-finite", True, "NaN and +inf located at (request 1, row 1); unused rows ignored")


def _law_pairs(v: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``[M, V]`` target and draft laws that stress a rule: peaked, flat, disjoint supports,
    zeros in either, equal laws."""
    def rand(scale: float, m: int) -> Tensor:
        return torch.softmax(torch.randn(m, v, generator=gen, dtype=torch.float64) * scale, -1)

    p = torch.cat([rand(3.0, 8), rand(0.3, 8), rand(1.0, 8), rand(1.0, 4)])
    q = torch.cat([rand(1.0, 8), rand(3.0, 8), rand(1.0, 8), p[-4:].clone()])
    half = torch.arange(v) < v // 2
    p[16:20] = torch.where(half, p[16:20], 0.0)  # disjoint supports
    q[16:20] = torch.where(half, 0.0, q[16:20])
    p[20:24, 0] = 0.0  # zeros in p only
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    return p, q


def declared_law(verifier_name: str, host: PluginHost, vocab: int = 12) -> Check:
    """The per-position law a verifier declares keeps p: Σ_x q(x)·[a(x)·e_x + (1 − a(x))·r_x] = p
    for sampled drafts, and a(x)·e_x + (1 − a(x))·r_x = p for a deterministic draft x."""
    from specforge_conformance.rounds import declares_law

    reg = host.get(ComponentKind.VERIFIER, verifier_name)
    verifier = reg.create()
    if not declares_law(verifier):
        return Check("declared law", True, "not applicable: the verifier does not declare a per-position law")
    if not reg.metadata.lossless:
        return Check("declared law", True, "not applicable: declared lossy (never certified)")
    if reg.metadata.greedy_only:
        return Check("declared law", True, "not applicable: greedy-only (checked at T = 0 by greedy parity)")
    p, q = _law_pairs(vocab, torch.Generator().manual_seed(0))
    m = p.shape[0]
    x = torch.arange(vocab).repeat(m)  # every draft token of every pair
    pp, qq = p.repeat_interleave(vocab, 0), q.repeat_interleave(vocab, 0)
    worst = 0.0
    for draft in (qq, None):
        a = verifier.accept_probability(pp.float(), None if draft is None else draft.float(), x).double()
        r = verifier.residual(pp.float(), None if draft is None else draft.float(), x).double()
        emitted = (1 - a)[:, None] * r
        emitted[torch.arange(x.numel()), x] += a
        if draft is None:
            err = (emitted - pp).abs().amax(-1).view(m, vocab)
            # a one-hot draft of x with p(x) = 0 cannot be accepted; nothing else to require
        else:
            weights = qq.gather(-1, x[:, None]).view(m, vocab, 1)
            err = ((weights * emitted.view(m, vocab, vocab)).sum(1) - p).abs().amax(-1)
        worst = max(worst, float(err.max()))
        if worst > 1e-4:
            where = "one-hot drafts" if draft is None else "sampled drafts"
            return Check("declared law", False, f"{where}: the law of the emitted token differs from p by "
                                                f"{worst:.3g} (accept_probability/residual are not lossless)")
    return Check("declared law", True, f"{m} law pairs × {vocab} draft tokens, sampled and one-hot: "
                                       f"max |emitted − p| = {worst:.1e}")


def _confidence_batches(gen: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    out = []
    # Global rules are most sensitive to one request's own slots when the batch is small.
    for r, g, count in ((1, 3, 24), (1, 5, 24), (2, 4, 12), (4, 4, 6), (16, 6, 4)):
        for _ in range(count):
            c = torch.rand(r, g, generator=gen, dtype=torch.float64)
            c = torch.where(torch.rand(r, g, generator=gen) < 0.2, 1.0, c)  # ties, certain slots
            available = torch.randint(0, g + 1, (r,), generator=gen)
            out.append((c.float(), available))
    return out


def scheduler_causality(name: str, host: PluginHost) -> Check:
    """Changing the confidences after slot k never changes whether slot k is verified (every
    declared parameter set)."""
    reg = host.get(ComponentKind.SCHEDULER, name)
    tried = 0
    for params in reg.metadata.examples or ({},):
        check = _scheduler_causality(reg.create(dict(params)))
        if not check.passed:
            return Check(check.name, False, f"with {dict(params)}: {check.detail}")
        tried += int(check.detail.split()[0])
    return Check("causality", True, f"{tried} perturbations of later slots left every earlier decision unchanged")


def _scheduler_causality(scheduler) -> Check:
    gen = torch.Generator().manual_seed(1)
    batches = _confidence_batches(gen)
    for c, available in batches[:3]:  # warm a scheduler with a history
        scheduler.schedule(c, available)
    tried = 0
    for c, available in batches:
        state = copy.deepcopy(scheduler)
        base = state.schedule(c.clone(), available.clone()).to(torch.long)
        r, g = c.shape
        for row in range(r):
            for k in range(g - 1):
                for _ in range(3):
                    changed = c.clone()
                    changed[row, k + 1:] = torch.rand(g - k - 1, generator=gen)
                    got = copy.deepcopy(scheduler).schedule(changed, available.clone()).to(torch.long)
                    tried += 1
                    if bool(got[row] > k) != bool(base[row] > k):
                        return Check("causality", False,
                                     f"request {row}: whether slot {k + 1} is verified changed when only the "
                                     f"confidences of slots {k + 2}..{g} changed ({c[row].tolist()} → "
                                     f"{changed[row].tolist()}, available {int(available[row])}): the "
                                     "decision reads later slots, which depend on the token it decides on")
        scheduler.schedule(c, available)
    return Check("causality", True, f"{tried} perturbations of later slots left every earlier decision unchanged")


def calibrator_causality(name: str, host: PluginHost) -> Check:
    """Changing the raw confidences after slot k never changes the calibrated ones up to k."""
    reg = host.get(ComponentKind.CALIBRATOR, name)
    calibrator = reg.create(_first_example(reg))
    gen = torch.Generator().manual_seed(2)
    tried = 0
    for c, _ in _confidence_batches(gen):
        c = c.clamp(1e-3, 1 - 1e-3)
        base = calibrator.apply(c.clone())
        r, g = c.shape
        for k in range(g - 1):
            changed = c.clone()
            changed[:, k + 1:] = torch.rand(r, g - k - 1, generator=gen).clamp(1e-3, 1 - 1e-3)
            got = calibrator.apply(changed)
            tried += 1
            if not torch.equal(got[:, : k + 1], base[:, : k + 1]):
                return Check("causality", False, f"calibrated confidences of slots 1..{k + 1} changed when only "
                                                 f"slots {k + 2}..{g} changed")
    return Check("causality", True, f"{tried} perturbations of later slots left earlier calibrated values unchanged")


def _first_example(reg) -> dict:
    return dict(reg.metadata.examples[0]) if reg.metadata.examples else {}


def component_checks(kind: ComponentKind, name: str, host: PluginHost) -> list[Check]:
    """The deterministic checks of one component by itself (not of a pipeline)."""
    checks = {
        ComponentKind.VERIFIER: (non_finite, declared_law),
        ComponentKind.SCHEDULER: (scheduler_causality,),
        ComponentKind.CALIBRATOR: (calibrator_causality,),
    }.get(kind, ())
    out = []
    for fn in checks:
        try:
            out.append(fn(name, host))
        except Exception as exc:  # noqa: BLE001 - a plug-in may raise anything; report it
            out.append(Check(fn.__name__.replace("_", " "), False, f"{type(exc).__name__}: {exc}"))
    return out


def deterministic_checks(case: Case, host: PluginHost) -> list[Check]:
    """Every check that applies to the pipeline of ``case``."""
    out = []
    greedy_ok = True
    for name, fn in (("greedy parity", greedy_parity), ("truncation", truncation), ("rollback", rollback)):
        if name != "rollback" and not greedy_ok:
            continue
        try:
            check = fn(case, host)
        except Exception as exc:  # noqa: BLE001 - a plug-in may raise anything; report it
            check = Check(name, False, f"{type(exc).__name__}: {exc}")
        greedy_ok = greedy_ok and check.passed
        out.append(check)
    return out

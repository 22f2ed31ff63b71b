"""Deterministic checks of one pipeline (docs/conformance.md): no statistics, exact answers.

* **greedy parity** — at T = 0 the pipeline's output equals plain autoregressive decoding of the
  same target token for token (fp32), at batch 1 and batch 3;
* **rollback** — after every round, the next-token logits read through the engine's KV cache
  equal those of a fresh prefill of the committed tokens;
* **truncation** — an EOS, or the max-token limit, that falls inside an accepted block ends the
  output exactly where plain decoding ends it;
* **non-finite rows** — a verifier given NaN/+inf logits on a row it uses raises
  :class:`~specforge.sampling.NonFiniteError` naming the request and position, and ignores the
  same garbage on rows it does not use.

Each check returns a :class:`Check`; a check that cannot apply (e.g. no drafter) says so.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from specforge.engine import GenerationRequest
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge.sampling import NonFiniteError, SamplingParams
from specforge.target import VarlenBatch
from specforge_conformance.harness import Case, build_engine

__all__ = ["Check", "deterministic_checks", "greedy_parity", "non_finite", "rollback", "truncation"]

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

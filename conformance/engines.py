"""The engines the black-box tier checks (``specforge conformance --engine NAME``), each driven
through its own public interface as a real process that the suite starts and stops.

* ``llama.cpp-*`` — ``llama-server`` (``make llama.cpp``) on the loopback, one slot, requests over
  HTTP with a seed each and pure temperature sampling (the sampler chain reduced to
  ``["temperature"]``, then llama.cpp's ``dist``; top-k 0, top-p 1, min-p 0, typical-p 1, no
  penalties, no DRY, no XTC, no top-n-σ, no mirostat — checked in the server's echo of its
  settings).  The reference law comes from llama.cpp's own logits on the same GGUF through the
  binding specforge builds (:mod:`specforge.runtime.llamacpp.libllama`), computed the way the server
  computes plain decoding (below).
* ``vllm-ngram`` — vLLM CPU's offline API in its own venv (``make vllm``), a persistent
  subprocess (:mod:`specforge.peers.vllm_sampler`) that returns, with every token, the
  log-probabilities vLLM sampled it from.
* ``simulated`` / ``simulated-over-accept`` — an in-process speculative sampler over a known
  16-token Markov law, exact or accepting drafts with min(1, 1.03·p/q): the statistics on a law
  known exactly, no process.

**How the llama.cpp reference is computed.**  llama.cpp's logits depend on how a sequence was cut
into decode passes and on the order of its KV cells (its Q4_1 × Q8_1 products round the
activations of each pass; a change of ~10⁻⁷ upstream can move one logit by up to ~0.5).  So the
reference reproduces the passes of the server's plain decoding: with the prompt cached in the
slot (one warm-up request per prompt, drawn once in one pass), every request re-decodes the
prompt's last token in a one-token pass — the logits of the first token — and the reference does
exactly that; every later position's reference is the one-token pass of plain decoding after
that prefix.  The first token is never drafted in llama-server (it is sampled before the first
draft), so its test checks the reference and the sampler: the server's own probabilities of the
first token (``n_probs``) are compared with the reference's and the difference is printed.  At
positions ≥ 2 the speculative server samples from the rows of a verify pass of several tokens,
whose numerics may differ slightly from a one-token pass: what is compared there is the law of
speculative decoding against the law of plain decoding of the same engine — a difference,
numerical or not, shows as a rejection, and is reported as the finding it is.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specforge_conformance.blackbox import (ALPHA, HORIZON, Arm, CaseReport, EngineFault, EngineReport, Sampled,
                                            default_arms, run_arms, run_level)
from specforge_conformance.vllm_engine import VllmEngine

__all__ = ["ENGINES", "EngineCase", "LlamaCppReference", "LlamaServerEngine", "MarkovReference", "PROMPTS",
           "SimulatedEngine", "VllmEngine", "engine_list", "run_engines"]

# The fixed prompts (SmolLM2's chat template): an open question, whose first token has some
# entropy (the first-token statistic's power), and two continuations that quote the context,
# where the n-gram modes find drafts and the draft model agrees with the target.
PROMPTS = (
    "<|im_start|>user\nName one animal.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nRepeat after me: red green blue red green blue red green blue<|im_end|>\n"
    "<|im_start|>assistant\nred green blue red green blue red",
    "<|im_start|>user\nCount from 1 to 20.<|im_end|>\n<|im_start|>assistant\n1, 2, 3, 4, 5, 6, 7,",
)
DEFAULT_N = 12_000  # requests of the T = 1 arm (see docs/engines.md for what it detects)
SAMPLER_NEUTRAL: dict[str, Any] = {
    # pure temperature: every other sampler of llama.cpp's chain neutral (checked in the reply)
    "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
    "top_n_sigma": -1.0, "mirostat": 0, "dynatemp_range": 0.0, "samplers": ["temperature"],
}


# --- the simulated engine -------------------------------------------------------------------------


class MarkovReference:
    """A known law: the next token after ``prefix`` is softmax(W[last] / T) over V tokens (the
    prompt's last token taken modulo V)."""

    def __init__(self, vocab: int = 16, seed: int = 0, scale: float = 1.6) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.weights = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * scale

    def law(self, last: int, temperature: float) -> Tensor:
        return torch.softmax(self.weights[last % self.vocab] / temperature, -1)

    def laws(self, prompt: Sequence[int], prefixes: Sequence[tuple[int, ...]],
             temperature: float) -> Iterator[tuple[tuple[int, ...], Tensor]]:
        for prefix in prefixes:
            yield prefix, self.law((tuple(prompt) + tuple(prefix))[-1], temperature)


class SimulatedEngine:
    """Speculative sampling of :class:`MarkovReference`'s law in process: a drafter with its own
    Markov law q drafts ``gamma`` tokens, each accepted with min(1, (1 + over)·p/q), a rejection
    resampled from norm(max(p − q, 0)), a bonus token from p — the rejection rule, exact at
    ``over`` = 0; ``over`` = 0.03 over-accepts by 3 %."""

    returns_laws = False

    def __init__(self, name: str = "simulated", over: float = 0.0, gamma: int = 3, seed: int = 0) -> None:
        self.name, self.over, self.gamma = name, over, gamma
        self.reference = MarkovReference(seed=seed)
        # an over-confident drafter: the target's own table, sharper and perturbed — most of the
        # target's mass lies where q > p, where an over-accepting rule errs
        self.drafter = MarkovReference(seed=seed)
        noise = torch.randn(self.drafter.weights.shape, generator=torch.Generator().manual_seed(seed + 1),
                            dtype=torch.float64)
        self.drafter.weights = self.drafter.weights * 1.6 + 0.5 * noise

    def __enter__(self) -> SimulatedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def sample(self, prompt: Sequence[int], n_tokens: int, temperature: float | Sequence[float],
               seeds: Sequence[int], progress: Callable[[int], None] | None = None) -> Sampled:
        """All requests at once, round by round (vectorised: 10⁵ requests take seconds), each at
        its own temperature when given one per seed; the random numbers come from one generator
        seeded with every request's seed."""
        import numpy as np

        V, m = self.reference.vocab, len(seeds)
        temps = [float(temperature)] * m if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
        levels = sorted(set(temps))
        level = np.array([levels.index(t) for t in temps], dtype=np.int64)  # each request's row of the tables
        p = np.stack([torch.stack([self.reference.law(i, t) for i in range(V)]).numpy() for t in levels])
        q = np.stack([torch.stack([self.drafter.law(i, t) for i in range(V)]).numpy() for t in levels])
        residual = np.maximum(p - q, 0.0)
        residual /= residual.sum(-1, keepdims=True)
        cdf = {name: np.cumsum(law, -1) for name, law in (("p", p), ("q", q), ("r", residual))}
        rng = np.random.default_rng(list(seeds))

        def draw(name: str, who: np.ndarray, ctx: np.ndarray) -> np.ndarray:
            u = rng.random(ctx.size)
            return np.minimum((cdf[name][level[who], ctx] < u[:, None]).sum(-1), V - 1)

        out = np.full((m, n_tokens), -1, dtype=np.int64)
        length = np.zeros(m, dtype=np.int64)
        last = np.full(m, prompt[-1] % V, dtype=np.int64)
        drafted = accepted = 0
        rows = np.arange(m)
        while (length < n_tokens).any():
            live = rows[length < n_tokens]
            ctx = last[live].copy()
            going = np.ones(live.size, dtype=bool)  # still inside this round's chain of accepted drafts
            room = n_tokens - length[live] - 1  # drafts that fit before the round's last token
            for j in range(self.gamma + 1):
                at = np.flatnonzero(going)
                if at.size == 0:
                    break
                drafting = at[room[at] > j] if j < self.gamma else at[:0]
                bonus = np.setdiff1d(at, drafting)
                if bonus.size:  # every draft accepted (or none fit): the bonus token from p
                    self._emit(out, length, live[bonus], draw("p", live[bonus], ctx[bonus]))
                    going[bonus] = False
                if drafting.size == 0:
                    continue
                c, who = ctx[drafting], live[drafting]
                x = draw("q", who, c)
                drafted += drafting.size
                a = np.minimum(1.0, (1 + self.over) * p[level[who], c, x] / q[level[who], c, x])
                ok = rng.random(drafting.size) < a
                accepted += int(ok.sum())
                self._emit(out, length, live[drafting[ok]], x[ok])
                ctx[drafting[ok]] = x[ok]
                rejected = drafting[~ok]
                if rejected.size:
                    self._emit(out, length, live[rejected], draw("r", who[~ok], c[~ok]))
                    going[rejected] = False
            last[live] = out[live, length[live] - 1]
        if progress:
            progress(m)
        return Sampled(out.tolist(), drafted, accepted)

    @staticmethod
    def _emit(out, length, who, tokens) -> None:
        out[who, length[who]] = tokens
        length[who] += 1


# --- llama.cpp ------------------------------------------------------------------------------------


class LlamaCppReference:
    """The target's law from llama.cpp's own logits on the same GGUF (the binding), computed with
    the passes of the server's plain decoding (module docstring).  ``ignore_eos``: the
    end-of-generation tokens are removed, as the server's ``ignore_eos`` does (a logit bias of
    −∞), and so are the vocabulary's suppressed tokens, as its sampler does."""

    def __init__(self, gguf: Path, threads: int, context: int = 512, ignore_eos: bool = True) -> None:
        from specforge.runtime.llamacpp.libllama import load

        binding = load()  # a BindingError names what to run
        import llama_cpp

        api = self.api = binding.api
        # flash attention on: what llama-server's default (auto) resolves to on a CPU, and what
        # it is started with here (-fa on)
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_batch=512, n_ubatch=512, flash_attn=True,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        vocab = api.llama_model_get_vocab(self.llm._model.model)
        self.vocab = int(api.llama_vocab_n_tokens(vocab))
        masked = [t for t in range(self.vocab) if ignore_eos and api.llama_vocab_is_eog(vocab, t)]
        import ctypes

        n = ctypes.c_int32(0)
        suppress = api.llama_vocab_get_suppress_tokens(vocab, ctypes.byref(n))
        masked += [int(suppress[i]) for i in range(n.value)]
        self.masked = torch.tensor(sorted(set(masked)), dtype=torch.long)
        self._prompt: tuple[int, ...] | None = None
        self._first: dict[tuple[int, ...], Tensor] = {}
        self.passes = 0

    def _start(self, prompt: tuple[int, ...]) -> None:
        if self._prompt != prompt:
            self.llm.reset()
            self.llm.eval(list(prompt))  # the warm-up request: the whole prompt in one pass
            self.passes += 1
            self._prompt = prompt

    def logits(self, prompt: Sequence[int], prefixes: Sequence[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...], Tensor]]:
        """Raw float32 logits after prompt + prefix, prefixes visited in sorted order so that
        consecutive ones share their KV; every position a one-token pass."""
        prompt = tuple(int(t) for t in prompt)
        self._start(prompt)
        base = len(prompt)
        for prefix in sorted(prefixes):
            if not prefix and prompt in self._first:
                yield prefix, self._first[prompt]
                continue
            done = list(self.llm.input_ids[base:self.llm.n_tokens]) if self.llm.n_tokens > base else []
            keep = 0
            while keep < min(len(done), len(prefix)) and done[keep] == prefix[keep]:
                keep += 1
            if not prefix:
                self.llm.n_tokens = base - 1
                self.llm.eval([prompt[-1]])  # the cached prompt's last token, re-decoded alone
                self.passes += 1
            else:
                keep = min(keep, len(prefix) - 1)  # the last token is always decoded, in a pass of its own
                self.llm.n_tokens = base + keep
                for t in prefix[keep:]:
                    self.llm.eval([int(t)])
                    self.passes += 1
            # the pass's last row, read from the context (the high-level class keeps no scores
            # without logits_all)
            import numpy as np

            ptr = self.api.llama_get_logits_ith(self.llm._ctx.ctx, -1)
            row = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy())
            if not prefix:
                self._first[prompt] = row
            yield prefix, row

    def laws(self, prompt: Sequence[int], prefixes: Sequence[tuple[int, ...]],
             temperature: float) -> Iterator[tuple[tuple[int, ...], Tensor]]:
        for prefix, row in self.logits(prompt, prefixes):
            z = row.to(torch.float64) / temperature
            z[self.masked] = -torch.inf
            yield prefix, torch.softmax(z, -1)

    def close(self) -> None:
        self.llm.close()


class LlamaServerEngine:
    """llama-server with one slot (``flags`` choose the speculative mode; none: plain decoding)."""

    returns_laws = False

    def __init__(self, name: str, gguf: Path, flags: Sequence[str], threads: int, context: int = 256,
                 log: Path | None = None) -> None:
        from specforge.peers.llama_server import LlamaServer

        self.name, self.flags = name, list(flags)
        self.server = LlamaServer(gguf, slots=1, context=context, threads=threads, extra=("-fa", "on", *self.flags),
                                  log=log)
        self._cached: tuple[int, ...] | None = None
        self._checked = False

    @property
    def command(self) -> str:
        return " ".join(a if a.startswith("-") or "/" not in a else Path(a).name for a in self.server.args)

    def __enter__(self) -> LlamaServerEngine:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.__exit__(*exc)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.server.post("/tokenize", {"content": text, "add_special": False,
                                                               "parse_special": True})["tokens"]]

    def _request(self, prompt: Sequence[int], n: int, temperature: float, seed: int, **extra: Any) -> dict[str, Any]:
        from specforge.peers.llama_server import ServerError

        try:
            return self.server.complete(prompt, n, temperature=temperature, seed=seed, ignore_eos=True,
                                        cache_prompt=True, **{**SAMPLER_NEUTRAL, **extra})
        except (ServerError, OSError) as exc:
            raise EngineFault(f"{self.name}: {exc}") from exc

    def _check_settings(self, reply: dict[str, Any]) -> None:
        """The sampler the server says it ran is pure temperature (a default we did not think of
        would show here)."""
        s = reply.get("generation_settings", {})
        wrong = {k: s.get(k) for k, v in SAMPLER_NEUTRAL.items() if k in s and s.get(k) != v
                 and not (isinstance(v, float) and isinstance(s.get(k), (int, float)) and abs(s[k] - v) < 1e-6)}
        if s.get("samplers") not in (["temperature"], None):
            wrong["samplers"] = s.get("samplers")
        if s.get("adaptive_target", -1) >= 0:
            wrong["adaptive_target"] = s["adaptive_target"]
        if wrong:
            raise EngineFault(f"{self.name}: the server did not sample with pure temperature: {wrong}")
        self._checked = True

    def _warm(self, prompt: tuple[int, ...]) -> None:
        """One discarded request: the prompt lands in the slot's cache in one pass, so every
        counted request re-decodes only its last token (the reference's passes)."""
        if self._cached != prompt:
            self._check_settings(self._request(prompt, 1, 1.0, 0))
            self._cached = prompt

    def first_token_probs(self, prompt: Sequence[int], k: int = 64) -> dict[int, float]:
        """The server's own probabilities (T = 1, before its sampler) of the first token's top
        ``k`` — from the very pass a counted request samples from."""
        prompt = tuple(prompt)
        self._warm(prompt)
        reply = self._request(prompt, 1, 1.0, 0, n_probs=k)
        entry = reply["completion_probabilities"][0]
        import math

        tops = entry.get("top_logprobs") or entry.get("probs") or []
        return {int(t["id"]): (math.exp(t["logprob"]) if "logprob" in t else float(t["prob"])) for t in tops}

    def sample(self, prompt: Sequence[int], n_tokens: int, temperature: float | Sequence[float],
               seeds: Sequence[int], progress: Callable[[int], None] | None = None) -> Sampled:
        prompt = tuple(prompt)
        self._warm(prompt)
        temps = [temperature] * len(seeds) if isinstance(temperature, (int, float)) else list(temperature)

        def one(job: tuple[int, float]) -> tuple[list[int], int, int]:
            seed, t = job
            reply = self._request(prompt, n_tokens, float(t), seed)
            timings = reply.get("timings", {})
            if progress:
                progress(1)
            return ([int(t) for t in reply.get("tokens", [])], int(timings.get("draft_n", 0)),
                     int(timings.get("draft_n_accepted", 0)))

        # two requests in flight on one slot: the server queues the second, so it never waits for
        # the client's HTTP round trip (the slot, its cache and its passes stay those of one stream)
        pool = ThreadPoolExecutor(2)
        try:
            replies = list(pool.map(one, zip(seeds, temps)))
        finally:
            # on Ctrl-C or an error, the requests not yet sent are dropped (not waited for): the
            # server is stopped right after
            pool.shutdown(wait=True, cancel_futures=True)
        return Sampled([r[0] for r in replies], sum(r[1] for r in replies), sum(r[2] for r in replies))


# --- vLLM -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineCase:
    name: str
    description: str
    install: str  # the command that makes it available
    flags: tuple[str, ...] = ()  # llama-server's speculative flags
    kind: str = "llama.cpp"  # llama.cpp | vllm | simulated
    needs_drafter: bool = False


ENGINES: dict[str, EngineCase] = {e.name: e for e in (
    # Lookup n-grams of one token: the answers are 2–4 tokens of a T = 1 sample, which rarely repeat
    # a longer n-gram of the prompt (measured: with n = 3, 0 drafts in 40 requests; with n = 1,
    # 44 drafted and 9 accepted in 30 requests of the "red green blue" prompt).
    EngineCase("llama.cpp-ngram", "llama-server, n-gram speculation (--spec-type ngram-simple; lookup n-gram of 1, "
               "draft m-gram of 3: with the defaults, 12 and 48, it needs 62 tokens of context and never drafts here)",
               "make llama.cpp",
               ("--spec-type", "ngram-simple", "--spec-draft-n-max", "3", "--spec-ngram-simple-size-n", "1",
                "--spec-ngram-simple-size-m", "3")),
    EngineCase("llama.cpp-ngram-map-k", "llama-server, n-gram map speculation (--spec-type ngram-map-k; n-gram of 1)",
               "make llama.cpp", ("--spec-type", "ngram-map-k", "--spec-draft-n-max", "3", "--spec-ngram-map-k-size-n", "1",
                "--spec-ngram-map-k-size-m", "3")),
    EngineCase("llama.cpp-ngram-mod", "llama-server, n-gram mod speculation (--spec-type ngram-mod)",
               "make llama.cpp", ("--spec-type", "ngram-mod", "--spec-draft-n-max", "3")),
    EngineCase("llama.cpp-lookup", "llama-server, lookup decoding from an n-gram cache (--spec-type ngram-cache)",
               "make llama.cpp", ("--spec-type", "ngram-cache", "--spec-draft-n-max", "3")),
    EngineCase("llama.cpp-draft", "llama-server, draft-model speculation (--spec-type draft-simple -md DRAFT; "
               "default draft: the target GGUF itself)", "make llama.cpp",
               ("--spec-type", "draft-simple", "--spec-draft-n-max", "3")),
    EngineCase("llama.cpp-dspark", "llama-server with our exported DSpark drafter (--spec-type draft-dspark -md "
               "DRAFTER.gguf)", "make llama.cpp", ("--spec-type", "draft-dspark"), needs_drafter=True),
    EngineCase("llama.cpp-dflash", "llama-server with our exported DFlash drafter (--spec-type draft-dflash -md "
               "DRAFTER.gguf)", "make llama.cpp", ("--spec-type", "draft-dflash"), needs_drafter=True),
    EngineCase("vllm-ngram", "vLLM CPU, ngram speculation (3 tokens, prompt lookup 1–3), offline API with logprobs",
               "make vllm", kind="vllm"),
    EngineCase("simulated", "in process: exact speculative sampling of a known 16-token Markov law (no process)",
               "-", kind="simulated"),
    EngineCase("simulated-over-accept", "in process: the same with drafts accepted with min(1, 1.03·p/q)", "-",
               kind="simulated"),
)}


def engine_list() -> str:
    """``--engine list``: every engine, whether it is available here, and what installs it."""
    lines = []
    for e in ENGINES.values():
        missing = _missing(e)
        state = "ready" if not missing else ("needs --drafter" if missing.startswith("needs") else "absent")
        lines.append(f"{e.name:<24} {state:<15}  {e.description}"
                     + (f"\n{'':<24} {missing}" if missing else ""))
    return "\n".join(lines)


def _missing(case: EngineCase, drafter: Path | None = None) -> str | None:
    """One line saying why ``case`` cannot run here and what to run, or None."""
    if case.kind == "simulated":
        return None
    if case.kind == "vllm":
        from specforge.peers.vllm_client import VllmNotInstalled, find_vllm_python

        try:
            find_vllm_python()
        except VllmNotInstalled as exc:
            return f"{exc} (`make vllm`)"
        return None
    from specforge.runtime.llamacpp.libllama import BindingError, load
    from specforge.peers.llamacpp_tools import missing_reason

    reason = missing_reason("llama-server")
    if reason:
        return reason
    try:
        load()
    except BindingError as exc:
        return str(exc)
    if case.needs_drafter and drafter is None:
        return ("needs a drafter: --drafter DRAFTER (a GGUF from `specforge export --to llama.cpp`, or a drafter "
                "checkpoint directory or shipped:NAME, exported on the fly)")
    return None


def _target_gguf() -> Path:
    from specforge.model_files import resolve_model

    directory, name = resolve_model("smollm2")
    return directory / name


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_engines(names: Sequence[str], n: int | None = None, seed: int = 0, threads: int | None = None,
                drafter: Path | None = None, draft: Path | None = None, log_dir: Path | None = None,
                arms: Sequence[Arm] | None = None, progress: Callable[[str], None] | None = None) -> EngineReport:
    """Run every engine case of ``names`` (each one started, checked and stopped in turn)."""
    unknown = [x for x in names if x not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine {', '.join(unknown)}; choose from {', '.join(ENGINES)} (or `list`)")
    arms = list(arms or default_arms(n or DEFAULT_N))
    statistics = 1 + (HORIZON - 1)  # first token and each later position (vLLM: its engine law; fewer)
    clean = sum(not a.control for a in arms) * len(names)
    level = run_level(clean, statistics)
    threads = threads or min(2, os.cpu_count() or 1)
    if log_dir is None:  # the engines' logs, for when one does not come up (named in the error)
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="specforge-engines-"))
    cases = []
    for name in names:
        case = ENGINES[name]
        missing = _missing(case, drafter)
        if missing:
            cases.append(CaseReport(name, case.description, "-", skipped=missing))
            continue
        cases.append(_run_case(case, arms, level, seed, threads, drafter, draft, log_dir, progress))
    from specforge.machine import machine_line

    # the project's one machine line (CPU model, the flags that matter, threads), as every bench prints
    return EngineReport(cases, ALPHA, level, machine_line().removeprefix("machine: "))


def _run_case(case: EngineCase, arms: Sequence[Arm], level: float, seed: int, threads: int, drafter: Path | None,
              draft: Path | None, log_dir: Path | None, progress: Callable[[str], None] | None) -> CaseReport:
    wall, cpu = time.perf_counter(), _cpu_seconds()
    log = None if log_dir is None else Path(log_dir) / f"{case.name}.log"
    report = CaseReport(case.name, case.description, "-")
    if case.kind == "simulated":
        engine = SimulatedEngine(case.name, over=0.03 if "over" in case.name else 0.0, seed=seed)
        report.command = f"in process: speculative sampling, γ = {engine.gamma}, over-acceptance {engine.over:g}"
        prompts = [[3], [7], [11]]
        with engine:
            report.arms = run_arms(engine, engine.reference, prompts, arms, level, seed, progress=progress)
    elif case.kind == "vllm":
        from specforge.peers.vllm_client import ngram_variant

        engine = VllmEngine(case.name, ngram_variant(3, 3, 1)["speculative_config"], log=log)
        # started only if an arm's laws come back unusable (vLLM 0.32 CPU: NaN processed
        # log-probabilities at the tokens of a verify pass), for the two-sample test instead
        plain = VllmEngine(f"{case.name} (speculation off)", None, log=log)
        report.command = engine.command
        with engine, plain:
            prompts = [engine.tokenize(p) for p in PROMPTS]
            report.arms = run_arms(engine, None, prompts, arms, level, seed, baseline=plain, progress=progress)
        if any(a.control and a.mix for a in arms):
            report.notes.append("the mixed arm's control (each request served at a neighbour's temperature) is not run: "
                                "without a reference it cannot be told apart (vLLM's laws are those it served)")
    else:
        gguf = _target_gguf()
        flags = list(case.flags)
        if case.name == "llama.cpp-draft":
            flags += ["-md", str(draft or gguf)]
            report.notes.append(f"draft model: {draft or 'the target GGUF itself'}")
        if case.needs_drafter:
            flags += ["-md", str(drafter)]
            report.notes.append(f"drafter: {drafter}")
        reference = LlamaCppReference(gguf, threads)
        try:
            with LlamaServerEngine(case.name, gguf, flags, threads, log=log) as engine:
                report.command = engine.command
                prompts = [engine.tokenize(p) for p in PROMPTS]
                report.notes += _first_token_agreement(engine, reference, prompts)
                report.arms = run_arms(engine, reference, prompts, arms, level, seed, progress=progress)
            report.notes.append(f"reference: {reference.passes:,} llama.cpp passes through the binding")
        except EngineFault as exc:
            report.notes.append(str(exc))
        finally:
            reference.close()
    report.wall_seconds = time.perf_counter() - wall
    report.cpu_seconds = _cpu_seconds() - cpu
    return report


def _first_token_agreement(engine: LlamaServerEngine, reference: LlamaCppReference,
                           prompts: Sequence[Sequence[int]]) -> list[str]:
    """How far the reference's first-token law is from the probabilities the server itself
    reports for the pass it samples the first token from (T = 1, its top 64 tokens)."""
    notes = []
    for i, prompt in enumerate(prompts):
        server = engine.first_token_probs(prompt)
        (_, logits), = reference.logits(prompt, [()])
        ref = torch.softmax(logits.to(torch.float64), -1)
        ids = torch.tensor(list(server))
        diff = (torch.tensor(list(server.values()), dtype=torch.float64) - ref[ids]).abs()
        notes.append(f"prompt {i}: server's first-token probabilities vs the reference: max |Δp| {diff.max():.2e}, "
                     f"TV over its top {len(ids)} {diff.sum() / 2:.2e}")
    return notes

"""llama.cpp decoding a GGUF its own way: the peers ``bench engine --systems llamacpp`` measures.

* ``llamacpp`` — through the binding specforge builds (llama-cpp-python's ``Llama``), one request
  at a time: plain greedy decoding and the binding's prompt-lookup speculation
  (``LlamaPromptLookupDecoding``: draft what followed the last n-gram's earlier occurrence).
* ``llamacpp-server`` — ``llama-server`` (``make llama.cpp``) with one slot per concurrent request
  and continuous batching, driven over HTTP on the loopback: llama.cpp's own parallel decoding,
  and at one request its n-gram speculative modes (``--spec-type ngram-*``).

Records share :mod:`specforge.bench.hf_baseline`'s format; what cannot run is a ``skipped`` record
saying why.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from specforge.engine.request import positions_needed
from specforge.peers.records import rounds_for, summarize

__all__ = ["LLAMACPP_VARIANTS", "SERVER_VARIANTS", "bench_llamacpp", "bench_llamacpp_server",
           "serve_llamacpp_closed_loop"]

# variant -> the binding's draft model (None: plain decoding)
LLAMACPP_VARIANTS = {"plain": None, "lookup": {"max_ngram_size": 3, "num_pred_tokens": 5}}
# variant -> llama-server's speculative flags (the n-gram modes need no draft model); all but
# plain run at one request, where speculation is meant to pay
SERVER_VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-map-k": ("--spec-type", "ngram-map-k"),
    "ngram-mod": ("--spec-type", "ngram-mod"),
    "ngram-cache": ("--spec-type", "ngram-cache"),
}


def _skipped(variant: str, concurrency: int, reason: str, system: str = "llamacpp") -> dict[str, Any]:
    return {"system": system, "variant": variant, "dtype": "llama.cpp", "concurrency": concurrency,
            "status": "skipped", "reason": reason, "tok_s": None}


def _capped_lookup(settings: Mapping[str, Any], context: int) -> Any:
    """The binding's prompt lookup, its draft cut to the room left in the context.  The binding
    caps a draft by the context llama.cpp allocated, which may be larger than the one asked for,
    while its logits buffer has the rows asked for: near the end of a long prompt a full draft
    overflowed it (``could not broadcast input array … into shape …`` in ``Llama.eval``)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class Capped(LlamaPromptLookupDecoding):
        def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
            room = context - len(input_ids)  # rows left after the token being decoded with the draft
            return super().__call__(input_ids, **kwargs)[:max(room, 0)]

    return Capped(**settings)


def bench_llamacpp(gguf: Path, prompt_ids: Sequence[Sequence[int]], concurrencies: Sequence[int],
                   max_new_tokens: int = 128, min_rounds: int = 2, progress: bool = True,
                   threads: int | None = None) -> list[dict[str, Any]]:
    """Greedy decoding of every prompt for exactly ``max_new_tokens`` tokens by llama.cpp, each
    variant of :data:`LLAMACPP_VARIANTS` at concurrency 1 (higher ones: skipped, with why)."""
    from tqdm.auto import tqdm

    from specforge.runtime.llamacpp.libllama import BindingError, load

    try:
        load()
    except BindingError as exc:
        return [_skipped(v, c, str(exc)) for c in concurrencies for v in LLAMACPP_VARIANTS]
    import llama_cpp

    records = []
    context = positions_needed(prompt_ids, max_new_tokens)
    for c in concurrencies:
        for variant, draft in LLAMACPP_VARIANTS.items():
            if c != 1:
                records.append(_skipped(variant, c, "the binding's Llama decodes one sequence; llama.cpp's parallel "
                                                    "decoding is llama-server's (make llama.cpp)"))
                continue
            # flash attention on: what llama.cpp's default (auto) resolves to on a CPU, and what the
            # engine's llama.cpp backend runs (the binding's own default is off)
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_batch=512, n_ubatch=512, flash_attn=True,
                                  n_threads=threads or torch.get_num_threads(), verbose=False,
                                  draft_model=None if draft is None else _capped_lookup(draft, context))

            def decode(ids: Sequence[int], n: int) -> int:
                count = 0
                for _ in llm.generate(list(ids), temp=0.0, reset=True):
                    count += 1
                    if count == n:
                        break
                return count

            decode(prompt_ids[0], 8)  # warm-up, untimed
            times, counts, ptoks = [], [], 0
            for indices in tqdm(rounds_for(len(prompt_ids), 1, min_rounds), desc=f"llamacpp {variant} c=1",
                                unit="round", disable=not progress, file=sys.stderr):
                t0 = time.perf_counter()
                counts.append([decode(prompt_ids[i], max_new_tokens) for i in indices])
                times.append(time.perf_counter() - t0)
                ptoks += sum(len(prompt_ids[i]) for i in indices)
            record = {"system": "llamacpp", "variant": variant, "dtype": "llama.cpp", "concurrency": c,
                      "status": "ok", "reason": None}
            record.update(summarize(times, counts, ptoks))
            records.append(record)
            del llm
    return records


def bench_llamacpp_server(gguf: Path, prompt_ids: Sequence[Sequence[int]], concurrencies: Sequence[int],
                          max_new_tokens: int = 128, min_rounds: int = 2, progress: bool = True,
                          threads: int | None = None, log_dir: Path | None = None,
                          variants: Mapping[str, tuple[str, ...]] = SERVER_VARIANTS,
                          system: str = "llamacpp-server") -> list[dict[str, Any]]:
    """llama-server with ``c`` slots, ``c`` requests in flight (each round submitted together, as
    the engine's rounds are), greedy, exactly ``max_new_tokens`` tokens each; each of ``variants``
    (name -> llama-server flags) but ``plain`` at one request only.  A speculative variant's record
    has the draft tokens llama.cpp drafted and accepted in ``extra``."""
    from tqdm.auto import tqdm

    from specforge.peers.llama_server import ServerError
    from specforge.peers.llamacpp_tools import missing_reason

    reason = missing_reason("llama-server")
    if reason:
        return [_skipped(v, c, reason, system) for c in concurrencies for v in variants if v == "plain" or c == 1]
    context = positions_needed(prompt_ids, max_new_tokens)
    records = []
    for c in concurrencies:
        for variant, flags in variants.items():
            if variant != "plain" and c != 1:
                continue
            log = None if log_dir is None else Path(log_dir) / f"llama-server-{variant}-c{c}.log"
            timed: list[dict[str, float]] = []
            try:
                with _server(gguf, c, context, threads, flags, log) as server, ThreadPoolExecutor(c) as pool:
                    list(pool.map(lambda i: _ask(server, prompt_ids[i], 8), range(min(c, len(prompt_ids)))))  # warm-up
                    times, counts, ptoks = [], [], 0
                    for indices in tqdm(rounds_for(len(prompt_ids), c, min_rounds),
                                        desc=f"llama-server {variant} c={c}", unit="round", disable=not progress,
                                        file=sys.stderr):
                        t0 = time.perf_counter()
                        replies = list(pool.map(lambda i: _ask(server, prompt_ids[i], max_new_tokens), indices))
                        times.append(time.perf_counter() - t0)
                        counts.append([r["tokens"] for r in replies])
                        timed += replies
                        ptoks += sum(len(prompt_ids[i]) for i in indices)
            except ServerError as exc:
                records.append(_skipped(variant, c, str(exc), system))
                continue
            record = {"system": system, "variant": variant, "dtype": "llama.cpp", "concurrency": c,
                      "status": "ok", "reason": None}
            record.update(summarize(times, counts, ptoks))
            if (extra := _drafts(timed)) is not None:
                record["extra"] = extra
            records.append(record)
    return records


def serve_llamacpp_closed_loop(gguf: Path, prompt_ids: Sequence[Sequence[int]], slots: int, max_new_tokens: int,
                               variants: Sequence[str], temperature: float = 0.0, threads: int | None = None,
                               log_dir: Path | None = None) -> list[dict[str, Any]]:
    """llama-server with ``slots`` slots in a closed loop over ``prompt_ids``: ``slots`` requests
    in flight, the next sent as soon as one answers, exactly ``max_new_tokens`` tokens each; one
    record per variant of :data:`SERVER_VARIANTS` (``system`` llama-server) with every request's
    own figures: its tokens/s (tokens ÷ its wall time from send to answer), time to first token
    (its wall time less llama.cpp's generation time: queueing and prefill) and inter-token latency
    (generation time ÷ the tokens after the first), from :func:`_ask`."""
    from specforge.peers.llama_server import ServerError
    from specforge.peers.llamacpp_tools import missing_reason

    system = "llama-server"
    reason = missing_reason("llama-server")
    if reason:
        return [_skipped(v, slots, reason, system) for v in variants]
    context = positions_needed(prompt_ids, max_new_tokens)
    records = []
    for variant in variants:
        log = None if log_dir is None else Path(log_dir) / f"llama-server-{variant}-r{slots}.log"
        try:
            with _server(gguf, slots, context, threads, SERVER_VARIANTS[variant], log) as server, \
                    ThreadPoolExecutor(slots) as pool:
                list(pool.map(lambda i: _ask(server, prompt_ids[i], 8), range(min(slots, len(prompt_ids)))))  # warm-up
                t0 = time.perf_counter()
                each = list(pool.map(lambda i: _ask(server, prompt_ids[i], max_new_tokens, temperature, seed=i),
                                     range(len(prompt_ids))))
                seconds = time.perf_counter() - t0
        except ServerError as exc:
            records.append(_skipped(variant, slots, str(exc), system))
            continue
        tokens = sum(e["tokens"] for e in each)
        records.append({"system": system, "variant": variant, "dtype": "llama.cpp", "concurrency": slots,
                        "status": "ok", "reason": None, "n_requests": len(each), "new_tokens": tokens,
                        "wall_s": seconds, "tok_s": tokens / seconds,
                        "per_request_tok_s": sum(e["tokens"] / e["wall"] for e in each) / len(each),
                        "ttft_s_each": [e["ttft"] for e in each], "itl_s_each": [e["itl"] for e in each],
                        "extra": _drafts(each)})
    return records


def _server(gguf: Path, slots: int, context: int, threads: int | None, flags: Sequence[str], log: Path | None) -> Any:
    """llama-server with ``slots`` slots of ``context`` positions, flash attention as llama.cpp's
    default resolves it on a CPU, one unified KV cache, and a variant's ``flags``."""
    from specforge.peers.llama_server import LlamaServer

    return LlamaServer(gguf, slots=slots, context=context, threads=threads or torch.get_num_threads(),
                       extra=("-fa", "auto", "-kvu", *flags), log=log)


def _ask(server: Any, ids: Sequence[int], n: int, temperature: float = 0.0, seed: int = 0) -> dict[str, float]:
    """One completion of exactly ``n`` tokens and what it took: its tokens, wall time (send to
    answer), time to first token (the wall time less llama.cpp's generation time: queueing and
    prefill), inter-token latency (generation time ÷ the tokens after the first) and the draft
    tokens llama.cpp drafted and accepted for it."""
    t0 = time.perf_counter()
    reply = server.complete(ids, n, temperature=temperature, seed=seed)
    wall = time.perf_counter() - t0
    timings = reply.get("timings", {})
    tokens = int(reply["tokens_predicted"])
    generating = float(timings.get("predicted_ms", 0.0)) / 1e3
    return {"tokens": tokens, "wall": wall, "ttft": max(0.0, wall - generating),
            "itl": generating / (tokens - 1) if tokens > 1 else 0.0,
            "drafted": int(timings.get("draft_n", 0)), "accepted": int(timings.get("draft_n_accepted", 0))}


def _drafts(replies: Sequence[dict[str, float]]) -> dict[str, Any] | None:
    """The draft tokens drafted and accepted over ``replies`` (:func:`_ask`); None where none were drafted."""
    drafted, accepted = sum(r["drafted"] for r in replies), sum(r["accepted"] for r in replies)
    return {"drafted": drafted, "accepted": accepted, "acceptance_rate": round(accepted / drafted, 4)} if drafted \
        else None

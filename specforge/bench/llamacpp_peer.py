"""llama.cpp decoding a GGUF its own way: the peer ``bench engine --systems llamacpp`` measures.

Through the binding specforge builds (llama-cpp-python's ``Llama``): one request at a time, plain
greedy decoding and its prompt-lookup speculation (``LlamaPromptLookupDecoding``: draft the tokens
that followed the last n-gram's earlier occurrence, verify them in one pass).  Those are what the
binding can drive; llama.cpp's parallel decoding and its other speculative modes live in its own
programs (``make llama.cpp``).  Records share :mod:`specforge.bench.hf_baseline`'s format.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specforge.bench.hf_baseline import rounds_for, summarize

__all__ = ["LLAMACPP_VARIANTS", "bench_llamacpp"]

# variant -> the binding's draft model (None: plain decoding)
LLAMACPP_VARIANTS = {"plain": None, "lookup": {"max_ngram_size": 3, "num_pred_tokens": 5}}


def _skipped(variant: str, concurrency: int, reason: str) -> dict[str, Any]:
    return {"system": "llamacpp", "variant": variant, "dtype": "llama.cpp", "concurrency": concurrency,
            "status": "skipped", "reason": reason, "tok_s": None}


def bench_llamacpp(gguf: Path, prompt_ids: Sequence[Sequence[int]], concurrencies: Sequence[int],
                   max_new_tokens: int = 128, min_rounds: int = 2, progress: bool = True,
                   threads: int | None = None) -> list[dict[str, Any]]:
    """Greedy decoding of every prompt for exactly ``max_new_tokens`` tokens by llama.cpp, each
    variant of :data:`LLAMACPP_VARIANTS` at concurrency 1 (higher ones: skipped, with why)."""
    from tqdm.auto import tqdm

    from specforge.llamacpp.binding import BindingError, load

    try:
        load()
    except BindingError as exc:
        return [_skipped(v, c, str(exc)) for c in concurrencies for v in LLAMACPP_VARIANTS]
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    records = []
    context = max(len(p) for p in prompt_ids) + max_new_tokens + 16
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
                                  draft_model=None if draft is None else LlamaPromptLookupDecoding(**draft))

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

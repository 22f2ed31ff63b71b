"""The dtype of the KV cache (and of the attention that reads it), chosen by measuring this CPU.

A bf16 model's keys and values are stored in bf16 by default — half the bytes of float32.  But
how fast torch's CPU SDPA reads them depends on the machine: on a Xeon with AMX the bf16 flash
kernel is fast, while on an EPYC with AVX512-BF16 and no AMX a *decode* row (one query over a
long context) runs 4–10x slower in bf16 than in float32 (SmolLM2's heads, 1 thread: 958 against
159 µs over 1,024 keys; verify rows and prefills cost the same in both), and decode attention
was 43 % of a plain decoding step at 16 requests there.  Guessing from CPU flags would tune a
default on one kind of machine, so ``"auto"`` times the two on the model's own head shapes once
per process (a few ms) and keeps the model's dtype unless float32 is clearly faster.

Only the attention's inputs change dtype: q/k/v are projected in the model's dtype, written to a
float32 cache, and the attention output is rounded back (see ``Transformer.attention``).  In
float32 the attention is at least as precise, so the target's law only moves by rounding.
docs: docs/engine.md#kv-cache-dtype
"""

from __future__ import annotations

from functools import lru_cache
from typing import get_args

import torch
import torch.nn.functional as F

from specforge.config import KVDtype
from specforge.runtime.timing import interleaved_seconds

__all__ = ["KV_DTYPES", "KVDtype", "decode_attention_seconds", "resolve_kv_dtype"]

KV_DTYPES: tuple[str, ...] = get_args(KVDtype)

# float32 doubles the cache's bytes; take it only for a clear win (AMD EPYC: ~5x; a near tie is
# noise on 2 shared cores, and then the smaller cache is the better choice).
_CLEAR_WIN = 1.5
_KEYS = 1024  # a typical decode context (ShareGPT first turns run 100-2,000 tokens)


def decode_attention_seconds(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                             keys: int = _KEYS, reps: int = 12) -> dict[torch.dtype, float]:
    """Seconds of one decode row's SDPA over ``keys`` cached keys in ``dtype`` and in float32,
    timed interleaved (:func:`~specforge.runtime.timing.interleaved_seconds`)."""
    gen = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=gen) for name, shape in
            (("q", (1, heads, 1, head_dim)), ("k", (1, kv_heads, keys, head_dim)), ("v", (1, kv_heads, keys, head_dim)))}
    arms = {dt: {n: t.to(dt) for n, t in base.items()} for dt in dict.fromkeys((dtype, torch.float32))}
    gqa = heads != kv_heads
    return interleaved_seconds(
        {dt: (lambda t=t: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], enable_gqa=gqa)) for dt, t in arms.items()},
        reps)


@lru_cache(maxsize=None)
def _measured_choice(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, threads: int) -> torch.dtype:
    seconds = decode_attention_seconds(dtype, heads, kv_heads, head_dim)
    return torch.float32 if seconds[dtype] > _CLEAR_WIN * seconds[torch.float32] else dtype


def resolve_kv_dtype(choice: str, model_dtype: torch.dtype, device: torch.device | str,
                     heads: int, kv_heads: int, head_dim: int) -> torch.dtype:
    """The cache dtype for ``choice`` (``"auto"``, ``"model"`` or ``"float32"``).

    ``"auto"`` on a CPU with a reduced-precision model measures (once per process and shape);
    on CUDA it is the model's dtype (the Triton kernel reads bf16 at full speed), and a float32
    model's cache is float32 whatever is asked.
    """
    if choice not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {choice!r}")
    if model_dtype == torch.float32 or choice == "model":
        return model_dtype
    if choice == "float32":
        return torch.float32
    if torch.device(device).type != "cpu":
        return model_dtype
    return _measured_choice(model_dtype, heads, kv_heads, head_dim, torch.get_num_threads())

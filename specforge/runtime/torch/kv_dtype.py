"""The dtype of the KV cache and the kernel of decode attention, chosen by measuring this CPU.

A bf16 model's keys and values are stored in bf16 by default — half the bytes of float32.  But
how fast torch's CPU SDPA reads them depends on the machine: on a Xeon with AMX the bf16 flash
kernel is fast, while on an EPYC with AVX512-BF16 and no AMX a *decode* row (one query over a
long context) runs 4–10x slower in bf16 than in float32 (SmolLM2's heads, 1 thread: 958 against
159 µs over 1,024 keys; verify rows and prefills cost the same in both).  There the same rows as
two oneDNN matmuls (:func:`~specforge_kernels.planned_attention.decode_rows`) run at the CPU's
bf16 speed over half the bytes — at 64 requests attention was 53 % of a plain step with the
float32 cache.  Guessing from CPU flags would tune a default on one kind of machine, so
``"auto"`` times three arms — float32 SDPA, SDPA and the matmuls in the model's dtype — on the
model's own head shapes at a batched decode, once per machine (cached with the other profiles).

Only the attention's inputs change dtype: q/k/v are projected in the model's dtype, written to a
float32 cache, and the attention output is rounded back (see ``Transformer.attention``).  In
float32 the attention is at least as precise, so the target's law only moves by rounding; the
matmul kernel rounds the scores to the cache's dtype once (its docstring).
docs: docs/engine.md#kv-cache-dtype
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import get_args

import torch
import torch.nn.functional as F

from specforge.config import KVDtype
from specforge.runtime.timing import interleaved_seconds
from specforge_kernels.planned_attention import decode_rows

__all__ = ["KV_DTYPES", "DecodeAttention", "KVDtype", "decode_attention", "decode_attention_seconds",
           "resolve_kv_dtype"]

KV_DTYPES: tuple[str, ...] = get_args(KVDtype)

# float32 doubles the cache's bytes; take it only for a clear win (AMD EPYC: ~5x; a near tie is
# noise on 2 shared cores, and then the smaller cache is the better choice).  The matmul kernel
# rounds the scores once more than SDPA: take it only when clearly faster too.
_CLEAR_WIN = 1.5
_MATMUL_WIN = 1.2
# A batched decode as the torch backend serves it (single users go to llama.cpp where it is
# faster, see specforge.runtime.choice): 16 rows over 1,024 keys each — in float32 25 MB of K/V
# per layer, past the caches, as a real step streams them.
_ROWS, _KEYS = 16, 1024
ARMS = ("float32", "model", "model+matmul")


@dataclass(frozen=True)
class DecodeAttention:
    """The cache's dtype and whether decode rows go through :func:`decode_rows` (two matmuls)
    instead of SDPA."""

    dtype: torch.dtype
    matmul: bool = False


def decode_attention_seconds(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, rows: int = _ROWS,
                             keys: int = _KEYS, reps: int = 8) -> dict[str, float]:
    """Seconds of ``rows`` decode rows over ``keys`` cached keys each, for every arm of :data:`ARMS`
    (float32 SDPA, SDPA and :func:`decode_rows` in ``dtype``), timed interleaved
    (:func:`~specforge.runtime.timing.interleaved_seconds`)."""
    gen = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=gen) for name, shape in
            (("q", (rows, heads, 1, head_dim)), ("k", (rows, kv_heads, keys, head_dim)),
             ("v", (rows, kv_heads, keys, head_dim)))}
    half = {n: t.to(dtype) for n, t in base.items()}
    gqa = heads != kv_heads
    scale = head_dim ** -0.5

    def sdpa(t: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], scale=scale, enable_gqa=gqa)

    return interleaved_seconds({"float32": lambda: sdpa(base), "model": lambda: sdpa(half),
                                "model+matmul": lambda: decode_rows(half["q"][:, :, 0], half["k"], half["v"], None, scale)},
                               reps)


def _choose(seconds: dict[str, float], dtype: torch.dtype) -> DecodeAttention:
    matmul = seconds["model+matmul"] * _MATMUL_WIN < seconds["model"]
    best = seconds["model+matmul"] if matmul else seconds["model"]
    if best > _CLEAR_WIN * seconds["float32"]:
        return DecodeAttention(torch.float32)
    return DecodeAttention(dtype, matmul)


@lru_cache(maxsize=None)
def _measured_choice(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, threads: int) -> DecodeAttention:
    from specforge.caches import profile_file
    from specforge.machine import machine_key
    from specforge.runtime.measured import cached_choice

    key = machine_key(what="decode-attention", dtype=str(dtype), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      rows=_ROWS, keys=_KEYS)
    seconds, _ = cached_choice(profile_file("attention", key, "decode"),
                               lambda: decode_attention_seconds(dtype, heads, kv_heads, head_dim),
                               lambda record: {arm: float(record["seconds"][arm]) for arm in ARMS},
                               lambda measured: {"seconds": measured, "rows": _ROWS, "keys": _KEYS})
    return _choose(seconds, dtype)


def decode_attention(choice: str, model_dtype: torch.dtype, device: torch.device | str,
                     heads: int, kv_heads: int, head_dim: int) -> DecodeAttention:
    """The cache dtype and decode kernel for ``choice`` (``"auto"``, ``"model"`` or ``"float32"``).

    ``"auto"`` on a CPU with a reduced-precision model measures (once per machine and shape,
    cached with the other profiles); on CUDA it is the model's dtype (the Triton kernel reads bf16
    at full speed), and a float32 model's cache is float32 whatever is asked.  Forced choices keep
    SDPA.
    """
    if choice not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {choice!r}")
    if model_dtype == torch.float32 or choice == "model":
        return DecodeAttention(model_dtype)
    if choice == "float32":
        return DecodeAttention(torch.float32)
    if torch.device(device).type != "cpu":
        return DecodeAttention(model_dtype)
    return _measured_choice(model_dtype, heads, kv_heads, head_dim, torch.get_num_threads())


def resolve_kv_dtype(choice: str, model_dtype: torch.dtype, device: torch.device | str,
                     heads: int, kv_heads: int, head_dim: int) -> torch.dtype:
    """The cache dtype of :func:`decode_attention`."""
    return decode_attention(choice, model_dtype, device, heads, kv_heads, head_dim).dtype

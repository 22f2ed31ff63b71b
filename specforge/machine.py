"""What machine this is: every benchmark records it beside its numbers, and every measured choice
(the step curve, the target's precision, the KV cache's dtype) is cached under a key made from it.

bf16 matmuls and attention behave differently on a Xeon with AMX, an EPYC with AVX512-BF16 and no
AMX, and an EPYC with AVX2 only (there a bf16 linear runs ~5x slower than float32), so a number
without the CPU it was measured on cannot be compared with another.  ``cpu_capability`` is what
torch's kernels actually dispatch to: ``ATEN_CPU_CAPABILITY=avx2`` lowers it on a bigger CPU, and a
choice measured under it is keyed apart from one measured without.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = ["GiB", "cpu_times", "machine", "machine_key", "machine_line", "memory_available", "native_float16",
           "others_share", "peak_resident"]

_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
    return model, flags


def _capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # an old torch
        return "unknown"


def machine() -> dict[str, Any]:
    """CPU model (as ``lscpu`` names it), the bf16/fp16-relevant CPU flags, the capability torch's
    kernels run at, the oneDNN ISA cap if one is set, cores, threads and torch."""
    model, flags = _cpuinfo()
    record = {"cpu": model, "flags": [f for f in _FLAGS if f in flags], "cpu_capability": _capability(),
              "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        record["onednn_max_cpu_isa"] = os.environ["ONEDNN_MAX_CPU_ISA"]
    return record


def machine_line(record: dict[str, Any] | None = None) -> str:
    """One line for a benchmark's output: ``machine: AMD EPYC · flags avx2 · torch kernels AVX2 ·
    2 threads · torch 2.13.0``."""
    m = record or machine()
    isa = f" · oneDNN ISA ≤ {m['onednn_max_cpu_isa']}" if m.get("onednn_max_cpu_isa") else ""
    return (f"machine: {m['cpu']} · flags {' '.join(m['flags']) or 'none of ' + ' '.join(_FLAGS)} · torch kernels "
            f"{m.get('cpu_capability', 'unknown')}{isa} · {m['torch_threads']} threads · torch {m['torch']}")


def machine_key(**what: Any) -> str:
    """A short hash of ``what`` together with this machine (CPU, flags, capability, threads,
    torch): the cache key of a choice measured here."""
    m = machine()
    key = {**what, "cpu": m["cpu"], "flags": m["flags"], "capability": m["cpu_capability"],
           "isa": m.get("onednn_max_cpu_isa", ""), "threads": m["torch_threads"], "torch": m["torch"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def native_float16() -> bool:
    """Whether this CPU does float16 arithmetic natively (AVX512-FP16 or AMX-FP16, and torch's
    kernels dispatching at AVX-512).  Elsewhere torch computes float16 by widening every value,
    which is never faster than float32 and rounds like a narrower type."""
    _, flags = _cpuinfo()
    return _capability().upper().startswith("AVX512") and bool({"avx512_fp16", "amx_fp16"} & flags)


GiB = 1 << 30


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``Key:  N kB`` field of a Linux /proc file, in bytes; None where there is none."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return None


def memory_available() -> int | None:
    """Bytes the kernel says can still be allocated without swapping (Linux's ``MemAvailable``);
    None where it does not say."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _release_free_heap() -> None:
    """Hand the pages malloc keeps after ``free`` back to the kernel (glibc's ``malloc_trim``).
    Without it work that follows reuses pages already resident and a peak measured over it reads
    low: in a long process (a test session) a training step's probe grew the peak by nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, the peak reads as it is
        pass


def peak_resident(reset: bool = False) -> int | None:
    """This process's peak resident bytes since the last reset (``reset``: give free heap back to
    the kernel, then start a new peak at the current size; Linux's ``VmHWM``); None where the
    kernel does not offer it."""
    if reset:
        _release_free_heap()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size (proc(5))
        except OSError:
            return None
    return _proc_bytes("/proc/self/status", "VmHWM")


def cpu_times() -> tuple[float, float, float] | None:
    """``(busy, total, own)`` CPU seconds so far: of all this machine's CPUs (Linux's
    ``/proc/stat``, steal counted busy: the hypervisor gave the time to someone else) and of this
    process's threads; None where the kernel does not say."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    own = os.times()
    return (total - idle) / tick, total / tick, own.user + own.system


def others_share(before: tuple[float, float, float] | None, after: tuple[float, float, float] | None) -> float | None:
    """The share of the machine's CPU time (all CPUs) that other processes took between two
    :func:`cpu_times`: 0 on a quiet machine, 0.5 when one of two cores ran someone else's work."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return min(1.0, max(0.0, others / (after[1] - before[1])))

"""What machine a benchmark ran on: every benchmark records it beside its numbers.

bf16 matmuls and attention behave differently on a Xeon with AMX and on an EPYC with AVX512-BF16
and no AMX, so a number without the CPU it was measured on cannot be compared with another.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["machine"]

_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def machine() -> dict[str, Any]:
    """CPU model (as ``lscpu`` names it), the bf16-relevant CPU flags, cores, threads and torch."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"cpu": model, "flags": [f for f in _FLAGS if f in flags], "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}

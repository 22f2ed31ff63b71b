"""Build the llama.cpp binding once per CPU, keep the wheel, install it from there.

``llama-cpp-python`` is published as a source distribution only: pip compiles its vendored
llama.cpp with cmake (about five minutes on two cores).  The build targets the CPU it runs on
(``GGML_NATIVE``: -march=native), so a wheel built on an AVX-512 machine would crash with SIGILL on
an AVX2-only one.  The wheel is therefore cached under a key made from the CPU's instruction-set
flags (:func:`cpu_key`) and reused only on a CPU with the same flags; the environment it was
installed into records that key (:data:`KEY_FILE`), so a virtual environment carried to another CPU
is refused at load time (:mod:`specforge.runtime.llamacpp.libllama`) rather than crashing.

Run by ``make install`` as ``python -m specforge.runtime.llamacpp.build``; idempotent.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["BINDING", "KEY_FILE", "cpu_flags", "cpu_key", "ensure_binding", "installed_key", "tools_dir", "wheel_dir"]

#: The binding specforge builds and is tested with: its vendored llama.cpp exports the layer-input
#: API (``llama_set_embeddings_layer_inp``) the backend reads taps through.
BINDING = "llama-cpp-python==0.3.36"
#: Where an environment records the CPU key its binding was built for (under ``sys.prefix``).
KEY_FILE = ".llama-cpp-cpu-key"
# The flags that decide which instructions a -march=native build may emit (x86 and Arm).
_ISA = re.compile(r"^(sse|ssse|avx|fma|f16c|bmi|amx|popcnt|movbe|aes|pclmul|sha|gfni|vaes|vpclmul|lzcnt|abm|"
                  r"adx|xsave|asimd|sve|i8mm|bf16|dotprod|fphp|asimdhp)")


def cpu_flags() -> tuple[str, ...]:
    """The instruction-set flags of this CPU, sorted (from /proc/cpuinfo; empty where it has none)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags.update(f for f in value.split() if _ISA.match(f))
    return tuple(sorted(flags))


def cpu_key() -> str:
    """A short hash of the architecture, the instruction-set flags and the binding's version:
    a native build is reused only where all three match."""
    text = "|".join((platform.machine(), BINDING, *cpu_flags()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def wheel_dir(root: Path | None = None) -> Path:
    """Where this CPU's wheel is kept: ``$SPECFORGE_CACHE_DIR/wheels/llama-cpp-<key>``."""
    from specforge.caches import cache_root

    return (root or cache_root()) / "wheels" / f"llama-cpp-{cpu_key()}"


def tools_dir(root: Path | None = None) -> Path:
    """Where ``make llama.cpp`` (``scripts/build-llama-cpp-tools.sh``) puts llama.cpp's command-line
    tools for this CPU: ``$SPECFORGE_CACHE_DIR/llama-cpp-tools-<key>`` (the programs in ``bin/``)."""
    from specforge.caches import cache_root

    return (root or cache_root()) / f"llama-cpp-tools-{cpu_key()}"


def installed_key(prefix: str | None = None) -> str | None:
    """The CPU key the environment's binding was built for (None: not installed by specforge)."""
    path = Path(prefix or sys.prefix) / KEY_FILE
    return path.read_text().strip() if path.is_file() else None


def _log(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def _build(target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # Native ISA (the key above makes that safe); no tests or examples: the tools are `make llama.cpp`.
    env["CMAKE_ARGS"] = " ".join(filter(None, (env.get("CMAKE_ARGS", ""), "-DGGML_NATIVE=ON",
                                               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    _log(f"building {BINDING} for this CPU ({len(cpu_flags())} ISA flags, key {cpu_key()}); "
         "about 5 minutes on 2 cores, once per CPU kind")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                    "-w", str(target), BINDING], check=True, env=env)
    _log(f"built in {time.perf_counter() - start:.0f} s, cached in {target}")
    return next(target.glob("llama_cpp_python-*.whl"))


def ensure_binding() -> Path:
    """Install this CPU's binding into the running environment, building its wheel if no cached
    one matches; returns the wheel used."""
    key = cpu_key()
    target = wheel_dir()
    wheels = sorted(target.glob("llama_cpp_python-*.whl"))
    wheel = wheels[-1] if wheels else _build(target)
    if installed_key() == key:
        try:
            import llama_cpp  # noqa: F401

            _log(f"binding already installed for this CPU (key {key})")
            return wheel
        except ImportError:
            pass
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
                   check=True)
    # Its small pure-Python requirements (diskcache, jinja2, …) without letting pip touch numpy.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(wheel)], check=True)
    (Path(sys.prefix) / KEY_FILE).write_text(key + "\n")
    _log(f"installed {wheel.name} (key {key})")
    return wheel


if __name__ == "__main__":
    ensure_binding()

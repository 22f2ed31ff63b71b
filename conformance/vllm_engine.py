"""vLLM CPU as the black-box tier drives it: a persistent subprocess of the vLLM venv running
:mod:`specforge.peers.vllm_sampler` (a standalone script, run, never imported), which returns with
every token the log-probabilities of its law (:mod:`specforge_conformance.engines` lists the engines).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specforge import peers
from specforge_conformance.blackbox import EngineFault, Sampled

__all__ = ["VllmEngine"]

class VllmEngine:
    """vLLM CPU's offline API in a persistent subprocess of the vLLM venv, one per law mode: its
    raw log-probabilities (the target's law at T = 1, whatever it samples at) for arms that claim
    T = 1, its processed ones (after temperature: what it sampled from) for the others."""

    returns_laws = True
    SCRIPT = Path(peers.__file__).with_name("vllm_sampler.py")  # a standalone script: run, never imported

    def __init__(self, name: str, speculative_config: dict[str, Any] | None, logprobs: int = 20,
                 log: Path | None = None, start_timeout: float = 600.0) -> None:
        from specforge.peers.vllm_client import export_smollm2_hf, find_vllm_python

        self.name, self.spec, self.logprobs = name, speculative_config, logprobs
        self.python = find_vllm_python()  # VllmNotInstalled names the install command
        self.model = export_smollm2_hf()
        self.log, self.start_timeout = log, start_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    @property
    def command(self) -> str:
        return (f"{self.python} {self.SCRIPT.name} (vllm.LLM(model=SmolLM2 HF, speculative_config={self.spec}), "
                f"logprobs={self.logprobs})")

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs.values():
            _stop_group(proc)
        self.procs.clear()

    def _proc(self, mode: str) -> subprocess.Popen:
        if mode in self.procs:
            return self.procs[mode]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        err = open(self.log, "a") if self.log else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen([str(self.python), str(self.SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, start_new_session=True)
        self.procs[mode] = proc
        self._send(proc, {"model": str(self.model), "speculative_config": self.spec, "logprobs_mode": mode,
                          "max_logprobs": self.logprobs})
        return proc

    def _send(self, proc: subprocess.Popen, message: dict[str, Any]) -> dict[str, Any]:
        assert proc.stdin and proc.stdout
        try:
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            raise EngineFault(f"{self.name}: the vLLM process died ({exc}); log: {self.log}") from exc
        if not line:
            raise EngineFault(f"{self.name}: the vLLM process exited with {proc.poll()}; log: {self.log}")
        reply = json.loads(line)
        if reply.get("error"):
            raise EngineFault(f"{self.name}: {reply['error']}")
        return reply

    def tokenize(self, text: str) -> list[int]:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model), local_files_only=True)(
            text, add_special_tokens=False)["input_ids"]

    def sample(self, prompt: Sequence[int], n_tokens: int, temperature: float | Sequence[float],
               seeds: Sequence[int], progress: Callable[[int], None] | None = None,
               claimed: float | Sequence[float] | None = None) -> Sampled:
        served = [float(temperature)] * len(seeds) if isinstance(temperature, (int, float)) else list(temperature)
        claims = served if claimed is None else (
            [float(claimed)] * len(seeds) if isinstance(claimed, (int, float)) else list(claimed))
        if all(c == 1.0 for c in claims):
            mode = "raw_logprobs"
        elif claims == served:
            mode = "processed_logprobs"
        else:
            raise EngineFault(f"{self.name}: vLLM returns its law at T = 1 (raw) or at the served temperature "
                              f"(processed), not at {sorted(set(claims))}")
        proc = self._proc(mode)
        # one temperature per request (a mixed arm's differ within the batch vLLM runs)
        reply = self._send(proc, {"prompt": list(prompt), "max_tokens": n_tokens, "temperature": served,
                                  "seeds": list(seeds), "logprobs": self.logprobs})
        if progress:
            progress(len(seeds))
        return Sampled(reply["tokens"], reply.get("drafted"), reply.get("accepted"),
                       [[(ids, probs) for ids, probs in per] for per in reply["laws"]])


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop a subprocess and whatever it started (its own session): vLLM starts an engine core."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream:
            stream.close()


# --- the registry ---------------------------------------------------------------------------------

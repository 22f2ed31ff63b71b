"""``llama-server`` as a real process on the loopback: started, waited for, asked, stopped.

The benches measure llama.cpp's own parallel decoding (and its speculative modes) through it, the
way people serve a GGUF: ``-np N`` slots with continuous batching, requests over HTTP.  The process
is stopped when the ``with`` block ends, however it ends (an exception, Ctrl-C), and its log is kept
beside the caller's results for when it does not come up.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specforge.peers.llamacpp_tools import missing_reason, tool

__all__ = ["LlamaServer", "ServerError"]


class ServerError(RuntimeError):
    """llama-server did not start, or answered with an error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """``with LlamaServer(gguf, slots=8, context=…) as server: server.complete(ids, 128)``."""

    def __init__(self, gguf: Path, slots: int, context: int, threads: int, extra: Sequence[str] = (),
                 log: Path | None = None, start_timeout: float = 120.0) -> None:
        reason = missing_reason("llama-server")
        if reason:
            raise ServerError(reason)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # -c is the whole cache: `context` positions for each of the slots.
        self.args = [str(tool("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "-tb", str(threads),
                     "--no-webui", "--no-warmup", *extra]
        self.log = log
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        sink = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115 - closed in __exit__
        self._sink = sink
        self.process = subprocess.Popen(self.args, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.__exit__(None, None, None)
                raise ServerError(f"llama-server exited with {self.process.returncode} while starting"
                                  + (f" (log: {self.log})" if self.log else ""))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise ServerError(f"llama-server did not answer /health within {self.start_timeout:.0f} s")

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._sink is not subprocess.DEVNULL:
            self._sink.close()

    def post(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{path}: HTTP {exc.code}: {exc.read()[:300]!r}") from exc

    def complete(self, prompt_ids: Sequence[int], n_predict: int, temperature: float = 0.0, seed: int = 0,
                 ignore_eos: bool = True, **options: Any) -> dict[str, Any]:
        """One ``/completion`` of token ids with pure temperature sampling (top-k 0, top-p 1,
        min-p 0 unless ``options`` say otherwise); the response carries ``tokens``."""
        body = {"prompt": list(prompt_ids), "n_predict": n_predict, "temperature": temperature, "seed": seed,
                "top_k": 0, "top_p": 1.0, "min_p": 0.0, "ignore_eos": ignore_eos, "return_tokens": True,
                "cache_prompt": False, "stream": False, **options}
        return self.post("/completion", body)

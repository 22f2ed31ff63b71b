"""llama.cpp as a peer serving a DSpark or DFlash drafter trained here: ``llama-server``
(``make llama.cpp``) with one slot, the target GGUF and the drafter exported with ``specforge export
--to llama.cpp`` as its draft (``-md FILE --spec-type draft-dspark|draft-dflash``), requests over the
loopback.  Its acceptance statistic is llama.cpp's acceptance rate (``draft_n_accepted / draft_n`` of
each response, what ``llama-speculative-simple`` prints as ``accept``).  ``specforge bench
llamacpp-drafter`` runs it (:mod:`specforge.bench.peer_drafter`).
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

from specforge.engine.request import positions_needed
from specforge.errors import SpecforgeError
from specforge.peers.drafter_peer import PeerDrafterSettings, PeerRun
from specforge.peers.records import TEMPERATURE

__all__ = ["LLAMACPP_METHODS", "LlamaCppPeer", "server_flags"]

#: specforge drafter method -> llama.cpp's ``--spec-type``.
LLAMACPP_METHODS = {"dspark": "draft-dspark", "dflash": "draft-dflash"}


def server_flags(method: str, export: Path, gamma: int) -> tuple[str, ...]:
    """llama-server's flags that run ``export`` as the draft of ``method``: the whole trained block
    drafted each round (``--spec-draft-n-max`` γ; a shorter block changes what every slot computes,
    the block being bidirectional) and no confidence cut (``--spec-draft-p-min 0``)."""
    return ("-md", str(export), "--spec-type", LLAMACPP_METHODS[method], "--spec-draft-n-max", str(gamma),
            "--spec-draft-p-min", "0")


class LlamaCppPeer:
    """llama.cpp's ``llama-server`` with one slot, the target GGUF and the exported draft GGUF."""

    name = "llama.cpp"
    layout = "llama.cpp"
    methods = LLAMACPP_METHODS
    acceptance = "acceptance rate"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads
        self.pipeline_overrides = ("target.backend=llama.cpp",)

    def check(self) -> str:
        from specforge.peers.llamacpp_tools import missing_reason, tool

        reason = missing_reason("llama-server")
        if reason:
            raise SpecforgeError(reason)
        info = tool("llama-server").parent.parent / "BUILD_INFO"  # type: ignore[union-attr]
        return info.read_text().split(",")[0].strip() if info.is_file() else "llama-server"

    def export_path(self, method: str, out: Path) -> Path:
        return out / f"{method}.gguf"

    def run(self, export: Path, method: str, gamma: int, prompt_ids: list[list[int]],
            settings: PeerDrafterSettings, out: Path, progress: bool, target: str) -> PeerRun | dict[str, Any]:
        import torch
        from tqdm.auto import tqdm

        from specforge.peers.llama_server import LlamaServer, ServerError
        from specforge.model_files import resolve_model

        directory, name = resolve_model(target)  # a GGUF: the export refused any other target
        gguf = directory / name
        threads = self.threads or torch.get_num_threads()
        context = positions_needed(prompt_ids, settings.max_new_tokens)
        arms = {"plain": ("-fa", "auto"), method: ("-fa", "auto", *server_flags(method, export, gamma))}
        results: dict[str, Any] = {}
        commands = []
        for arm, flags in arms.items():
            log = out / f"llama-server-{arm}.log"
            try:
                with LlamaServer(gguf, slots=1, context=context, threads=threads, extra=flags, log=log,
                                 start_timeout=settings.timeout) as server:
                    commands.append(_command(server.args))
                    server.complete(prompt_ids[0], 8)  # warm-up, untimed
                    tokens, counts, seconds = [], [], 0.0
                    for ids in tqdm(prompt_ids, desc=f"llama-server {arm}", unit="prompt", disable=not progress,
                                    file=sys.stderr):
                        t0 = time.perf_counter()
                        reply = server.complete(ids, settings.max_new_tokens, temperature=TEMPERATURE)
                        seconds += time.perf_counter() - t0
                        tokens.append([int(t) for t in reply["tokens"]])
                        timings = reply.get("timings", {})
                        counts.append((int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))))
            except ServerError as exc:
                return {arm: str(exc)}
            results[arm] = (tokens, counts, sum(len(t) for t in tokens) / seconds)
        (plain, _, plain_rate), (spec, counts, spec_rate) = results["plain"], results[method]
        drafted, accepted = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if drafted == 0:
            return {method: "llama-server drafted no token with the drafter (its log: "
                            f"{out / f'llama-server-{method}.log'})"}
        return PeerRun(plain_tokens=plain, drafter_tokens=spec, plain_tok_s=plain_rate,
                       drafter_tok_s=spec_rate, acceptance=accepted / drafted, drafted=drafted, accepted=accepted,
                       per_prompt=counts, commands=commands)


def _command(args: list[str]) -> str:
    """The server's command line as one would type it (without this run's loopback port)."""
    kept, skip = [], False
    for a in args:
        if not skip and a not in ("--host", "--port"):
            kept.append(a)
        skip = a in ("--host", "--port")
    return shlex.join(kept)

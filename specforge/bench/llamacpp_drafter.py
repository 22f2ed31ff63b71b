"""``specforge bench llamacpp-drafter``: a DSpark or DFlash drafter trained here, run by llama.cpp
as its speculative draft, beside the same drafter in specforge's engine (docs/llama-cpp.md).

llama.cpp is a real client here: the drafter is written with ``specforge export --to llama.cpp``
and ``llama-server`` (``make llama.cpp``) loads the GGUF itself (``-md FILE --spec-type
draft-dspark|draft-dflash --spec-draft-n-max γ``), one slot, requests over the loopback.  The
checks — lossless in llama.cpp, the same acceptance, the speedups — are
:mod:`specforge.bench.peer_drafter`'s; the statistic compared is llama.cpp's acceptance rate (the
draft tokens it accepted over those it drafted, ``draft_n_accepted / draft_n`` of each response,
what ``llama-speculative-simple`` prints as ``accept``) against ours, per eval set too.

specforge's side runs on its llama.cpp target backend by default (``target.backend=llama.cpp``):
the same GGUF in the same library, so the two greedy paths, and the counts, differ only where a
row's logits depend on how many rows share the pass.  ``target.backend=torch`` compares against
the torch runtime instead.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from specforge.bench import peer_drafter as peer
from specforge.bench.peer_drafter import PeerDrafterSettings, PeerRun
from specforge.bench.runner import TEMPERATURE, Report, add_output_arguments, bench_command
from specforge.errors import SpecforgeError

__all__ = ["COMMAND", "LLAMACPP_METHODS", "LlamaCppPeer", "REPORT", "run_llamacpp_drafter", "server_flags"]

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
        from specforge.llamacpp.tools import missing_reason, tool

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

        from specforge.llamacpp.server import LlamaServer, ServerError
        from specforge.target.loading import resolve_model

        directory, name = resolve_model(target)  # a GGUF: the export refused any other target
        gguf = directory / name
        threads = self.threads or torch.get_num_threads()
        context = max(len(p) for p in prompt_ids) + settings.max_new_tokens + 16
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


def run_llamacpp_drafter(drafter_dir: str | Path, settings: PeerDrafterSettings, out: str | Path,
                         progress: bool = True) -> dict[str, Any]:
    """Export ``drafter_dir`` for llama.cpp under ``out``, decode with both systems, check them."""
    return peer.run_peer_drafter(LlamaCppPeer(), drafter_dir, settings, out, progress)


REPORT = Report("bench.json", peer.table, table_file="table.md")


def _arguments(p: argparse.ArgumentParser) -> None:
    peer.add_peer_arguments(p, PeerDrafterSettings())
    add_output_arguments(p, "runs/bench-llamacpp-drafter")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """run a DSpark or DFlash drafter trained here in llama.cpp (exported with `specforge export --to llama.cpp`)
    and compare it with specforge's engine

    Exports DRAFTER (a checkpoint directory or shipped:NAME) as GGUF, then decodes the same prompts
    greedily with llama-server (plain, and with the drafter as its speculative draft) and with
    specforge's engine on its llama.cpp target backend (plain and with the drafter).  Checks that
    llama.cpp's output with the drafter equals its plain output token for token and that its
    acceptance rate is within the tolerance of ours (also per eval set); reports both systems'
    speedups over their own plain decoding.  Needs llama.cpp's tools (`make llama.cpp`).  Exit
    status 1 when a check fails.
    """
    return run_llamacpp_drafter(args.drafter, peer.settings_from(args), args.out)


COMMAND = bench_command("llamacpp-drafter", _arguments, _measure, REPORT, passed=peer.passed)

"""vLLM's CPU build as a peer serving a drafter trained here: the drafter exported with ``specforge
export --to vllm`` and loaded by vLLM itself (``speculative_config={"method": …, "model": <folder>}``),
in its own venv and process (:mod:`specforge.peers.vllm_client`).  Its acceptance statistic is vLLM's mean
acceptance length (1 + accepted draft tokens per draft, from its own ``spec_decode`` counters).
``specforge bench vllm-drafter`` runs it (:mod:`specforge.bench.peer_drafter`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge.peers.drafter_peer import PeerDrafterSettings, PeerRun

__all__ = ["VLLM_METHODS", "VllmDrafterSettings", "VllmPeer"]

# One request of a few hundred tokens needs megabytes of KV cache; vLLM's CPU default here (4 GiB,
# vllm_runner) fails to start on a 24 GiB machine that is also training.  The caller's setting wins.
_KV_SPACE_GIB = "1"

#: specforge drafter method -> vLLM's ``speculative_config.method``.
VLLM_METHODS = {"eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash", "dspark": "dspark"}


@dataclass
class VllmDrafterSettings(PeerDrafterSettings):
    # float32 by default: in bfloat16 a verify pass over γ + 1 positions rounds differently from a
    # one-token step, so near-ties flip and even a drafter that is never accepted changes vLLM's
    # greedy output.
    dtype: str = "float32"


class VllmPeer:
    """vLLM's CPU build in its own venv and process (:mod:`specforge.peers.vllm_client`)."""

    name = "vLLM"
    layout = "vllm"
    methods = VLLM_METHODS
    acceptance = "mean acceptance length"

    def __init__(self, dtype: str = "float32") -> None:
        self.dtype = dtype
        # both targets in one dtype, on the torch backend (vLLM runs the dequantized weights)
        self.pipeline_overrides = (f"target.dtype={dtype}", "target.backend=torch")

    def check(self) -> str:
        from specforge.peers.vllm_client import find_vllm_python, vllm_version

        return vllm_version(find_vllm_python())  # VllmNotInstalled says how to install it

    def export_path(self, method: str, out: Path) -> Path:
        return out / f"{method}-vllm"

    def run(self, export: Path, method: str, gamma: int, prompt_ids: list[list[int]],
            settings: PeerDrafterSettings, out: Path, progress: bool, target: str) -> PeerRun | dict[str, Any]:
        from specforge.acceptance import tau
        from specforge.peers.vllm_client import bench_vllm

        variants = [{"name": "plain"},
                    {"name": method, "speculative_config": {"method": VLLM_METHODS[method],
                                                            "model": str(export.resolve()),
                                                            "num_speculative_tokens": gamma}}]
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", _KV_SPACE_GIB)}
        records = {r["variant"]: r for r in bench_vllm(prompt_ids, [1], variants, settings.max_new_tokens,
                                                        min_rounds=1, warmup_tokens=8, dtype=self.dtype,
                                                        timeout=settings.timeout, keep_tokens=True,
                                                        progress=progress, log_dir=out / "vllm-logs", env=env)}
        failed = {v: r.get("reason") for v, r in records.items() if r.get("status") != "ok"}
        if failed:
            return failed
        tokens = {v: {o["prompt"]: o["tokens"] for o in r["outputs"]} for v, r in records.items()}
        counters = records[method]["extra"].get("spec_decode") or {}
        n = len(prompt_ids)
        return PeerRun(plain_tokens=[tokens["plain"][i] for i in range(n)],
                       drafter_tokens=[tokens[method][i] for i in range(n)],
                       plain_tok_s=records["plain"]["tok_s"], drafter_tok_s=records[method]["tok_s"],
                       acceptance=tau(counters.get("accepted_tokens", 0), counters.get("drafts", 0)),
                       drafted=counters.get("draft_tokens"), accepted=counters.get("accepted_tokens"),
                       extra={"spec_decode": counters, "startup_s": records[method]["extra"].get("startup_s")})

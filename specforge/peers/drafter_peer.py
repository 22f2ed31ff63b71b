"""A drafter trained here, served by an engine specforge does not own: what such a peer is asked
(:class:`PeerDrafterSettings`), what it returns (:class:`PeerRun`) and what it must do (:class:`Peer`).
One sibling module per peer implements it (:mod:`.vllm_drafter`, :mod:`.llamacpp_drafter`); the
measurement around them — specforge's own arms, the checks, the table — is
:mod:`specforge.bench.peer_drafter`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Peer", "PeerDrafterSettings", "PeerRun"]


@dataclass
class PeerDrafterSettings:
    """What to decode (the eval sets, prompts per set, tokens per prompt), the acceptance
    tolerance, and specforge's side (``overrides`` of its pipeline)."""

    datasets: Sequence[str] = ("gsm8k", "humaneval", "mt-bench")
    prompts: int = 4
    max_new_tokens: int = 128
    tolerance: float = 0.10
    trials: int = 2  # specforge's arms, interleaved; the fastest trial counts
    timeout: float = 1800.0  # seconds per peer variant, its start-up included
    eval_dir: str | None = None
    overrides: Sequence[str] = field(default_factory=tuple)  # pipeline key=value for specforge's side


@dataclass
class PeerRun:
    """What a peer measured: its tokens per prompt plain and with the drafter, its speeds, and its
    acceptance statistic (overall and, where it reports per request, per prompt)."""

    plain_tokens: list[list[int]]
    drafter_tokens: list[list[int]]
    plain_tok_s: float
    drafter_tok_s: float
    acceptance: float
    drafted: int | None = None
    accepted: int | None = None
    per_prompt: list[tuple[int, int]] | None = None  # (drafted, accepted) of each request, where reported
    commands: list[str] = field(default_factory=list)  # how to rerun what the peer ran
    extra: dict[str, Any] = field(default_factory=dict)


class Peer(Protocol):
    """An engine that serves exported drafters (vLLM, llama.cpp)."""

    name: str  # as tables print it
    layout: str  # ``specforge export --to`` of its files
    methods: dict[str, str]  # specforge drafter method -> the peer's name for it
    acceptance: str  # a key of ACCEPTANCE: the statistic the peer reports
    pipeline_overrides: tuple[str, ...]  # what specforge's side runs with, before the user's

    def check(self) -> str:
        """Raise (naming the install command) when the peer cannot run; its version."""

    def export_path(self, method: str, out: Path) -> Path:
        """Where the exported drafter goes under ``out``."""

    def run(self, export: Path, method: str, gamma: int, prompt_ids: list[list[int]],
            settings: PeerDrafterSettings, out: Path, progress: bool, target: str) -> PeerRun | dict[str, Any]:
        """Decode every prompt plainly and with the drafter, the target being ``target`` (the
        pipeline's ``target.model``); a dict says what failed instead."""

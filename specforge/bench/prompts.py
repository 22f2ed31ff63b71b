"""Benchmark prompts from the eval sets (SPEC §10): JSON lines ``{"turns": [...]}``.

Only the first turn of a conversation is used.  Selection is deterministic, so every system in a
benchmark run (HF ``generate``, the specforge engine, vLLM) sees the same prompts in the same
order:

* from one set, ``n`` rows spread evenly over the file (row ``floor(i * rows / n)``), so a small
  ``n`` still samples the whole set rather than its first few problems;
* from several sets, the per-set picks are interleaved round-robin (``a0 b0 a1 b1 ...``), so any
  batch of ``c`` consecutive prompts mixes the sets.

The eval directory is, in order: the ``eval_dir`` argument, ``$SPECFORGE_EVAL_DIR``, then
``shared/eval`` beside the repository checkout (where the project keeps its shared files; CI lays
a copy there too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_EVAL_DIR",
    "BenchPrompt",
    "PromptError",
    "apply_chat_template",
    "eval_dir",
    "list_datasets",
    "load_turns",
    "select_prompts",
]

# <checkout>/specforge/bench/prompts.py -> <checkout>/../shared/eval
DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[3] / "shared" / "eval"


class PromptError(ValueError):
    """A prompt file that is missing, empty or malformed (the message names the file and line)."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: the first turn of row ``index`` of ``dataset``."""

    dataset: str
    index: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def eval_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding ``<dataset>.jsonl`` files."""
    if path is not None:
        return Path(path)
    env = os.environ.get("SPECFORGE_EVAL_DIR")
    return Path(env) if env else DEFAULT_EVAL_DIR


def list_datasets(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Names of the ``*.jsonl`` sets in the eval directory, sorted."""
    d = eval_dir(directory)
    return sorted(p.stem for p in d.glob("*.jsonl"))


def _resolve(dataset: str | os.PathLike[str], directory: str | os.PathLike[str] | None) -> Path:
    p = Path(dataset)
    if p.suffix == ".jsonl" or p.is_file():
        return p
    return eval_dir(directory) / f"{dataset}.jsonl"


def load_turns(dataset: str | os.PathLike[str], directory: str | os.PathLike[str] | None = None) -> list[str]:
    """First turn of every row of a set, in file order.

    ``dataset`` is a set name (``humaneval``) looked up in the eval directory, or a path to a
    ``.jsonl`` file.  Blank lines are skipped.
    """
    path = _resolve(dataset, directory)
    if not path.is_file():
        known = ", ".join(list_datasets(directory)) or "none"
        raise PromptError(f"{path}: no such prompt file (sets in {eval_dir(directory)}: {known})")
    turns: list[str] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            t = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(t, list) or not t or not isinstance(t[0], str) or not t[0].strip():
                raise PromptError(f'{path}:{lineno}: expected {{"turns": ["<non-empty text>", ...]}}')
            turns.append(t[0])
    if not turns:
        raise PromptError(f"{path}: no prompts")
    return turns


def _spread(total: int, k: int) -> list[int]:
    """``k`` distinct row indices spread evenly over ``range(total)`` (``k <= total``)."""
    return [i * total // k for i in range(k)]


def select_prompts(
    datasets: str | Sequence[str],
    n: int,
    directory: str | os.PathLike[str] | None = None,
) -> list[BenchPrompt]:
    """``n`` prompts drawn deterministically from one or more sets (see the module docstring).

    The ``n`` prompts are split as evenly as possible over the sets, earlier sets taking the
    remainder.  A set smaller than its share is used whole and the shortfall goes to the others;
    asking for more prompts than all sets hold together is an error.
    """
    names = [datasets] if isinstance(datasets, str) else list(datasets)
    if not names:
        raise PromptError("no prompt sets given")
    if n < 1:
        raise PromptError(f"need at least one prompt, asked for {n}")
    rows = {name: load_turns(name, directory) for name in dict.fromkeys(names)}
    names = list(rows)
    total = sum(len(r) for r in rows.values())
    if n > total:
        raise PromptError(f"asked for {n} prompts but {', '.join(names)} hold only {total}")
    # Water-filling: give each set an equal share, capped at its size; redistribute the rest.
    share = dict.fromkeys(names, 0)
    left = n
    while left:
        open_ = [s for s in names if share[s] < len(rows[s])]
        base, extra = divmod(left, len(open_))
        for i, s in enumerate(open_):
            give = min(base + (1 if i < extra else 0), len(rows[s]) - share[s])
            share[s] += give
            left -= give
    picks = {
        s: [BenchPrompt(Path(s).stem, i, rows[s][i]) for i in _spread(len(rows[s]), share[s])]
        for s in names
    }
    out: list[BenchPrompt] = []
    for j in range(max(share.values())):
        out.extend(picks[s][j] for s in names if j < share[s])
    return out


def apply_chat_template(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as the single user turn of a chat, with the assistant prompt open.

    Falls back to plain tokenization when the tokenizer has no chat template.
    """
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        # transformers ≥ 5 may return a BatchEncoding / dict rather than a list
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]

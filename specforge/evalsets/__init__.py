"""The evaluation prompt sets and how prompts are drawn from them: JSON lines ``{"turns": [...]}``.

The five sets the paper evaluates on — ``gsm8k``, ``math500``, ``humaneval``, ``mbpp`` and
``mt-bench`` — ship inside this package (``SOURCES.md`` beside them gives their origin and
licences), so an installed specforge evaluates anywhere.  A set is named by its file stem; any
other JSONL file of the same shape is used by its path.

Only the first turn of a conversation is used.  Selection is deterministic, so every system in a
benchmark run (HF ``generate``, the specforge engine, vLLM) sees the same prompts in the same
order:

* from one set, ``n`` rows spread evenly over the file (row ``floor(i * rows / n)``), so a small
  ``n`` still samples the whole set rather than its first few problems;
* from several sets, the per-set picks are interleaved round-robin (``a0 b0 a1 b1 ...``), so any
  batch of ``c`` consecutive prompts mixes the sets.

Sets are looked up, in order, in the ``directory`` argument (``--eval-dir``),
``$SPECFORGE_EVAL_DIR``, then this package.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specforge.errors import SpecforgeError

if TYPE_CHECKING:  # importlib.resources.abc is Python ≥ 3.11
    from importlib.resources.abc import Traversable

__all__ = [
    "BenchPrompt",
    "PromptError",
    "apply_chat_template",
    "eval_dir",
    "list_datasets",
    "load_turns",
    "packaged_sets",
    "read_jsonl",
    "read_prompt_file",
    "select_prompts",
]


class PromptError(SpecforgeError, ValueError):
    """A prompt file that is missing, empty or malformed (the message names the file and line)."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: the first turn of row ``index`` of ``dataset``."""

    dataset: str
    index: int
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def packaged_sets() -> Traversable:
    """The folder of the shipped sets, inside the installed package (``importlib.resources``)."""
    return files(__name__)


def eval_dir(path: str | os.PathLike[str] | None = None) -> Traversable:
    """The folder holding ``<dataset>.jsonl`` files: ``path``, ``$SPECFORGE_EVAL_DIR`` or the package."""
    if path is not None:
        return Path(path)
    env = os.environ.get("SPECFORGE_EVAL_DIR")
    return Path(env) if env else packaged_sets()


def list_datasets(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Names of the ``*.jsonl`` sets in the eval folder, sorted."""
    d = eval_dir(directory)
    if not d.is_dir():
        return []
    return sorted(p.name.removesuffix(".jsonl") for p in d.iterdir() if p.name.endswith(".jsonl"))


def _resolve(dataset: str | os.PathLike[str], directory: str | os.PathLike[str] | None) -> Traversable:
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
        raise PromptError(f"{path}: no such prompt file (sets in {eval_dir(directory)}: {known}); "
                          "name one of those sets or give the path of a JSONL file of {\"turns\": [...]} rows")
    turns: list[str] = []
    for lineno, row in read_jsonl(path):
        t = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(t, list) or not t or not isinstance(t[0], str) or not t[0].strip():
            raise PromptError(f'{path}:{lineno}: expected {{"turns": ["<non-empty text>", ...]}}')
        turns.append(t[0])
    if not turns:
        raise PromptError(f"{path}: no prompts")
    return turns


def read_jsonl(path: Traversable) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSON-lines file; a line that is not
    JSON raises :class:`PromptError` naming the file and the line."""
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            yield lineno, row


def read_prompt_file(path: str | os.PathLike[str]) -> list[Any]:
    """The prompts of a JSONL file, one per line (``specforge generate --prompts``): the first of a
    row's ``turns``, its ``prompt`` (text) or its ``messages`` (a chat, as the target's template
    takes it)."""
    path = Path(path)
    prompts: list[Any] = []
    try:
        for lineno, row in read_jsonl(path):
            if isinstance(row, dict) and row.get("turns"):
                prompts.append(row["turns"][0])
            elif isinstance(row, dict) and ("prompt" in row or "messages" in row):
                prompts.append(row["prompt"] if "prompt" in row else row["messages"])
            else:
                raise PromptError(f"{path}:{lineno}: expected a 'turns', 'prompt' or 'messages' key")
    except OSError as exc:
        raise PromptError(f"{path}: {exc.strerror or exc}") from None
    if not prompts:
        raise PromptError(f"{path}: no prompts")
    return prompts


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

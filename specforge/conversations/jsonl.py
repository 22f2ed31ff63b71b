"""Conversations from a JSONL file: one JSON object a line, in any of the common prompt shapes.

Accepted lines (an optional ``"id"`` is kept; otherwise the id is ``<file stem>:<line number>``):

- ``{"turns": ["first user turn", "second user turn", ...]}`` — user turns only, as in the
  evaluation sets (mt-bench has two); the target answers each in turn.
- ``{"messages": [{"role": ..., "content": ...}, ...]}`` — chat messages (ShareGPT's
  ``{"from", "value"}`` turns are accepted too, also under ``"conversations"``).
- ``{"prompt": "..."}`` — a single user turn.

A file that was cut short while being written, or has a bad line in the middle, still gives all
of its good lines: each bad line is reported with its number and the reason, so a dataset that
lost records says so instead of failing outright or shrinking silently.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from specforge.conversations.chat import Conversation, normalize_message, take

__all__ = ["JsonlReport", "LineError", "iter_jsonl", "load_jsonl", "record_to_conversation"]


@dataclass(frozen=True)
class LineError:
    line: int  # 1-based, as an editor shows it
    error: str


@dataclass
class JsonlReport:
    path: str
    lines: int = 0  # non-blank lines read
    records: int = 0  # lines that became conversations
    errors: list[LineError] = field(default_factory=list)
    truncated: bool = False  # the last line has no newline and does not parse: the file was cut

    def summary(self) -> str:
        out = [f"{self.path}: {self.records:,} of {self.lines:,} lines kept"]
        out += [f"  line {e.line}: {e.error}" for e in self.errors[:20]]
        if len(self.errors) > 20:
            out.append(f"  ... and {len(self.errors) - 20} more bad lines")
        return "\n".join(out)


def record_to_conversation(record: Any, default_id: str) -> Conversation:
    """One JSONL object as a :class:`Conversation`; ValueError saying what is wrong otherwise."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a list of strings")
        messages = [{"role": "user", "content": t} for t in turns]
    elif "messages" in record or "conversations" in record:
        raw = record.get("messages", record.get("conversations"))
        if not isinstance(raw, list):
            raise ValueError("'messages' must be a list of messages")
        messages = [normalize_message(m) for m in raw]
    elif "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError("'prompt' must be a string")
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError(f"expected a 'turns', 'messages' or 'prompt' field; found {sorted(record)}")
    rid = record.get("id")
    conversation = Conversation(id=str(rid) if rid is not None else default_id, messages=messages)
    if not conversation.has_user_turn:
        raise ValueError("no user turn")
    return conversation


def iter_jsonl(path: str | os.PathLike, report: JsonlReport | None = None) -> Iterator[Conversation]:
    """Conversations of ``path`` in file order; bad lines go to ``report.errors`` and are skipped.

    A missing file raises at once (not at the first ``next``), so the error points at the call.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no JSONL file at {path}")
    if not path.is_file():
        raise IsADirectoryError(f"{path} is not a file (expected a .jsonl file)")
    report = report if report is not None else JsonlReport(path=str(path))
    report.path = str(path)
    return _iter_lines(path, report)


def _iter_lines(path: Path, report: JsonlReport) -> Iterator[Conversation]:
    with open(path, "rb") as fh:  # bytes, so one undecodable line does not stop the rest
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            report.lines += 1
            last_unterminated = not raw.endswith(b"\n")
            try:
                record = json.loads(raw.decode("utf-8"))
                conversation = record_to_conversation(record, f"{path.stem}:{number}")
            except UnicodeDecodeError as exc:
                report.errors.append(LineError(number, f"not UTF-8 ({exc.reason} at byte {exc.start})"))
                continue
            except json.JSONDecodeError as exc:
                # Only the final line can lack its newline; one that also fails to parse is what a
                # writer killed mid-line leaves behind.
                if last_unterminated:
                    report.truncated = True
                    message = f"truncated last line: {exc.msg} at column {exc.colno}"
                else:
                    message = f"invalid JSON: {exc.msg} at column {exc.colno}"
                report.errors.append(LineError(number, message))
                continue
            except ValueError as exc:
                report.errors.append(LineError(number, str(exc)))
                continue
            report.records += 1
            yield conversation


def load_jsonl(path: str | os.PathLike, limit: int | None = None) -> tuple[list[Conversation], JsonlReport]:
    """``(conversations, report)`` for ``path``, the first ``limit`` conversations when given."""
    report = JsonlReport(path=str(path))
    return take(iter_jsonl(path, report), limit), report

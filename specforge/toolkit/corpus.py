"""Token documents from conversations: the assistant turns of JSONL files, tokenised.

A drafter that searches what the target wrote elsewhere (``suffix``, docs/composition.md#suffix)
reads its corpus here, in the conversation format training reads (docs/data.md): a JSONL file,
or a directory of them — the regenerated answers of ``specforge train`` are one.  A file cut
short or with bad lines still gives its good lines, and says which it skipped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from specforge.conversations.jsonl import JsonlReport, iter_jsonl
from specforge.errors import SpecforgeError

__all__ = ["answer_documents"]


def answer_documents(paths: Sequence[str], encode: Callable[[str], list[int]], key: str = "corpus") -> list[list[int]]:
    """The token ids of every assistant turn in ``paths`` (JSONL files, or directories whose
    ``*.jsonl`` files are read in name order); ``key`` names the setting in errors."""
    files: list[Path] = []
    for i, name in enumerate(paths):
        path = Path(name)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise SpecforgeError(f"{key}.{i}: {name} holds no .jsonl file")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise SpecforgeError(f"{key}.{i}: no such file or directory {name!r}")
    documents = []
    for path in files:
        report = JsonlReport(path=str(path))
        for conversation in iter_jsonl(path, report):
            documents += [encode(m["content"]) for m in conversation.messages
                          if m["role"] == "assistant" and m["content"].strip()]
        if report.errors:
            warnings.warn(f"{key}: {report.summary()}", stacklevel=2)
    if not documents:
        raise SpecforgeError(f"{key}: no assistant turn in {', '.join(map(str, files))}")
    return documents

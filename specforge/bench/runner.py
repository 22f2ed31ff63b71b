"""What every ``specforge bench`` sub-command does around its measurement.

A bench module declares its sub-command with :func:`bench_command`: its options, a ``measure(args)``
returning the JSON-ready result, and its :class:`Report`.  The runner writes the result as one JSON
file (plus the plots and files of the report) under ``--out``, prints its table (or, with
``--json``, the JSON) and the machine line: a number without the CPU it was measured on cannot be
compared with another (:mod:`specforge.machine`).  A bench that outlives a session (``bench serving``) checkpoints an
unfinished result in the same file and a rerun with the same ``--out`` continues it, refused when
it was measured with other settings (:mod:`specforge.resume`).

Benches decode at :data:`TEMPERATURE` unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge.peers.records import TEMPERATURE
from specforge.commands import Subcommand
from specforge.files import write_atomic
from specforge.machine import machine_line
from specforge.resume import UnreadableRecord, read_record, write_record

__all__ = ["TEMPERATURE", "Report", "add_output_arguments", "add_temperature_argument", "aligned", "bench_command",
           "finish", "save", "unfinished"]

@dataclass(frozen=True)
class Report:
    """How a bench's result is kept and shown: its JSON file's name (fixed, or made from the
    result), the table printed (and, with ``table_file``, also written), and ``files``: further
    files made from the result (plots, reusable profiles), returning their paths."""

    json_name: str | Callable[[dict[str, Any]], str]
    table: Callable[[dict[str, Any]], str]
    table_file: str | None = None
    files: Callable[[dict[str, Any], Path], list[Path]] | None = None


def aligned(rows: list[list[str]]) -> str:
    """``rows`` (the header first) as right-aligned columns, a rule of dashes under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    text = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def save(report: Report, result: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``result`` under ``out`` as ``report`` says; the paths written, the JSON first."""
    out = Path(out)
    name = report.json_name(result) if callable(report.json_name) else report.json_name
    paths = [out / name]
    write_record(paths[0], result)
    if report.table_file:
        paths.append(out / report.table_file)
        write_atomic(paths[-1], report.table(result) + "\n")
    if report.files:
        paths += report.files(result, out)
    return paths


def finish(report: Report, result: dict[str, Any], out: str | Path, as_json: bool = False) -> list[Path]:
    """Save ``result``, then print its table (or its JSON), the machine it was measured on and the
    files written — the JSON alone on stdout with ``as_json``, so that tools can read it."""
    paths = save(report, result, out)
    print(json.dumps(result, indent=2, default=str) if as_json else report.table(result))
    print(machine_line(result.get("machine")), file=sys.stderr if as_json else sys.stdout)
    print(f"wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return paths


def bench_command(name: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                  measure: Callable[[argparse.Namespace], dict[str, Any] | None], report: Report, *,
                  out: Callable[[argparse.Namespace, dict[str, Any]], str | Path] = lambda args, result: args.out,
                  passed: Callable[[dict[str, Any]], bool] = lambda result: True) -> Subcommand:
    """``specforge bench NAME``: ``measure(args)`` (None when there is nothing to show), then
    :func:`finish` under ``out(args, result)`` (default ``--out``); exit status 1 when ``passed``
    says a check failed.  Its help and description are ``measure``'s docstring."""

    def run(args: argparse.Namespace) -> int:
        result = measure(args)
        if result is None:
            return 0
        finish(report, result, out(args, result), args.json)
        return 0 if passed(result) else 1

    return Subcommand.documented(name, add_arguments, run, measure.__doc__)


def unfinished(path: Path, error: Callable[[str], Exception]) -> dict[str, Any] | None:
    """The checkpoint an unfinished run (killed, or a session that ended) left at ``path`` — a
    result with ``complete: false`` — to resume; None when there is none or that run finished.
    An unreadable file raises ``error(why)``: it is not overwritten unasked."""
    try:
        previous = read_record(path)
    except UnreadableRecord as exc:
        raise error(f"{exc}; give another --out") from None
    return previous if previous is not None and previous.get("complete") is False else None


def add_output_arguments(p: argparse.ArgumentParser, out: str | None, help: str | None = None) -> None:
    """``--out DIR`` (default ``out``) and ``--json``, which every bench takes."""
    p.add_argument("--out", default=out, help=help or "output directory")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")


def add_temperature_argument(p: argparse.ArgumentParser) -> None:
    """``--temperature`` for the benches where a user may measure at another than :data:`TEMPERATURE`."""
    p.add_argument("--temperature", type=float, default=TEMPERATURE,
                   help=f"sampling temperature of every arm (default {TEMPERATURE:g}: greedy)")

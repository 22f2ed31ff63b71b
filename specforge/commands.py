"""How a sub-command reaches the ``specforge`` command line: one shape for every kind.

A sub-command is a name, a one-line help and a description, ``add_arguments(parser)`` declaring
its options on its own parser, and ``run(args)`` returning the exit status — the shape of a
plug-in's ``register(name, add_arguments, run, help=..., description=...)``
(:func:`~specforge.hookspecs.specforge_register_commands`).  The module that implements a command
declares it as a :class:`Subcommand` beside its code (each bench its ``COMMAND``), its help and
description taken from the docstring of what runs it (:meth:`Subcommand.documented`), and
:func:`add_subcommand` adds it, or a plug-in's :class:`~specforge.plugins.Command`, to a parser:
:mod:`specforge.cli` only wires them together.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Subcommand", "add_subcommand"]


@dataclass(frozen=True)
class Subcommand:
    """A sub-command (see the module docstring); ``description`` defaults to ``help``.  A group of
    sub-commands (``config``, ``bench``) has no ``run`` of its own: ``add_arguments`` adds its
    members, and the one named on the command line runs."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int] | None
    help: str
    description: str | None = None

    @classmethod
    def documented(cls, name: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], int], doc: str | None = None) -> Subcommand:
        """The command whose help is the first paragraph of ``doc`` (default: ``run``'s docstring)
        and whose description is the rest: what ``specforge NAME --help`` says is written once,
        where the command is."""
        first, *rest = inspect.cleandoc(doc or run.__doc__ or "").split("\n\n")
        description = "  ".join(" ".join(paragraph.split()) for paragraph in rest)
        return cls(name, add_arguments, run, " ".join(first.split()), description or None)


def add_subcommand(sub: Any, command: Any) -> argparse.ArgumentParser:
    """Add ``command`` (a :class:`Subcommand` or anything of its fields) to the sub-parsers
    ``sub``: its parser, then its options, so that ``args.func`` is its ``run``."""
    parser = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
    if command.run is not None:
        parser.set_defaults(func=command.run)
    command.add_arguments(parser)
    return parser

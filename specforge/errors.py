"""The one base class of the failures a user can act on.

A :class:`SpecforgeError` says what failed, on which file or key, and what to do about it, in its
message.  The command line prints that message on one line (``error: …``) and exits with status
2 instead of showing a traceback; anything else that escapes is a bug and keeps its traceback.
Each module raises its own subclass (``ConfigError``, ``TargetLoadError``, ``PromptError``, …), so
callers can still catch the narrow kind.
"""

from __future__ import annotations

__all__ = ["ConfigError", "SectionError", "SpecforgeError"]


class SpecforgeError(Exception):
    """A failure caused by the input or the environment, explained by its message."""


class ConfigError(SpecforgeError, ValueError):
    """A pipeline config that cannot be used; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        where = f" ({source})" if source else ""
        super().__init__(f"invalid pipeline config{where}:\n" + "\n".join(f"  {p}" for p in problems))


class SectionError(ValueError):
    """Raised by a validator of a config section whose keys are checked against another model (a
    component's own config inside a training config, say): ``problems`` are ``(relative key
    path, message)`` pairs, reported under the section's path like any other key."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in problems))

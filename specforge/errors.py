"""The one base class of the failures a user can act on.

A :class:`SpecforgeError` says what failed, on which file or key, and what to do about it, in its
message.  The command line prints that message on one line (``error: …``) and exits with status
2 instead of showing a traceback; anything else that escapes is a bug and keeps its traceback.
Each module raises its own subclass (``ConfigError``, ``TargetLoadError``, ``PromptError``, …), so
callers can still catch the narrow kind.
"""

from __future__ import annotations

__all__ = ["SpecforgeError"]


class SpecforgeError(Exception):
    """A failure caused by the input or the environment, explained by its message."""

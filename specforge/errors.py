"""The one base class of the failures a user can act on.

A :class:`SpecforgeError` says what failed, on which file or key, and what to do about it, in its
message.  The command line prints that message on one line (``error: …``) and exits with status
2 instead of showing a traceback; anything else that escapes is a bug and keeps its traceback.
Each module raises its own subclass (``ConfigError``, ``TargetLoadError``, ``PromptError``, …), so
callers can still catch the narrow kind.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "SectionError", "SpecforgeError", "validation_problems"]


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


def _fields_at(model: type[BaseModel], path: Sequence[str]) -> list[str]:
    """The fields of the (sub)model a dotted error path points into."""
    for key in path:
        field = model.model_fields.get(key)
        sub = getattr(field, "annotation", None) if field else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            break
        model = sub
    return list(model.model_fields)


def validation_problems(exc: ValidationError, model: type[BaseModel], prefix: Sequence[str] = (), *,
                        named: bool = False, owner: str = "") -> list[str]:
    """One line per pydantic error of ``model`` validated under the key path ``prefix``: the dotted
    key path, and for an unknown key the keys valid at that level (``name`` first when the section
    is a component's, ``named``).  A validator's :class:`SectionError` reports its own keys."""
    problems = []
    for err in exc.errors():
        loc = [*prefix, *map(str, err["loc"])]
        path = ".".join(loc) or "(top level)"
        nested = (err.get("ctx") or {}).get("error")
        if isinstance(nested, SectionError):  # a sub-section checked against its own model
            problems += [f"{'.'.join([*loc, key]) if key else path}: {msg}" for key, msg in nested.problems]
        elif err["type"] == "extra_forbidden":
            inner = [str(x) for x in err["loc"]][:-1]
            valid = _fields_at(model, inner)
            if named and not inner:
                valid = ["name", *valid]
            problems.append(f"{path}: unknown key{owner}; valid keys: {', '.join(valid)}")
        elif err["type"] == "missing":
            problems.append(f"{path}: required key is missing")
        else:
            problems.append(f"{path}: {err['msg']} (got {err.get('input')!r})")
    return problems

"""Components made of other registered components: resolving the members a config names.

A composed component (the ``compose`` drafter, docs/composition.md) lists other registered
components in its config, each as ``{name: <registered name>, ...its own params}``.  Its config
model resolves them against the plug-in host that is validating the pipeline: the host hands
itself to every component's config model as the pydantic validation context ``{"host": host}``
(:meth:`specforge.registry.Registration.create`, :func:`specforge.config.validate_pipeline`), so a
third party's drafter can be a member exactly like a shipped one.  Outside a host — a
registration's examples are validated while the plug-ins are still registering — only the shape
of a member is checked; the component resolves it when the host builds it.

A member's problems are :class:`~specforge.errors.SectionError` pairs keyed below the member
(``members.1.name``, ``members.0.gamma``), so the pipeline's error names the full key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError, ValidationInfo

from specforge.errors import SectionError, validation_problems

__all__ = ["Member", "keyed_problems", "resolve_member", "validation_host"]


@dataclass(frozen=True)
class Member:
    """A resolved member: the registration it names, its validated params and the host that
    resolved it (its own members, if any, resolve against the same one)."""

    kind: str
    name: str
    registration: Any
    params: BaseModel
    host: Any

    def create(self) -> Any:
        return self.registration.create(self.params, host=self.host)


def validation_host(info: ValidationInfo) -> Any | None:
    """The plug-in host validating this config, or ``None`` outside one."""
    context = info.context if isinstance(info.context, dict) else None
    return None if context is None else context.get("host")


def resolve_member(host: Any, kind: str, raw: Any, key: str, label: str | None = None) -> Member:
    """``raw`` (``{name: ..., ...params}`` or a bare name) as a registered component of ``kind``
    (a pipeline slot: ``"drafter"``, ``"confidence"``, …), its params validated by its own model.

    Raises :class:`SectionError` with every problem keyed below ``key`` (``members.1``)."""
    label = label or kind.replace("_", " ")
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise SectionError([(key, f"expected a mapping {{name: ..., ...params}} or a name, got {raw!r}")])
    params = dict(raw)
    name = params.pop("name", None)
    names = host.names(kind)
    if name is None:
        raise SectionError([(f"{key}.name", f"required key is missing; registered {label}s: {', '.join(names)}")])
    if name not in names:
        raise SectionError([(f"{key}.name", f"unknown {label} {name!r}; registered {label}s: {', '.join(names)}")])
    registration = host.get(kind, name)
    try:
        validated = registration.config.model_validate(params, context={"host": host})
    except ValidationError as exc:
        raise SectionError(keyed_problems(exc, registration.config, key, owner=f" for {label} {name!r}")) from None
    return Member(kind, name, registration, validated, host)


def keyed_problems(exc: ValidationError, model: type[BaseModel], key: str, owner: str = "") -> list[tuple[str, str]]:
    """``model``'s validation problems as :class:`SectionError` pairs keyed below ``key``
    (``gamma: must be ≥ 1`` under ``members.0`` → ``("members.0.gamma", "must be ≥ 1")``)."""
    pairs = []
    for line in validation_problems(exc, model, [], named=True, owner=owner):
        path, _, message = line.partition(": ")
        pairs.append((key if path == "(top level)" else f"{key}.{path}", message))
    return pairs

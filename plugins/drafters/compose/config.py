"""The ``compose`` drafter's config: its mode and its members (docs/composition.md).

A member is any registered drafter, written as in a pipeline's ``drafter`` slot, plus two keys
of the composition's own:

* ``confidence`` — a registered confidence estimator run on that member's proposals (``{name:
  ..., ...params}`` or a name).  Leave it out for a member that reports a confidence itself
  (``DraftBlock.confidence``, e.g. ``ngram``'s match length);
* ``threshold`` — cascade only: the member's proposal for a request is taken when the confidence
  of its first token reaches this; else the next member drafts for that request.  The last
  member's proposal is always taken (its threshold must be left out).

The members resolve against the plug-in host that validates the pipeline
(:mod:`specforge.toolkit.members`), so a third party's drafter is a member like a shipped one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

from specforge.errors import SectionError
from specforge.toolkit.members import Member, resolve_member, validation_host

__all__ = ["ComposeConfig", "ResolvedMember", "MAX_TREE_NODES"]

OWN_KEYS = ("confidence", "threshold")  # a member's keys that the composition reads, not the member
MAX_TREE_NODES = 63  # the most nodes a token tree may have (specforge.components.DraftBlock.parents)


class ResolvedMember(BaseModel):
    """One member, resolved: the drafter, its confidence estimator (None: the drafter's own) and
    its cascade threshold."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    drafter: Any  # Member
    confidence: Any = None  # Member | None
    threshold: float | None = None


class ComposeConfig(BaseModel):
    """Parameters of the ``compose`` drafter."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["cascade", "tree"] = Field(
        "cascade", description="cascade: per request and round, the first member whose proposal clears its "
                               "threshold, else the next; tree: every member's proposal is one branch of a token "
                               "tree under the anchor")
    members: list[dict[str, Any]] = Field(
        min_length=1, description="the composed drafters, in order: {name: <registered drafter>, ...its params, "
                                  "confidence: <estimator>, threshold: <cascade>}")
    _resolved: list[ResolvedMember] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _members(self, info: ValidationInfo) -> ComposeConfig:
        problems = _shape_problems(self)
        if problems:
            raise SectionError(problems)
        host = validation_host(info)
        if host is not None:
            self._resolved = resolve_members(self, host)
        return self

    def resolved(self) -> list[ResolvedMember]:
        """The members as resolved by the host that validated this config."""
        if self._resolved is None:
            raise RuntimeError("compose: the members are resolved by the plug-in host; build the drafter through a "
                               "pipeline (specforge.config.load_pipeline) or PluginHost.create_drafter")
        return self._resolved


def _shape_problems(config: ComposeConfig) -> list[tuple[str, str]]:
    """What is wrong with the members' shape, without the host (names, own keys)."""
    problems = []
    last = len(config.members) - 1
    for i, raw in enumerate(config.members):
        key = f"members.{i}"
        if not isinstance(raw.get("name"), str):
            problems.append((f"{key}.name", "required: the name of a registered drafter"))
        threshold = raw.get("threshold")
        if threshold is not None:
            if config.mode != "cascade":
                problems.append((f"{key}.threshold", "only a cascade's members have a threshold"))
            elif i == last:
                problems.append((f"{key}.threshold", "the last member's proposal is always taken; leave it out"))
            elif not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
                problems.append((f"{key}.threshold", f"a confidence in [0, 1], got {threshold!r}"))
    return problems


def resolve_members(config: ComposeConfig, host: Any) -> list[ResolvedMember]:
    """Every member as a registered drafter (and estimator), or one :class:`SectionError` listing
    every problem under its key."""
    problems: list[tuple[str, str]] = []
    resolved = []
    for i, raw in enumerate(config.members):
        key = f"members.{i}"
        params = {k: v for k, v in raw.items() if k not in OWN_KEYS}
        try:
            drafter = resolve_member(host, "drafter", params, key)
        except SectionError as exc:
            problems += exc.problems
            continue
        problems += _member_problems(config, drafter, raw, key)
        confidence = None
        if raw.get("confidence") is not None:
            try:
                confidence = resolve_member(host, "confidence", raw["confidence"], f"{key}.confidence",
                                            label="confidence estimator")
            except SectionError as exc:
                problems += exc.problems
        elif "confidence" not in drafter.registration.metadata.provides:
            problems.append((f"{key}.confidence", f"drafter {drafter.name!r} reports no confidence of its own; name "
                                                  f"an estimator for its proposals (e.g. entropy, dspark-head)"))
        threshold = raw.get("threshold")
        resolved.append(ResolvedMember(drafter=drafter, confidence=confidence,
                                       threshold=None if threshold is None else float(threshold)))
    if config.mode == "tree" and not problems:
        depth = sum(_gamma(m.drafter) for m in resolved)
        if depth > MAX_TREE_NODES:
            problems.append(("members", f"the branches hold up to {depth} nodes (the members' gamma); a token tree "
                                        f"holds at most {MAX_TREE_NODES}"))
    if problems:
        raise SectionError(problems)
    return resolved


def _member_problems(config: ComposeConfig, drafter: Member, raw: dict, key: str) -> list[tuple[str, str]]:
    problems = []
    if issubclass(drafter.registration.config, ComposeConfig):
        problems.append((f"{key}.name", f"{drafter.name!r} composes drafters itself: a composition cannot be a "
                                        "member of one (list its members here instead)"))
    clash = [k for k in OWN_KEYS if k in raw and k in drafter.registration.config.model_fields]
    if clash:
        problems.append((f"{key}.{clash[0]}", f"both drafter {drafter.name!r} and the composition read this key; "
                                              "rename the drafter's parameter"))
    if config.mode == "tree" and getattr(drafter.params, "tree", None) is not None:
        problems.append((f"{key}.tree", f"drafter {drafter.name!r} is set to propose a token tree; the branches of a "
                                        "composed tree are chains (leave its tree out, or use a cascade)"))
    return problems


def _gamma(member: Member) -> int:
    """The most tokens a member proposes per round (its γ; 7 when its config leaves it open)."""
    gamma = getattr(member.params, "gamma", None)
    return int(gamma) if gamma else 7

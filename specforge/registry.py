"""Component registrations: what a plug-in's ``register`` call records, and its validation."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, field_validator

from specforge.components import Calibrator, ConfidenceEstimator, CorrectionHead, Drafter, Scheduler, Verifier

__all__ = [
    "KIND_HOOKS",
    "ComponentKind",
    "EmptyConfig",
    "KindSpec",
    "Registration",
    "RegistrationError",
    "Registry",
]

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class RegistrationError(ValueError):
    """A ``register`` call that the host refuses (bad name, config model, metadata, duplicate)."""


class EmptyConfig(BaseModel):
    """Config model of components that take no parameters."""

    model_config = ConfigDict(extra="forbid")


# --- per-kind metadata ------------------------------------------------------------------------


BlockField = Literal["probs", "logits", "hidden", "confidence"]


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str = ""
    # Parameter sets the conformance suite tries (each validated against the config model at
    # registration).  Empty: the config's defaults, which must then be complete.
    examples: tuple[dict[str, Any], ...] = ()


class DrafterMeta(_Meta):
    deterministic: bool = False
    parallel: bool = False
    # DraftBlock fields the drafter fills, so the suite pairs it only with estimators it can feed.
    provides: tuple[BlockField, ...] = ()
    # Whether the drafter runs a correction head; if not, only identity heads combine with it.
    uses_correction_head: bool = False
    # Whether it may propose token trees (DraftBlock.parents): it then pairs only with verifiers
    # that declare ``trees``.
    trees: bool = False
    # The training method (specforge.toolkit.training): a class with a ``config`` model, built
    # as ``training(config, target)``.  None: the drafter cannot be trained by ``specforge train``.
    training: Any = Field(None, exclude=True)
    # Foreign layouts of its checkpoints (specforge.toolkit.formats.CheckpointFormat): what `specforge
    # export --to` writes and `specforge import` reads.
    formats: tuple[Any, ...] = Field((), exclude=True)

    @computed_field  # what `specforge plugins --json` shows of it
    @property
    def trainable(self) -> bool:
        return self.training is not None

    @computed_field
    @property
    def checkpoint_formats(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.formats)

    @field_validator("formats")
    @classmethod
    def _formats(cls, value: Any) -> Any:
        for f in value:
            missing = [a for a in ("name", "description", "export", "detect", "import_checkpoint") if not hasattr(f, a)]
            if missing:
                raise ValueError(f"format {f!r} lacks {', '.join(missing)} "
                                 "(see specforge.toolkit.formats.CheckpointFormat)")
        names = [f.name for f in value]
        if len(set(names)) != len(names):
            raise ValueError(f"formats: a name is given twice ({names})")
        return tuple(value)

    @field_validator("training")
    @classmethod
    def _training_method(cls, value: Any) -> Any:
        if value is None:
            return value
        config = getattr(value, "config", None)
        if not callable(value) or not (isinstance(config, type) and issubclass(config, BaseModel)):
            raise ValueError("training must be a class with a pydantic `config` model "
                             "(see specforge.toolkit.training)")
        if config.model_config.get("extra") != "forbid":
            raise ValueError(f"training config model {config.__name__} must set extra='forbid'")
        return value


class CorrectionHeadMeta(_Meta):
    trainable: bool = False
    identity: bool = False  # leaves the logits unchanged (``none``): fits any drafter


class ConfidenceMeta(_Meta):
    pre_token: bool = True
    trainable: bool = False
    # The estimator needs at least one of these DraftBlock fields (empty: needs none).
    needs_any: tuple[BlockField, ...] = ()


class CalibratorMeta(_Meta):
    trainable: bool = False


class SchedulerMeta(_Meta):
    reads: tuple[Literal["confidence", "hardware_profile", "history"], ...] = ()


class VerifierMeta(_Meta):
    lossless: bool
    greedy_only: bool = False
    trees: bool = False  # its verify takes ``parents``: it verifies token trees too


# --- the kinds ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KindSpec:
    """Everything the host knows about one component kind."""

    slot: str  # the pipeline key that selects a component of this kind (the kind's value)
    hook: str  # the hookspec in specforge.hookspecs through which plug-ins register them
    metadata: type[_Meta]  # validates the ``**metadata`` of a ``register`` call
    protocol: type  # what a factory returns (specforge.components)
    default: str | None  # the component of a pipeline that leaves the slot out; None: optional
    label: str  # how messages name the kind


class ComponentKind(str, Enum):
    """The component kinds, one row each: adding a kind is a row here plus its hookspec (pluggy
    needs the function; tests/test_registry.py checks that the two agree)."""

    spec: KindSpec

    DRAFTER = KindSpec("drafter", "specforge_register_drafters", DrafterMeta, Drafter,
                       default=None, label="drafter")  # no drafter: plain decoding
    CORRECTION_HEAD = KindSpec("correction_head", "specforge_register_correction_heads", CorrectionHeadMeta,
                               CorrectionHead, default="none", label="correction head")
    CONFIDENCE = KindSpec("confidence", "specforge_register_confidence_estimators", ConfidenceMeta,
                          ConfidenceEstimator, default="constant", label="confidence estimator")
    CALIBRATOR = KindSpec("calibrator", "specforge_register_calibrators", CalibratorMeta, Calibrator,
                          default="identity", label="calibrator")
    SCHEDULER = KindSpec("scheduler", "specforge_register_schedulers", SchedulerMeta, Scheduler,
                         default="fixed", label="scheduler")
    VERIFIER = KindSpec("verifier", "specforge_register_verifiers", VerifierMeta, Verifier,
                        default="rejection", label="verifier")

    def __new__(cls, spec: KindSpec) -> ComponentKind:
        # The value is the slot name, so ComponentKind("drafter") and kind == "drafter" work.
        member = str.__new__(cls, spec.slot)
        member._value_ = spec.slot
        member.spec = spec
        return member

    @property
    def label(self) -> str:
        """Human name used in messages ("correction head", "confidence estimator")."""
        return self.spec.label


# Views of the table, by kind.
KIND_HOOKS: dict[ComponentKind, str] = {kind: kind.spec.hook for kind in ComponentKind}
META_MODELS: dict[ComponentKind, type[_Meta]] = {kind: kind.spec.metadata for kind in ComponentKind}


@dataclass(frozen=True)
class Registration:
    """One registered component."""

    kind: ComponentKind
    name: str
    factory: Callable[[BaseModel], Any]
    config: type[BaseModel]
    metadata: _Meta
    plugin: str  # the plug-in (entry-point or registration) name that registered it
    package: str  # its distribution, or "<unknown>" for plug-ins registered by hand
    version: str

    def create(self, config: BaseModel | dict[str, Any] | None = None, *, host: Any = None) -> Any:
        """Validate ``config`` against the component's model and build the component.

        ``host``: the plug-in host building it, handed to the config model's validators as the
        validation context ``{"host": host}`` — how a component made of other registered
        components (a composed drafter's members) resolves them (:mod:`specforge.toolkit.members`)."""
        if not isinstance(config, self.config):
            config = self.config.model_validate(config or {}, context=None if host is None else {"host": host})
        return self.factory(config)

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (what ``specforge plugins --json`` prints)."""
        return {
            "kind": self.kind.value,
            "name": self.name,
            "plugin": self.plugin,
            "package": self.package,
            "version": self.version,
            "metadata": self.metadata.model_dump(mode="json"),
            "config": self.config.model_json_schema().get("properties", {}),
        }


def _check_config_model(kind: ComponentKind, name: str, config: Any) -> type[BaseModel]:
    if config is None:
        return EmptyConfig
    if not (isinstance(config, type) and issubclass(config, BaseModel)):
        raise RegistrationError(
            f"{kind.label} {name!r}: config must be a pydantic BaseModel subclass, got {config!r}"
        )
    if config.model_config.get("extra") != "forbid":
        raise RegistrationError(
            f"{kind.label} {name!r}: config model {config.__name__} must set extra='forbid' "
            "so that misspelt keys are reported"
        )
    return config


def make_registration(
    kind: ComponentKind,
    name: Any,
    factory: Any,
    config: Any,
    metadata: dict[str, Any],
    *,
    plugin: str,
    package: str,
    version: str,
) -> Registration:
    """Validate one ``register`` call and turn it into a :class:`Registration`."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise RegistrationError(
            f"{kind.label} name {name!r} is invalid: use lower-case letters, digits, '-' and '_'"
        )
    if not callable(factory):
        raise RegistrationError(f"{kind.label} {name!r}: factory {factory!r} is not callable")
    model = _check_config_model(kind, name, config)
    try:
        meta = kind.spec.metadata.model_validate(metadata)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(metadata)'}: {e['msg']}" for e in exc.errors()
        )
        valid = ", ".join(kind.spec.metadata.model_fields)
        raise RegistrationError(
            f"{kind.label} {name!r}: bad metadata ({problems}); valid keys: {valid}"
        ) from None
    for i, example in enumerate(meta.examples):
        try:
            model.model_validate(example)
        except ValidationError as exc:
            raise RegistrationError(f"{kind.label} {name!r}: examples[{i}] is not a valid config: {exc}") from None
    return Registration(kind, name, factory, model, meta, plugin, package, version)


@dataclass
class Registry:
    """All registrations of all kinds, keyed by (kind, name)."""

    _items: dict[ComponentKind, dict[str, Registration]] = field(
        default_factory=lambda: {k: {} for k in ComponentKind}
    )

    def add(self, reg: Registration) -> None:
        existing = self._items[reg.kind].get(reg.name)
        if existing is not None:
            raise RegistrationError(
                f"{reg.kind.label} {reg.name!r} is registered twice: by {existing.package} "
                f"(plug-in {existing.plugin!r}) and by {reg.package} (plug-in {reg.plugin!r})"
            )
        self._items[reg.kind][reg.name] = reg

    def remove_plugin(self, plugin: str) -> None:
        for items in self._items.values():
            for name in [n for n, r in items.items() if r.plugin == plugin]:
                del items[name]

    def get(self, kind: ComponentKind | str, name: str) -> Registration:
        kind = ComponentKind(kind)
        try:
            return self._items[kind][name]
        except KeyError:
            raise KeyError(
                f"unknown {kind.label} {name!r}; registered: {', '.join(self.names(kind)) or '(none)'}"
            ) from None

    def names(self, kind: ComponentKind | str) -> list[str]:
        return sorted(self._items[ComponentKind(kind)])

    def of_kind(self, kind: ComponentKind | str) -> dict[str, Registration]:
        return dict(sorted(self._items[ComponentKind(kind)].items()))

    def __iter__(self) -> Iterator[Registration]:
        for kind in ComponentKind:
            yield from self.of_kind(kind).values()

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())

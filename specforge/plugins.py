"""The plug-in host: discovers plug-ins, collects their registrations, isolates their failures.

Discovery goes through one entry-point group, ``specforge``; the components that ship with
specforge are found there too, exactly like a third party's.  Environment switches:

``SPECFORGE_DISABLE_PLUGIN_AUTOLOAD=1``
    load only the plug-ins shipped with specforge (third-party entry points are ignored).
``SPECFORGE_PLUGINS=name[,name...]``
    allow-list: load only these third-party plug-ins (entry-point or distribution names); the
    shipped ones always load.
``SPECFORGE_TRACE_HOOKS=1``
    print every hook call and its result to stderr (pluggy's tracer).
``SPECFORGE_STRICT_PLUGINS=1``
    a plug-in that fails to import or register raises instead of being skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy
from pydantic import BaseModel

from specforge.errors import SpecforgeError
from specforge import hookspecs
from specforge.components import Calibrator, ConfidenceEstimator, CorrectionHead, Drafter, Scheduler, Verifier
from specforge.registry import (
    NAME_RE,
    ComponentKind,
    Registration,
    RegistrationError,
    Registry,
    make_registration,
)

__all__ = ["ENTRY_POINT_GROUP", "Command", "PluginError", "PluginFailure", "PluginHost", "get_host"]

ENTRY_POINT_GROUP = "specforge"
DISTRIBUTION = "specforge-lossless"
_UNKNOWN = "<unknown>"


class PluginError(SpecforgeError, RuntimeError):
    """Raised in strict mode when a plug-in cannot be imported or registered."""


@dataclass(frozen=True)
class PluginFailure:
    """A plug-in that was skipped, and why."""

    plugin: str
    package: str
    version: str
    stage: str  # "import" or "register"
    error: str

    def describe(self) -> dict[str, str]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Command:
    """A sub-command of the ``specforge`` command line, as a plug-in registered it through
    :func:`~specforge.hookspecs.specforge_register_commands`."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    help: str
    description: str | None
    plugin: str
    package: str
    version: str

    def describe(self) -> dict[str, str]:
        return {"name": self.name, "help": self.help, "plugin": self.plugin, "package": self.package,
                "version": self.version}


def _make_command(name: Any, add_arguments: Any, run: Any, help: str, description: str | None,
                  **origin: str) -> Command:
    """Check one ``register`` call of ``specforge_register_commands``."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise RegistrationError(f"command {name!r}: a name is lower-case letters, digits, '-' and '_'")
    for role, fn in (("add_arguments", add_arguments), ("run", run)):
        if not callable(fn):
            raise RegistrationError(f"command {name!r}: {role} {fn!r} is not callable")
    return Command(name, add_arguments, run, str(help), description, **origin)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


class PluginHost:
    """One plug-in manager plus the registry it fills.

    Arguments left as ``None`` are read from the environment switches described above.
    """

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        allow: Iterable[str] | None = None,
        strict: bool | None = None,
        trace: bool | None = None,
    ) -> None:
        self.autoload = (not _env_flag("SPECFORGE_DISABLE_PLUGIN_AUTOLOAD")) if autoload is None else autoload
        self.allow = _env_list("SPECFORGE_PLUGINS") if allow is None else set(allow)
        self.strict = _env_flag("SPECFORGE_STRICT_PLUGINS") if strict is None else strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.commands: dict[str, Command] = {}  # command line sub-commands, by name
        self.failures: list[PluginFailure] = []
        self._packages: dict[str, str] = {}  # plug-in name -> distribution
        self._loaded = False
        if _env_flag("SPECFORGE_TRACE_HOOKS") if trace is None else trace:
            self.pm.trace.root.setwriter(sys.stderr.write)
            self.pm.enable_tracing()

    # -- discovery ---------------------------------------------------------------------------

    def load(self) -> PluginHost:
        """Discover and register every entry-point plug-in; calling it again does nothing."""
        if self._loaded:
            return self
        self._loaded = True
        for ep in self._entry_points():
            dist = getattr(ep, "dist", None)
            package = dist.name if dist is not None else _UNKNOWN
            version = dist.version if dist is not None else ""
            try:
                module = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a plug-in may raise anything on import
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                self._fail(ep.name, package, version, "import", exc)
                continue
            self.add_plugin(module, ep.name, package=package, version=version)
        return self

    def _entry_points(self) -> list[metadata.EntryPoint]:
        seen: set[tuple[str, str]] = set()
        found = []
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            key = (ep.name, ep.value)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            builtin = _dist_name(ep) == DISTRIBUTION
            if not builtin:
                if not self.autoload:
                    continue
                if self.allow is not None and not ({ep.name, _dist_name(ep)} & self.allow):
                    continue
            found.append((not builtin, _dist_name(ep), ep.name, ep))
        found.sort(key=lambda t: t[:3])  # shipped plug-ins first, then by package and name
        return [t[3] for t in found]

    # -- registration ------------------------------------------------------------------------

    def add_plugin(
        self, plugin: Any, name: str, *, package: str = _UNKNOWN, version: str = ""
    ) -> bool:
        """Register a plug-in object and collect its components and commands.

        All of the plug-in's registrations are accepted or, if any fails, none is: the plug-in is
        then unregistered and listed in :attr:`failures`.  Registering the same object twice is a
        no-op.  Returns whether the plug-in is active.
        """
        if self.pm.is_registered(plugin):
            return True
        try:
            self.pm.register(plugin, name=name)
        except ValueError:
            owner = self._packages.get(name, _UNKNOWN)
            self._fail(name, package, version, "register",
                       RegistrationError(f"plug-in name {name!r} is already used by {owner}"))
            return False
        collected: list[Registration] = []
        commands: list[Command] = []
        try:
            for kind in ComponentKind:
                def register(reg_name: Any, factory: Any, config: Any = None, _kind=kind, **meta: Any) -> None:
                    collected.append(
                        make_registration(_kind, reg_name, factory, config, meta,
                                          plugin=name, package=package, version=version)
                    )

                self._own_hook(kind.spec.hook, name)(register=register)

            def register_command(cmd_name: Any, add_arguments: Any, run: Any, help: str = "",
                                 description: str | None = None) -> None:
                commands.append(_make_command(cmd_name, add_arguments, run, help, description,
                                              plugin=name, package=package, version=version))

            self._own_hook("specforge_register_commands", name)(register=register_command)
            self._check_command_names(commands)
            for reg in collected:
                self.registry.add(reg)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self.registry.remove_plugin(name)
            self.pm.unregister(name=name)
            self._fail(name, package, version, "register", exc)
            return False
        self.commands.update((c.name, c) for c in commands)
        self._packages[name] = package
        return True

    def _own_hook(self, hook_name: str, plugin: str) -> Any:
        """A caller of ``hook_name`` that reaches only ``plugin``, so that each plug-in's
        registrations are collected (and fail) on their own."""
        others = [p for n, p in self.pm.list_name_plugin() if n != plugin]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)

    def _check_command_names(self, commands: list[Command]) -> None:
        taken = {n: c.package for n, c in self.commands.items()}
        for c in commands:
            if c.name in taken:
                raise RegistrationError(f"command {c.name!r} of {c.package} is already registered by {taken[c.name]}")
            taken[c.name] = c.package

    def _fail(self, plugin: str, package: str, version: str, stage: str, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        if self.strict:
            raise PluginError(f"plug-in {plugin!r} from {package} failed to {stage}: {message}") from exc
        self.failures.append(PluginFailure(plugin, package, version, stage, message))

    # -- typed access ------------------------------------------------------------------------

    def get(self, kind: ComponentKind | str, name: str) -> Registration:
        """The registration of ``name``; ``KeyError`` listing the registered names otherwise."""
        return self.load().registry.get(kind, name)

    def names(self, kind: ComponentKind | str) -> list[str]:
        return self.load().registry.names(kind)

    def create(self, kind: ComponentKind | str, name: str, config: BaseModel | dict | None = None) -> Any:
        return self.get(kind, name).create(config, host=self)

    # Typed shorthands of create(), one per kind, each returning the kind's protocol
    # (tests/test_registry.py holds them to ComponentKind's table).

    def create_drafter(self, name: str, config: BaseModel | dict | None = None) -> Drafter:
        return self.create(ComponentKind.DRAFTER, name, config)

    def create_correction_head(self, name: str, config: BaseModel | dict | None = None) -> CorrectionHead:
        return self.create(ComponentKind.CORRECTION_HEAD, name, config)

    def create_confidence(self, name: str, config: BaseModel | dict | None = None) -> ConfidenceEstimator:
        return self.create(ComponentKind.CONFIDENCE, name, config)

    def create_calibrator(self, name: str, config: BaseModel | dict | None = None) -> Calibrator:
        return self.create(ComponentKind.CALIBRATOR, name, config)

    def create_scheduler(self, name: str, config: BaseModel | dict | None = None) -> Scheduler:
        return self.create(ComponentKind.SCHEDULER, name, config)

    def create_verifier(self, name: str, config: BaseModel | dict | None = None) -> Verifier:
        return self.create(ComponentKind.VERIFIER, name, config)

    def describe(self) -> dict[str, Any]:
        """Everything ``specforge plugins --json`` prints."""
        self.load()
        return {
            "components": [reg.describe() for reg in self.registry],
            "commands": [c.describe() for c in self.commands.values()],
            "failed": [f.describe() for f in self.failures],
        }


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else _UNKNOWN


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide host, loaded on first use."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST.load()

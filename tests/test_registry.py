"""The table of component kinds (specforge.registry.ComponentKind) against everything that must
agree with it: the hookspecs pluggy calls, the host's typed factories, the pipeline defaults."""

from __future__ import annotations

import inspect
import typing

import pytest

from specforge import components, hookspecs
from specforge.config import DEFAULT_COMPONENTS
from specforge.plugins import PluginHost
from specforge.registry import KIND_HOOKS, META_MODELS, ComponentKind

KINDS = list(ComponentKind)


def hookspec_functions() -> dict[str, typing.Callable]:
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(fn, hookspecs.PROJECT + "_spec")}


def test_every_hookspec_that_registers_components_is_a_kinds_hook():
    specs = hookspec_functions()
    hooks = {kind.spec.hook for kind in KINDS}
    assert len(hooks) == len(KINDS) and hooks <= set(specs)
    # the other hooks (sub-commands) register no component: their factories return no protocol
    assert not [name for name in set(specs) - hooks if "specforge.components." in inspect.getdoc(specs[name])]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_each_kinds_hookspec_takes_register_and_names_its_protocol(kind):
    spec = hookspec_functions()[kind.spec.hook]
    assert list(inspect.signature(spec).parameters) == ["register"]
    protocol = kind.spec.protocol
    assert getattr(components, protocol.__name__) is protocol
    assert f"specforge.components.{protocol.__name__}" in inspect.getdoc(spec)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_each_kind_has_a_typed_factory_returning_its_protocol(kind):
    factory = getattr(PluginHost, f"create_{kind.value}")
    assert typing.get_type_hints(factory)["return"] is kind.spec.protocol


def test_the_kinds_value_is_its_slot_and_looks_it_up():
    for kind in KINDS:
        assert kind.value == kind.spec.slot == kind
        assert ComponentKind(kind.value) is kind
    assert ComponentKind.CONFIDENCE.label == "confidence estimator"
    assert ComponentKind.CORRECTION_HEAD.label == "correction head"


def test_the_views_are_the_table():
    assert KIND_HOOKS == {kind: kind.spec.hook for kind in KINDS}
    assert META_MODELS == {kind: kind.spec.metadata for kind in KINDS}
    assert DEFAULT_COMPONENTS == {kind: kind.spec.default for kind in KINDS}
    assert [kind for kind in KINDS if kind.spec.default is None] == [ComponentKind.DRAFTER]


@pytest.mark.parametrize("kind", [k for k in KINDS if k.spec.default is not None], ids=lambda k: k.value)
def test_each_default_is_a_shipped_component_of_its_kind(kind):
    registration = PluginHost(autoload=False).get(kind, kind.spec.default)
    assert isinstance(registration.metadata, kind.spec.metadata)
    assert isinstance(registration.create(), kind.spec.protocol)

"""The hook specifications are the plug-in author's contract: documented, and in the docs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from specforge import hookspecs
from specforge.registry import KIND_HOOKS

HOOK_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "hooks.md"


def spec_functions():
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, hookspecs.PROJECT + "_spec")
    }


def test_every_spec_has_the_prefix_and_a_real_docstring():
    specs = spec_functions()
    assert specs, "no hookspecs found"
    for name, fn in specs.items():
        assert name.startswith("specforge_"), name
        doc = inspect.getdoc(fn) or ""
        assert len(doc.split()) >= 20, f"{name} needs a docstring that explains the hook"


COMMANDS_HOOK = "specforge_register_commands"  # the one hook that registers no component


def test_every_kind_has_exactly_one_registration_spec():
    assert set(KIND_HOOKS.values()) == set(spec_functions()) - {COMMANDS_HOOK}
    for name in [*KIND_HOOKS.values(), COMMANDS_HOOK]:
        assert list(inspect.signature(spec_functions()[name]).parameters) == ["register"]


def test_every_spec_is_on_the_hook_reference_page():
    page = HOOK_PAGE.read_text()
    listed = set(re.findall(r"^\s*-\s+(specforge_\w+)\s*$", page, flags=re.M))
    missing = set(spec_functions()) - listed
    assert not missing, f"{HOOK_PAGE} does not document: {sorted(missing)}"
    assert "::: specforge.hookspecs" in page

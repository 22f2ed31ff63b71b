"""The import layers (docs/design/layers.md; docs/writing-a-plugin.md#what-a-plug-in-may-import),
read from the source by scripts/layers.py — the same table the layer map in the docs is drawn from.

Four rules:

* no circles between modules;
* no import runs back up: a module imports its own layer and those below it (foundation → kernels
  → toolkit → plug-ins → runtime → engine → peers → jobs → CLI), and every package ``__init__`` that
  importing runs counts too;
* a plug-in (shipped or the example third-party package) imports from specforge only the contracts
  and the toolkit (:data:`PUBLIC`), and from ``specforge_plugins`` only its own method's modules
  (:data:`UNITS`) — what a third party could import, nothing more;
* the conformance suite reaches the shipped plug-ins only through their packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import layers  # noqa: E402  (scripts/layers.py)
from layers import GRAPH, LAYERS, MODULES, imports, layer_of, upward  # noqa: E402

_is_package = layers.is_package

# What a plug-in may import from specforge: the contracts, and the toolkit (a prefix).
PUBLIC = {"specforge", "specforge.hookspecs", "specforge.components", "specforge.protocols", "specforge.errors",
          "specforge.sampling", "specforge.vocab", "specforge.files", "specforge.metrics", "specforge.acceptance",
          "specforge.hardware"}
TOOLKIT = "specforge.toolkit"
TOOLKIT = "specforge.toolkit"
# A plug-in's own method: the modules of one unit may import each other.  The packages'
# registration modules (``__init__``) may import every unit below them.
UNITS = [
    ("specforge_plugins.confidence", "specforge_plugins.correction_heads"),
    ("specforge_plugins.drafters.block", "specforge_plugins.drafters.dspark", "specforge_plugins.drafters.dflash"),
    ("specforge_plugins.drafters.eagle3",),
    ("specforge_plugins.drafters.medusa",),
    ("specforge_plugins.drafters.ngram",),
    ("specforge_plugins.drafters.suffix",),
    ("specforge_plugins.drafters.compose",),
    ("specforge_plugins.drafters.shipped",),
    ("specforge_plugins.verifiers",),
    ("specforge_plugins.schedulers",),
    ("specforge_plugins.calibrators",),
    ("specforge_example",),
]
REGISTRATION = {"specforge_plugins.drafters"}


def _public(module: str) -> bool:
    return module in PUBLIC or module == TOOLKIT or module.startswith(TOOLKIT + ".")


def _unit(module: str) -> tuple[str, ...] | None:
    for unit in UNITS:
        if any(module == u or module.startswith(u + ".") for u in unit):
            return unit
    return None


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    cycles = _cycles()
    assert not cycles, "\n".join(" ↔ ".join(c) for c in cycles)


def test_plugins_import_only_contracts_the_toolkit_and_their_own_method():
    plugins = [m for m in MODULES if m.split(".")[0] in ("specforge_plugins", "specforge_example")]
    assert len(plugins) > 20
    bad = []
    for module in plugins:
        unit = _unit(module)
        registration = module in REGISTRATION or module == "specforge_plugins"
        for dep in sorted(GRAPH[module]):
            if dep.startswith("specforge.") or dep == "specforge":
                if not _public(dep):
                    bad.append(f"{module} imports {dep}")
            elif dep.split(".")[0] in ("specforge_plugins", "specforge_example"):
                allowed = (unit is not None and _unit(dep) == unit) or (
                    registration and dep.startswith(module + "."))
                if not allowed:
                    bad.append(f"{module} imports {dep} (another plug-in's module)")
            elif dep.split(".")[0] == "specforge_conformance":
                bad.append(f"{module} imports {dep}")
    assert not bad, "\n".join(bad)


def test_the_conformance_suite_reaches_shipped_plugins_only_through_their_packages():
    """Its negative controls extend shipped components (``RejectionVerifier``, ``HardwareConfig``)
    through what each plug-in package exports, and reuse the toolkit's building blocks — never a
    plug-in's inner module."""
    bad = [f"{module} imports {dep}" for module in MODULES if module.startswith("specforge_conformance")
           for dep in sorted(GRAPH[module]) if dep.startswith("specforge_plugins") and not _is_package(dep)]
    assert not bad, "\n".join(bad)


def test_no_import_runs_back_up():
    bad = upward()
    assert not bad, "\n".join(bad)


def test_every_module_is_in_a_layer_and_the_toolkit_stands_on_the_foundation_alone():
    assert {layer_of(m) for m in MODULES} == set(range(len(LAYERS))), "a layer without modules"
    toolkit = [layer.name for layer in LAYERS].index("toolkit")
    assert layer_of("specforge.toolkit.projection") == toolkit
    below = {layer_of(dep) for m in MODULES if layer_of(m) == toolkit for dep in GRAPH[m]}
    assert below <= set(range(toolkit + 1)), below


def test_the_rule_fails_on_an_upward_import(tmp_path):
    """The checker itself: a toolkit module importing the engine is reported."""
    path = tmp_path / "upward.py"
    path.write_text("def f():\n    from specforge.engine import Engine\n")
    MODULES["specforge.toolkit.upward_probe"] = path
    GRAPH["specforge.toolkit.upward_probe"] = imports("specforge.toolkit.upward_probe")
    try:
        assert any(line.startswith("specforge.toolkit.upward_probe (toolkit) → specforge.engine (engine)")
                   for line in upward())
    finally:
        del MODULES["specforge.toolkit.upward_probe"], GRAPH["specforge.toolkit.upward_probe"]


def test_the_graph_sees_local_imports_and_relative_ones(tmp_path):
    """The reader itself: a function-local import and a relative one are edges, a
    TYPE_CHECKING-only one is not."""
    source = ("from typing import TYPE_CHECKING\n"
              "from .errors import SpecforgeError\n"
              "if TYPE_CHECKING:\n    from specforge.engine import Engine\n"
              "def f():\n    from specforge.config import load_pipeline\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    MODULES["specforge.probe_module"] = path
    try:
        assert imports("specforge.probe_module") == {"specforge.errors", "specforge.config"}
    finally:
        del MODULES["specforge.probe_module"]

"""The import layers (docs/writing-a-plugin.md#what-a-plug-in-may-import), read from the source.

Every ``import`` statement of every module counts — function-local ones too, since a local import
that dodges a circle at import time is still a circle in the design; only ``if TYPE_CHECKING:``
blocks are left out.  Three rules:

* no circles between modules;
* a plug-in (shipped or the example third-party package) imports from specforge only the contracts
  and the toolkit (:data:`PUBLIC`), and from ``specforge_plugins`` only its own method's modules
  (:data:`UNITS`) — what a third party could import, nothing more;
* the contracts and the toolkit stand at the bottom: whatever they import, transitively and with
  every package ``__init__`` that importing runs, is public or one of a few leaf modules
  (:data:`LEAVES`) — never the host, the engine or a job.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# import name → source directory (pyproject.toml's package-dir, and the example plug-in)
ROOTS = {"specforge": REPO / "specforge", "specforge_plugins": REPO / "plugins",
         "specforge_conformance": REPO / "conformance", "specforge_kernels": REPO / "kernels",
         "specforge_example": REPO / "examples" / "specforge-example-plugin" / "specforge_example"}

# What a plug-in may import from specforge: the contracts, and the toolkit (a prefix).
PUBLIC = {"specforge", "specforge.hookspecs", "specforge.components", "specforge.protocols", "specforge.errors",
          "specforge.sampling", "specforge.vocab", "specforge.files", "specforge.metrics", "specforge.acceptance",
          "specforge.hardware"}
TOOLKIT = "specforge.toolkit"
# Leaf modules of the runtime the toolkit may stand on (no specforge imports beyond each other and
# the public layer): the projection's kernel plan and compiled-op registry, the batch layout and
# the cache directory a step curve measures with and is kept in, the machine key, a target's shape
# (ModelArgs) a checkpoint format checks a recorded target against, the conversation files.
LEAVES = {"specforge.target", "specforge.target.args", "specforge.target.batch", "specforge.target.loading",
          "specforge.target.linear_plan", "specforge.target.bands", "specforge.target.compiled", "specforge.machine",
          "specforge_kernels", "specforge_kernels.varlen_attention",
          # the conversation files a drafter's corpus is read from (toolkit.corpus)
          "specforge.data", "specforge.data.jsonl", "specforge.data.chat",
          # what those packages' __init__ imports names on first use with (it imports nothing)
          "specforge.lazy"}
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


def _modules() -> dict[str, Path]:
    found = {}
    for name, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES.get(module, Path()).name == "__init__.py" or (
        module in ROOTS and not (ROOTS[module] / "__init__.py").exists())


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            yield from (n for stmt in child.orelse for n in [stmt, *_walk(stmt)])
            continue
        yield child
        yield from _walk(child)


def _internal(name: str) -> bool:
    return name.split(".")[0] in ROOTS


def imports(module: str) -> set[str]:
    """The internal modules ``module`` imports (``from pkg import sub`` counts as ``pkg.sub`` when
    ``sub`` is a module)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    found = set()
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if _internal(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if not _internal(source):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in MODULES else source)
    found.discard(module)
    return {m for m in found if m in MODULES or m in ROOTS}


GRAPH = {m: imports(m) for m in MODULES}


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


def _public(module: str) -> bool:
    return module in PUBLIC or module == TOOLKIT or module.startswith(TOOLKIT + ".")


def _unit(module: str) -> tuple[str, ...] | None:
    for unit in UNITS:
        if any(module == u or module.startswith(u + ".") for u in unit):
            return unit
    return None


def _with_packages(module: str) -> set[str]:
    """``module`` and every package ``__init__`` importing it runs."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


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


def test_the_contracts_and_the_toolkit_stand_at_the_bottom():
    bottom = sorted(m for m in MODULES if _public(m))
    assert {"specforge.toolkit", "specforge.protocols", "specforge.components"} <= set(bottom)
    bad = []
    for start in bottom:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            for dep in GRAPH.get(module, ()):
                for step in _with_packages(dep):
                    if step in seen:
                        continue
                    seen.add(step)
                    if not (_public(step) or step in LEAVES):
                        bad.append(f"{start} → … {module} → {step}")
                    else:
                        todo.append(step)
    assert not bad, "\n".join(bad)


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

"""specforge's import layers, read from the source: which module belongs to which layer, and every
arrow between them.

The map on docs/design/layers.md is drawn from here by a mkdocs hook, and tests/test_import_layers.py
fails on an arrow that runs back up, so the drawing and the rule are the same table (:data:`LAYERS`).
Every ``import`` statement of every module counts — function-local ones too, since a local import
that dodges a circle at import time is still a circle in the design; only ``if TYPE_CHECKING:``
blocks are left out.  Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so those
packages count as imported too.

    python scripts/layers.py            # the layers, their modules and the arrows between them
    python scripts/layers.py --check    # exit 1 and list every arrow that runs back up
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# import name → source directory (pyproject.toml's package-dir, and the example plug-in)
ROOTS = {"specforge": REPO / "specforge", "specforge_plugins": REPO / "plugins",
         "specforge_conformance": REPO / "conformance", "specforge_kernels": REPO / "kernels",
         "specforge_example": REPO / "examples" / "specforge-example-plugin" / "specforge_example"}


@dataclass(frozen=True)
class Layer:
    name: str
    what: str
    modules: tuple[str, ...]  # module names or package prefixes; the longest match decides


# Bottom first.  A module may import its own layer and those below it, never one above.
LAYERS = (
    Layer("foundation", "the contracts plug-ins implement and the helpers every layer shares: component and "
          "protocol contracts, hook specs, sampling, metrics, errors, files and caches, a target's shape, files "
          "and pass layout, the conversation format",
          ("specforge", "specforge.errors", "specforge.components", "specforge.protocols", "specforge.hookspecs",
           "specforge.sampling", "specforge.vocab", "specforge.files", "specforge.metrics", "specforge.acceptance",
           "specforge.hardware", "specforge.machine", "specforge.measured", "specforge.lazy", "specforge.resume",
           "specforge.caches",
           "specforge.registry", "specforge.passes", "specforge.model_args", "specforge.model_files",
           "specforge.conversations", "specforge.evalsets", "specforge.plots")),
    Layer("kernels", "Triton kernels, each with a pure-torch twin", ("specforge_kernels",)),
    Layer("toolkit", "the building blocks a plug-in author composes (heads, layers, losses, trees, the "
          "projection and its kernel plan, checkpoints and formats)", ("specforge.toolkit",)),
    Layer("plug-ins", "the shipped methods, registered as a third party's are, the example plug-in, and the "
          "host that finds them and validates pipelines",
          ("specforge_plugins", "specforge_example", "specforge.plugins", "specforge.config", "specforge.commands",
           "specforge.presets")),
    Layer("runtime", "what computes a target's passes: the contract, the torch and llama.cpp siblings, "
          "the backend choice and the loader", ("specforge.runtime",)),
    Layer("engine", "continuous batching of speculative rounds over the runtime", ("specforge.engine",)),
    Layer("peers", "clients of engines specforge does not own (vLLM, llama-server, llama.cpp's programs)",
          ("specforge.peers",)),
    Layer("jobs", "what a user runs: data, features, training, evaluation, calibration, profiling, "
          "interop, benchmarks and the conformance suite",
          ("specforge.data", "specforge.features", "specforge.training", "specforge.evaluation",
           "specforge.calibration", "specforge.profiling", "specforge.main_job", "specforge.interop",
           "specforge.model_card", "specforge.bench", "specforge_conformance")),
    Layer("CLI", "the command line, wiring the jobs together", ("specforge.cli", "specforge.__main__")),
)


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


def is_package(module: str) -> bool:
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
    package = module if is_package(module) else module.rpartition(".")[0]
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


def with_packages(module: str) -> set[str]:
    """``module`` and every package ``__init__`` importing it runs."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer (the longest matching entry decides)."""
    best, found = -1, None
    for i, layer in enumerate(LAYERS):
        for entry in layer.modules:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
                best, found = len(entry), i
    if found is None:
        raise KeyError(f"{module} is in no layer of scripts/layers.py")
    return found


def arrows() -> Counter[tuple[int, int]]:
    """How many module imports run from each layer to each other (same-layer ones left out)."""
    count: Counter[tuple[int, int]] = Counter()
    for module, deps in GRAPH.items():
        for dep in deps:
            a, b = layer_of(module), layer_of(dep)
            if a != b:
                count[(a, b)] += 1
    return count


def upward() -> list[str]:
    """Every import that runs to a higher layer (with the packages it runs on the way)."""
    bad = []
    for module in sorted(GRAPH):
        mine = layer_of(module)
        for dep in sorted(GRAPH[module]):
            for step in sorted(with_packages(dep)):
                if step in MODULES and layer_of(step) > mine:
                    bad.append(f"{module} ({LAYERS[mine].name}) → {step} ({LAYERS[layer_of(step)].name})")
    return sorted(set(bad))


def mermaid() -> str:
    """The layers bottom-up as a flowchart: an edge per pair of layers with imports, labelled by count."""
    lines = ["flowchart BT"]
    sizes = Counter(layer_of(m) for m in MODULES)
    for i, layer in enumerate(LAYERS):
        lines.append(f'    L{i}["<b>{layer.name}</b><br/>{sizes[i]} modules"]')
    for (a, b), n in sorted(arrows().items()):
        lines.append(f"    L{a} -->|{n}| L{b}")
    return "\n".join(lines)


def table() -> str:
    """A markdown table of the layers, top first: what each holds and which folders."""
    rows = ["| layer | what | modules |", "|---|---|---|"]
    for i in reversed(range(len(LAYERS))):
        layer = LAYERS[i]
        names = ", ".join(f"`{m}`" for m in layer.modules)
        rows.append(f"| {layer.name} | {layer.what} | {names} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 on an import that runs back up")
    args = p.parse_args(argv)
    bad = upward()
    if args.check:
        print("\n".join(bad) if bad else "no import runs back up")
        return 1 if bad else 0
    sizes = Counter(layer_of(m) for m in MODULES)
    for i in reversed(range(len(LAYERS))):
        print(f"{LAYERS[i].name:<11} {sizes[i]:>4} modules")
    print()
    for (a, b), n in sorted(arrows().items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        print(f"{LAYERS[a].name:>11} → {LAYERS[b].name:<11} {n:>4} imports{'   ← UP' if b > a else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

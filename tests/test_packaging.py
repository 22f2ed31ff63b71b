"""A built wheel carries every module the entry points name, the presets and the eval sets."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_entry_point_module_and_preset(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = tmp_path.glob("specforge_lossless-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    parser = configparser.ConfigParser()
    parser.read_string(zipfile.ZipFile(wheel).read(info).decode())
    targets = dict(parser["specforge"])
    assert set(targets) == {
        "verifiers", "schedulers", "calibrators", "confidence", "correction_heads", "drafters", "conformance"
    }
    for module in targets.values():
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, module
    assert "specforge/presets/default.yaml" in names
    # Every module of the source tree ships (plugins/, kernels/, conformance/ under their import
    # names), so a package added without listing it in pyproject.toml fails here.
    mapping = {"specforge": "specforge", "plugins": "specforge_plugins", "kernels": "specforge_kernels",
               "conformance": "specforge_conformance"}
    for src, pkg in mapping.items():
        for module in (REPO / src).rglob("*.py"):
            rel = module.relative_to(REPO / src).as_posix()
            assert f"{pkg}/{rel}" in names, f"{src}/{rel} is missing from the wheel"
    assert parser["console_scripts"]["specforge"] == "specforge.cli:main"
    # The eval prompt sets and their attribution ship as package data: an installed specforge
    # evaluates with nothing beside it.
    for name in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench"):
        data = zipfile.ZipFile(wheel).read(f"specforge/evalsets/{name}.jsonl")
        assert data == (REPO / "specforge" / "evalsets" / f"{name}.jsonl").read_bytes()
    assert "specforge/evalsets/SOURCES.md" in names
    # The shipped drafters travel whole: weights (byte-identical), config with their hash, card.
    shipped = REPO / "plugins" / "drafters" / "shipped"
    drafters = [d for d in shipped.iterdir() if (d / "config.json").is_file()]
    assert drafters, "no shipped drafter in the source tree"
    for d in drafters:
        for f in ("config.json", "model.safetensors", "MODEL_CARD.md"):
            data = zipfile.ZipFile(wheel).read(f"specforge_plugins/drafters/shipped/{d.name}/{f}")
            assert data == (d / f).read_bytes(), f"{d.name}/{f}"
    # So do the suffix drafter's corpora: every file of each, byte-identical.
    corpora = REPO / "plugins" / "drafters" / "suffix" / "corpora"
    shipped_corpora = [d for d in corpora.iterdir() if (d / "CORPUS.md").is_file()]
    assert shipped_corpora, "no shipped corpus in the source tree"
    for d in shipped_corpora:
        for f in d.iterdir():
            data = zipfile.ZipFile(wheel).read(f"specforge_plugins/drafters/suffix/corpora/{d.name}/{f.name}")
            assert data == f.read_bytes(), f"{d.name}/{f.name}"


def test_the_repository_root_shadows_no_installed_package():
    """Run from a clone's root the current directory is on ``sys.path``; a top-level directory that
    were a regular package would shadow an installed distribution of its name (transformers >= 5.25
    imports Hugging Face's ``kernels``), so the mapped directories are namespace portions."""
    for src in ("plugins", "kernels", "conformance"):
        assert not (REPO / src / "__init__.py").exists(), f"{src}/__init__.py would shadow an installed `{src}`"
    probe = (
        "import importlib.util, json, transformers\n"
        "from transformers import LlamaConfig\n"  # imports the kernel hub integration
        "spec = importlib.util.find_spec('kernels')\n"
        "print(json.dumps(None if spec is None else (spec.origin or '')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True, capture_output=True, text=True)
    origin = out.stdout.strip().splitlines()[-1]
    assert str(REPO / "kernels") not in origin, origin


def test_the_package_list_names_every_package_folder():
    """pyproject.toml lists the packages by hand, since plugins/, conformance/ and kernels/ import
    under other names (specforge_plugins, …); a package folder missing from the list would be left
    out of the wheel, silently."""
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setup["package-dir"].items():
        root = REPO / folder
        found.add(name)
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if parts and "__pycache__" not in parts:
                found.add(".".join([name, *parts]))
    listed = set(setup["packages"])
    assert not found - listed, f"package folders missing from pyproject.toml: {sorted(found - listed)}"

    def folder(package: str) -> Path:
        root, *rest = package.split(".")
        return REPO / setup["package-dir"][root] / Path(*rest)

    assert all(folder(p).is_dir() for p in listed), [p for p in listed if not folder(p).is_dir()]

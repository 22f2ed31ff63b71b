"""The peers' standalone scripts run as files in another interpreter (vLLM's venv), where the
script's own folder comes first on ``sys.path``: a sibling module named like a package the script
imports would be imported instead of it.  ``specforge/peers/vllm.py`` did exactly that to
``import vllm`` in both scripts, and every vLLM arm died at start — caught only where vLLM is
installed.  This checks it everywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specforge import peers
from specforge.peers.vllm_client import RUNNER

SCRIPTS = [RUNNER, Path(peers.__file__).with_name("vllm_sampler.py")]


def _imported_top_levels(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_sibling_module_shadows_what_a_standalone_script_imports(script):
    assert script.is_file()
    siblings = {p.stem for p in script.parent.glob("*.py")} | {p.name for p in script.parent.iterdir() if p.is_dir()}
    own = {script.stem}
    shadowed = sorted((_imported_top_levels(script) & siblings) - own - {"vllm_runner"})
    assert not shadowed, f"{script.name} imports {shadowed}, which its folder's own modules would shadow"
    assert "vllm" in _imported_top_levels(script)

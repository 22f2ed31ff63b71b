"""A throw-away virtual environment that sees this one's packages: where tests pip-install a
package (the example plug-in, specforge itself from a copy) without touching this environment."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path


def make_child_env(directory: Path) -> tuple[Path, Path]:
    """Create the environment; returns its python and its own site-packages.

    The child's own site-packages come first on its path, so what is installed there shadows this
    environment's copy; this environment's packages (torch, pytest, an editable specforge …) are
    added after it with ``site.addsitedir``, which also runs their ``.pth`` files."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    python = directory / "bin" / "python"
    child_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    parent = sysconfig.get_paths()["purelib"]
    (child_site / "parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return python, child_site

"""Session-wide test settings."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config) -> None:
    # Measured choices (precision plans, step curves) and GGUF conversions are cached under
    # $SPECFORGE_CACHE_DIR; the tests write theirs to a directory of their own, never the user's
    # (child processes inherit it).  A caller that set it keeps it.
    if "SPECFORGE_CACHE_DIR" not in os.environ:
        os.environ["SPECFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="specforge-tests-")
    # A choice measured on a busy machine is not cached (specforge.measured); the tests'
    # choices are cached whatever the CI host's neighbours do, so what they assert stays the same.
    os.environ.setdefault("SPECFORGE_CACHE_WHEN_BUSY", "1")

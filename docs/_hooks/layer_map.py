"""mkdocs hook: fill ``<!-- layers:map -->`` and ``<!-- layers:table -->`` on docs/design/layers.md
with the import layers read from the source (scripts/layers.py, the table tests/test_import_layers.py
checks), so the drawing cannot drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- layers:" not in markdown:
        return markdown
    sys.path.insert(0, str(SCRIPTS))
    try:
        import layers
    finally:
        sys.path.remove(str(SCRIPTS))
    bad = layers.upward()
    verdict = (f"**{len(bad)} imports run back up** (`python scripts/layers.py --check` lists them)" if bad else
               "No import runs back up (`python scripts/layers.py --check`).")
    return (markdown.replace("<!-- layers:map -->", f"```mermaid\n{layers.mermaid()}\n```\n\n{verdict}")
            .replace("<!-- layers:table -->", layers.table()))

"""mkdocs hook: fill ``<!-- components:KIND -->`` markers with tables built from the live registry.

The parameter tables on the "Shipped components" page are generated from the same pydantic
models that validate pipeline YAML, so the docs cannot drift from the code.
"""

from __future__ import annotations

import re

MARKER = re.compile(r"<!--\s*components:(\w+)\s*-->")


def _default(info: dict) -> str:
    if "default" in info:
        return f"`{info['default']!r}`".replace("'", "")
    return "**required**"


def _table(kind: str) -> str:
    from specforge.plugins import PluginHost

    host = PluginHost(autoload=False).load()  # shipped components only
    rows = []
    for name, reg in host.registry.of_kind(kind).items():
        props = reg.config.model_json_schema().get("properties", {})
        meta = reg.metadata.model_dump(mode="json")
        flags = ", ".join(f"{k}={v}" for k, v in meta.items()
                          if k not in ("description", "examples") and v not in ([], (), ""))
        params = "<br>".join(
            f"`{p}` ({_default(info)}){': ' + info['description'] if info.get('description') else ''}"
            for p, info in props.items()
        ) or "—"
        rows.append(f"| `{name}` | {meta.get('description', '')} | {flags or '—'} | {params} |")
    head = "| name | what it does | metadata | parameters (default) |\n|---|---|---|---|\n"
    return head + "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, **kwargs) -> str:
    return MARKER.sub(lambda m: _table(m.group(1)), markdown)

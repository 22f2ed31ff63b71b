"""The ``specforge`` command line (also ``python -m specforge``).

Sub-commands exist only once they work; each prints a table for people and ``--json`` for tools.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from specforge import __version__
from specforge.config import ConfigError, load_pipeline, preset_names
from specforge.plugins import PluginError, get_host
from specforge.registry import ComponentKind

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _meta_summary(meta: dict) -> str:
    parts = []
    for key, value in meta.items():
        if key == "description" or value in ((), [], None, ""):
            continue
        parts.append(f"{key}={','.join(value) if isinstance(value, list) else value}")
    return " ".join(parts)


def cmd_plugins(args: argparse.Namespace) -> int:
    info = get_host().describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    console = Console()
    table = Table(title="specforge components", show_lines=False)
    for column in ("kind", "name", "package", "version", "metadata", "description"):
        table.add_column(column, overflow="fold")
    for comp in info["components"]:
        table.add_row(
            comp["kind"], comp["name"], comp["package"], comp["version"],
            _meta_summary(comp["metadata"]), comp["metadata"].get("description", ""),
        )
    console.print(table)
    missing = [k.value for k in ComponentKind if not any(c["kind"] == k.value for c in info["components"])]
    if missing:
        console.print(f"no component registered yet for: {', '.join(missing)}")
    if info["failed"]:
        failed = Table(title="plug-ins that failed to load (skipped)", style="red")
        for column in ("plugin", "package", "version", "stage", "error"):
            failed.add_column(column, overflow="fold")
        for f in info["failed"]:
            failed.add_row(f["plugin"], f["package"], f["version"], f["stage"], f["error"])
        console.print(failed)
    return EXIT_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    sources = [s for s in args.items if "=" not in s] or ["default"]
    overrides = [s for s in args.items if "=" in s]
    pipeline = load_pipeline(sources, overrides)
    if args.json:
        print(json.dumps(pipeline.to_dict(), indent=2))
    else:
        sys.stdout.write(pipeline.to_yaml())
    return EXIT_OK


def cmd_config_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        print(name)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specforge",
        description="Lossless speculative decoding from composable plug-ins.",
    )
    parser.add_argument("--version", action="version", version=f"specforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plugins", help="list every registered component and failed plug-in")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)

    config = sub.add_parser("config", help="compose and validate pipeline configs")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print the resolved, validated pipeline",
        description="Merge config files or presets left to right, apply key=value overrides, "
        "validate, and print the result (defaults filled in).",
    )
    show.add_argument(
        "items", nargs="*", metavar="FILE|PRESET|key=value",
        help="config files or preset names (default: 'default'), then dot-list overrides",
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.set_defaults(func=cmd_config_show)
    presets = config_sub.add_parser("presets", help="list the shipped pipeline presets")
    presets.set_defaults(func=cmd_config_presets)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())

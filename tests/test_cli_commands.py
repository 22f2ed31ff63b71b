"""Sub-commands from plug-ins (``specforge_register_commands``): found through the entry-point
group, isolated when broken, and ``specforge conformance`` among them."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from specforge import cli as specforge_cli
from specforge import hookimpl
from specforge.cli import build_parser
from specforge.plugins import PluginHost
from test_plugin_host import make_dist, site  # noqa: F401 - site is a fixture

HELLO_PLUGIN = """
    from specforge import hookimpl

    def add_arguments(parser):
        parser.add_argument("--name", default="world")

    def run(args):
        print(f"hello {args.name}")
        return 0

    @hookimpl
    def specforge_register_commands(register):
        register("hello", add_arguments, run, help="say hello")
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specforge", *args], capture_output=True, text=True)


def run_parsed(parser, *argv: str) -> int:
    args = parser.parse_args(argv)
    return args.func(args)


def test_conformance_is_a_command_found_through_the_entry_point():
    helped = cli("--help")
    assert helped.returncode == 0
    assert "conformance" in helped.stdout and "plug-ins skipped" not in helped.stdout
    info = json.loads(cli("plugins", "--json").stdout)
    (command,) = [c for c in info["commands"] if c["name"] == "conformance"]
    assert command["plugin"] == "conformance" and command["package"] == "specforge-lossless"
    # the CLI knows the suite only through its entry point
    assert "specforge_conformance" not in inspect.getsource(specforge_cli)


def test_the_cli_works_and_names_the_failure_when_conformance_does_not_load(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "specforge_conformance.cli", None)  # its import now fails
    host = PluginHost().load()
    failure = next(f for f in host.failures if f.plugin == "conformance")
    assert failure.stage == "import" and failure.package == "specforge-lossless"
    parser = build_parser(host)
    assert "plug-ins skipped: 'conformance' (specforge-lossless, failed to import)" in " ".join(
        parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["conformance"])
    assert "invalid choice: 'conformance'" in capsys.readouterr().err
    assert run_parsed(parser, "config", "presets") == 0
    assert "default" in capsys.readouterr().out.split()


def test_a_third_party_command_runs_like_a_built_in_one(site, capsys):  # noqa: F811
    make_dist(site, "hello-pkg", {"hello_mod": HELLO_PLUGIN}, {"hello": "hello_mod"})
    host = PluginHost().load()
    assert host.commands["hello"].package == "hello-pkg"
    parser = build_parser(host)
    assert "say hello" in parser.format_help()
    assert run_parsed(parser, "hello", "--name", "plug-in") == 0
    assert capsys.readouterr().out == "hello plug-in\n"


def plugin_with_command(*register_args, **register_kwargs):
    class Plugin:
        @hookimpl
        def specforge_register_commands(self, register):
            register(*register_args, **register_kwargs)

    return Plugin()


def noop(*_):
    return 0


@pytest.mark.parametrize(
    ("register_args", "message"),
    [
        (("Bad Name", noop, noop), "command 'Bad Name'"),
        (("ok", "not-callable", noop), "add_arguments 'not-callable' is not callable"),
        (("ok", noop, None), "run None is not callable"),
    ],
)
def test_invalid_commands_fail_their_plugin_with_a_reason(register_args, message):
    host = PluginHost(autoload=False).load()
    assert not host.add_plugin(plugin_with_command(*register_args), "p")
    assert "ok" not in host.commands and message in host.failures[-1].error


def test_a_command_name_belongs_to_the_first_plugin_that_registers_it():
    host = PluginHost(autoload=False).load()
    assert host.add_plugin(plugin_with_command("dup", noop, noop), "first", package="first-pkg")
    assert not host.add_plugin(plugin_with_command("dup", noop, noop), "second", package="second-pkg")
    assert host.commands["dup"].package == "first-pkg"
    assert "already registered by first-pkg" in host.failures[-1].error


def test_a_builtin_name_cannot_be_taken_over():
    host = PluginHost(autoload=False).load()
    host.add_plugin(plugin_with_command("plugins", noop, noop, help="an impostor"), "impostor")
    parser = build_parser(host)
    assert "command 'plugins' of plug-in 'impostor' (<unknown>) skipped: it is built in" in " ".join(
        parser.format_help().split())
    assert parser.parse_args(["plugins"]).func is specforge_cli.cmd_plugins


def test_a_command_whose_options_fail_is_unusable_alone(capsys):
    def broken(parser):
        parser.add_argument("--x")
        parser.add_argument("--x")  # argparse refuses the conflict

    host = PluginHost(autoload=False).load()
    host.add_plugin(plugin_with_command("broken", broken, noop), "broken-plugin")
    parser = build_parser(host)
    assert run_parsed(parser, "broken") == 1
    assert "cannot declare its options" in capsys.readouterr().err
    assert run_parsed(parser, "config", "presets") == 0

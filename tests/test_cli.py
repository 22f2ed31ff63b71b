"""The command line, run as a user runs it: a subprocess of the installed package."""

from __future__ import annotations

import json
import subprocess
import sys

from test_plugin_host import SHIPPED


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specforge", *args], capture_output=True, text=True)


def test_plugins_json_lists_every_shipped_component():
    result = run("plugins", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    listed = {(c["kind"], c["name"]): c for c in info["components"]}
    for kind, names in SHIPPED.items():
        for name in names:
            comp = listed[(kind, name)]
            assert comp["package"] == "specforge-lossless"
            assert comp["version"]
            assert isinstance(comp["metadata"], dict) and "description" in comp["metadata"]
    assert listed[("verifier", "typical")]["metadata"]["lossless"] is False
    assert listed[("verifier", "rejection")]["metadata"]["lossless"] is True
    assert "confidence" in listed[("scheduler", "hw-prefix")]["metadata"]["reads"]
    assert info["failed"] == []


def test_plugins_table():
    result = run("plugins")
    assert result.returncode == 0, result.stderr
    for name in ("rejection", "hw-prefix", "sts", "entropy"):
        assert name in result.stdout


def test_config_show_default_and_presets():
    shown = run("config", "show")
    assert shown.returncode == 0, shown.stderr
    assert "model: smollm2" in shown.stdout and "drafter: null" in shown.stdout
    as_json = json.loads(run("config", "show", "default", "--json").stdout)
    assert as_json["verifier"]["name"] == "rejection"
    presets = run("config", "presets").stdout.split()
    assert "default" in presets


def test_config_error_is_one_message_with_exit_code_2():
    result = run("config", "show", "default", "scheduler.name=fixed", "scheduler.lenght=3")
    assert result.returncode == 2 and result.stdout == ""
    assert "scheduler.lenght: unknown key" in result.stderr and "valid keys: name, length" in result.stderr
    assert "Traceback" not in result.stderr


def test_version():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.startswith("specforge ")

"""The plug-in host: discovery through real entry points, failure isolation, switches."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from specforge import hookimpl
from specforge.plugins import PluginError, PluginHost
from specforge.registry import ComponentKind

SHIPPED = {
    "verifier": {"rejection", "match", "greedy", "typical"},
    "scheduler": {"fixed", "threshold", "hw-prefix", "async-topk"},
    "calibrator": {"identity", "sts"},
    "confidence": {"constant", "entropy"},
    "correction_head": {"none"},
    "drafter": {"ngram"},
}


def make_dist(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
    """Lay out an installed distribution (dist-info + modules) that importlib.metadata finds."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    eps = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[specforge]\n{eps}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


GOOD_PLUGIN = """
    from pydantic import BaseModel, ConfigDict
    from specforge import hookimpl

    class Cfg(BaseModel):
        model_config = ConfigDict(extra="forbid")
        level: int = 1

    class Thing:
        def __init__(self, config):
            self.config = config

    @hookimpl
    def specforge_register_calibrators(register):
        register("{name}", Thing, config=Cfg, description="a test calibrator")
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path where tests install fake distributions."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("SPECFORGE_DISABLE_PLUGIN_AUTOLOAD", "SPECFORGE_PLUGINS", "SPECFORGE_STRICT_PLUGINS",
                "SPECFORGE_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_every_shipped_component_is_registered_through_the_entry_point_group():
    host = PluginHost().load()
    for kind, names in SHIPPED.items():
        regs = host.registry.of_kind(kind)
        assert names <= set(regs), kind
        for name in names:
            assert regs[name].package == "specforge-lossless"
            assert regs[name].version
    assert not [f for f in host.failures if f.package == "specforge-lossless"]
    assert host.get("verifier", "rejection").metadata.lossless is True
    assert host.get("verifier", "typical").metadata.lossless is False


def test_loading_is_idempotent():
    host = PluginHost()
    host.load()
    count = len(host.registry)
    host.load()
    assert len(host.registry) == count
    plugin = host.pm.get_plugin("verifiers")
    assert host.add_plugin(plugin, "verifiers")
    assert len(host.registry) == count


def test_a_plugin_that_raises_on_import_is_reported_and_skipped(site):
    make_dist(site, "broken-pkg", {"broken_mod": "raise RuntimeError('boom at import')"},
              {"broken": "broken_mod"})
    make_dist(site, "good-pkg", {"good_mod": GOOD_PLUGIN.format(name="good-one")}, {"good": "good_mod"})
    host = PluginHost().load()
    failure = next(f for f in host.failures if f.plugin == "broken")
    assert failure.package == "broken-pkg" and failure.stage == "import"
    assert "boom at import" in failure.error
    assert host.get("calibrator", "good-one").package == "good-pkg"
    assert SHIPPED["verifier"] <= set(host.names("verifier"))


def test_strict_mode_makes_a_failure_fatal(site, monkeypatch):
    make_dist(site, "broken-pkg", {"broken_mod2": "raise RuntimeError('boom')"}, {"broken": "broken_mod2"})
    monkeypatch.setenv("SPECFORGE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="broken.*broken-pkg.*boom"):
        PluginHost().load()


def test_a_failing_registration_is_rolled_back_whole():
    class HalfBroken:
        @hookimpl
        def specforge_register_calibrators(self, register):
            register("half-ok", object)

        @hookimpl
        def specforge_register_verifiers(self, register):
            register("no-lossless-flag", object)  # verifier metadata requires `lossless`

    host = PluginHost(autoload=False).load()
    assert not host.add_plugin(HalfBroken(), "half")
    assert "half-ok" not in host.names("calibrator")
    failure = host.failures[-1]
    assert failure.stage == "register" and "lossless" in failure.error
    assert host.pm.get_plugin("half") is None


@pytest.mark.parametrize(
    ("register_args", "message"),
    [
        (("Bad Name", object), "name 'Bad Name' is invalid"),
        (("ok", "not-callable"), "is not callable"),
        (("ok", object, dict), "must be a pydantic BaseModel"),
        (("ok", object, type("Loose", (BaseModel,), {})), "extra='forbid'"),
    ],
)
def test_invalid_registrations_are_refused_with_a_reason(register_args, message):
    class Plugin:
        @hookimpl
        def specforge_register_schedulers(self, register):
            register(*register_args)

    host = PluginHost(autoload=False).load()
    assert not host.add_plugin(Plugin(), "p")
    assert message in host.failures[-1].error


def test_a_hook_that_raises_is_isolated():
    class Raises:
        @hookimpl
        def specforge_register_schedulers(self, register):
            raise KeyError("inside the plug-in")

    host = PluginHost(autoload=False).load()
    assert not host.add_plugin(Raises(), "raises")
    assert "inside the plug-in" in host.failures[-1].error
    assert SHIPPED["scheduler"] <= set(host.names("scheduler"))


def test_duplicate_names_are_an_error_naming_both_packages(site):
    make_dist(site, "first-pkg", {"dup_a": GOOD_PLUGIN.format(name="twin")}, {"a": "dup_a"})
    make_dist(site, "second-pkg", {"dup_b": GOOD_PLUGIN.format(name="twin")}, {"b": "dup_b"})
    host = PluginHost().load()
    assert host.get("calibrator", "twin").package == "first-pkg"
    failure = next(f for f in host.failures if f.plugin == "b")
    assert "first-pkg" in failure.error and "second-pkg" in failure.error and "twin" in failure.error


def test_shadowing_a_shipped_component_is_refused(site):
    make_dist(site, "shadow-pkg", {"shadow_mod": GOOD_PLUGIN.format(name="sts")}, {"shadow": "shadow_mod"})
    host = PluginHost().load()
    assert host.get("calibrator", "sts").package == "specforge-lossless"
    assert "specforge-lossless" in next(f for f in host.failures if f.plugin == "shadow").error


def test_disable_autoload_keeps_only_shipped_plugins(site, monkeypatch):
    make_dist(site, "extra-pkg", {"extra_mod": GOOD_PLUGIN.format(name="extra")}, {"extra": "extra_mod"})
    monkeypatch.setenv("SPECFORGE_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = PluginHost().load()
    assert "extra" not in host.names("calibrator")
    assert SHIPPED["calibrator"] <= set(host.names("calibrator"))


def test_allow_list_selects_third_party_plugins(site, monkeypatch):
    make_dist(site, "one-pkg", {"one_mod": GOOD_PLUGIN.format(name="one")}, {"one": "one_mod"})
    make_dist(site, "two-pkg", {"two_mod": GOOD_PLUGIN.format(name="two")}, {"two": "two_mod"})
    monkeypatch.setenv("SPECFORGE_PLUGINS", "two-pkg")  # a distribution name works too
    names = set(PluginHost().load().names("calibrator"))
    assert "two" in names and "one" not in names and "sts" in names


def test_trace_switch_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("SPECFORGE_TRACE_HOOKS", "1")
    PluginHost().load()
    assert "specforge_register_verifiers" in capsys.readouterr().err


def test_create_validates_the_config():
    host = PluginHost().load()
    reg = host.get("scheduler", "fixed")
    with pytest.raises(Exception, match="extra"):
        reg.create({"no_such_param": 1})
    assert host.create_scheduler("fixed", {}) is not None


def test_registered_config_models_forbid_extra_keys():
    for reg in PluginHost().load().registry:
        assert reg.config.model_config.get("extra") == "forbid", reg.name


def test_describe_is_json_ready():
    import json

    info = PluginHost().load().describe()
    json.dumps(info)
    kinds = {c["kind"] for c in info["components"]}
    assert {"verifier", "scheduler", "calibrator", "confidence", "correction_head"} <= kinds
    assert {k.value for k in ComponentKind} >= kinds


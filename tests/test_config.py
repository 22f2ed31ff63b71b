"""Pipeline configs: composition, overrides, validation and its error messages."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from specforge.cli import main
from pydantic import ValidationError

from specforge.config import EngineConfig, load_pipeline, preset_names, validate_pipeline
from specforge.errors import ConfigError
from specforge.registry import ComponentKind


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_every_preset_validates():
    assert {"default", "greedy", "scheduled", "ngram"} <= set(preset_names())
    for name in preset_names():
        load_pipeline(name)


def test_defaults_fill_every_slot():
    pipeline = validate_pipeline({})
    assert pipeline.component("drafter") is None  # plain decoding
    assert pipeline.component("verifier").name == "rejection"
    assert pipeline.component("scheduler").name == "fixed"
    assert pipeline.target.model == "smollm2"
    assert pipeline.sampling.temperature == 1.0


def test_files_merge_left_to_right_then_overrides(tmp_path):
    base = write(tmp_path, "base.yaml", "scheduler: {name: threshold, theta: 0.3}\nsampling: {top_k: 5}\n")
    top = write(tmp_path, "top.yaml", "scheduler: {theta: 0.6}\n")
    pipeline = load_pipeline([base, top], ["sampling.top_p=0.9", "verifier=match"])
    assert pipeline.component("scheduler").params.theta == 0.6
    assert pipeline.sampling.top_k == 5 and pipeline.sampling.top_p == 0.9
    assert pipeline.component("verifier").name == "match"


def test_interpolation_is_resolved(tmp_path):
    path = write(tmp_path, "i.yaml", "sampling: {top_k: 7}\nscheduler: {name: fixed, length: '${sampling.top_k}'}\n")
    assert load_pipeline(path).component("scheduler").params.length == 7


def test_round_trip_through_save(tmp_path):
    pipeline = load_pipeline("scheduled", ["sampling.seed=3"])
    saved = pipeline.save(tmp_path / "run")
    again = load_pipeline(str(saved))
    assert again.to_dict() == pipeline.to_dict()


def problems_of(*args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_pipeline(*args, **kwargs)
    return info.value.problems


def test_unknown_component_key_names_path_and_valid_keys():
    (problem,) = problems_of(
        "default", ["scheduler.name=threshold", "scheduler.theta=0.3", "scheduler.thetta=0.2"]
    )
    assert problem.startswith("scheduler.thetta: unknown key")
    assert "valid keys: name, theta" in problem


def test_unknown_top_level_key():
    (problem,) = problems_of("default", ["schedular.name=fixed"])
    assert problem.startswith("schedular: unknown key")
    assert "scheduler" in problem and "verifier" in problem


def test_unknown_plugin_name_lists_registered_ones():
    (problem,) = problems_of("default", ["verifier.name=rejektion"])
    assert problem.startswith("verifier.name: unknown verifier 'rejektion'")
    for name in ("rejection", "match", "greedy", "typical"):
        assert name in problem


def test_wrong_type_names_the_path():
    (problem,) = problems_of("default", ["sampling.top_k=lots"])
    assert problem.startswith("sampling.top_k:") and "integer" in problem and "'lots'" in problem


def test_literal_choices_are_listed():
    (problem,) = problems_of("default", ["target.dtype=fp8"])
    assert problem.startswith("target.dtype:") and "bfloat16" in problem and "float32" in problem


def test_all_problems_are_reported_at_once():
    problems = problems_of("default", ["sampling.top_p=2", "scheduler.name=nope", "extra=1"])
    assert len(problems) == 3


def test_greedy_only_verifier_needs_temperature_zero():
    (problem,) = problems_of("default", ["verifier.name=greedy"])
    assert "temperature 0" in problem
    load_pipeline("default", ["verifier.name=greedy", "sampling.temperature=0"])


def test_missing_file_lists_presets():
    (problem,) = problems_of("no/such/file.yaml")
    assert "no such config file or preset" in problem and "default" in problem


def test_malformed_override_and_yaml(tmp_path):
    assert problems_of("default", ["novalue"]) == ["override 'novalue' must look like key.path=value"]
    bad = write(tmp_path, "bad.yaml", "target: [unclosed\n")
    assert "cannot be read as YAML" in problems_of(bad)[0]
    listy = write(tmp_path, "list.yaml", "- a\n- b\n")
    assert "must be a mapping" in problems_of(listy)[0]


def test_slot_shorthand_and_null_drafter():
    pipeline = validate_pipeline({"verifier": "match", "drafter": None})
    assert pipeline.component("verifier").name == "match"
    assert pipeline.component(ComponentKind.DRAFTER) is None
    assert "a verifier is required" in str(pytest.raises(ConfigError, validate_pipeline, {"verifier": None}).value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("scheduler.bogus=1", "scheduler.bogus: unknown key for scheduler 'fixed'; valid keys: name, length"),
        ("verifier.name=nope", "verifier.name: unknown verifier 'nope'; registered verifiers:"),
        ("sampling.temperature=hot", "sampling.temperature:"),
    ],
)
def test_cli_reports_one_message_and_exits_non_zero(override, expected, capsys):
    assert main(["config", "show", "default", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert err[0] == "error: invalid pipeline config (default):"
    assert len(err) == 2 and err[1].strip().startswith(expected)


def test_cli_prints_the_resolved_config(capsys):
    assert main(["config", "show", "scheduled", "sampling.seed=9"]) == 0
    shown = OmegaConf.to_container(OmegaConf.create(capsys.readouterr().out))
    assert shown["sampling"]["seed"] == 9
    assert shown["calibrator"]["name"] == "sts"
    assert shown["scheduler"] == {"name": "threshold", "theta": 0.5}


def test_naming_another_component_drops_the_keys_of_the_previous_one():
    """``scheduler.name=fixed`` over the dspark preset's ``hw-prefix`` (with ``profile``) is a
    plain ``fixed`` scheduler, not an error about hw-prefix's key; the same in a later file."""
    p = load_pipeline(["dspark"], ["scheduler.name=fixed"])
    assert p.to_dict()["scheduler"] == {"name": "fixed", "length": None}
    same = load_pipeline(["dspark"], ["scheduler.profile=auto"])  # same name: keys still merge
    assert same.to_dict()["scheduler"]["profile"] == "auto"


@pytest.mark.parametrize("bad", [0, -3, "whole"])
def test_prefill_chunk_is_auto_off_or_a_positive_count(bad):
    with pytest.raises(ValidationError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=bad)
    assert EngineConfig(prefill_chunk=64).prefill_chunk == 64 and EngineConfig().prefill_chunk == "auto"

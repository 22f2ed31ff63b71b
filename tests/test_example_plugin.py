"""A third-party package installed with pip shows up, is selectable, and goes away again.

The example package under examples/ is pip-installed into a throw-away virtual environment that
sees this environment's packages, its own test suite runs there (the conformance fixture
certifies its scheduler and its drafter), then it is uninstalled.  Its drafter is trained with
``specforge train`` and evaluated with ``specforge eval`` with no change to specforge.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from child_env import make_child_env
from tiny_models import tiny_training_files

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "specforge-example-plugin"


def _installed_here() -> bool:
    try:
        metadata.distribution("specforge-example-plugin")
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.fixture
def child_env(tmp_path):
    if _installed_here():
        pytest.skip("specforge-example-plugin is installed in this environment; "
                    "uninstall it to test a clean install/uninstall round trip")
    python, _ = make_child_env(tmp_path / "venv")
    return python


def pip(python: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "-q", *args],
                   check=True, capture_output=True, text=True)


def components(python: Path) -> set[tuple[str, str, str]]:
    out = subprocess.run([str(python), "-m", "specforge", "plugins", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return {(c["kind"], c["name"], c["package"]) for c in json.loads(out)["components"]}


def test_install_select_test_uninstall(child_env, tmp_path):
    budget = ("scheduler", "budget", "specforge-example-plugin")
    assert budget not in components(child_env)

    pip(child_env, "install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    assert budget in components(child_env)

    config = tmp_path / "pipeline.yaml"
    config.write_text("scheduler: {name: budget, tokens: 5}\n")
    shown = subprocess.run([str(child_env), "-m", "specforge", "config", "show", str(config), "--json"],
                           check=True, capture_output=True, text=True).stdout
    assert json.loads(shown)["scheduler"] == {"name": "budget", "tokens": 5}

    # The conformance suite has never heard of `budget`: it finds it through the entry point.
    checked = subprocess.run([str(child_env), "-m", "specforge", "conformance", "--plugin", "budget",
                              "--n", "400", "--no-deterministic", "--json"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    combos = json.loads(checked.stdout)["combinations"]
    assert combos and all(c["combination"]["scheduler"] == "budget" for c in combos if c["status"] == "certified")
    assert sum(c["status"] == "certified" for c in combos) >= 6
    # it met the probe cases built for schedulers too
    assert any(c["label"] == "probes of scheduler budget" and c["status"] == "certified" for c in combos)

    # The reproduce line a failure would print works for a third party's component.
    case = next(k["case"] for c in combos if c["status"] == "certified" for k in c["cases"])
    again = subprocess.run([str(child_env), "-m", "specforge", "conformance", "--case", json.dumps(case)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "budget" in again.stdout and "passed" in again.stdout

    # The package's own test suite, as its CI would run it (conformance through the pytest plug-in,
    # at a small N to keep this test quick: the certification at N = 400 is
    # the CLI run above; this one checks the pytest plug-in's wiring).
    tests = subprocess.run([str(child_env), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--specforge-n", "100",
                            str(EXAMPLE / "tests" / "test_budget.py"), str(EXAMPLE / "tests" / "test_conformance.py")],
                           capture_output=True, text=True, cwd=tmp_path)
    assert tests.returncode == 0, tests.stdout + tests.stderr

    pip(child_env, "uninstall", "-y", "specforge-example-plugin")
    assert budget not in components(child_env)


def test_a_third_party_drafter_trains_evaluates_resumes_and_is_certified(child_env, tmp_path):
    pip(child_env, "install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    model, chats, prompts = tiny_training_files(tmp_path)
    config = tmp_path / "train.yaml"
    config.write_text(
        f"target: {{model: '{model}', dtype: float32}}\n"
        f"data: {{source: '{chats}', max_length: 64, eval_sequences: 2}}\n"
        "features: {mode: offline, sequences_per_shard: 4}\n"
        "schedule: {total_steps: 6, warmup_steps: 1}\n"
        "batch: {sequences: 4, anchors: 4}\n"
        f"output: {{dir: '{tmp_path / 'run'}', checkpoint_interval: 3, eval_interval: 3, progress: false}}\n"
        "device: cpu\n")
    sf = [str(child_env), "-m", "specforge"]

    def train(*extra: str) -> dict:
        r = subprocess.run([*sf, "train", "--config", str(config), "drafter.name=hidden-head", "--json", *extra],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    # Killed after 4 steps (no final checkpoint, as a kill), then resumed from step 3 to the end.
    assert train("--max-steps", "4")["step"] == 4
    assert train()["step"] == 6
    drafter = tmp_path / "run" / "drafter"
    meta = json.loads((drafter / "config.json").read_text())
    assert meta["method"] == "hidden-head" and meta["trained_steps"] == 6
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert {"ce", "tau", "accept_rate@1"} <= set(metrics[-1])

    # A key the method does not have is named with the method's valid keys.
    bad = subprocess.run([*sf, "train", "--config", str(config), "drafter.name=hidden-head", "drafter.rank=4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "drafter.rank: unknown key; valid keys: name, seed, distill" in bad.stderr

    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(f"target: {{model: '{model}', dtype: float32}}\n"
                        f"drafter: {{name: hidden-head, checkpoint: '{drafter}'}}\n")
    r = subprocess.run([*sf, "eval", "--config", str(pipeline), "--dataset", str(prompts), "--prompts", "2",
                        "--max-new-tokens", "6", "--out", str(tmp_path / "eval"), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)["results"]
    assert [row["temperature"] for row in rows] == [0.0, 1.0]
    assert all(row["failed"] == 0 and row["rounds"] > 0 and 1.0 <= row["tau"] <= 2.0 for row in rows)

    # Certified by the conformance fixture, in the package's own test (as its CI would run it).
    certified = subprocess.run([str(child_env), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--specforge-n",
                                "1000", str(EXAMPLE / "tests" / "test_hidden_head.py")],
                               capture_output=True, text=True, cwd=tmp_path)
    assert certified.returncode == 0, certified.stdout[-3000:] + certified.stderr[-3000:]

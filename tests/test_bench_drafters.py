"""``specforge bench drafters`` end to end on a tiny target: every method trains on one
regenerated dataset at one budget (its step count from a timed probe), every arm (and a tree arm)
is measured against plain decoding in one run, and a second call reuses what the first made."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specforge.bench.drafters import TRAINING_PROMPTS, bench_table, load_bench_config, run_drafters_bench
from specforge.errors import ConfigError
from tiny_models import tiny_training_files


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model, chats, prompts = tiny_training_files(root)
    train = root / "train.yaml"
    train.write_text(
        f"target: {{model: '{model}', dtype: float32}}\n"
        f"data: {{source: '{chats}', max_length: 64, eval_sequences: 2,"
        " regenerate: {enabled: true, max_new_tokens: 12, max_batch: 4, shard_size: 6}}\n"
        "features: {mode: offline, sequences_per_shard: 4}\n"
        "schedule: {total_steps: 4, warmup_steps: 1}\n"
        "batch: {sequences: 4, anchors: 4}\n"
        "output: {progress: false}\n"
        "device: cpu\n")
    bench = root / "bench.yaml"
    bench.write_text(
        f"train: ['{train}']\n"
        "budget_minutes: 0.02\nprobe_steps: 2\neval_points: 2\n"
        "methods:\n"
        "  dspark: {drafter: {name: dspark, layers: 1, gamma: 3, target_layers: [0, 2], head: {name: markov, rank: 8},"
        " confidence: {name: dspark-head, rank: 8}}}\n"
        "  dflash: {drafter: {name: dflash, layers: 1, gamma: 3, target_layers: [0, 2]}}\n"
        "  eagle3: {drafter: {name: eagle3, steps: 3}}\n"
        "  medusa: {drafter: {name: medusa, heads: 3}}\n"
        "trees:\n"
        "  eagle3-tree: {of: eagle3, drafter: {tree: {topk: 2, nodes: 4}}}\n"
        "  medusa-tree: {of: medusa, drafter: {tree: [[0], [1], [0, 0]]}}\n"
        f"datasets: ['{prompts}']\nprompts: 2\nmax_new_tokens: 6\ntemperatures: [0.0, 1.0]\n"
        f"out: '{root / 'out'}'\n")
    return root, bench


def test_the_config_names_a_wrong_key_and_a_tree_of_no_method(tiny_bench):
    _, bench = tiny_bench
    with pytest.raises(ConfigError, match=r"budget_minute: unknown key; valid keys: train, overrides, budget_minutes"):
        load_bench_config([str(bench)], ["budget_minute=3"])
    with pytest.raises(ConfigError, match=r"trees.t.of: 'nope' is not one of the methods \(dspark, dflash"):
        load_bench_config([str(bench)], ["trees.t.of=nope", "trees.t.drafter={}"])
    paper = load_bench_config()
    assert list(paper.methods) == ["dspark-2", "dspark-5", "dflash-5", "eagle3", "medusa"]
    assert {t.of for t in paper.trees.values()} == {"eagle3", "medusa"}


def test_every_method_trains_at_one_budget_and_every_arm_is_measured_in_one_run(tiny_bench):
    root, bench = tiny_bench
    cmd = [sys.executable, "-m", "specforge", "bench", "drafters", "--config", str(bench), "--json"]
    # Data preparation alone first (nothing timed): the caches are made, nothing is trained.
    prep = subprocess.run([*cmd[:-1], "--prepare-only"], capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr[-4000:]
    out = root / "out"
    assert len(list((out / "features").iterdir())) == 3 and not list(out.glob("*/budget.json"))
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-4000:]
    result = json.loads(first.stdout)
    assert (out / "regenerated" / "progress.json").is_file()  # one regenerated dataset for all
    caches = sorted(p.name for p in (out / "features").iterdir())
    assert len(caches) == 3  # dspark and dflash tap the same layers and share a cache
    for name in ("dspark", "dflash", "eagle3", "medusa"):
        budget = json.loads((out / name / "budget.json").read_text())
        assert budget["steps"] == max(1, int(0.02 * 60 / budget["probe_step_seconds"]))
        meta = json.loads((out / name / "drafter" / "config.json").read_text())
        assert meta["method"] == name and meta["drafter"]["trained_steps"] == budget["steps"]
        assert result["methods"][name]["budget"] == budget
        assert not (out / name / "probe").exists()
    assert list(result["arms"]) == ["dspark", "dflash", "eagle3", "medusa", "eagle3-tree", "medusa-tree"]
    plain = None
    for name, arm in result["arms"].items():
        assert [(r["temperature"]) for r in arm["results"]] == [0.0, 1.0]
        for r in arm["results"]:
            assert r["failed"] == 0 and r["rounds"] > 0 and r["tau"] >= 1.0
            plain = plain or r["ar_tok_s"]
            assert r["ar_tok_s"] in (result["arms"]["dspark"]["results"][0]["ar_tok_s"],
                                     result["arms"]["dspark"]["results"][1]["ar_tok_s"])  # one baseline per T
        for key in ("T=0", "T=1"):
            assert arm["summary"][key]["round_cost"] > 0
    assert result["arms"]["eagle3-tree"]["pipeline"]["drafter"]["tree"] == {"topk": 2, "nodes": 4}
    assert result["machine"]["cpu"]
    table = bench_table(result)
    assert "eagle3-tree** | eagle3 | 0 |" in table and "macro τ" in table  # the only eagle3 tree: the best
    for png in ("acceptance.png", "learning.png"):
        assert (out / png).stat().st_size > 0
    assert (out / "table.md").read_text().strip() == table.strip()

    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "training steps" not in again.stderr  # every method complete: reused, not retrained


def test_the_memorisation_mode_evaluates_on_the_prompts_trained_on_with_each_methods_own_overrides(tmp_path):
    """``on_training_prompts``: the eval set is the first user turn of every conversation the methods
    trained on (the held-out tail left out); a method's ``train`` overrides reach its run only."""
    model, chats, _ = tiny_training_files(tmp_path, conversations=8)
    train = tmp_path / "train.yaml"
    train.write_text(
        f"target: {{model: '{model}', dtype: float32}}\n"
        f"data: {{source: '{chats}', max_length: 64, eval_sequences: 2,"
        " regenerate: {enabled: true, max_new_tokens: 8, max_batch: 4, shard_size: 8, temperature: 0}}\n"
        "features: {mode: offline, sequences_per_shard: 4}\n"
        "schedule: {total_steps: 2, warmup_steps: 1}\nbatch: {sequences: 2, anchors: 2}\n"
        "output: {progress: false}\ndevice: cpu\n")
    dspark = "{name: dspark, layers: 1, gamma: 3, target_layers: [0, 2], head: {name: none}, confidence: {name: none}}"
    bench = load_bench_config([], [
        f"train=['{train}']", "budget_minutes=0.01", "probe_steps=2", "eval_points=1", "on_training_prompts=true",
        f"methods.few.drafter={dspark}", f"methods.many.drafter={dspark}", "methods.many.train=[batch.anchors=6]",
        "prompts=6", "max_new_tokens=4", "temperatures=[0.0]", f"out={tmp_path / 'out'}"])
    result = run_drafters_bench(bench, say=lambda msg: None)
    out = tmp_path / "out"
    conversations = [json.loads(line) for line in (out / "regenerated").glob("*.jsonl").__next__().open()]
    prompts = [json.loads(line) for line in (out / TRAINING_PROMPTS).open()]
    assert prompts == [{"turns": [c["messages"][0]["content"]]} for c in conversations[:-2]]
    for arm in result["arms"].values():
        assert [r["dataset"] for r in arm["results"]] == ["training-prompts"]
    anchors = {m: json.loads(line)["blocks"] for m in ("few", "many")
               for line in (out / m / "metrics.jsonl").open() if '"split": "train"' in line}
    assert anchors["many"] > anchors["few"]  # 6 anchors a sequence, not the shared 2
    with pytest.raises(ConfigError, match=r"data.limit=3: the data, features and target are shared"):
        load_bench_config([], [f"methods.x.drafter={dspark}", "methods.x.train=[data.limit=3]"])

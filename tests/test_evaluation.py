"""`specforge eval` and the main job (`specforge run`): acceptance statistics computed by hand,
and the whole data → training → evaluation chain on a tiny checkpoint — run by specforge
installed from a copy of the repository, in a folder with nothing of the project around it —
reused on a second call, and its failures reported in one line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specforge.engine.request import RequestOutput, RequestStats
from specforge.evaluation import aggregate, comparison_table, summarize, table
from child_env import make_child_env
from tiny_models import tiny_training_files

REPO = Path(__file__).resolve().parents[1]


def _output(rounds: list[tuple[int, int]], tokens: int) -> RequestOutput:
    stats = RequestStats()
    for verified, accepted in rounds:
        stats.record_round(verified, accepted, drafted=verified)
    return RequestOutput(0, [1], list(range(tokens)), "", "length", stats)


def test_aggregate_pools_rounds_of_all_requests():
    a = _output([(3, 2), (3, 0)], tokens=4)  # 2 accepted + bonus, then 0 + correction
    b = _output([(3, 3)], tokens=4)
    agg = aggregate([a, b])
    assert agg["rounds"] == 3 and agg["new_tokens"] == 8
    assert agg["tau"] == pytest.approx((5 + 3) / 3)
    assert agg["verified_per_position"] == [3, 3, 3]
    assert agg["accepted_per_position"] == [2, 2, 1]
    assert agg["reached_per_position"] == [3, 2, 2]  # position 2 and 3 of A's second round were moot
    assert agg["acceptance"] == pytest.approx([2 / 3, 1.0, 0.5])
    assert agg["survival"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert agg["verify_waste"] == pytest.approx(4 / 9)


def test_aggregate_of_plain_rounds_and_of_nothing():
    agg = aggregate([_output([(0, 0)] * 5, tokens=5)])
    assert agg["tau"] == 1.0 and agg["acceptance"] == [] and math.isnan(agg["verify_waste"])
    assert math.isnan(aggregate([])["tau"])


def test_summary_and_table_cover_every_row():
    rows = [{"dataset": d, "temperature": t, "tau": tau, "acceptance": [0.5, 0.25], "speedup": s, "tok_s": 10.0,
             "ar_tok_s": 8.0, "latency_share": {"correction_head": 0.01}}
            for d, t, tau, s in (("a", 0.0, 2.0, 1.5), ("b", 0.0, 3.0, 2.5), ("a", 1.0, 1.5, 1.0))]
    summary = summarize(rows)
    assert summary["T=0"] == {"tau": 2.5, "speedup": 2.0}
    assert summary["T=1"]["tau"] == 1.5
    text = table({"results": rows, "summary": summary})
    assert "acc@2" in text and "mean (T=0)" in text and text.count("\n") == len(rows) + 3


def test_the_table_shows_draft_vocabulary_coverage_when_there_is_one():
    row = {"dataset": "a", "temperature": 0.0, "tau": 2.0, "acceptance": [0.5], "speedup": 1.5, "tok_s": 10.0,
           "ar_tok_s": 8.0, "latency_share": {}, "vocab_coverage": 0.9731}
    text = table({"results": [row], "summary": summarize([row])})
    assert "vocab %" in text.splitlines()[0] and "97.3" in text
    plain = {k: v for k, v in row.items() if k != "vocab_coverage"}
    assert "vocab %" not in table({"results": [plain], "summary": {}})


def test_the_comparison_table_puts_every_arm_beside_the_evaluated_one():
    def rows(tau, speedup):
        return [{"dataset": "a", "temperature": t, "tau": tau, "acceptance": [], "speedup": speedup,
                 "ar_tok_s": 8.0} for t in (0.0, 1.0)]

    result = {"results": rows(2.0, 1.5), "summary": summarize(rows(2.0, 1.5)),
              "compare": {"ngram": {"results": rows(1.25, 0.9), "summary": summarize(rows(1.25, 0.9))}}}
    lines = comparison_table(result, label="trained").splitlines()
    assert lines[0].split() == ["dataset", "T", "plain", "tok/s", "trained", "τ", "trained", "×plain",
                                "ngram", "τ", "ngram", "×plain"]
    assert lines[2].split() == ["a", "0", "8.0", "2.00", "1.50", "1.25", "0.90"]
    assert lines[-1].split() == ["mean", "(T=1)", "2.00", "1.50", "1.25", "0.90"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny checkpoint, conversations, eval prompts and a main-job config with regeneration."""
    root = tmp_path_factory.mktemp("mainjob")
    model, chats, prompts = tiny_training_files(root)
    cfg = root / "train.yaml"
    cfg.write_text(
        f"target: {{model: '{model}', dtype: float32}}\n"
        f"data: {{source: '{chats}', max_length: 64,"
        " regenerate: {enabled: true, max_new_tokens: 12, max_batch: 4, shard_size: 6}}\n"
        "features: {mode: offline, sequences_per_shard: 4}\n"
        "drafter: {layers: 1, gamma: 3, target_layers: [0, 2], head: {name: markov, rank: 8},"
        " confidence: {name: dspark-head, rank: 8}}\n"
        "schedule: {total_steps: 4, warmup_steps: 1}\n"
        "batch: {sequences: 4, anchors: 4}\n"
        f"output: {{dir: '{root / 'run'}', checkpoint_interval: 2, progress: false}}\n"
        "device: cpu\n")
    lookup = root / "lookup.yaml"  # a comparison arm on the same tiny target
    lookup.write_text(f"target: {{model: '{model}', dtype: float32}}\n"
                      "drafter: {name: ngram, gamma: 3}\nscheduler: {name: fixed}\nverifier: {name: rejection}\n")
    return root, cfg, prompts


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory):
    """specforge installed (not editable) from a copy of this repository into a throw-away
    environment, in a folder with nothing of the project above it: what a user who cloned or
    pip-installed the project has.  The environment sees this one's packages (torch, …)."""
    root = tmp_path_factory.mktemp("elsewhere")
    assert not any((d / "shared").exists() for d in root.parents), "a shared/ folder above the temp dir"
    copy = root / "specforge-copy"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "site", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    python, child_site = make_child_env(root / "venv")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "-q", "install", "--no-deps",
                    "--no-build-isolation", str(copy)], check=True, capture_output=True, text=True)
    where = subprocess.run([str(python), "-c", "import specforge.evalsets as e; print(e.packaged_sets())"],
                           check=True, capture_output=True, text=True, cwd=root).stdout.strip()
    assert Path(where).is_relative_to(child_site), where
    return python, root


def test_main_job_runs_anywhere_every_stage_then_reuses_them(tiny_run, installed_copy):
    """The installed package, run from a folder with no checkout around it, evaluates on the
    prompt sets it ships (named, not given as paths)."""
    python, cwd = installed_copy
    root, cfg, _ = tiny_run
    cmd = [str(python), "-m", "specforge", "run", "--config", str(cfg), "--dataset", "gsm8k",
           "--dataset", "mt-bench", "--prompts", "2", "--max-new-tokens", "6", "--temperature", "0", "1",
           "--compare", f"lookup={root / 'lookup.yaml'}", "--compare", "shipped=dspark"]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    assert first.returncode == 0, first.stderr[-3000:]
    run = root / "run"
    assert (run / "regenerated" / "progress.json").is_file()
    assert (run / "drafter" / "model.safetensors").is_file()
    result = json.loads((run / "eval" / "eval.json").read_text())
    assert (run / "eval" / "acceptance.png").stat().st_size > 0
    assert [(r["dataset"], r["temperature"]) for r in result["results"]] == [
        ("gsm8k", 0.0), ("gsm8k", 1.0), ("mt-bench", 0.0), ("mt-bench", 1.0)]
    for r in result["results"]:
        assert r["requests"] == 2 and r["failed"] == 0 and r["new_tokens"] > 0
        assert 1.0 <= r["tau"] <= 4.0 and len(r["acceptance"]) <= 3
        assert r["ar_new_tokens"] > 0 and r["speedup"] > 0
    assert result["main_job"]["training"]["train"]["step"] == 4
    assert set(result["main_job"]["seconds"]) == {"data_s", "training_s", "eval_s"}
    assert "τ" in first.stdout and "mean (T=0)" in first.stdout
    # The comparison arm decoded the same prompts against the same plain baseline; the arm for
    # another target (the shipped SmolLM2 drafter) was left out with a note.
    arm = result["compare"]["lookup"]["results"]
    assert [(r["dataset"], r["temperature"]) for r in arm] == [(r["dataset"], r["temperature"]) for r in result["results"]]
    for mine, theirs in zip(result["results"], arm):
        assert theirs["requests"] == 2 and theirs["tau"] >= 1.0 and theirs["ar_tok_s"] == mine["ar_tok_s"]
    assert "shipped" not in result["compare"] and "comparison arm 'shipped' left out" in first.stderr
    assert "lookup τ" in first.stdout and "trained ×plain" in first.stdout

    second = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "training already complete" in second.stderr
    assert "reusing" in second.stderr and "eval.json" in second.stderr


def _error_line(r: subprocess.CompletedProcess) -> str:
    """The one line a user-facing failure prints, after checking there is exactly one."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    return errors[0]


def test_main_job_failures_are_one_line_and_keep_the_earlier_stages(tiny_run, installed_copy):
    python, cwd = installed_copy
    root, cfg, _ = tiny_run
    run = root / "run"
    base = [str(python), "-m", "specforge", "run", "--config", str(cfg), "--prompts", "1",
            "--max-new-tokens", "4", "--temperature", "0"]
    if not (run / "drafter").is_dir():  # the test above made it; alone, this one makes it too
        subprocess.run([*base, "--dataset", "gsm8k"], check=True, capture_output=True, text=True, cwd=cwd)
    made = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())

    # A set that does not exist is refused before any stage starts, naming the sets there are.
    line = _error_line(subprocess.run([*base, "--dataset", "gsm8k", "--dataset", "nosuchset"],
                                      capture_output=True, text=True, cwd=cwd))
    assert "nosuchset.jsonl: no such prompt file" in line and "gsm8k, humaneval, math500, mbpp, mt-bench" in line

    # A damaged drafter fails the evaluation stage: the stage, the file and what to do, in one
    # line; regenerated data, features and checkpoints are all still there.
    weights = run / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = _error_line(subprocess.run([*base, "--dataset", "mbpp"], capture_output=True, text=True, cwd=cwd))
    assert line.startswith("error: evaluation failed:") and str(weights) in line, line
    assert "kept in" in line and "run the same command again" in line
    left = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert {m for m in made if not m.startswith(("drafter/", "eval/"))} <= left


def test_eval_cli_needs_a_drafter(tiny_run):
    root, _, prompts = tiny_run
    bad = subprocess.run([sys.executable, "-m", "specforge", "eval", "--config", "greedy",
                          f"target.model={root / 'model'}", "target.dtype=float32", "--dataset", str(prompts),
                          "--out", str(root / "eval-bad")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no drafter" in bad.stderr


def test_a_learning_drafter_forgets_before_each_set_and_temperature(tiny_run, monkeypatch):
    """No set is drafted from answers to its own prompts, nor gated by another set's rounds: a
    drafter that learns from finished requests (``suffix``) and a scheduler whose draft gate
    weighs the rounds it saw are returned to their configured state before every set × temperature."""
    from specforge.config import load_pipeline
    from specforge.evaluation import EvalSettings, evaluate
    from specforge_plugins.drafters import SuffixDrafter
    from specforge_plugins.schedulers import HwPrefixScheduler

    root, _, prompts = tiny_run
    learned_at_forget, gated_at_forget = [], []
    forget = SuffixDrafter.forget
    monkeypatch.setattr(SuffixDrafter, "forget",
                        lambda self: (learned_at_forget.append(len(self._learned)), forget(self)))
    forget_gate = HwPrefixScheduler.forget
    monkeypatch.setattr(HwPrefixScheduler, "forget",
                        lambda self: (gated_at_forget.append(sum(map(len, self._rounds.values()))), forget_gate(self)))
    config = root / "suffix.yaml"
    config.write_text(f"target: {{model: '{root / 'model'}', dtype: float32}}\n"
                      "drafter: {name: suffix, gamma: 3, min_context: 1}\n"
                      "scheduler: {name: hw-prefix, sps: [1.0, 0.9, 0.8, 0.7], draft_cost: 0.1}\n"
                      "verifier: {name: rejection}\n")
    pipeline = load_pipeline(str(config))
    evaluate(pipeline, EvalSettings(datasets=[str(prompts)], prompts=2, temperatures=(0.0, 1.0), max_new_tokens=6,
                                    speedup=False, progress=False))
    # the warm-up's request, then the T = 0 set's two, were learned — and forgotten before the next job
    assert learned_at_forget == [1, 2]
    assert len(gated_at_forget) == 2 and gated_at_forget[1] > 0  # the T = 0 set's drafted rounds, forgotten


def test_an_evaluation_sizes_every_arms_cache_for_its_prompts(tiny_run, monkeypatch):
    """Each arm keeps its own KV cache: sized for what these prompts can reach, not the 4,096
    positions a server keeps (64 requests × 4,096 positions × 4 arms did not fit a 23 GB machine)."""
    from specforge.config import load_pipeline
    from specforge.engine import engine as engine_mod
    from specforge.evaluation import EvalSettings, evaluate

    root, _, prompts = tiny_run
    sized = []
    check = engine_mod._check_cache_fits
    monkeypatch.setattr(engine_mod, "_check_cache_fits",
                        lambda target, slots, positions: (sized.append((slots, positions)), check(target, slots, positions)))
    pipeline = load_pipeline(str(root / "lookup.yaml"))
    evaluate(pipeline, EvalSettings(datasets=[str(prompts)], prompts=2, temperatures=(0.0,), max_new_tokens=6,
                                    concurrency=4, progress=False), compare={"again": pipeline})
    assert len(sized) == 3 and all(slots == 4 for slots, _ in sized)  # the pipeline, its comparison, plain
    assert len({p for _, p in sized}) == 1 and sized[0][1] < pipeline.engine.max_context

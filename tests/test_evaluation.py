"""`specforge eval` and the main job (`specforge run`): acceptance statistics computed by hand,
and the whole data → training → evaluation chain on a tiny checkpoint, reused on a second call."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from specforge.engine.request import RequestOutput, RequestStats
from specforge.evaluation import aggregate, summarize, table
from tiny_models import save_tiny, save_tokenizer


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


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny checkpoint, conversations, eval prompts and a main-job config with regeneration."""
    root = tmp_path_factory.mktemp("mainjob")
    model = save_tokenizer(save_tiny("llama", root / "model", vocab=96), vocab=96)
    chats = root / "chats.jsonl"
    chats.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": " ".join(f"w{5 + (i + j) % 40}" for j in range(6))},
                                 {"role": "assistant", "content": "w9 w9"}]}) + "\n" for i in range(12)))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [" ".join(f"w{7 + (3 * i + j) % 30}" for j in range(5))]}) + "\n"
                               for i in range(4)))
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
    return root, cfg, prompts


def test_main_job_runs_every_stage_then_reuses_them(tiny_run):
    root, cfg, prompts = tiny_run
    cmd = [sys.executable, "-m", "specforge", "run", "--config", str(cfg), "--dataset", str(prompts),
           "--prompts", "2", "--max-new-tokens", "6", "--temperature", "0", "1"]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    run = root / "run"
    assert (run / "regenerated" / "progress.json").is_file()
    assert (run / "drafter" / "model.safetensors").is_file()
    result = json.loads((run / "eval" / "eval.json").read_text())
    assert (run / "eval" / "acceptance.png").stat().st_size > 0
    assert [r["temperature"] for r in result["results"]] == [0.0, 1.0]
    for r in result["results"]:
        assert r["requests"] == 2 and r["failed"] == 0 and r["new_tokens"] > 0
        assert 1.0 <= r["tau"] <= 4.0 and len(r["acceptance"]) <= 3
        assert r["ar_new_tokens"] > 0 and r["speedup"] > 0
    assert result["main_job"]["training"]["train"]["step"] == 4
    assert "τ" in first.stdout and "mean (T=0)" in first.stdout

    second = subprocess.run(cmd, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "training already complete" in second.stderr
    assert "reusing" in second.stderr and "eval.json" in second.stderr


def test_eval_cli_needs_a_drafter(tiny_run):
    root, _, prompts = tiny_run
    bad = subprocess.run([sys.executable, "-m", "specforge", "eval", "--config", "greedy",
                          f"target.model={root / 'model'}", "target.dtype=float32", "--dataset", str(prompts),
                          "--out", str(root / "eval-bad")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no drafter" in bad.stderr

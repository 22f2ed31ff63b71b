"""`specforge train` end to end on a tiny checkpoint with a tokenizer: JSONL conversations →
feature cache → a few steps → checkpoint; a second call resumes instead of starting over."""

from __future__ import annotations

import json
import subprocess
import sys

from tiny_models import save_tiny, save_tokenizer


def test_train_cli_trains_then_resumes(tmp_path):
    model = save_tokenizer(save_tiny("llama", tmp_path / "model", vocab=96), vocab=96)
    data = tmp_path / "chats.jsonl"
    lines = [{"messages": [{"role": "user", "content": " ".join(f"w{5 + (i + j) % 40}" for j in range(6))},
                           {"role": "assistant", "content": " ".join(f"w{10 + (i * j) % 50}" for j in range(12))}]}
             for i in range(12)]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run"
    cfg = tmp_path / "train.yaml"
    cfg.write_text(
        f"target: {{model: '{model}', dtype: float32}}\n"
        f"data: {{source: '{data}', max_length: 64}}\n"
        "features: {mode: offline, sequences_per_shard: 4}\n"
        "drafter: {layers: 1, gamma: 3, target_layers: [0, 2], head: {name: markov, rank: 8},"
        " confidence: {name: dspark-head, rank: 8}}\n"
        "schedule: {total_steps: 6, warmup_steps: 1}\n"
        "batch: {sequences: 4, anchors: 4}\n"
        f"output: {{dir: '{out}', checkpoint_interval: 2, progress: false}}\n"
        "device: cpu\n")
    cmd = [sys.executable, "-m", "specforge", "train", "--config", str(cfg), "--json"]
    first = subprocess.run([*cmd, "--max-steps", "3"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["step"] == 3
    assert (out / "features" / "manifest.json").is_file()
    second = subprocess.run(cmd, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1])["step"] == 6
    assert (out / "drafter" / "model.safetensors").is_file()
    bad = subprocess.run([sys.executable, "-m", "specforge", "train", "--config", str(cfg), "optimizer.lrr=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "valid keys: lr, betas, eps, weight_decay" in bad.stderr

"""`specforge bench round` on a tiny target: every part of a round measured against plain steps of
the same run, in JSON, a table and a stacked-bar plot."""

from __future__ import annotations

import json
import subprocess
import sys

from tiny_models import tiny_training_files


def test_bench_round_reports_every_part_in_plain_steps(tmp_path):
    model, _, prompts = tiny_training_files(tmp_path)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(f"target: {{model: '{model}', dtype: float32}}\n"
                        "drafter: {name: dspark, layers: 1}\n"
                        "correction_head: {name: markov, rank: 8}\n"
                        "confidence: {name: dspark-head, rank: 8}\n")
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "specforge", "bench", "round", "--config", str(pipeline),
                        "--concurrency", "1", "2", "--gamma", "2", "3", "--datasets", str(prompts),
                        "--max-new-tokens", "6", "--repeats", "2", "--out", str(out), "drafter.candidates=4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "round.json").read_text())
    assert result["machine"]["cpu"] and result["machine"]["cpu"] in r.stdout
    assert [(row["concurrency"], row["gamma"]) for row in result["rows"]] == [(1, 2), (1, 3), (2, 2), (2, 3)]
    for row in result["rows"]:
        parts = row["parts_ms"]
        assert set(parts) == {"ingest", "backbone", "lm_head", "sequential", "draft_other", "confidence",
                              "scheduler", "verify_pass", "verifier", "commit"}
        assert all(v >= 0 for v in parts.values()) and parts["verify_pass"] > 0 and parts["backbone"] > 0
        assert abs(sum(parts.values()) - row["round_ms"]) < 1e-6 and row["plain_step_ms"] > 0
        assert row["round_in_plain_steps"] > row["overhead_in_plain_steps"] >= 0
        assert 1.0 <= row["tau"] <= row["gamma"] + 1 and row["speedup"] > 0
    assert (out / "round.png").stat().st_size > 0
    assert "overhead" in r.stdout and "verify" in r.stdout

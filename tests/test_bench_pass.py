"""`specforge bench pass` on a tiny target: a plain decoding step split into the engine's parts
and, on the torch runtime, the pass into its projections, attention, LM head and the rest — the
parts adding up to the step — in JSON, a table and a plot; a pipeline with a drafter refused."""

from __future__ import annotations

import json
import subprocess
import sys

from specforge.bench.pass_profile import PASS_PARTS, ROUND_PARTS
from tiny_models import tiny_training_files


def _bench(tmp_path, pipeline_text, *extra):
    model, _, _ = tiny_training_files(tmp_path)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(pipeline_text.format(model=model))
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "specforge", "bench", "pass", "--config", str(pipeline),
                        "--concurrency", "1", "3", "--context", "12", "--steps", "3", "--out", str(out), *extra],
                       capture_output=True, text=True)
    return r, out


def test_bench_pass_splits_a_plain_step_into_parts_that_add_up(tmp_path):
    r, out = _bench(tmp_path, "target: {{model: '{model}', dtype: float32}}\nsampling: {{temperature: 0}}\n"
                              "verifier: {{name: greedy}}\n")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "pass.json").read_text())
    assert result["backend"] == "torch" and result["machine"]["cpu"] in r.stdout
    assert [row["concurrency"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert set(row["round_ms"]) == set(ROUND_PARTS) and set(row["pass_ms"]) == set(PASS_PARTS)
        assert abs(sum(row["round_ms"].values()) - row["step_ms"]) < 1e-6
        assert abs(sum(row["pass_ms"].values()) - row["round_ms"]["pass"]) < 1e-6
        assert all(row["pass_ms"][p] > 0 for p in PASS_PARTS if p != "pass other")
        assert row["tok_per_s"] > 0 and row["steps"] == 3
    assert (out / "pass.png").stat().st_size > 0
    assert "attention" in r.stdout and "lm head" in r.stdout


def test_bench_pass_refuses_a_pipeline_that_drafts(tmp_path):
    r, out = _bench(tmp_path, "target: {{model: '{model}', dtype: float32}}\ndrafter: {{name: ngram}}\n")
    assert r.returncode != 0 and "without a drafter" in r.stderr
    assert not (out / "pass.json").exists()

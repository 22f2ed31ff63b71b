"""`specforge generate` as a user runs it, on a tiny checkpoint with a real tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiny_models import save_tiny, save_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", d, seed=3)
    save_tokenizer(d)
    return d


def run(*args):
    return subprocess.run([sys.executable, "-m", "specforge", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_streams_one_prompt_and_prints_stats(model_dir):
    r = run("--prompt", "w10 w11 w12 w10 w11", f"target.model={model_dir}", "target.dtype=float32",
            "sampling.temperature=0", "sampling.max_new_tokens=12", "drafter.name=ngram")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("w")
    assert "[stats] requests=1 failed=0 new_tokens=" in r.stderr


def test_json_for_a_prompt_file_with_one_bad_request(model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    long = " ".join(["w5"] * 300)  # longer than the context limit below
    prompts.write_text(
        json.dumps({"turns": ["w7 w8 w9"]}) + "\n" + json.dumps({"prompt": long}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "w20 w21"}]}) + "\n"
    )
    r = run("--prompts", str(prompts), "--json", f"target.model={model_dir}", "target.dtype=float32",
            "sampling.temperature=0", "sampling.max_new_tokens=8", "engine.max_context=128")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["finish_reason"] for row in rows][1] == "error"
    assert "context limit is 128" in rows[1]["error"]
    for row in (rows[0], rows[2]):
        assert row["error"] is None and len(row["tokens"]) == row["stats"]["new_tokens"] > 0
        assert row["stats"]["rounds"] >= 1


def test_greedy_cli_output_matches_hf_generate(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = run("--prompt", "w30 w31 w32", "--json", f"target.model={model_dir}", "target.dtype=float32",
            "sampling.temperature=0", "sampling.max_new_tokens=10", "drafter.name=ngram")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "w30 w31 w32"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert row["tokens"] == expected[: len(row["tokens"])]
    assert len(row["tokens"]) == 10 or row["tokens"][-1] == 1  # ran to the limit or hit EOS (w1)


def test_unknown_model_is_one_clear_error():
    r = run("--prompt", "hi", "target.model=/no/such/dir")
    assert r.returncode == 2
    assert "error: no model at '/no/such/dir'" in r.stderr and "Traceback" not in r.stderr

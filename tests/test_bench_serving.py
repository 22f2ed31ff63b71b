"""``specforge bench serving`` on a tiny target: every arm at every concurrency in one run, each
divided by plain decoding at the same concurrency, with latency percentiles and the verify budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specforge.bench.serving import LLAMA_SERVER_MODES, arm_pipelines, at_floors
from specforge.errors import ConfigError
from tiny_models import tiny_training_files


def _drafter_pipeline(tmp_path, model):
    """A random-init DSpark pipeline on the tiny target, as a YAML file (the bench's --drafter)."""
    drafter = tmp_path / "drafter.yaml"
    drafter.write_text(f"target: {{model: '{model}', dtype: float32}}\n"
                       "drafter: {name: dspark, gamma: 3, layers: 1, seed: 1}\ncorrection_head: {name: markov, rank: 8}\n"
                       "confidence: {name: entropy}\nscheduler: {name: fixed}\n")
    return drafter


def test_an_unknown_arm_is_named_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown arm 'fast'; valid arms: plain, fixed-2"):
        arm_pipelines(["fast"])


def test_every_arm_at_every_concurrency_against_plain_in_one_run(tmp_path):
    model, _, prompts = tiny_training_files(tmp_path, prompts=6)
    drafter = _drafter_pipeline(tmp_path, model)
    arms = ["fixed-2", "threshold-0.3", "threshold-0.5", "async-topk"]
    r = subprocess.run([sys.executable, "-m", "specforge", "bench", "serving", "--drafter", str(drafter),
                        "--arms", *arms, "--concurrency", "1", "3", "--datasets", str(prompts), "--prompts", "6",
                        "--sharegpt", "0", "--max-new-tokens", "6", "--out", str(tmp_path / "out"), "--json",
                        "--rate", "50", "--sla-ttft", "5", "--sla-itl", "1"],
                       capture_output=True, text=True,
                       env={**os.environ, "SPECFORGE_VLLM_PYTHON": str(tmp_path / "no-vllm" / "python")})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert list(result["arms"]) == ["plain", *arms]  # plain added: the denominator
    assert all(a["target"]["model"] == str(model) for a in result["arms"].values())
    # vLLM's and llama-server's arms are asked for (the default) but cannot run here: vLLM is not
    # installed, and the tiny target is no GGUF (or llama.cpp's tools are not built) — left out,
    # and the result says why
    assert result["peers"] == {}
    assert set(result["peers_missing"]) == {"vllm-plain", "vllm-ngram", *(f"llama-server-{m}" for m in LLAMA_SERVER_MODES)}
    assert all("not installed" in why for a, why in result["peers_missing"].items() if a.startswith("vllm"))
    assert all("GGUF" in why or "make llama.cpp" in why
               for a, why in result["peers_missing"].items() if a.startswith("llama-server"))
    # every arm's best throughput at each per-user floor (the defaults, 10 and 20 tok/s)
    assert set(result["floors"]) == {"10", "20"} and set(result["floors"]["10"]) == {"plain", *arms}
    recs = result["records"]
    assert {(x["arm"], x["concurrency"]) for x in recs} == {(a, c) for a in ["plain", *arms] for c in (1, 3)}
    for x in recs:
        assert x["failed"] == 0 and x["requests"] == 6 and x["new_tokens"] == 36
        # R = 1 goes twice round its slot per half: two halves in ABBA order; R = 3 runs once
        assert x["runs"] == (2 if x["concurrency"] == 1 else 1)
        assert x["ttft_s"]["p50"] > 0 and x["itl_s"]["p99"] >= x["itl_s"]["p50"] > 0
        assert 0 <= x["verify_waste"] <= 1
        if x["arm"] == "plain":
            assert x["vs_plain"] == 1.0 and x["verified_per_round"] == 0
        elif x["arm"] == "fixed-2":
            assert 0 < x["verified_per_round"] <= 2
    # the open loop: every arm under Poisson arrivals, latencies from each request's arrival
    ol = result["open_loop"]
    assert ol["rates"] == [50.0] and {x["arm"] for x in ol["records"]} == {"plain", *arms}
    for x in ol["records"]:
        assert x["requests"] == 6 and x["new_tokens"] == 36 and 0 <= x["sla_met"] <= 1
        assert x["ttft_s"]["p50"] > 0 and x["goodput_rps"] >= 0
    for png in ("frontier.png", "verify-budget.png", "theta-sweep.png"):
        assert (tmp_path / "out" / png).stat().st_size > 0


def test_the_best_throughput_at_a_per_user_floor():
    recs = [{"arm": "plain", "concurrency": 1, "tok_s": 60.0, "tok_s_per_user": 60.0},
            {"arm": "plain", "concurrency": 8, "tok_s": 200.0, "tok_s_per_user": 25.0},
            {"arm": "plain", "concurrency": 64, "tok_s": 400.0, "tok_s_per_user": 6.25},
            {"arm": "vllm-plain", "concurrency": 64, "tok_s": 800.0, "tok_s_per_user": 12.5},
            {"arm": "vllm-ngram", "concurrency": 1, "tok_s": None, "tok_s_per_user": None}]  # did not run
    floors = at_floors(recs, [10, 20, 100])
    assert floors["10"] == {"plain": {"tok_s": 200.0, "concurrency": 8, "tok_s_per_user": 25.0},
                            "vllm-plain": {"tok_s": 800.0, "concurrency": 64, "tok_s_per_user": 12.5}}
    assert floors["20"]["plain"]["concurrency"] == 8 and floors["20"]["vllm-plain"] is None
    assert floors["100"] == {"plain": None, "vllm-plain": None}


def test_an_unfinished_run_resumes_at_its_next_concurrency_and_refuses_other_settings(tmp_path):
    from specforge.bench.serving import ServingResumeError, run_serving_benchmark

    model, _, prompts = tiny_training_files(tmp_path, prompts=4)
    drafter = _drafter_pipeline(tmp_path, model)
    kw = dict(arms=["fixed-2"], drafter=[str(drafter)], datasets=[str(prompts)], per_set=4, sharegpt=0,
              max_new_tokens=4, vllm=False)

    class Stop(Exception):
        pass

    saved = []

    def killed_after_first(partial):
        saved.append(json.loads(json.dumps(partial)))  # what the file would hold
        raise Stop

    with pytest.raises(Stop):
        run_serving_benchmark(concurrency=(1, 2), checkpoint=killed_after_first, **kw)
    assert saved[0]["complete"] is False and saved[0]["concurrency_done"] == [1]
    lines = []
    result = run_serving_benchmark(concurrency=(1, 2), resume=saved[0], progress=lines.append, **kw)
    assert lines[0].startswith("resuming: R = 1") and not any(line.startswith("R=1 ") for line in lines)
    assert {(x["arm"], x["concurrency"]) for x in result["records"]} == {(a, c) for a in ("plain", "fixed-2")
                                                                         for c in (1, 2)}
    assert result["complete"] is True and all("vs_plain" in x for x in result["records"])
    with pytest.raises(ServingResumeError, match=r"max_new_tokens: 4 on disk, 5 now"):
        run_serving_benchmark(concurrency=(1, 2), resume=saved[0], **{**kw, "max_new_tokens": 5})


def test_llama_server_not_built_is_a_skipped_record_naming_the_build(monkeypatch, tmp_path):
    from specforge.peers import llamacpp, llamacpp_tools

    monkeypatch.setattr(llamacpp_tools, "_places", lambda: [tmp_path])  # built nowhere
    recs = llamacpp.serve_llamacpp_closed_loop(llamacpp_tools.tools_dir() / "x.gguf", [[1, 2, 3]], 2, 4,
                                               LLAMA_SERVER_MODES)
    assert [r["variant"] for r in recs] == list(LLAMA_SERVER_MODES)
    assert all(r["status"] == "skipped" and "make llama.cpp" in r["reason"] and r["tok_s"] is None for r in recs)


def test_llama_server_serves_the_gguf_in_a_closed_loop(tmp_path):
    """The real llama-server on the embedded GGUF: R slots, every request's own figures."""
    from specforge.bench.serving import _llama_server_records
    from specforge.peers.llamacpp_tools import missing_reason

    if missing_reason("llama-server"):
        pytest.skip(missing_reason("llama-server"))
    prompts = [[1, 504, 3158, 314, 260, 3767, 28, 198], [1, 2684, 1069, 1701, 30, 198], [1, 504, 1003, 198]]
    recs = _llama_server_records(prompts * 2, 2, 6, "smollm2", 0.0, tmp_path)
    assert [r["arm"] for r in recs] == [f"llama-server-{m}" for m in LLAMA_SERVER_MODES]
    for r in recs:
        assert r["status_line"] == "ok", r["status_line"]
        assert r["requests"] == 6 and r["new_tokens"] == 36 and r["tok_s"] > 0 and r["tok_s_per_user"] > 0
        assert r["ttft_s"]["p50"] > 0 and r["itl_s"]["p99"] >= r["itl_s"]["p50"] > 0
    assert (tmp_path / "llama-server-plain-r2.log").stat().st_size > 0

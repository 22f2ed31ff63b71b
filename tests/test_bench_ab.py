"""``specforge bench ab``: its options, and the per-trial ratios it reports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specforge.bench.ab import ARMS, REPORT, own_plain, ratios, table
from specforge.bench.runner import save


def specforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specforge", *args], capture_output=True, text=True)


def test_help_lists_every_arm():
    result = specforge("bench", "ab", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--arms", "--baseline", "--trials", "--concurrency", "--prompts", "--sharegpt",
                   "--max-new-tokens", "--threads", "--out"):
        assert option in result.stdout
    variants = ("plain", "ngram", "ngram-hw", "ngram-shut")
    engine = {f"{w}{f}-{v}" for w in ("", "native-") for f in ("eager", "compiled") for v in variants}
    engine |= {f"{a}/{p}" for a in engine for p in ("auto", "float32", "bfloat16")}
    hf = {"hf", "hf/float32", "hf/bfloat16"}
    llamacpp = {f"llamacpp-{v}" for v in variants}
    assert set(ARMS) == hf | engine | {f"{a}:{kv}" for a in engine for kv in ("model", "float32")} | llamacpp
    assert ":float32 suffix" in " ".join(result.stdout.split())
    assert "/PRECISION suffix" in " ".join(result.stdout.split())


def test_an_arm_names_its_kv_cache_dtype(tmp_path, monkeypatch):
    """``eager-plain:float32`` and ``eager-plain:model`` decode with those caches, paired."""
    from specforge.bench import ab
    from specforge.runtime import load_target
    from tiny_models import save_tiny, save_tokenizer

    path = save_tiny("llama", tmp_path / "m")
    save_tokenizer(path)
    monkeypatch.setattr(ab, "load_target", lambda *a, **k: load_target(str(path), dtype="bfloat16", backend="torch"))
    result = ab.run_ab(["eager-plain:model", "eager-plain:float32"], trials=2, concurrency=2, prompts=2,
                       max_new_tokens=3)
    assert result["kv_dtype"] == {"eager-plain:model": "bfloat16", "eager-plain:float32": "float32"}
    assert len(result["tok_s"]["eager-plain:float32"]) == 2
    assert save(ab.REPORT, result, tmp_path)[0].name == "ab-eager-plain=model-eager-plain=float32-c2.json"


def test_an_arm_names_its_precision(tmp_path, monkeypatch):
    """``eager-plain/float32`` and ``eager-plain/bfloat16`` decode with those targets, beside HF
    generate in float32; the JSON says what each arm ran in and on which machine."""
    from specforge.bench import ab
    from specforge.runtime import load_target
    from tiny_models import save_tiny, save_tokenizer

    path = save_tiny("llama", tmp_path / "m")
    save_tokenizer(path)
    monkeypatch.setattr(ab, "load_target", lambda model, **k: load_target(str(path), **k))
    monkeypatch.setattr(ab, "load_smollm2", lambda dtype, tokenizer=True: (
        load_target(str(path), dtype="float32", backend="torch").hf_model, None))
    arms = ["eager-plain/float32", "eager-plain/bfloat16", "hf/float32"]
    result = ab.run_ab(arms, trials=2, concurrency=2, prompts=2, max_new_tokens=3)
    assert {a: p["label"] for a, p in result["precision"].items()} == {
        "eager-plain/float32": "float32", "eager-plain/bfloat16": "bfloat16"}
    assert result["machine"]["cpu_capability"] and len(result["tok_s"]["hf/float32"]) == 2
    assert save(ab.REPORT, result, tmp_path)[0].name == "ab-eager-plain@float32-eager-plain@bfloat16-hf@float32-c2.json"


def test_a_baseline_outside_the_arms_is_refused_before_anything_loads():
    result = specforge("bench", "ab", "--arms", "hf", "eager-plain", "--baseline", "compiled-plain")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --baseline 'compiled-plain' is not one of --arms"


def test_ratios_divide_by_the_baseline_of_the_same_trial(tmp_path):
    # The machine halves its speed from the second trial on: per-trial ratios do not see it.
    speeds = {"hf": [10.0, 5.0, 5.0], "eager-plain": [20.0, 10.0, 10.0]}
    summary = ratios(speeds, "hf")
    assert summary["eager-plain"]["ratio_to_hf_median"] == 2.0
    assert summary["eager-plain"]["ratio_to_hf_quartiles"] == [2.0, 2.0, 2.0]
    assert summary["eager-plain"]["tok_s_median"] == 10.0
    assert summary["hf"]["ratio_to_hf_median"] == 1.0
    result = {"arms": list(speeds), "baseline": "hf", "concurrency": 1, "summary": summary}
    lines = table(result).splitlines()
    assert lines[0].split()[:3] == ["arm", "tok/s", "median"] and "÷ hf median" in lines[0]
    assert lines[3].split()[:3] == ["eager-plain", "10.0", "2.00"]
    assert save(REPORT, result, tmp_path)[0].name == "ab-hf-eager-plain-c1.json"


def test_a_drafting_arm_is_also_divided_by_its_own_backends_plain_arm():
    assert own_plain("llamacpp-ngram-shut") == "llamacpp-plain"
    assert own_plain("eager-ngram-hw/float32:model") == "eager-plain/float32:model"
    assert own_plain("native-compiled-ngram:float32") == "native-compiled-plain:float32"
    assert own_plain("eager-plain") == "eager-plain" and own_plain("hf/float32") == "hf/float32"
    speeds = {"eager-plain": [40.0, 20.0], "llamacpp-plain": [30.0, 30.0], "llamacpp-ngram-shut": [27.0, 30.0]}
    summary = ratios(speeds, "eager-plain")
    assert summary["llamacpp-ngram-shut"]["ratio_to_own_plain_median"] == 0.95
    assert summary["llamacpp-ngram-shut"]["ratio_to_eager-plain_median"] == pytest.approx(1.0875, abs=1e-3)
    assert "ratio_to_own_plain_median" not in summary["llamacpp-plain"]
    lines = table({"baseline": "eager-plain", "summary": summary}).splitlines()
    assert "÷ own plain median" in lines[0] and lines[4].split()[4] == "0.95"


def test_the_gated_ngram_arm_pairs_with_plain_and_counts_its_plain_rounds(tmp_path, monkeypatch):
    """``eager-ngram-hw``: the n-gram drafter behind the hardware-aware scheduler's draft gate,
    scheduled with this machine's step curve (measured once into the profile cache), paired with
    plain decoding; the JSON says how many rounds its gate kept plain."""
    from specforge.bench import ab
    from specforge.runtime import load_target
    from tiny_models import save_tiny, save_tokenizer

    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    path = save_tiny("llama", tmp_path / "m")
    save_tokenizer(path)
    monkeypatch.setattr(ab, "load_target", lambda *a, **k: load_target(str(path), dtype="float32", backend="torch"))
    result = ab.run_ab(["eager-plain", "eager-ngram-hw"], trials=2, concurrency=2, prompts=2, max_new_tokens=4)
    assert set(result["plain_rounds"]) == {"eager-ngram-hw"} and result["plain_rounds"]["eager-ngram-hw"] >= 0
    assert len(result["tok_s"]["eager-ngram-hw"]) == 2
    assert list((tmp_path / "cache" / "profiles").glob("*.json"))  # the step curve, measured once

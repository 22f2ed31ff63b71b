"""``specforge conformance summary``: the reports of a split false-alarm run, pooled."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specforge_conformance.summary import ReportError, read_seeds, summarize


def case(p_value: float, tv: float, label: str = "ngram / rejection", rerun: bool = False) -> dict:
    return {"combination": label, "alpha": 1e-7, "fit": {"p_value": p_value, "tv": tv},
            "rerun": {"fit": {"p_value": 0.5, "tv": 0.01}} if rerun else None}


def report(seed: int, *cases: dict, passed: bool = True, seconds: float = 10.0) -> dict:
    return {"tier": "fast", "seed": seed, "passed": passed, "seconds": seconds,
            "combinations": [{"cases": list(cases)}]}


@pytest.fixture
def reports(tmp_path):
    """A two-seed --out file and a single-seed report; seed 2 is missing."""
    several = tmp_path / "false-alarms-a.json"
    several.write_text(json.dumps({"seeds": [report(0, case(0.2, 0.03), case(0.01, 0.05, rerun=True)),
                                             report(1, case(0.3, 0.02), seconds=30.0)],
                                   "passed": True, "complete": True}))
    single = tmp_path / "false-alarms-b.json"
    single.write_text(json.dumps(report(3, case(0.4, 0.08, label="match / greedy"), seconds=20.0)))
    return [str(several), str(single)]


def specforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specforge", *args], capture_output=True, text=True)


def test_summary_pools_every_seed_of_every_file(reports):
    text, passed = summarize(read_seeds(reports))
    assert passed
    assert text.splitlines() == [
        "seeds: 3 (0..3; missing: [2]), code fingerprint unrecorded",
        "statistical cases: 4 (4 statistics), failed seeds: none, cases re-run at 10x N: 1",
        "smallest p-value: 0.01 (its level 1e-07; ngram / rejection [sequence], seed 0)",
        "largest TV: 0.0800 (match / greedy [sequence], seed 3)",
        "median seconds per seed: 20",
    ]


def test_every_statistic_of_a_case_is_pooled(tmp_path):
    """Reports with round-level statistics: the smallest p-value is looked for among all of them."""
    rich = {"combination": "probes of verifier rejection", "alpha": 6e-8, "level": 1e-8,
            "fit": {"p_value": 0.4, "tv": 0.05}, "rerun": None,
            "tests": {"sequence": {"p_value": 0.4, "tv": 0.05}, "emission": {"p_value": 0.002, "tv": 0.01}}}
    path = tmp_path / "rich.json"
    path.write_text(json.dumps(report(0, rich)))
    text, _ = summarize(read_seeds([str(path)]))
    assert "statistical cases: 1 (2 statistics)" in text
    assert "smallest p-value: 0.002 (its level 1e-08; probes of verifier rejection [emission], seed 0)" in text


def test_the_command_prints_the_summary_and_fails_with_a_failed_seed(reports, tmp_path):
    ok = specforge("conformance", "summary", *reports)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("seeds: 3 (0..3; missing: [2]), code fingerprint unrecorded\n")
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps(report(2, case(1e-9, 0.2), passed=False)))
    bad = specforge("conformance", "summary", *reports, str(failed))
    assert bad.returncode == 1
    assert "failed seeds: [2]" in bad.stdout and "missing: none" in bad.stdout


def test_an_unreadable_report_is_one_line_of_error(tmp_path):
    result = specforge("conformance", "summary", str(tmp_path / "absent.json"))
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert "absent.json" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(ReportError, match="no statistical case"):
        summarize({0: report(0)})


def test_seeds_run_on_different_code_are_not_pooled(tmp_path):
    """A long false-alarm run spans sessions: seeds of another code fingerprint certify nothing here."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"seeds": [dict(report(0, case(0.2, 0.03)), code="aaaa")]}))
    b.write_text(json.dumps({"seeds": [dict(report(1, case(0.3, 0.02)), code="bbbb")]}))
    with pytest.raises(ReportError, match=r"different code \(fingerprints aaaa: .*a.json seed 0; bbbb: .*b.json seed 1\)"):
        read_seeds([str(a), str(b)])
    b.write_text(json.dumps({"seeds": [dict(report(1, case(0.3, 0.02)), code="aaaa")]}))
    assert "code fingerprint aaaa" in summarize(read_seeds([str(a), str(b)]))[0]


def test_the_fingerprint_follows_the_code(tmp_path):
    from specforge_conformance.fingerprint import code_fingerprint, fingerprint_of

    now = code_fingerprint()
    assert len(now) == 16 and now == code_fingerprint()
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "sub" / "b.py").write_text("Y = 1\n")
    (pkg / "notes.txt").write_text("not code")
    first = fingerprint_of({"pkg": [pkg]})
    (pkg / "notes.txt").write_text("still not code")
    assert fingerprint_of({"pkg": [pkg]}) == first
    (pkg / "sub" / "b.py").write_text("Y = 2\n")
    assert fingerprint_of({"pkg": [pkg]}) != first
    (pkg / "sub" / "b.py").write_text("Y = 1\n")
    assert fingerprint_of({"pkg": [pkg]}) == first and fingerprint_of({"other": [pkg]}) != first


def test_the_shards_of_a_seed_are_joined_and_a_seed_missing_one_is_named(tmp_path):
    """--shard I/K reports: each row from the shard that ran it, seconds summed; a seed whose
    shards are not all there is left out of the pool and named."""
    def shard(seed, i, rows, passed=True):
        return {**report(seed, passed=passed, seconds=5.0), "shard": [i, 2], "code": "c0de",
                "combinations": rows}
    other = {"label": "x", "status": "other shard", "cases": []}
    a = {"label": "probes of verifier rejection", "status": "certified", "cases": [case(0.2, 0.01)]}
    b = {"label": "ngram / greedy", "status": "certified", "cases": [case(0.03, 0.02, label="ngram / greedy")]}
    path = tmp_path / "shards.json"
    path.write_text(json.dumps({"seeds": [shard(0, 1, [a, other]), shard(0, 2, [other, b]), shard(1, 2, [other, b])]}))
    incomplete: list[str] = []
    seeds = read_seeds([str(path)], incomplete)
    assert list(seeds) == [0] and incomplete == ["seed 1 (shards 2/2 only)"]
    assert [r["label"] for r in seeds[0]["combinations"]] == [a["label"], b["label"]]
    assert seeds[0]["seconds"] == 10.0 and seeds[0]["shards"] == 2 and "shard" not in seeds[0]
    text, passed = summarize(seeds, incomplete)
    assert passed and "statistical cases: 2" in text and text.endswith("not pooled, shards missing: seed 1 (shards 2/2 only)")
    path.write_text(json.dumps({"seeds": [shard(0, 1, [a, other]), shard(0, 2, [other, b], passed=False)]}))
    assert summarize(read_seeds([str(path)]))[1] is False

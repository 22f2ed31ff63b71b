"""``scripts/reference/deepspec_dspark.py`` refuses, in one line and before it writes anything,
to run without a DeepSpec checkout or on a checkout at another commit than the one it was written
against (the reference run's patches are specific to that commit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "reference" / "deepspec_dspark.py"


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--features", str(tmp_path / "features"), "--out", str(out), "--steps", "1",
           *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert not out.exists()  # nothing is half-written
    return done


def test_without_a_checkout_it_names_what_it_needs(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "deepspec_dspark: give --deepspec DIR, a checkout of github.com/deepseek-ai/DeepSpec at afdfa7c"]
    done = _run(tmp_path, "--deepspec", str(tmp_path))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "not a DeepSpec checkout (no deepspec/modeling/dspark/qwen3/modeling.py)" in done.stderr


def test_a_checkout_at_another_commit_is_refused_naming_both(tmp_path):
    repo = tmp_path / "DeepSpec"
    (repo / "deepspec/modeling/dspark/qwen3").mkdir(parents=True)
    (repo / "deepspec/modeling/dspark/qwen3/modeling.py").write_text("# not the reference\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "other"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    done = _run(tmp_path, "--deepspec", str(repo))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"at commit {head[:12]}; this script needs DeepSpec at afdfa7c" in done.stderr

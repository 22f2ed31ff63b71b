"""A measured choice is cached only where it was measured on a quiet machine, and says how quiet."""

from __future__ import annotations

import json
import time

import pytest

from specforge import machine
from specforge import measured


def _load(record):
    return record["value"]


def _dump(value):
    return {"value": value}


def test_a_choice_measured_while_others_used_the_cpus_is_used_but_not_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECFORGE_CACHE_WHEN_BUSY", raising=False)
    monkeypatch.setattr(machine, "others_share", lambda before, after: 0.5)  # one core of two taken
    path = tmp_path / "choice.json"
    with pytest.warns(RuntimeWarning, match=r"other processes took 50% .* not cached"):
        assert measured.cached_choice(path, lambda: 7, _load, _dump) == (7, False)
    assert not path.exists()
    monkeypatch.setattr(machine, "others_share", lambda before, after: 0.01)
    assert measured.cached_choice(path, lambda: 8, _load, _dump) == (8, False)
    assert json.loads(path.read_text()) == {"value": 8, "others_cpu": 0.01}
    assert measured.cached_choice(path, lambda: 9, _load, _dump) == (8, True)


def test_a_record_without_its_load_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "others_share", lambda before, after: 0.0)
    path = tmp_path / "choice.json"
    path.write_text(json.dumps({"value": 1}))  # written before the check existed
    with pytest.warns(RuntimeWarning, match="without checking that the machine was quiet"):
        assert measured.cached_choice(path, lambda: 2, _load, _dump) == (2, False)
    assert json.loads(path.read_text())["value"] == 2


def test_others_share_counts_what_other_processes_took():
    assert machine.others_share((10.0, 100.0, 1.0), (60.0, 200.0, 1.0)) == 0.5  # 50 of 100 s, none ours
    assert machine.others_share((10.0, 100.0, 1.0), (60.0, 200.0, 41.0)) == pytest.approx(0.1)  # 40 s ours
    assert machine.others_share(None, (1.0, 2.0, 0.0)) is None
    before = machine.cpu_times()
    if before is not None:  # Linux: this process's own spinning is not someone else's load
        time.sleep(0.3)
        idle = machine.others_share(before, after := machine.cpu_times())  # the neighbours alone
        t = time.perf_counter()
        while time.perf_counter() - t < 0.3:
            pass
        # spinning one core would read ≥ 0.5 on two cores were it counted as another process's
        assert machine.others_share(after, machine.cpu_times()) < idle + 0.3

"""Atomic writes (specforge.files): the target is the old version or the new one, never half."""

from __future__ import annotations

import os

import pytest

from specforge.files import remove_leftovers, replace_atomically, temporary_path, write_atomic


def test_write_atomic_replaces_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "a.json"
    write_atomic(path, "é\n")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_write_that_fails_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    write_atomic(path, "old")

    def no_rename(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="disk gone"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_write_without_overwrite_refuses_an_existing_file(tmp_path):
    path = tmp_path / "shard"
    write_atomic(path, b"first", overwrite=False)
    with pytest.raises(FileExistsError):
        write_atomic(path, b"second", overwrite=False)
    assert path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["shard"]


def test_a_directory_replaces_the_old_one_only_when_complete(tmp_path):
    target = tmp_path / "drafter"
    for version in ("1", "2"):
        with replace_atomically(target) as tmp:
            tmp.mkdir()
            (tmp / "model").write_text(version)
    assert (target / "model").read_text() == "2"
    with pytest.raises(RuntimeError):
        with replace_atomically(target) as tmp:
            tmp.mkdir()
            (tmp / "model").write_text("half")
            raise RuntimeError("killed")
    assert (target / "model").read_text() == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]


def test_leftovers_of_a_killed_run_are_removed(tmp_path):
    half_file = temporary_path(tmp_path / "a.json")
    half_file.write_text("{")
    half_dir = tmp_path / ".step-00000003.tmp4242"
    (half_dir / "drafter").mkdir(parents=True)
    (tmp_path / "keep.json").write_text("{}")
    remove_leftovers(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.json"]

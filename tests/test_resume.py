"""specforge.resume: the record a resumable job keeps, and the one error a rerun of other settings gets."""

from __future__ import annotations

import json

import pytest

from specforge.errors import SpecforgeError
from specforge.resume import (
    UnreadableRecord,
    differences,
    read_record,
    refuse_other_settings,
    tree_digest,
    write_record,
)


class Refused(SpecforgeError):
    pass


def test_a_record_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "deep" / "progress.json"
    assert read_record(path) is None  # a first run
    write_record(path, {"settings": {"n": 3}, "done": [1, 2], "where": tmp_path}, indent=1)
    assert read_record(path) == {"settings": {"n": 3}, "done": [1, 2], "where": str(tmp_path)}
    assert path.read_text().endswith("\n") and not list(path.parent.glob(".*tmp*"))


@pytest.mark.parametrize("text", ["{broken", "[1, 2]", "\xff"])
def test_an_unreadable_record_names_the_file(tmp_path, text):
    path = tmp_path / "progress.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(UnreadableRecord, match=rf"{path} is unreadable \("):
        read_record(path)


def test_differences_are_the_keys_of_this_run_the_record_does_not_hold():
    recorded = {"a": 1, "b": [1, 2], "gone": True}
    assert differences(recorded, {"a": 1, "b": [1, 2]}) == []
    assert differences(recorded, {"a": 2, "b": [1, 2], "new": 0}) == ["a", "new"]


def test_a_rerun_of_other_settings_is_refused_naming_each_difference():
    refuse_other_settings({"n": 4}, {"n": 4}, subject="x", remedy="y", error=Refused)  # the same: resumed
    with pytest.raises(Refused) as caught:
        refuse_other_settings({"n": 4, "layers": [0, 2], "shards": [1]}, {"n": 5, "layers": [0, 1], "shards": [2]},
                              subject="cache c", remedy="use a new directory", error=Refused,
                              summaries={"shards": "computed from other sequences"})
    assert str(caught.value) == ("cache c was made with other inputs or settings (n: 4 on disk, 5 now; layers: [0, 2] "
                                 "on disk, [0, 1] now; shards: computed from other sequences); use a new directory")


def test_the_tree_digest_follows_names_and_bytes_only(tmp_path):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "x.py").write_text("X = 1\n")
    (tmp_path / "a" / "sub" / "y.bin").write_bytes(b"\0" * 3)
    (tmp_path / "a" / "__pycache__").mkdir()
    (tmp_path / "a" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"compiled")
    first = tree_digest({"pkg": [tmp_path / "a"]})
    assert tree_digest({"pkg": [tmp_path / "a"]}) == first and len(first) == 64
    (tmp_path / "a" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"again")
    assert tree_digest({"pkg": [tmp_path / "a"]}) == first
    assert tree_digest({"other": [tmp_path / "a"]}) != first
    py_only = tree_digest({"pkg": [tmp_path / "a"]}, ".py")
    (tmp_path / "a" / "sub" / "y.bin").write_bytes(b"\1" * 3)
    assert tree_digest({"pkg": [tmp_path / "a"]}, ".py") == py_only and tree_digest({"pkg": [tmp_path / "a"]}) != first
    json.dumps(first)  # a record can hold it

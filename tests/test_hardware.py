"""HardwareProfile: SPS(B) lookup between, below and beyond the measured points; JSON files."""

from __future__ import annotations

import json

import pytest
import torch

from specforge.hardware import FORMAT, VERSION, HardwareProfile, HardwareProfileError


def test_list_index_zero_is_batch_one():
    prof = HardwareProfile([10.0, 8.0, 5.0])
    assert prof.points() == [(1, 10.0), (2, 8.0), (3, 5.0)]
    assert prof.sps(2) == 8.0


def test_piecewise_linear_between_points():
    prof = HardwareProfile({1: 10.0, 4: 4.0, 8: 2.0})
    assert prof.sps(1) == 10.0
    assert prof.sps(2) == pytest.approx(8.0)
    assert prof.sps(3) == pytest.approx(6.0)
    assert prof.sps(4) == 4.0
    assert prof.sps(6) == pytest.approx(3.0)
    assert prof.sps(8) == 2.0


def test_below_smallest_point_is_flat():
    prof = HardwareProfile({4: 5.0, 8: 3.0})
    assert prof.sps(1) == 5.0
    assert prof.sps(0) == 5.0
    assert prof.sps(4) == 5.0


def test_beyond_largest_point_decays_compute_bound():
    prof = HardwareProfile({4: 5.0, 8: 3.0})
    assert prof.sps(16) == pytest.approx(3.0 * 8 / 16)
    assert prof.sps(24) == pytest.approx(1.0)
    # Continuous at the last point, and B·SPS(B) (tokens/s) is constant past it.
    assert prof.sps(8.000001) == pytest.approx(3.0, rel=1e-6)
    assert 12 * prof.sps(12) == pytest.approx(8 * 3.0)


def test_single_point():
    prof = HardwareProfile({2: 4.0})
    assert prof.sps(1) == 4.0
    assert prof.sps(2) == 4.0
    assert prof.sps(8) == pytest.approx(1.0)


def test_vectorised_lookup_matches_scalar_and_keeps_shape():
    prof = HardwareProfile({1: 9.0, 3: 7.0, 10: 2.5})
    batch = torch.tensor([[0, 1, 2, 3], [5, 10, 11, 40]])
    out = prof.sps(batch)
    assert out.shape == batch.shape and out.dtype == torch.float64
    expected = [[prof.sps(int(b)) for b in row] for row in batch]
    assert out.tolist() == expected


def test_order_of_mapping_does_not_matter():
    assert HardwareProfile({8: 1.0, 1: 3.0}) == HardwareProfile({1: 3.0, 8: 1.0})


@pytest.mark.parametrize(
    "points, message",
    [
        ([], "at least one"),
        ({}, "at least one"),
        ([1.0, 0.0], "SPS(2)"),
        ([1.0, float("nan")], "SPS(2)"),
        ({0: 1.0}, "batch size 0"),
        ({1.5: 1.0}, "batch size 1.5"),
        ("1,2", "mapping"),
    ],
)
def test_bad_points_are_rejected(points, message):
    with pytest.raises(HardwareProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HardwareProfile(points)


def test_json_round_trip(tmp_path):
    prof = HardwareProfile({1: 18.25, 2: 18.0, 4: 17.125, 16: 9.5}, device="cpu: 2 cores", target="tiny",
                           dtype="bfloat16")
    path = tmp_path / "sps.json"
    prof.save(path)
    data = json.loads(path.read_text())
    assert data == {
        "format": FORMAT,
        "version": VERSION,
        "device": "cpu: 2 cores",
        "target": "tiny",
        "dtype": "bfloat16",
        "points": [[1, 18.25], [2, 18.0], [4, 17.125], [16, 9.5]],
    }
    again = HardwareProfile.load(path)
    assert again == prof
    assert again.sps(torch.arange(1, 40)).tolist() == prof.sps(torch.arange(1, 40)).tolist()


def test_hand_written_file_needs_only_points(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"points": [[1, 2.0], [4, 1.0]]}')
    prof = HardwareProfile.load(path)
    assert prof.points() == [(1, 2.0), (4, 1.0)]
    assert prof.device == "unknown"


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nowhere.json"
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        HardwareProfile.load(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"device": "x"}', 'missing "points"'),
        ('{"points": [[1, 2.0]], "sps": [1]}', "unknown key"),
        ('{"points": [1.0, 2.0]}', "pairs"),
        ('{"points": [[1, 2.0, 3]]}', "pairs"),
        ('{"points": [[1, -2.0]]}', "positive finite"),
        ('{"points": [[1, 2.0], [1, 3.0]]}', "given twice"),
        ('{"points": [[2.0, 1.0]]}', "positive integer"),
        ('{"format": "other", "points": [[1, 1.0]]}', "format"),
        ('{"version": 7, "points": [[1, 1.0]]}', "version 7"),
        ('{"device": 3, "points": [[1, 1.0]]}', '"device" must be a string'),
    ],
)
def test_malformed_file_names_the_file(tmp_path, content, message):
    path = tmp_path / "broken_profile.json"
    path.write_text(content)
    with pytest.raises(HardwareProfileError) as info:
        HardwareProfile.load(path)
    assert "broken_profile.json" in str(info.value)
    assert message in str(info.value)

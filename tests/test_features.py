"""Feature cache and anchor packing (docs/training.md#how-training-works) on a tiny random target."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch

from specforge.features import (
    CacheIntegrityError,
    CacheManifest,
    CacheMismatchError,
    FeatureCache,
    LayerRangeError,
    OnlineFeatures,
    anchor_candidates,
    estimate_size,
    pack_blocks,
    project_logits,
    sample_anchors,
    write_feature_cache,
)
from specforge.features import cache as cache_mod
from specforge.passes import VarlenBatch
from specforge.runtime.target import TargetModel

from tiny_models import tiny_model

LAYERS = [0, 2]  # the tiny model has 3 layers: the first and the last
# fp32 throughout: stored features differ from a one-sequence forward only by the row blocking of
# the batched matmuls (measured ≤ 3e-5 on activations of magnitude ~50).
ATOL, RTOL = 1e-4, 1e-5
QUIET = dict(progress=False, log=lambda *_: None)


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", vocab=96), None, torch.float32, name="tiny-a")


@pytest.fixture(scope="module")
def other_target():
    return TargetModel(tiny_model("llama", seed=1, vocab=96), None, torch.float32, name="tiny-b")


def make_sequences(n: int = 5, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 24, (1,), generator=g))
        ids = torch.randint(0, 96, (length,), generator=g)
        mask = (torch.rand(length, generator=g) > 0.3).long()
        out.append((ids, mask))
    return out


def write(target, seqs, directory, layers=LAYERS, **kw):
    kw = {"sequences_per_shard": 2, "max_batch_tokens": 24, **QUIET, **kw}
    return write_feature_cache(target, seqs, directory, layers, **kw)


def snapshot(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def direct_forward(target, ids):
    """The target alone on one sequence: fresh cache, positions from 0, logits on every row."""
    cache = target.new_cache(1, len(ids))
    batch = VarlenBatch.build([ids], [0], [0])
    return target.forward(batch, cache, torch.arange(len(ids)), tuple(LAYERS))


# -- cache round trip --------------------------------------------------------------------------


def test_round_trip_matches_direct_forward_and_lm_head(target, tmp_path):
    seqs = make_sequences()
    cache = write(target, seqs, tmp_path / "c")
    assert cache.verify().ok and len(cache) == len(seqs)
    feats = list(cache)
    assert [f.index for f in feats] == list(range(len(seqs)))
    for f, (ids, mask) in zip(feats, seqs):
        assert torch.equal(f.input_ids, ids) and torch.equal(f.loss_mask, mask)
        ref = direct_forward(target, ids)
        for k, layer in enumerate(LAYERS):
            torch.testing.assert_close(f.taps[:, k], ref.taps[layer], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(f.hidden, ref.hidden, atol=ATOL, rtol=RTOL)
        # The last hidden state through the frozen head gives back the target's logits, both the
        # runtime's and the Hugging Face oracle's.
        logits = project_logits(f.hidden, target.runtime.lm_head)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(logits, target.reference_logits(ids.tolist()), atol=ATOL, rtol=RTOL)
        # Layer 0's output is an independent check against HF's hidden_states (entry i+1 is the
        # output of layer i; HF's last entry is already normed, so layer 2 is checked above only).
        with torch.no_grad():
            hs = target.hf_model(ids[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(f.taps[:, 0], hs[1][0], atol=ATOL, rtol=RTOL)


def test_manifest_fields(target, tmp_path):
    seqs = make_sequences()
    write(target, seqs, tmp_path / "c")
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["format_version"] == 1 and m["target_name"] == "tiny-a" and len(m["target_fingerprint"]) == 16
    assert m["layer_ids"] == LAYERS and m["num_target_layers"] == 3 and m["hidden_size"] == 64
    assert (m["feature_dtype"], m["id_dtype"], m["mask_dtype"]) == ("float32", "int32", "uint8")
    assert m["num_sequences"] == 5 and m["num_tokens"] == sum(len(s[0]) for s in seqs)
    assert [s["num_sequences"] for s in m["shards"]] == [2, 2, 1]
    for s in m["shards"]:
        data = (tmp_path / "c" / s["file"]).read_bytes()
        assert s["sha256"] == hashlib.sha256(data).hexdigest() and s["num_bytes"] == len(data)


def test_online_features_match_the_cache_and_train(target, tmp_path):
    seqs = make_sequences()
    offline = list(write(target, seqs, tmp_path / "c"))
    online = OnlineFeatures(target, LAYERS)(seqs)
    for a, b in zip(offline, online):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(a.taps, b.taps, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(a.hidden, b.hidden, atol=ATOL, rtol=RTOL)
    # Online features come out of the target's inference mode yet must feed a trainable layer.
    w = torch.nn.Linear(2 * 64, 8)
    w(online[0].taps.flatten(1)).sum().backward()
    assert w.weight.grad is not None


# -- resume ------------------------------------------------------------------------------------


def test_killed_write_resumes_to_identical_content(target, tmp_path, monkeypatch):
    seqs = make_sequences(7)
    reference = snapshot(write(target, seqs, tmp_path / "ref").directory)

    real = cache_mod._write_new_file
    calls = []

    def dies_on_third_shard(path, data):
        calls.append(path.name)
        if len(calls) == 3:  # killed halfway through writing: only a temp file is left
            (path.parent / f".{path.name}.tmp999").write_bytes(data[: len(data) // 2])
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(cache_mod, "_write_new_file", dies_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        write(target, seqs, tmp_path / "c")
    monkeypatch.setattr(cache_mod, "_write_new_file", real)
    partial = FeatureCache(tmp_path / "c")
    assert not partial.complete
    with pytest.raises(CacheIntegrityError, match="not written yet"):
        partial.verify()
    done = {p: (tmp_path / "c" / p).stat().st_mtime_ns for p in ("shard-00000.safetensors", "shard-00001.safetensors")}

    written = []
    monkeypatch.setattr(cache_mod, "_write_new_file", lambda p, d: (written.append(p.name), real(p, d)))
    cache = write(target, seqs, tmp_path / "c")
    assert written == ["shard-00002.safetensors", "shard-00003.safetensors"]  # the first two were skipped
    assert {p: (tmp_path / "c" / p).stat().st_mtime_ns for p in done} == done
    assert cache.verify().ok
    assert snapshot(tmp_path / "c") == reference  # shards and manifest byte for byte; no temp files


def test_shard_written_but_not_recorded_is_adopted(target, tmp_path, monkeypatch):
    seqs = make_sequences(4)
    reference = snapshot(write(target, seqs, tmp_path / "ref").directory)
    real = CacheManifest.save
    calls = []

    def dies_before_recording_shard_1(manifest, directory):
        calls.append(1)
        if len(calls) == 3:  # initial manifest, shard 0 recorded, shard 1 renamed but not recorded
            raise KeyboardInterrupt
        real(manifest, directory)

    monkeypatch.setattr(CacheManifest, "save", dies_before_recording_shard_1)
    with pytest.raises(KeyboardInterrupt):
        write(target, seqs, tmp_path / "c")
    monkeypatch.setattr(CacheManifest, "save", real)
    assert (tmp_path / "c" / "shard-00001.safetensors").exists()
    write(target, seqs, tmp_path / "c")
    assert snapshot(tmp_path / "c") == reference


# -- bad input: one clear error, nothing lost or overwritten -------------------------------------


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # flip bytes in the tensor data, keeping the size
        for i in range(len(data) - 40, len(data) - 20):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, words", [("truncate", "is truncated"), ("flip", "is corrupt")])
def test_damaged_shard_is_named_and_left_alone(target, tmp_path, how, words):
    seqs = make_sequences()  # shards of 2, 2, 1 sequences
    write(target, seqs, tmp_path / "c")
    _damage(tmp_path / "c" / "shard-00001.safetensors", how)
    before = snapshot(tmp_path / "c")
    cache = FeatureCache(tmp_path / "c")
    report = cache.verify(raise_on_error=False)
    assert list(report.problems) == ["shard-00001.safetensors"] and report.readable_sequences == 3
    expected = rf"shard-00001.safetensors {words}.*3 of 5 sequences are still readable"
    with pytest.raises(CacheIntegrityError, match=expected):
        cache.verify()
    with pytest.raises(CacheIntegrityError, match=expected):
        list(cache)
    assert len(cache.shard(0)) == 2  # the intact shards still read
    with pytest.raises(CacheIntegrityError, match=rf"shard-00001.safetensors {words}.*delete"):
        write(target, seqs, tmp_path / "c")  # a rerun refuses rather than overwrite it
    assert snapshot(tmp_path / "c") == before


def test_damaged_manifest_is_named_and_left_alone(target, tmp_path):
    seqs = make_sequences()
    write(target, seqs, tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    before = snapshot(tmp_path / "c")
    with pytest.raises(CacheIntegrityError, match=r"manifest.json is unreadable"):
        FeatureCache(tmp_path / "c")
    with pytest.raises(CacheIntegrityError, match=r"manifest.json is unreadable"):
        write(target, seqs, tmp_path / "c")
    assert snapshot(tmp_path / "c") == before


def test_cache_of_another_target(target, other_target, tmp_path):
    seqs = make_sequences()
    write(target, seqs, tmp_path / "c")
    before = snapshot(tmp_path / "c")
    mine = FeatureCache(tmp_path / "c", target=target)
    assert mine.manifest.target_name == "tiny-a"
    pattern = (rf"made by target 'tiny-a' \(fingerprint {mine.manifest.target_fingerprint}\), not by this "
               rf"target 'tiny-b' \(fingerprint [0-9a-f]{{16}}\)")
    with pytest.raises(CacheMismatchError, match=pattern):
        FeatureCache(tmp_path / "c", target=other_target)
    with pytest.raises(CacheMismatchError, match=pattern):
        write(other_target, seqs, tmp_path / "c")
    assert snapshot(tmp_path / "c") == before


def test_other_inputs_or_settings_do_not_resume(target, tmp_path):
    seqs = make_sequences()
    write(target, seqs, tmp_path / "c")
    before = snapshot(tmp_path / "c")
    with pytest.raises(CacheMismatchError, match="computed from other sequences"):
        write(target, make_sequences(seed=1), tmp_path / "c")
    with pytest.raises(CacheMismatchError, match=r"layer_ids: \[0, 2\] on disk, \[0, 1\] now"):
        write(target, seqs, tmp_path / "c", layers=[0, 1])
    assert snapshot(tmp_path / "c") == before


def test_layer_ids_beyond_depth(target, tmp_path):
    seqs = make_sequences()
    message = r"layer ids \[3\] are beyond the target's depth: it has 3 layers \(valid ids are 0..2\)"
    with pytest.raises(LayerRangeError, match=message):
        write(target, seqs, tmp_path / "new", layers=[0, 3])
    assert not (tmp_path / "new").exists()  # checked before any work
    write(target, seqs, tmp_path / "c")
    before = snapshot(tmp_path / "c")
    with pytest.raises(LayerRangeError, match=message):
        write(target, seqs, tmp_path / "c", layers=[0, 3])
    with pytest.raises(LayerRangeError, match=message):
        OnlineFeatures(target, [3])
    assert snapshot(tmp_path / "c") == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_size_estimate_equals_tensor_bytes(target, tmp_path, dtype):
    seqs = make_sequences(7)
    cache = write(target, seqs, tmp_path / "c", dtype=dtype)
    files = sorted(tmp_path.joinpath("c").glob("shard-*.safetensors"))
    data_bytes, header_bytes = 0, 0
    for f in files:
        raw = f.read_bytes()
        header = 8 + int.from_bytes(raw[:8], "little")
        header_bytes += header
        data_bytes += len(raw) - header
    tokens = sum(len(s[0]) for s in seqs)
    assert estimate_size(tokens, LAYERS, 64, dtype, num_sequences=len(seqs)) == data_bytes
    assert header_bytes < 1024 * len(files)  # the overhead on top: one small JSON header per shard
    assert cache.num_tokens == tokens


# -- anchor packing ----------------------------------------------------------------------------


def dense_reference(seqs, anchors, block_size, trim, shift=1, mask_id=95):
    """Explicit loops over blocks and slots, straight from the packing rules (docs/training.md)."""
    ctx_off, off = [], 0
    for ids, _ in seqs:
        ctx_off.append(off)
        off += len(ids)
    tc = off
    blocks = []  # (seq, anchor, [(slot, label, valid)])
    for s, (ids, mask) in enumerate(seqs):
        for a in anchors[s]:
            slots, prefix_ok = [], True
            for j in range(block_size):
                q = a + shift + j
                prefix_ok = prefix_ok and q < len(ids) and bool(mask[q])
                slots.append((j, int(ids[q]) if prefix_ok else -100, prefix_ok))
            if trim:
                slots = [x for x in slots if x[2]]
            blocks.append((s, a, slots))
    tb = sum(len(b[2]) for b in blocks)
    mask = torch.zeros(tb, tc + tb, dtype=torch.bool)
    labels, valid, inputs, positions = [], [], [], []
    row = 0
    for s, a, slots in blocks:
        first = row
        for j, label, ok in slots:
            for c in range(tc):
                mask[row, c] = ctx_off[s] <= c < ctx_off[s] + a  # own sequence, strictly before the anchor
            for k in range(first, first + len(slots)):
                mask[row, tc + k] = True  # own block, both directions
            labels.append(label)
            valid.append(ok)
            inputs.append(int(seqs[s][0][a]) if j == 0 else mask_id)
            positions.append(a + j)
            row += 1
    return mask, torch.tensor(labels), torch.tensor(valid), torch.tensor(inputs), torch.tensor(positions)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("trim", [False, True])
def test_packed_mask_equals_dense_reference(seed, trim):
    g = torch.Generator().manual_seed(seed)
    seqs = make_sequences(4, seed=seed)
    block = int(torch.randint(1, 8, (1,), generator=g))
    packed = pack_blocks(seqs, block, max_anchors=3, generator=g, trim=trim, mask_token_id=95)
    anchors = [packed.block_anchor[packed.block_seq == s].tolist() for s in range(len(seqs))]
    mask, labels, valid, inputs, positions = dense_reference(seqs, anchors, block, trim)
    assert torch.equal(packed.dense_mask(), mask)
    assert torch.equal(packed.labels, labels) and torch.equal(packed.valid, valid)
    assert torch.equal(packed.input_ids, inputs) and torch.equal(packed.positions, positions)
    # no padding: the packed dimension is exactly the blocks' tokens, each block contiguous
    lengths = packed.block_cu[1:] - packed.block_cu[:-1]
    assert packed.num_tokens == int(lengths.sum()) == mask.shape[0]
    assert torch.equal(packed.block, torch.repeat_interleave(torch.arange(packed.num_blocks), lengths))
    if trim:
        assert bool(packed.valid.all())
    else:
        assert packed.num_tokens == block * packed.num_blocks
    # teacher rows: the target's hidden state one position before each valid label
    flat = torch.cat([s[0] for s in seqs])
    tr = packed.teacher_rows[packed.valid]
    assert torch.equal(tr - packed.ctx_start[packed.valid] + 1,
                       packed.block_anchor[packed.block[packed.valid]] + packed.slot[packed.valid] + 1)
    assert torch.equal(packed.prev_ids[packed.valid], flat[tr])


def test_valid_prefix_at_sequence_end_and_mask_boundary():
    ids = torch.arange(10) + 10
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    assert anchor_candidates(mask).tolist() == [2, 3, 6, 7, 8]  # 4: next is unmasked; 9: no next
    packed = pack_blocks([(ids, mask)], 4, anchors=[[2, 7]], mask_token_id=0)
    # anchor 2 predicts 3, 4, 5, 6: position 5 leaves the mask, so 6 is not supervised either
    # anchor 7 predicts 8, 9, then runs past the end of the sequence
    assert packed.valid.view(2, 4).tolist() == [[True, True, False, False], [True, True, False, False]]
    assert packed.labels.view(2, 4).tolist() == [[13, 14, -100, -100], [18, 19, -100, -100]]
    assert packed.input_ids.view(2, 4).tolist() == [[12, 0, 0, 0], [17, 0, 0, 0]]
    trimmed = pack_blocks([(ids, mask)], 4, anchors=[[2, 7]], trim=True)
    assert trimmed.num_tokens == 4 and trimmed.labels.tolist() == [13, 14, 18, 19]
    with pytest.raises(ValueError, match=r"anchors \[4\] are not inside the loss mask"):
        pack_blocks([(ids, mask)], 4, anchors=[[4]])


def test_anchor_sampling_is_seeded_and_bounded():
    mask = torch.ones(50, dtype=torch.long)
    a = sample_anchors(mask, 6, torch.Generator().manual_seed(3))
    b = sample_anchors(mask, 6, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and len(a) == 6 and len(set(a.tolist())) == 6
    assert bool((a[1:] > a[:-1]).all()) and int(a.max()) <= 48
    assert sample_anchors(torch.tensor([0, 1, 1, 0]), 6).tolist() == [1]  # fewer candidates than N


def test_flex_block_mask_matches_dense_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention",
                               reason="flex_attention is not in this torch; the dense mask is the CPU path")
    from specforge.features import flex_block_mask

    g = torch.Generator().manual_seed(0)
    packed = pack_blocks(make_sequences(4), 5, max_anchors=3, generator=g, trim=True)
    tb, tc = packed.num_tokens, packed.num_context
    q, k, v = torch.randn(1, 2, tb, 8), torch.randn(1, 2, tc + tb, 8), torch.randn(1, 2, tc + tb, 8)
    with warnings.catch_warnings():  # outside torch.compile it warns that it runs unfused: expected
        warnings.simplefilter("ignore")
        out = flex.flex_attention(q, k, v, block_mask=flex_block_mask(packed, block=16))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packed.dense_mask())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)



def test_micro_batches_bound_the_kv_cache():
    from specforge.features.compute import _micro_batches

    groups = _micro_batches([5, 5, 5, 20, 1, 1, 1, 1], 20)  # slots × longest ≤ 20, a longer one alone
    assert groups == [range(0, 3), range(3, 4), range(4, 8)]
    assert _micro_batches([30, 2], 20) == [range(0, 1), range(1, 2)]

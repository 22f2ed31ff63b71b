"""The runtime transformer against the Hugging Face forward (the oracle), on real tiny checkpoints."""

from __future__ import annotations

import pytest
import torch

from specforge.model_args import UnsupportedModelError
from specforge.model_files import TargetLoadError
from specforge.passes import VarlenBatch
from specforge.runtime import TargetModel, load_target
from tiny_models import FAMILIES, save_tiny, tiny_model

# fp32, same weights, different fusion of the projections: agreement to float rounding.  Gemma's
# sqrt(d)-scaled embeddings make its logits larger, hence a relative term.
TOL = 1e-4


@pytest.fixture(scope="module", params=[*FAMILIES, "llama-compiled"])
def target(request, tmp_path_factory):
    # "llama-compiled": the same oracle checks through the torch.compile'd forward
    family, _, compiled = request.param.partition("-")
    if compiled:
        from specforge.toolkit.compiled import compile_available

        if not compile_available():
            pytest.skip("no C++ compiler for inductor")
    path = save_tiny(family, tmp_path_factory.mktemp(request.param))
    return load_target(str(path), dtype="float32", compile=bool(compiled), backend="torch")


def prefill_logits(target: TargetModel, ids: list[int]) -> torch.Tensor:
    cache = target.new_cache(1, 128)
    batch = VarlenBatch.build([ids], [0], [0])
    return target.forward(batch, cache, logits_rows=torch.arange(len(ids))).logits


def test_prefill_matches_the_hf_forward(target):
    ids = torch.randint(0, target.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_logits(target, ids)
    ref = target.reference_logits(ids)
    assert torch.allclose(ours, ref, atol=TOL, rtol=1e-5), (ours - ref).abs().max()


def test_incremental_extension_matches_one_prefill(target):
    ids = torch.randint(0, target.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = target.new_cache(2, 128)
    pieces, start, rows = [ids[:11], ids[11:12], ids[12:20], ids[20:21], ids[21:]], 0, []
    for piece in pieces:
        out = target.forward(VarlenBatch.build([piece], [1], [start]), cache,
                             logits_rows=torch.arange(len(piece)))
        cache.advance(1, start + len(piece))
        start += len(piece)
        rows.append(out.logits)
    assert torch.allclose(torch.cat(rows), target.reference_logits(ids), atol=TOL, rtol=1e-5)


def test_varlen_batch_equals_each_request_alone_and_has_no_padding(target):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in (7, 19, 3)]
    news = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 3)]
    cache = target.new_cache(4, 128)
    slots = [3, 0, 2]  # not in request order, on purpose
    target.forward(VarlenBatch.build(prompts, slots, [0, 0, 0]), cache)
    batch = VarlenBatch.build(news, slots, [len(p) for p in prompts])
    assert batch.num_tokens == sum(len(n) for n in news)  # no padding tokens in the pass
    assert batch.tokens.tolist() == [t for n in news for t in n]
    out = target.forward(batch, cache, logits_rows=torch.arange(batch.num_tokens))
    for r, (prompt, new) in enumerate(zip(prompts, news)):
        alone = prefill_logits(target, prompt + new)[len(prompt):]
        rows = out.logits[int(batch.cu_seqlens[r]) : int(batch.cu_seqlens[r + 1])]
        assert torch.allclose(rows, alone, atol=TOL, rtol=1e-5)


def test_rollback_equals_a_fresh_prefill(target):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (12,), generator=gen).tolist()
    drafts = torch.randint(0, target.vocab_size, (6,), generator=gen).tolist()
    cache = target.new_cache(1, 128)
    target.forward(VarlenBatch.build([ids[:-1]], [0], [0]), cache)
    cache.advance(0, len(ids) - 1)
    # Verify [anchor, 6 drafts]; keep 2 accepted drafts, then a correction token.
    target.forward(VarlenBatch.build([[ids[-1], *drafts]], [0], [len(ids) - 1]), cache,
                   logits_rows=torch.arange(7))
    cache.advance(0, len(ids) + 6)  # the pass wrote anchor + 6 drafts
    cache.crop(0, len(ids) + 2)
    committed = ids + drafts[:2] + [5]
    nxt = target.forward(VarlenBatch.build([[5]], [0], [len(committed) - 1]), cache,
                         logits_rows=torch.tensor([0])).logits[0]
    assert torch.allclose(nxt, target.reference_logits(committed)[-1], atol=TOL, rtol=1e-5)


def test_taps_and_hidden_state(target):
    ids = list(range(1, 9))
    cache = target.new_cache(1, 64)
    out = target.forward(VarlenBatch.build([ids], [0], [0]), cache, taps=(0, 2))
    ref = target.hf_model(torch.tensor([ids]), output_hidden_states=True)
    # HF's hidden_states[i + 1] is the output of layer i; the last one is after the final norm.
    assert torch.allclose(out.taps[0], ref.hidden_states[1][0], atol=TOL)
    assert torch.allclose(out.hidden, ref.hidden_states[-1][0], atol=TOL)
    assert set(out.taps) == {0, 2}


def test_repeated_logits_rows_are_each_the_rows_logits(target):
    # the engine repeats a request's last row past its verified drafts; each distinct row is
    # projected once and handed out at every place it was asked for
    ids = [3, 17, 42, 9, 11, 5]
    rows = torch.tensor([0, 2, 2, 2, 5, 1, 5])
    out = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, 32), logits_rows=rows)
    whole = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, 32),
                           logits_rows=torch.arange(len(ids))).logits
    assert out.logits.shape == (len(rows), whole.shape[1])
    torch.testing.assert_close(out.logits, whole[rows])


def test_bfloat16_runtime_stays_close(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    ids = list(range(3, 30))
    fp32 = prefill_logits(load_target(str(path), dtype="float32", backend="torch"), ids)
    bf16 = prefill_logits(load_target(str(path), dtype="bfloat16", backend="torch"), ids)
    assert bf16.dtype == torch.float32  # logits are always handed out in float32
    assert (fp32.argmax(-1) == bf16.argmax(-1)).float().mean() > 0.8
    assert torch.allclose(fp32.softmax(-1), bf16.softmax(-1), atol=0.05)


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_path_is_one_clear_error():
    with pytest.raises(TargetLoadError, match="no model at 'no/such/model'.*embedded name"):
        load_target("no/such/model", backend="torch")


def test_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(TargetLoadError, match="pickled .bin checkpoints are refused"):
        load_target(str(tmp_path), backend="torch")


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama"):
        load_target(str(tmp_path), backend="torch")


def test_gguf_of_an_unsupported_architecture(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "bert")  # an architecture transformers' GGUF loader lacks
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TargetLoadError, match="odd.gguf.*bert"):
        load_target(str(path), backend="torch")


def test_a_checkpoint_missing_weights_is_refused_not_randomly_filled(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny("llama", tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetLoadError, match="missing weights.*layers.1.mlp.down_proj"):
        load_target(str(path), backend="torch")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"x")
    with pytest.raises(TargetLoadError, match="must be a .gguf"):
        load_target(str(path), backend="torch")


def test_embedded_model_resolves_without_network():
    from specforge.model_files import resolve_model

    directory, name = resolve_model("smollm2")
    assert (directory / name).is_file() and name.endswith(".gguf")


def test_reference_oracle_is_the_unchanged_hf_model():
    model = tiny_model("llama")
    target = TargetModel(model, None, torch.float32)
    assert target.hf_model is model


def test_cache_hands_out_the_lowest_free_slot():
    # Requests admitted together get consecutive slots in admission order, whatever order the
    # previous ones finished in: the padded attention reads them without a gather, and a
    # compiled forward keeps one layout (no new graph for the second batch).
    from specforge.runtime.torch.cache import KVCache

    cache = KVCache(1, 4, 1, 8, 2, torch.float32, "cpu")
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
    for slot in (0, 1, 2, 3):
        cache.free(slot)
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
    cache.free(2)
    cache.free(0)
    assert [cache.allocate(), cache.allocate()] == [0, 2]


def _fake_gguf(tmp_path, monkeypatch):
    """A GGUF "file" whose conversion is a tiny Llama with a real tokenizer; counts conversions."""
    import specforge.model_files as loading
    from tiny_models import save_tokenizer

    gguf = tmp_path / "src" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    source = save_tokenizer(save_tiny("llama", tmp_path / "tiny"))
    real_load, calls = loading._load, []

    def convert(directory, name, dtype):
        if name is None:  # the cached directory: the real loader
            return real_load(directory, None, dtype)
        calls.append(name)
        return real_load(source, None, dtype)

    monkeypatch.setattr(loading, "resolve_model", lambda model: (gguf.parent, gguf.name))
    monkeypatch.setattr(loading, "_load", convert)
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return gguf, calls


def test_a_converted_gguf_is_cached_and_reused(tmp_path, monkeypatch):
    from specforge.model_files import gguf_cache_dir, load_hf

    gguf, calls = _fake_gguf(tmp_path, monkeypatch)
    first, tok1 = load_hf("whatever.gguf")
    cached = gguf_cache_dir(gguf)
    assert calls == ["m.gguf"] and (cached / "config.json").is_file() and any(cached.glob("*.safetensors"))
    second, tok2 = load_hf("whatever.gguf")
    assert calls == ["m.gguf"]  # read from the cache, not converted again
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert tok2.apply_chat_template([{"role": "user", "content": "w5 w6"}], tokenize=True) == \
        tok1.apply_chat_template([{"role": "user", "content": "w5 w6"}], tokenize=True)
    # a changed file (size or mtime) is a different cache entry: converted again
    gguf.write_bytes(b"GGUF2")
    assert gguf_cache_dir(gguf) != cached
    load_hf("whatever.gguf")
    assert calls == ["m.gguf", "m.gguf"]
    # other dtypes are converted on the fly and never cached (the cache holds float32)
    load_hf("whatever.gguf", torch.bfloat16)
    assert calls == ["m.gguf"] * 3
    # a cache damaged after it was written is reported, replaced, and the load still succeeds
    weights = next(gguf_cache_dir(gguf).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="cached conversion is unreadable"):
        model, _ = load_hf("whatever.gguf")
    assert calls == ["m.gguf"] * 4 and torch.equal(model.state_dict()["lm_head.weight"], first.state_dict()["lm_head.weight"])
    load_hf("whatever.gguf")
    assert calls == ["m.gguf"] * 4  # the rewritten cache is read again


def test_an_unwritable_gguf_cache_warns_and_still_loads(tmp_path, monkeypatch):
    from specforge.model_files import load_hf

    gguf, calls = _fake_gguf(tmp_path, monkeypatch)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    with pytest.warns(RuntimeWarning, match="could not cache the converted GGUF"):
        model, _ = load_hf("whatever.gguf")
    assert model is not None and calls == ["m.gguf"]
    assert list(tmp_path.glob("cache*")) == [blocker]  # nothing half-written left behind


def test_a_truncated_checkpoint_is_one_clear_error(tmp_path):
    path = save_tiny("llama", tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(TargetLoadError, match="cannot load .*m"):
        load_target(str(path), backend="torch")


def test_peers_get_the_cached_conversion_as_a_directory(tmp_path, monkeypatch):
    # vLLM reads HF directories only: it gets the loader's own cached conversion, not a copy.
    from specforge.model_files import converted_checkpoint, gguf_cache_dir, load_hf

    gguf, calls = _fake_gguf(tmp_path, monkeypatch)
    path = converted_checkpoint("whatever.gguf")
    assert path == gguf_cache_dir(gguf) and (path / "config.json").is_file() and calls == ["m.gguf"]
    load_hf("whatever.gguf")
    assert converted_checkpoint("whatever.gguf") == path and calls == ["m.gguf"]  # reused by both
    converted_checkpoint("whatever.gguf", refresh=True)
    assert calls == ["m.gguf"] * 2
    monkeypatch.undo()  # the real model lookup: an HF directory is its own checkpoint
    directory = save_tiny("llama", tmp_path / "hf")
    assert converted_checkpoint(str(directory)) == directory


def test_peers_get_an_error_when_the_conversion_cannot_be_written(tmp_path, monkeypatch):
    from specforge.model_files import converted_checkpoint

    _fake_gguf(tmp_path, monkeypatch)
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    with pytest.raises(OSError):
        converted_checkpoint("whatever.gguf")

"""``specforge export`` / ``specforge import``: an eagle3 checkpoint in the layouts vLLM and SGLang
serve — their key names and config fields (from their ``llama_eagle3.py`` loaders), exact round
trips, and one clear error (nothing written) for every kind of bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.interop import export_checkpoint, import_checkpoint
from specforge.runtime import TargetModel
from specforge.toolkit.formats import InteropError
from specforge.vocab import DraftVocab
from specforge.toolkit.layers import SharedWeights
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, save_eagle3
from interop_cases import (PICKLE_REFUSED, assert_export_refused, assert_imports_refused, broken_copy,
                           pickle_only)
from tiny_models import tiny_model

SERVING_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("llama", seed=7, vocab=96, eos=None, layers=8), None, torch.float32)


@pytest.fixture(scope="module")
def checkpoint(target, tmp_path_factory):
    """A trained-looking eagle3 checkpoint for the target: random weights, a 40-token draft vocabulary."""
    vocab = DraftVocab.random(40, target.args.vocab_size, seed=3)
    shape = Eagle3Shape.from_model_args(target.args, target.runtime, draft_vocab_size=40)
    model = Eagle3Model(shape, seed=5, vocab=vocab).bind(SharedWeights.from_target(target.runtime), init_head=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = tmp_path_factory.mktemp("eagle3") / "drafter"
    save_eagle3(out, model, {"kind": "eagle3"}, target="tiny")
    return out, model


@pytest.mark.parametrize("fmt, top_level", [("vllm", True), ("sglang", False)])
def test_export_writes_the_serving_layout_and_imports_back_bit_for_bit(checkpoint, tmp_path, fmt, top_level, target):
    source, model = checkpoint
    s = model.shape
    assert len(s.layers) == 3 and s.rope_theta is not None
    out = tmp_path / fmt
    export_checkpoint(source, fmt, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == 96 and config["target_hidden_size"] == s.dim
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(s.layers)  # outputs of layers i
    if top_level:  # vLLM reads the inputs of layers i + 1, top-level
        assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in s.layers]
    else:
        assert "eagle_aux_hidden_state_layer_ids" not in config
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == SERVING_KEYS  # exactly: vLLM refuses unknown keys, SGLang drops them
    assert tensors["fc.weight"].shape == (s.dim, 3 * s.dim)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (s.n_heads * s.head_dim, 2 * s.dim)
    assert torch.equal(torch.arange(40) + tensors["d2t"], model.vocab.ids) and tensors["t2d"].sum() == 40
    torch.testing.assert_close(torch.cat([tensors["midlayer.mlp.gate_proj.weight"], tensors["midlayer.mlp.up_proj.weight"]]),
                               model.layer.w13.weight, rtol=0, atol=0)
    back = tmp_path / f"{fmt}-back"
    method, found, _ = import_checkpoint(out, back, target=target)
    assert (method, found) == ("eagle3", fmt)  # the layout is detected
    mine, theirs = load_file(str(source / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    again = tmp_path / f"{fmt}-again"
    export_checkpoint(back, fmt, again)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("fmt, maps", [("vllm", False), ("sglang", True)])
def test_a_whole_vocabulary_eagle3_goes_to_vllm_without_maps_and_to_sglang_with_identity_maps(target, tmp_path, fmt,
                                                                                              maps):
    # vLLM 0.32 refused to load d2t for a whole-vocabulary drafter ("no module or parameter named
    # 'draft_id_to_target_id'": tests/test_vllm_client.py found it); SGLang reads identity maps.
    shape = Eagle3Shape.from_model_args(target.args, target.runtime)
    model = Eagle3Model(shape, seed=5).bind(SharedWeights.from_target(target.runtime), init_head=True)
    source = tmp_path / "drafter"
    save_eagle3(source, model, {}, target="tiny")
    out = tmp_path / fmt
    export_checkpoint(source, fmt, out)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == (SERVING_KEYS if maps else SERVING_KEYS - {"d2t", "t2d"})
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 96
    if maps:
        assert not tensors["d2t"].any() and bool(tensors["t2d"].all())
    back = tmp_path / "back"
    import_checkpoint(out, back, target=target)
    mine, theirs = load_file(str(source / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_an_sglang_layout_with_layers_0_keys_and_a_frozen_embedding_is_imported(checkpoint, tmp_path, target):
    """SpecForge's own save (before its export) may name the layer ``layers.0`` and keep a copy of
    the target's embedding: the copy is checked against the target and dropped."""
    source, _ = checkpoint
    out = tmp_path / "sglang"
    export_checkpoint(source, "sglang", out)
    tensors = load_file(str(out / "model.safetensors"))
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    renamed["embed_tokens.weight"] = target.runtime.embed.clone()
    save_file(renamed, str(out / "model.safetensors"))
    method, fmt, notes = import_checkpoint(out, tmp_path / "back", target=target)
    assert method == "eagle3" and any("embed_tokens.weight" in n and "checked equal" in n for n in notes)
    renamed["embed_tokens.weight"] = torch.zeros_like(renamed["embed_tokens.weight"])
    save_file(renamed, str(out / "model.safetensors"))
    with pytest.raises(InteropError, match=r"not the target's embedding"):
        import_checkpoint(out, tmp_path / "back2", target=target)
    assert not (tmp_path / "back2").exists()


def test_bad_input_is_one_error_naming_the_file_and_nothing_is_written(checkpoint, tmp_path, target):
    source, _ = checkpoint
    good = tmp_path / "good"
    export_checkpoint(source, "vllm", good)

    def broken(name: str, change) -> Path:
        return broken_copy(good, tmp_path / name, change)

    cases = [
        (broken("missing", lambda c, t: t.pop("midlayer.self_attn.o_proj.weight")),
         r"model.safetensors: the tensor 'midlayer.self_attn.o_proj.weight' is missing"),
        (broken("misshaped", lambda c, t: t.update({"norm.weight": torch.ones(3)})),
         r"'norm.weight' has shape \(3,\), the config says"),
        (broken("other-target", lambda c, t: c.update({"hidden_size": 32})), r"made for another target — dim 32 \(target: 64\)"),
        (broken("unknown", lambda c, t: c.update({"architectures": ["MysteryModel"]})), r"an unknown checkpoint layout"),
    ]
    cases.append((pickle_only(tmp_path / "pickled", {}), PICKLE_REFUSED))
    assert_imports_refused(cases, tmp_path, target)
    assert_export_refused(source, "medusa-1", tmp_path / "ds",
                          r"eagle3 exports to vllm, sglang, deepspec, eagle, hf, not 'medusa-1'")


def test_the_commands(checkpoint, tmp_path):
    source, _ = checkpoint
    out = tmp_path / "v"
    r = subprocess.run([sys.executable, "-m", "specforge", "export", str(source), "--to", "vllm", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "specforge", "import", str(out), "--out", str(tmp_path / "b")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "drafter.name=eagle3" in r.stdout, r.stderr[-2000:]
    assert "the target's depth is not recorded" not in r.stderr  # the export recorded it
    r = subprocess.run([sys.executable, "-m", "specforge", "export", str(source), "--to", "vllm", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not empty; choose a new folder" in r.stderr


@pytest.fixture(scope="module")
def medusa_checkpoints(target, tmp_path_factory):
    """Two trained-looking medusa checkpoints: over a draft vocabulary, and over the whole one."""
    from specforge_plugins.drafters.medusa.model import MedusaHeads, MedusaShape, save_medusa

    root = tmp_path_factory.mktemp("medusa")
    out = {}
    for name, n in (("vocab", 30), ("whole", None)):
        vocab = None if n is None else DraftVocab.random(n, target.args.vocab_size, seed=4)
        shape = MedusaShape.from_model_args(target.args, heads=3, res_layers=2, draft_vocab_size=n)
        heads = MedusaHeads(shape, seed=2, vocab=vocab).bind(target.runtime.norm, target.runtime.lm_head, init_output=True)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        save_medusa(root / name, heads, {"kind": "medusa"}, target="tiny")
        out[name] = root / name
    return out


@pytest.mark.parametrize("fmt, which", [("vllm", "vocab"), ("vllm", "whole"), ("medusa-1", "whole")])
def test_medusa_exports_and_imports_back_bit_for_bit(medusa_checkpoints, tmp_path, target, fmt, which):
    source = medusa_checkpoints[which]
    out = tmp_path / "x"
    export_checkpoint(source, fmt, out)
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / ("model.safetensors" if fmt == "vllm" else "medusa_lm_head.safetensors")))
    if fmt == "vllm":
        assert config["architectures"] == ["MedusaModel"] and config["medusa_fc_bias"] is True
        assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2
        assert {"blocks.2.layers.1.weight", "blocks.2.layers.1.bias", "lm_heads.2.weight"} <= set(weights)
        assert ("token_map" in weights) == (which == "vocab")
    else:
        assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
        assert {"2.1.linear.weight", "2.1.linear.bias", "2.2.weight"} <= set(weights)
    method, found, _ = import_checkpoint(out, tmp_path / "back", target=target)
    assert (method, found) == ("medusa", fmt)
    mine, theirs = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_draft_vocabulary_cannot_go_to_fasterdecoding_and_a_missing_head_is_named(medusa_checkpoints, tmp_path,
                                                                                      target):
    assert_export_refused(medusa_checkpoints["vocab"], "medusa-1", tmp_path / "m1",
                          r"a draft vocabulary of 30 tokens; FasterDecoding's heads")
    out = tmp_path / "v"
    export_checkpoint(medusa_checkpoints["whole"], "vllm", out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("lm_heads.1.weight")
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(InteropError, match=r"model.safetensors: the tensor 'lm_heads.1.weight' is missing"):
        import_checkpoint(out, tmp_path / "back", target=target)
    assert not (tmp_path / "back").exists()


def test_hf_export_is_the_checkpoint_with_a_model_card_and_refuses_a_corrupt_one(checkpoint, tmp_path):
    source, _ = checkpoint
    evaluation = {"settings": {"prompts": 2, "max_new_tokens": 16, "concurrency": 1},
                  "results": [{"dataset": "gsm8k", "temperature": 0.0, "tau": 2.5, "acceptance": [0.8, 0.6],
                               "tok_s": 30.0, "ar_tok_s": 20.0, "speedup": 1.5}],
                  "summary": {"T=0": {"tau": 2.5, "speedup": 1.5}}}
    conformance = {"tier": "fast", "alpha": 1e-6, "passed": True, "combinations": [{}, {}, {}]}
    (tmp_path / "eval.json").write_text(json.dumps(evaluation))
    (tmp_path / "conf.json").write_text(json.dumps(conformance))
    out = tmp_path / "hf"
    notes = export_checkpoint(source, "hf", out, evaluation=tmp_path / "eval.json", conformance=tmp_path / "conf.json")
    assert notes == [] and {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    assert (out / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: specforge\nbase_model: tiny\n") and "- eagle3" in card
    assert "gsm8k" in card and "2.50" in card and "**passed** over 3 combinations" in card
    bare = tmp_path / "bare"
    notes = export_checkpoint(source, "hf", bare)
    assert notes and "no τ table and no conformance result" in notes[0]
    assert "Not measured for this card" in (bare / "README.md").read_text()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(source, corrupt)
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    assert_export_refused(corrupt, "hf", tmp_path / "never", r"model.safetensors is corrupt")
    assert_export_refused(source, "hf", tmp_path / "never", r"not a `specforge eval` result",
                          evaluation=tmp_path / "conf.json")


def test_the_format_api_and_the_model_card_import_no_job_and_no_host():
    """A format author's module imports only low-level specforge modules (docs/interop.md), and the
    jobs depend on the model card, not the other way round: importing either drags in none of
    the host, the pipeline config, the engine, the evaluation or the export/import jobs."""
    code = ("import sys, specforge.toolkit.formats, specforge.model_card; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('specforge'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(r.stdout.split())
    forbidden = {"specforge.plugins", "specforge.config", "specforge.engine", "specforge.evaluation",
                 "specforge.interop", "specforge.runtime"}
    assert not loaded & forbidden, sorted(loaded & forbidden)

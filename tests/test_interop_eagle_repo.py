"""``specforge export --to eagle`` / ``specforge import`` of ``eagle3`` checkpoints in the original
EAGLE repository's layout (SafeAILab/EAGLE: ``EaModel.from_pretrained`` reads a ``LlamaForCausalLM``
config and ``midlayer.*`` tensors; the fused layers are hard-coded from the target's depth): exact
round trips, a folder written with EAGLE's own key names and config imported with ``--target``, a
reference forward written from ``eagle/model/cnets.py`` alone agreeing with our model, detection
unambiguous against the other layouts, and one clear error (nothing written) for whatever cannot
be exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.interop import _formats, export_checkpoint, import_checkpoint
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel
from specforge.toolkit.formats import InteropError
from specforge.vocab import DraftVocab
from specforge.toolkit.layers import SharedWeights
from specforge_plugins.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specforge_plugins.drafters.eagle3.formats.eagle_repo import eagle_repo_layers
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, eagle3_layers, load_eagle3, save_eagle3
from interop_cases import (PICKLE_REFUSED, assert_export_refused, assert_imports_refused, broken_copy, our_chain,
                           pickle_only, read)
from tiny_models import save_tiny, tiny_model

V, L, D, N = 96, 8, 64, 40
EAGLE_LAYERS = (1, 3, 4)  # the inputs of layers 2, L//2 = 4, L − 3 = 5 of an 8-layer target
KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
}


def make_target(layers: int = L, family: str = "llama") -> TargetModel:
    return TargetModel(tiny_model(family, seed=7, vocab=V, eos=None, layers=layers), None, torch.float32,
                       name=f"tiny-{family}-{layers}")


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


def build(root: Path, name: str, target: TargetModel, vocab: int | None = N, **shape) -> Path:
    """A trained-looking eagle3 checkpoint for ``target``: random weights, no norm weight left at 1."""
    overrides = {"draft_vocab_size": vocab, **shape}
    s = Eagle3Shape.from_model_args(target.args, None if shape.get("rope_theta", 0) is None else target.runtime,
                                    **overrides)
    model = Eagle3Model(s, seed=5, vocab=None if vocab is None else DraftVocab.random(vocab, V, seed=3))
    model.bind(SharedWeights.from_target(target.runtime), init_head=True)
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    save_eagle3(root / name, model, {"kind": "eagle3", "gamma": 4}, target="tiny")
    return root / name


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("drafters")
    return {"vocab": build(root, "vocab", target), "whole": build(root, "whole", target, vocab=None)}


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_eagles_hard_coded_layers_are_eagle3s_default_for_every_depth_it_can_serve():
    assert eagle_repo_layers(8) == EAGLE_LAYERS and eagle_repo_layers(7) == (1, 2, 3)
    assert eagle_repo_layers(32) == (1, 15, 28)  # Llama-3.1-8B: inputs of 2, 16, 29
    assert all(eagle_repo_layers(n) == eagle3_layers(n) for n in range(7, 160))
    assert all(eagle_repo_layers(n) is None for n in range(1, 7))  # no three distinct layer outputs


@pytest.mark.parametrize("name", ["vocab", "whole"])
def test_export_writes_eagles_layout_and_imports_back_bit_for_bit(drafters, target, tmp_path, name):
    source = drafters[name]
    model, _ = load_eagle3(source)
    out = tmp_path / "eagle"
    export_checkpoint(source, "eagle", out)
    config, tensors = read(out)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == V and config["hidden_size"] == D
    assert config["draft_vocab_size"] == (N if name == "vocab" else V)  # cnets.Model sizes lm_head from it
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    # no layer ids (EAGLE hard-codes them), no head_dim (derived), no target_hidden_size (EAGLE then
    # reads the target's own embedding)
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "head_dim", "target_hidden_size"):
        assert key not in config
    assert config["specforge"]["n_target_layers"] == L and model.shape.layers == EAGLE_LAYERS
    assert set(tensors) == (KEYS | {"d2t", "t2d"} if name == "vocab" else KEYS)  # maps only for a draft vocabulary
    assert tensors["fc.weight"].shape == (D, 3 * D)
    assert tensors["lm_head.weight"].shape == (config["draft_vocab_size"], D)
    if name == "vocab":
        assert torch.equal(torch.arange(N) + tensors["d2t"], model.vocab.ids) and int(tensors["t2d"].sum()) == N
    for checked in (None, target):
        back = tmp_path / f"back-{checked is None}"
        method, fmt, notes = import_checkpoint(out, back, target=checked)
        assert (method, fmt) == ("eagle3", "eagle")  # detected
        assert tensors_equal(read(source)[1], read(back)[1])
        assert json.loads((back / "config.json").read_text())["eagle3"] == json.loads((source / "config.json")
                                                                                      .read_text())["eagle3"]
    again = tmp_path / "again"
    export_checkpoint(back, "eagle", again)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert {k: v for k, v in read(again)[0].items() if k != "specforge"} == \
           {k: v for k, v in config.items() if k != "specforge"}


# -- a folder written with EAGLE's own names and config ------------------------------------------------


def eagle_folder(root: Path, target: TargetModel, dtype=torch.float32, embed: bool = True,
                 vocab: int | None = N) -> Path:
    """config.json = ``eagle/traineagle3/config.json`` of the tiny target's sizes (no rope_theta:
    EAGLE's default 10000 is the tiny Llama's); model.safetensors = ``cnets.Model``'s state dict
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, the ``d2t``/``t2d`` buffers of ``scandata``'s
    formula) and, as with ``target_hidden_size`` or a save that keeps frozen parameters, the
    target's ``embed_tokens``."""
    n = vocab or V
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
              "hidden_size": D, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 2048,
              "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
              "torch_dtype": str(dtype).removeprefix("torch."), "transformers_version": "4.28.1", "use_cache": True,
              "vocab_size": V, "draft_vocab_size": n}
    gen = torch.Generator().manual_seed(17)

    def rnd(*shape, scale=0.1, base=0.0):
        return (base + scale * torch.randn(*shape, generator=gen)).to(dtype)

    p, i = "midlayer.", 128
    t = {"fc.weight": rnd(D, 3 * D), "norm.weight": rnd(D, base=1.0), "lm_head.weight": rnd(n, D),
         p + "self_attn.q_proj.weight": rnd(64, 2 * D), p + "self_attn.k_proj.weight": rnd(32, 2 * D),
         p + "self_attn.v_proj.weight": rnd(32, 2 * D), p + "self_attn.o_proj.weight": rnd(D, 64),
         p + "hidden_norm.weight": rnd(D, base=1.0), p + "input_layernorm.weight": rnd(D, base=1.0),
         p + "post_attention_layernorm.weight": rnd(D, base=1.0), p + "mlp.gate_proj.weight": rnd(i, D),
         p + "mlp.up_proj.weight": rnd(i, D), p + "mlp.down_proj.weight": rnd(D, i)}
    counts = torch.randint(0, 1000, (V,), generator=gen)
    used = counts.topk(n).indices.sort().values  # scandata: the N most frequent ids, ascending
    t["d2t"] = used - torch.arange(n)
    t["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    if embed:
        t["embed_tokens.weight"] = target.runtime.embed.to(dtype)
    root.mkdir()
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def eagle_reference(config: dict, w: dict[str, torch.Tensor], embed: torch.Tensor, ids: torch.Tensor,
                    feats: torch.Tensor, a: int, steps: int) -> torch.Tensor:
    """EAGLE's drafting (``eagle/model/cnets.py``: ``Model.forward`` and ``topK_genrate`` with
    top_k = 1, teacher-forced), from the foreign key names and config alone.  The context rows
    t < a read (``fc(feats_t)``, token t + 1) at position t, causally (``_make_causal_mask``); the
    first draft is ``lm_head(norm(out_hidden[a − 1]))``; draft step i reads (token a + i,
    ``out_hidden`` of the step before — not normed) at position a − 1 + i, attending to the context
    and its ancestors.  ``LlamaDecoderLayeremb``: cat(input_layernorm(emb), hidden_norm(hidden)),
    head_dim = hidden_size // heads, ``LlamaRotaryEmbedding`` of the config's rope_theta (10000 when
    absent).  Logits ``[steps, N]``."""
    w = {k: v.float() for k, v in w.items()}
    d, heads, kvh = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps, p = d // heads, config["rms_norm_eps"], "midlayer."
    inv_freq = 1.0 / (config.get("rope_theta", 10000) ** (torch.arange(0, hd, 2).float() / hd))

    def rms(x, weight):  # LlamaRMSNorm
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

    def layer(emb, hidden, positions, cache, visible):
        x = torch.cat([rms(emb, w[p + "input_layernorm.weight"]), rms(hidden, w[p + "hidden_norm.weight"])], -1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(-1, kvh, hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, kvh, hd)
        angles = positions.float()[:, None] * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        cache[0], cache[1] = torch.cat([cache[0], k]), torch.cat([cache[1], v])
        kk, vv = (c.repeat_interleave(heads // kvh, 1) for c in cache)  # repeat_kv
        scores = torch.einsum("thd,shd->hts", q, kk) / hd ** 0.5
        o = torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv)
        y = hidden + o.reshape(-1, d) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(y, w[p + "post_attention_layernorm.weight"])
        return y + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T

    cache = [torch.zeros(0, kvh, hd), torch.zeros(0, kvh, hd)]
    hidden = feats[:a].float() @ w["fc.weight"].T  # the 3·d-wide input differs from the embedding's d
    out = layer(embed[ids[1:a + 1]], hidden, torch.arange(a), cache, torch.ones(a, a, dtype=torch.bool).tril())
    h, logits = out[-1:], []
    for i in range(steps):
        logits.append((rms(h, w["norm.weight"]) @ w["lm_head.weight"].T)[0])
        if i + 1 < steps:
            h = layer(embed[ids[a + 1 + i:a + 2 + i]], h, torch.tensor([a + i]), cache,
                      torch.ones(1, a + 1 + i, dtype=torch.bool))
    return torch.stack(logits)


@torch.no_grad()
def test_an_eagle_folder_imports_with_target_and_computes_eagles_function(target, tmp_path):
    foreign = eagle_folder(tmp_path / "eagle", target)
    with pytest.raises(InteropError, match=r"config.json: EAGLE records no fused layers .* the target's depth n is "
                                           r"not recorded: import with --target"):
        import_checkpoint(foreign, tmp_path / "unchecked")
    assert not (tmp_path / "unchecked").exists()
    method, fmt, notes = import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert (method, fmt) == ("eagle3", "eagle")
    assert any("embed_tokens.weight" in n and "checked equal" in n for n in notes)
    meta = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert meta["target"] == target.name  # the target it was checked against
    s = meta["eagle3"]
    assert s["layers"] == list(EAGLE_LAYERS) and s["n_target_layers"] == L and s["draft_vocab_size"] == N
    assert s["norm_eps"] == 1e-5 and s["rope_theta"] == 10000.0 and s["head_dim"] == D // 4
    config, w = read(foreign)
    model = load_eagle3(tmp_path / "ours")[0].bind(SharedWeights.from_target(target.runtime))
    assert torch.equal(model.vocab.ids, torch.arange(N) + w["d2t"])  # target id = draft id + d2t[draft id]
    gen = torch.Generator().manual_seed(0)
    t_len, steps = 10, 4
    ids = torch.randint(0, V, (t_len + steps + 1,), generator=gen)
    feats = torch.randn(t_len, 3 * D, generator=gen)
    for a in (1, 4, t_len):
        theirs = eagle_reference(config, w, target.runtime.embed, ids, feats, a, steps)
        mine = our_chain(model, ids, feats, a, steps)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))  # the same drafts (then id + d2t[id] in both)
    export_checkpoint(tmp_path / "ours", "eagle", tmp_path / "again")
    w.pop("embed_tokens.weight")  # the frozen copy is the target's: not written back
    assert tensors_equal(w, read(tmp_path / "again")[1])


def test_a_half_precision_eagle_folder_keeps_its_dtype(target, tmp_path):
    """EAGLE's trainer saves float16/bfloat16 (``save_16bit_model``), without the frozen embedding."""
    foreign = eagle_folder(tmp_path / "eagle", target, dtype=torch.float16, embed=False)
    import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert read(tmp_path / "ours")[1]["model.fc.weight"].dtype == torch.float16
    export_checkpoint(tmp_path / "ours", "eagle", tmp_path / "again")
    config, tensors = read(tmp_path / "again")
    assert config["torch_dtype"] == "float16" and tensors_equal(read(foreign)[1], tensors)


def engine(target, host, drafter):
    return Engine(target, host.create_verifier("rejection"), drafter=drafter,
                  correction_head=host.create_correction_head("none", {}),
                  confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                  scheduler=host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=0.0, max_new_tokens=10),
                  engine=EngineConfig(max_batch=2, max_context=96),
                  trees=host.get("verifier", "rejection").metadata.trees)


def test_an_imported_eagle_checkpoint_drafts_as_a_chain_and_a_tree_with_greedy_parity(target, host, tmp_path):
    import_checkpoint(eagle_folder(tmp_path / "eagle", target), tmp_path / "ours", target=target)
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=10, seed=i)
                for i, p in enumerate(([5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14]))]
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=10),
                   engine=EngineConfig(max_batch=2, max_context=96)).generate(requests)
    for tree in (None, {"topk": 3, "nodes": 8}):  # EAGLE drafts a dynamic tree (topK_genrate)
        d = Eagle3Drafter(Eagle3Config(checkpoint=str(tmp_path / "ours"), gamma=3, tree=tree))
        outs = engine(target, host, d).generate(requests)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain] and sum(o.stats.drafted for o in outs)


# -- detection: exactly one format claims each folder ---------------------------------------------------


def test_detection_is_unambiguous_against_the_other_layouts(drafters, target, host, tmp_path):
    def claims(directory: Path) -> list[str]:
        return [f"{m}/{f.name}" for m, fs in _formats(host).items() for f in fs.values() if f.detect(directory)]

    for fmt in ("eagle", "vllm", "sglang"):
        export_checkpoint(drafters["vocab"], fmt, tmp_path / fmt)
        assert claims(tmp_path / fmt) == [f"eagle3/{fmt}"]
    assert claims(eagle_folder(tmp_path / "foreign", target)) == ["eagle3/eagle"]
    # a Llama model's own one-layer folder: LlamaForCausalLM, num_hidden_layers 1, but model.layers.0.*
    llama = save_tiny("llama", tmp_path / "llama", seed=1, vocab=V, eos=None, layers=1)
    assert json.loads((llama / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert claims(llama) == []
    # EAGLE's config over another layer name (EAGLE's strict=False load would leave midlayer random)
    config, tensors = read(tmp_path / "eagle")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(renamed / "model.safetensors"))
    (renamed / "config.json").write_text(json.dumps(config))
    assert claims(renamed) == []
    # a pickle-only EAGLE folder (its trainer's pytorch_model.bin) is claimed by none and refused by the driver
    pickled = pickle_only(tmp_path / "pickled", config, key="fc.weight")
    assert claims(pickled) == []
    assert_imports_refused([(pickled, PICKLE_REFUSED)], tmp_path, target)


# -- what cannot be exact is refused, with nothing written -------------------------------------------------


@pytest.mark.parametrize("spec, layers, message", [
    (dict(layers=(2, 3, 5)), L, r"fuses the target layers \[2, 3, 5\] and EAGLE hard-codes the outputs of layers "
                                r"\[1, 3, 4\] for a 8-layer target .* export --to vllm or sglang"),
    (dict(layers=(1, 4, 3)), L, r"fuses the target layers \[1, 4, 3\] and EAGLE hard-codes"),
    (dict(qk_norm=True), L, r"EAGLE's Llama EAGLE-3 layer has no q/k norm — export --to deepspec keeps it"),
    (dict(), 6, r"its target has 6 layers, and EAGLE's hard-coded captures \(the inputs of layers 2, n//2 and "
                r"n − 3: \[2, 3\]\) are not the outputs of three distinct layers"),
    (dict(head_dim=32), L, r"its attention is 4 heads × 32 wide and its hidden size 64; EAGLE's layer derives "
                           r"head_dim = hidden_size / num_attention_heads"),
    (dict(rope_theta=None), L, r"does not record its target's RoPE base"),
])
def test_an_eagle3_checkpoint_that_eagle_cannot_load_exactly_is_refused(target, tmp_path, spec, layers, message):
    source = build(tmp_path, "d", target if layers == L else make_target(layers), **spec)
    assert_export_refused(source, "eagle", tmp_path / "out", message)


def test_bad_eagle_folders_are_one_error_naming_the_file_and_nothing_is_written(target, tmp_path):
    good = eagle_folder(tmp_path / "good", target)

    def broken(name: str, change) -> Path:
        return broken_copy(good, tmp_path / name, change)

    cases = [
        (broken("shallow", lambda c, t: c.update(specforge={"n_target_layers": 6})), None,
         r"config.json: for a 6-layer target EAGLE's captures \(the inputs of layers 2, n//2, n − 3: \[2, 3\]\) are "
         r"not the outputs of three distinct layers"),
        (broken("other-depth", lambda c, t: c.update(specforge={"n_target_layers": 10})), target,
         r"made for another target — n_target_layers 10 \(target: 8\)"),
        (broken("other-rope", lambda c, t: c.update(rope_theta=500000.0)), target,
         r"made for another target — RoPE base 500000 \(target: 10000\); EAGLE rotates with its config's rope_theta"),
        (broken("scaled-rope", lambda c, t: c.update(rope_scaling={"type": "linear", "factor": 2.0})), target,
         r"config.json: its own RoPE scaling .* rotates with the target's RoPE"),
        (broken("target-width", lambda c, t: c.update(target_hidden_size=32)), target,
         r"config.json: target_hidden_size 32 differs from hidden_size 64"),
        (broken("other-dim", lambda c, t: c.update(hidden_size=32)), target,
         r"made for another target — dim 32 \(target: 64\)"),
        (broken("other-embedding", lambda c, t: t.update({"embed_tokens.weight": torch.zeros(V, D)})), target,
         r"its 'embed_tokens.weight' is not the target's embedding"),
        (broken("missing", lambda c, t: t.pop("midlayer.self_attn.o_proj.weight")), target,
         r"model.safetensors: the tensor 'midlayer.self_attn.o_proj.weight' is missing"),
        (broken("two-fused", lambda c, t: t.update({"fc.weight": torch.ones(D, 2 * D)})), target,
         r"'fc.weight' has shape \(64, 128\), the config says \(64, 192\)"),
        (broken("bias", lambda c, t: t.update({"midlayer.self_attn.q_proj.bias": torch.zeros(64)})), target,
         r"model.safetensors: tensors the EAGLE-3 layer does not have: midlayer.self_attn.q_proj.bias"),
    ]
    for directory, checked, message in cases:
        out = tmp_path / f"out-{directory.name}"
        with pytest.raises(InteropError, match=message):
            import_checkpoint(directory, out, target=checked)
        assert not out.exists(), directory.name
    qwen3 = make_target(family="qwen3")  # θ = 10⁶: EAGLE's config without rope_theta rotates with 10000
    with pytest.raises(InteropError, match=r"RoPE base 10000 \(target: 1e\+06\)"):
        import_checkpoint(good, tmp_path / "out-qwen3", target=qwen3)
    assert not (tmp_path / "out-qwen3").exists()
    two = broken("two-layers", lambda c, t: c.update(num_hidden_layers=2))
    with pytest.raises(InteropError, match=r"an unknown checkpoint layout"):  # not claimed: EAGLE-3 has one layer
        import_checkpoint(two, tmp_path / "out-two", target=target)
    assert not (tmp_path / "out-two").exists()


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_specforges_own_eagle3_options_are_refused_by_the_serving_layouts(drafters, target, tmp_path, fmt):
    """sgl-project SpecForge's LlamaForCausalLMEagle3 (llama3_eagle.py) records ``norm_output`` and
    ``fc_norm`` in this layout's config; EAGLE's cnets.Model has neither (it always norms)."""
    export_checkpoint(drafters["vocab"], fmt, tmp_path / "good")
    for name, change, message in [("no-norm", {"norm_output": False}, r"norm_output: false — .* of norm\(y\)"),
                                  ("fc-norm", {"fc_norm": True}, r"fc_norm: true — .* before fc")]:
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes((tmp_path / "good" / "model.safetensors").read_bytes())
        (d / "config.json").write_text(json.dumps({**read(tmp_path / "good")[0], **change}))
        with pytest.raises(InteropError, match=message):
            import_checkpoint(d, tmp_path / f"out-{name}", target=target)
        assert not (tmp_path / f"out-{name}").exists()
    import_checkpoint(tmp_path / "good", tmp_path / "back", target=target)  # norm_output absent: true, as ours

"""``specforge export --to deepspec`` / ``specforge import`` of ``eagle3`` checkpoints in DeepSpec's
``Qwen3Eagle3Model`` layout: exact round trips, a checkpoint written with DeepSpec's own key names
(float32 and bfloat16), DeepSpec's training-time test written from the foreign key names alone
agreeing with our model and with our chain drafter, one clear error (nothing written) for every
layout that cannot be exact — and an eagle3 checkpoint of before ``qk_norm`` loading, resuming and
drafting as it did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.features import compute_features
from specforge.interop import export_checkpoint, import_checkpoint
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel
from specforge.toolkit.formats import InteropError
from specforge.toolkit.training import DataSummary
from specforge.vocab import DraftVocab
from specforge.toolkit.layers import SharedWeights
from specforge_plugins.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from specforge_plugins.drafters.eagle3.model import Eagle3Model, Eagle3Shape, load_eagle3, save_eagle3
from specforge_plugins.drafters.eagle3.training import Eagle3TrainConfig, Eagle3Training
from interop_cases import (PICKLE_REFUSED, assert_export_refused, assert_imports_refused, broken_copy, our_chain,
                           pickle_only, read)
from tiny_models import save_tiny, tiny_model

V, L, D, HD = 96, 8, 64, 16
FIVE = (1, 2, 3, 4, 5)  # DeepSpec's trainer fuses exactly five layers; its model takes any count
DEEPSPEC_KEYS = {
    "embed_tokens.weight", "fc.weight", "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
    "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
}


def make_target(directory: Path, family: str = "qwen3", dtype=torch.float32) -> TargetModel:
    return TargetModel(tiny_model(family, seed=11, vocab=V, eos=None, layers=L), None, dtype, name=str(directory))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny Qwen3 (q/k-norm, untied LM head) saved as an HF folder: the target checkpoints record."""
    return save_tiny("qwen3", tmp_path_factory.mktemp("qwen3") / "target", seed=11, vocab=V, eos=None, layers=L)


@pytest.fixture(scope="module")
def target(target_dir):
    return make_target(target_dir)


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


# Our drafters: fused layers, qk-norm, draft vocabulary, the target recorded; the last ones refused.
SPECS = {
    "five": dict(),
    "three": dict(layers=(1, 3, 5)),
    "vocab": dict(vocab=40),
    "no-qk": dict(qk_norm=False),
    "one-layer": dict(layers=(2,)),
    "unsorted": dict(layers=(5, 1, 3)),
    "last-layer": dict(layers=(1, 3, L - 1)),
    "no-target": dict(recorded="/nowhere/target"),
}


def build(root: Path, name: str, target: TargetModel, recorded: str, **spec) -> Path:
    s = {"layers": FIVE, "qk_norm": True, "vocab": None, "recorded": recorded, **SPECS.get(name, {}), **spec}
    shape = Eagle3Shape.from_model_args(target.args, target.runtime, layers=s["layers"], draft_vocab_size=s["vocab"],
                                        qk_norm=s["qk_norm"])
    vocab = None if s["vocab"] is None else DraftVocab.random(s["vocab"], V, seed=3)
    model = Eagle3Model(shape, seed=5, vocab=vocab).bind(SharedWeights.from_target(target.runtime), init_head=True)
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():  # trained-looking: no norm weight left at 1, the LM head no longer the target's
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    save_eagle3(root / name, model, {"kind": "eagle3", "gamma": 4}, target=s["recorded"])
    return root / name


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, target, target_dir):
    root = tmp_path_factory.mktemp("drafters")
    return {name: build(root, name, target, str(target_dir)) for name in SPECS}


def tensors_equal(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("name", ["five", "three"])
def test_export_writes_deepspecs_layout_and_imports_back_bit_for_bit(drafters, target, target_dir, tmp_path, name):
    source = drafters[name]
    model, _ = load_eagle3(source)
    out = tmp_path / "out"
    notes = export_checkpoint(source, "deepspec", out)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    mine = json.loads((target_dir / "config.json").read_text())  # a copy of the target's config, plus the fields
    assert config["architectures"] == ["Qwen3Eagle3Model"] and config["model_type"] == "qwen3"
    assert config["rope_parameters"] == mine["rope_parameters"] and config["rms_norm_eps"] == mine["rms_norm_eps"]
    assert config["num_hidden_layers"] == config["draft_num_hidden_layers"] == 1 and config["num_target_layers"] == L
    assert config["target_layer_ids"] == list(model.shape.layers) and config["ttt_length"] == 4
    assert config["layer_types"] == ["full_attention"] and config["tie_word_embeddings"] is False
    assert set(tensors) == DEEPSPEC_KEYS
    assert tensors["fc.weight"].shape == (D, len(model.shape.layers) * D)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * HD, 2 * D)
    assert tensors["layers.0.self_attn.q_norm.weight"].shape == (HD,)
    assert torch.equal(tensors["embed_tokens.weight"], target.runtime.embed)  # the frozen copy
    assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight)  # the drafter's own head, not the target's
    assert not torch.equal(tensors["lm_head.weight"], target.runtime.lm_head)
    assert any("its trainer builds only five" in n for n in notes) == (name == "three")
    method, found, notes = import_checkpoint(out, tmp_path / "back", target=target)
    assert (method, found) == ("eagle3", "deepspec")  # the layout is detected
    assert any("embed_tokens.weight" in n and "checked equal" in n for n in notes)
    assert tensors_equal(source, tmp_path / "back")
    export_checkpoint(tmp_path / "back", "deepspec", tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


# -- the same function: DeepSpec's training-time test written from the foreign key names alone ---------


def deepspec_ttt(config: dict, w: dict[str, torch.Tensor], ids: torch.Tensor, feats: torch.Tensor,
                 steps: int) -> torch.Tensor:
    """DeepSpec's TTT (``loss.py`` ``compute_eagle3_loss``) over ``Qwen3Eagle3Model.forward``
    (``qwen3/modeling.py``): step 0 reads ``fc(feats)`` with the tokens shifted by one at positions
    0…T−1; step k the tokens shifted k + 1 times and step k − 1's layer output (before the final
    norm) at positions t + k (``rope_cache_step_offset``), slot t attending to step 0's slots ≤ t and
    to its own earlier steps (``create_eagle3_attention_mask``'s mask_mod).  ``ids [≥ T + steps]``,
    ``feats [T, m·d]`` → logits ``[steps, T, V]``; q/k norm where the tensors have it."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half

    cfg = Qwen3Config(**{k: v for k, v in config.items() if k != "specforge"})
    eps, hd, heads, kvh = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    w = {k: v.float() for k, v in w.items()}
    p = "layers.0."

    def rms(x, weight):  # Qwen3RMSNorm
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    t_len = feats.shape[0]
    hidden = feats.float() @ w["fc.weight"].T  # project_hidden_states
    rotary = Qwen3RotaryEmbedding(cfg)
    q_idx = torch.arange(t_len)[:, None]
    keys, values, out = [], [], []
    for k in range(steps):
        emb = w["embed_tokens.weight"][ids[1 + k:1 + k + t_len]]
        cos, sin = (e[0, :, None] for e in rotary(emb[None], (torch.arange(t_len) + k)[None]))
        x = torch.cat([rms(emb, w[p + "input_layernorm.weight"]), rms(hidden, w[p + "hidden_norm.weight"])], -1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t_len, heads, hd)
        key = (x @ w[p + "self_attn.k_proj.weight"].T).view(t_len, kvh, hd)
        value = (x @ w[p + "self_attn.v_proj.weight"].T).view(t_len, kvh, hd)
        if p + "self_attn.q_norm.weight" in w:
            q, key = rms(q, w[p + "self_attn.q_norm.weight"]), rms(key, w[p + "self_attn.k_norm.weight"])
        q, key = q * cos + rotate_half(q) * sin, key * cos + rotate_half(key) * sin
        keys.append(key)
        values.append(value)
        kv_idx = torch.arange((k + 1) * t_len)[None]
        visible = (q_idx >= kv_idx) | ((kv_idx >= t_len) & ((kv_idx - q_idx) % t_len == 0))
        kk = torch.cat(keys).repeat_interleave(heads // kvh, 1)
        vv = torch.cat(values).repeat_interleave(heads // kvh, 1)
        scores = torch.einsum("thd,shd->hts", q, kk) * hd ** -0.5
        o = torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv)
        y = hidden + o.reshape(t_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(y, w[p + "post_attention_layernorm.weight"])
        y = y + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        out.append(rms(y, w["norm.weight"]) @ w["lm_head.weight"].T)  # compute_logits
        hidden = y  # the next step reads the layer output before the final norm
    return torch.stack(out)


@torch.no_grad()
def assert_same_function(ours: Path, foreign: Path, target: TargetModel, steps: int = 3) -> None:
    config, w = read(foreign)
    model = load_eagle3(ours)[0].bind(SharedWeights.from_target(target.runtime))
    gen = torch.Generator().manual_seed(0)
    t_len = 10
    ids = torch.randint(0, V, (t_len + steps + 1,), generator=gen)
    feats = torch.randn(t_len, len(config["target_layer_ids"]) * D, generator=gen)
    theirs = deepspec_ttt(config, w, ids, feats, steps)
    for a in (1, 4, t_len):  # slot a − 1 of DeepSpec's TTT is our chain from the anchor at a
        mine = our_chain(model, ids, feats, a, steps)
        torch.testing.assert_close(mine, theirs[:, a - 1], rtol=1e-4, atol=1e-4)
        assert torch.equal(mine.argmax(-1), theirs[:, a - 1].argmax(-1))


@pytest.mark.parametrize("name", ["five", "three"])
def test_the_export_computes_what_the_drafter_computes(drafters, target, tmp_path, name):
    export_checkpoint(drafters[name], "deepspec", tmp_path / "out")
    assert_same_function(drafters[name], tmp_path / "out", target)


# -- a checkpoint written with DeepSpec's own names (save_pretrained of Qwen3Eagle3Model) --------------


def deepspec_folder(root: Path, target_dir: Path, target: TargetModel, dtype=torch.float32, layers=FIVE) -> Path:
    """config.json = a deep copy of the target's config plus build_draft_config's fields (DeepSpec
    eagle3/qwen3/config.py); model.safetensors = Qwen3Eagle3Model's state dict with its frozen copies
    of the target's embed_tokens and lm_head (trainer/eagle3_trainer.py)."""
    config = json.loads((target_dir / "config.json").read_text())
    config.update(architectures=["Qwen3Eagle3Model"], num_target_layers=L, num_hidden_layers=1,
                  layer_types=["full_attention"], target_model_name_or_path=str(target_dir),
                  target_layer_ids=list(layers), ttt_length=4, step_loss_decay=0.8, draft_num_hidden_layers=1,
                  tie_word_embeddings=False)
    for key in [k for k in ("dtype", "torch_dtype") if k in config]:
        config[key] = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(17)

    def rnd(*shape, scale=0.1, base=0.0):
        return (base + scale * torch.randn(*shape, generator=gen)).to(dtype)

    p, i = "layers.0.", 128
    t = {"embed_tokens.weight": target.runtime.embed.to(dtype), "lm_head.weight": target.runtime.lm_head.to(dtype),
         "fc.weight": rnd(D, len(layers) * D), "norm.weight": rnd(D, base=1.0),
         p + "self_attn.q_proj.weight": rnd(4 * HD, 2 * D), p + "self_attn.k_proj.weight": rnd(2 * HD, 2 * D),
         p + "self_attn.v_proj.weight": rnd(2 * HD, 2 * D), p + "self_attn.o_proj.weight": rnd(D, 4 * HD),
         p + "self_attn.q_norm.weight": rnd(HD, base=1.0), p + "self_attn.k_norm.weight": rnd(HD, base=1.0),
         p + "hidden_norm.weight": rnd(D, base=1.0), p + "input_layernorm.weight": rnd(D, base=1.0),
         p + "post_attention_layernorm.weight": rnd(D, base=1.0), p + "mlp.gate_proj.weight": rnd(i, D),
         p + "mlp.up_proj.weight": rnd(i, D), p + "mlp.down_proj.weight": rnd(D, i)}
    root.mkdir()
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deepspec_checkpoint_imports_computes_the_same_and_exports_back_bit_for_bit(target_dir, tmp_path, dtype):
    target = make_target(target_dir, dtype=dtype)  # DeepSpec's copies are of its (bf16) target
    foreign = deepspec_folder(tmp_path / "deepspec", target_dir, target, dtype)
    method, fmt, notes = import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert (method, fmt) == ("eagle3", "deepspec")
    assert any("embed_tokens.weight" in n and "checked equal" in n for n in notes)
    meta = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert meta["eagle3"]["qk_norm"] is True and meta["eagle3"]["layers"] == list(FIVE)
    assert meta["eagle3"]["draft_vocab_size"] is None and meta["drafter"]["gamma"] == 4
    assert load_file(str(tmp_path / "ours" / "model.safetensors"))["model.fc.weight"].dtype == dtype
    if dtype == torch.float32:
        assert_same_function(tmp_path / "ours", foreign, target)
    export_checkpoint(tmp_path / "ours", "deepspec", tmp_path / "again")
    assert tensors_equal(foreign, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    mine = json.loads((foreign / "config.json").read_text())
    assert {k: again[k] for k in mine} == mine


def engine(target, host, drafter, temperature=0.0, new=10, verifier="rejection"):
    return Engine(target, host.create_verifier(verifier), drafter=drafter,
                  correction_head=host.create_correction_head("none", {}),
                  confidence=host.create_confidence("constant", {}), calibrator=host.create_calibrator("identity", {}),
                  scheduler=host.create_scheduler("fixed", {}),
                  sampling=SamplingConfig(temperature=temperature, max_new_tokens=new),
                  engine=EngineConfig(max_batch=2, max_context=96), trees=host.get("verifier", verifier).metadata.trees)


PROMPTS = ([5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14])


def requests(new=10):
    return [GenerationRequest(prompt_ids=p, max_new_tokens=new, seed=i) for i, p in enumerate(PROMPTS)]


@torch.no_grad()
def test_drafting_an_imported_deepspec_checkpoint_is_deepspecs_forward(target_dir, target, host, tmp_path):
    """Every round's chain logits in the engine (incremental context cache, q/k-normed) equal
    DeepSpec's TTT over the committed history with the drafted tokens; chain and tree keep
    greedy parity."""
    foreign = deepspec_folder(tmp_path / "deepspec", target_dir, target)
    import_checkpoint(foreign, tmp_path / "ours", target=target)
    config, w = read(foreign)
    drafter = Eagle3Drafter(Eagle3Config(checkpoint=str(tmp_path / "ours"), gamma=3))
    drafter.bind(target)
    seen = []
    original = drafter.draft
    drafter.draft = lambda ctx: seen.append((ctx, original(ctx))) or seen[-1][1]
    outs = engine(target, host, drafter, temperature=1.0).generate(requests())
    assert all(o.error is None for o in outs)
    checked = 0
    for ctx, block in seen:
        for r, history in enumerate(ctx.histories):
            n = int(block.lengths[r])
            if n == 0:
                continue
            a = len(history) - 1  # the anchor; rows 0…a−1 are the context
            (feats,) = compute_features(target, [(history, torch.ones_like(history))], list(FIVE))
            ids = torch.cat([history, block.tokens[r, :n - 1], torch.zeros(1, dtype=torch.long)])
            theirs = deepspec_ttt(config, w, ids, feats.taps.flatten(1)[:a], n)[:, a - 1]
            torch.testing.assert_close(block.logits[r, :n], theirs, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 6
    plain = Engine(target, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=10),
                   engine=EngineConfig(max_batch=2, max_context=96)).generate(requests())
    for tree in (None, {"topk": 3, "nodes": 8}):
        d = Eagle3Drafter(Eagle3Config(checkpoint=str(tmp_path / "ours"), gamma=3, tree=tree))
        assert [o.token_ids for o in engine(target, host, d).generate(requests())] == [o.token_ids for o in plain]


# -- what cannot be exact is refused, with nothing written -------------------------------------------------


@pytest.mark.parametrize("name, fmt, message", [
    ("vocab", "deepspec", r"drafts over the whole vocabulary .* draft vocabulary of 40 — export --to vllm or sglang"),
    ("no-qk", "deepspec", r"has no qk-norm; an RMSNorm is not the identity, .* drafter.qk_norm=true"),
    ("one-layer", "deepspec", r"fuses one target layer \(2\); .* re-project the fed-back hidden state"),
    ("unsorted", "deepspec", r"strictly increasing order and this drafter fuses \[5, 1, 3\]"),
    ("last-layer", "deepspec", r"fuses the target's last layer \(7\), which DeepSpec reads final-normed"),
    ("no-target", "deepspec", r"its target '/nowhere/target' cannot be read"),
    ("three", "vllm", r"vLLM's Llama EAGLE-3 layer has no q/k norm — export --to deepspec keeps it"),
    ("three", "sglang", r"SGLang's Llama EAGLE-3 layer has no q/k norm"),
])
def test_a_layout_that_cannot_be_exact_is_refused(drafters, tmp_path, name, fmt, message):
    assert_export_refused(drafters[name], fmt, tmp_path / "out", message)


def test_a_target_that_scales_its_embeddings_is_refused(tmp_path):
    gemma_dir = save_tiny("gemma", tmp_path / "gemma", seed=11, vocab=V, eos=None, layers=L)
    source = build(tmp_path, "gemma-drafter", make_target(gemma_dir, "gemma"), str(gemma_dir))
    assert_export_refused(source, "deepspec", tmp_path / "out",
                          r"its target \(gemma\) scales its embeddings by 8 .* reads its embed_tokens unscaled")


def test_bad_input_is_one_error_naming_the_file_and_nothing_is_written(drafters, target, tmp_path):
    good = tmp_path / "good"
    export_checkpoint(drafters["five"], "deepspec", good)

    def broken(name: str, change) -> Path:
        return broken_copy(good, tmp_path / name, change)

    cases = [
        (broken("missing", lambda c, t: t.pop("layers.0.self_attn.k_norm.weight")),
         r"model.safetensors: the tensor 'layers.0.self_attn.k_norm.weight' is missing"),
        (broken("misshaped", lambda c, t: t.update({"fc.weight": torch.ones(D, 3 * D)})),
         r"'fc.weight' has shape \(64, 192\), the config says \(64, 320\)"),
        (broken("other-dim", lambda c, t: c.update(hidden_size=32)),
         r"made for another target — dim 32 \(target: 64\)"),
        (broken("other-rope", lambda c, t: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                                     rope_theta=1e4)),
         r"RoPE base 10000.0 \(target: 1000000.0\)"),
        (broken("other-embedding", lambda c, t: t.update({"embed_tokens.weight": torch.zeros(V, D)})),
         r"its 'embed_tokens.weight' is not the target's embedding"),
        (broken("two-layers", lambda c, t: c.update(num_hidden_layers=2)),
         r"config.json: 2 draft layers \(num_hidden_layers\), and specforge's eagle3 drafter has one"),
        (broken("one-fused", lambda c, t: c.update(target_layer_ids=[3])),
         r"config.json: it fuses 1 target layer\(s\), and with one Qwen3Eagle3Model re-projects"),
        (broken("last-layer", lambda c, t: c.update(target_layer_ids=[1, 3, 4, 5, 7])),
         r"config.json: it fuses the target's last layer \(7\)"),
        (broken("bias", lambda c, t: c.update(attention_bias=True)), r"config.json: attention biases"),
        (broken("unknown", lambda c, t: t.update({"layers.0.self_attn.q_proj.bias": torch.zeros(4 * HD)})),
         r"model.safetensors: tensors the EAGLE-3 layer does not have: layers.0.self_attn.q_proj.bias"),
        (broken("unknown-layout", lambda c, t: c.update(architectures=["MysteryModel"])),
         r"an unknown checkpoint layout"),
    ]
    cases.append((pickle_only(tmp_path / "pickled", {"architectures": ["Qwen3Eagle3Model"]}), PICKLE_REFUSED))
    assert_imports_refused(cases, tmp_path, target)
    no_depth = broken("no-depth", lambda c, t: c.pop("num_target_layers"))
    with pytest.raises(InteropError, match=r"num_target_layers\) is not recorded: import with --target"):
        import_checkpoint(no_depth, tmp_path / "out-no-depth")
    assert not (tmp_path / "out-no-depth").exists()


# -- an eagle3 checkpoint of before qk_norm: the running training and the benchmark ------------------


OLD_SHAPE_FIELDS = {"vocab_size", "dim", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "n_target_layers",
                    "norm_eps", "activation", "rope_theta", "max_positions", "layers", "draft_vocab_size"}
OLD_TENSORS = {"model.fc.weight", "model.layer.input_norm.weight", "model.layer.hidden_norm.weight",
               "model.layer.wq.weight", "model.layer.wk.weight", "model.layer.wv.weight", "model.layer.wo.weight",
               "model.layer.mlp_norm.weight", "model.layer.w13.weight", "model.layer.w2.weight", "model.norm.weight",
               "model.lm_head.weight", "vocab.d2t", "vocab.t2d"}
# Ours -> DeepSpec's names, for the reference forward (the layer without q/k norm).
_NAMES = {"fc.weight": "fc.weight", "layer.input_norm.weight": "layers.0.input_layernorm.weight",
          "layer.hidden_norm.weight": "layers.0.hidden_norm.weight",
          "layer.wq.weight": "layers.0.self_attn.q_proj.weight",
          "layer.wk.weight": "layers.0.self_attn.k_proj.weight", "layer.wv.weight": "layers.0.self_attn.v_proj.weight",
          "layer.wo.weight": "layers.0.self_attn.o_proj.weight",
          "layer.mlp_norm.weight": "layers.0.post_attention_layernorm.weight",
          "layer.w2.weight": "layers.0.mlp.down_proj.weight", "norm.weight": "norm.weight",
          "lm_head.weight": "lm_head.weight"}


@torch.no_grad()
def test_an_eagle3_checkpoint_of_before_qk_norm_loads_resumes_and_drafts_as_before(tmp_path):
    """A Llama target's training (the running SmolLM2 one) builds what it built before; its
    checkpoint has the fields and tensors of before, re-saves byte for byte, resumes, and its layer
    computes DeepSpec's forward without q/k norm (which is the vLLM/SGLang EAGLE-3 layer)."""
    llama = TargetModel(tiny_model("llama", seed=7, vocab=V, eos=None, layers=L), None, torch.float32, name="tiny")
    method = Eagle3Training(Eagle3TrainConfig(draft_vocab=None), llama)
    assert method.shape == Eagle3Shape.from_model_args(llama.args, llama.runtime) and not method.shape.qk_norm
    qwen3 = make_target(tmp_path / "q")
    assert Eagle3Training(Eagle3TrainConfig(), qwen3).shape.qk_norm  # None: as the target's layers
    assert not Eagle3Training(Eagle3TrainConfig(qk_norm=False), qwen3).shape.qk_norm

    shape = Eagle3Shape.from_model_args(llama.args, llama.runtime, draft_vocab_size=40)
    model = Eagle3Model(shape, seed=5, vocab=DraftVocab.random(40, V, seed=3))
    model.bind(SharedWeights.from_target(llama.runtime), init_head=True)
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
    old = tmp_path / "old"
    save_eagle3(old, model, {"kind": "eagle3", "gamma": 4}, target="tiny")
    meta = json.loads((old / "config.json").read_text())
    assert set(meta["eagle3"]) == OLD_SHAPE_FIELDS  # no qk_norm written: earlier versions read it as before
    assert set(load_file(str(old / "model.safetensors"))) == OLD_TENSORS
    loaded, _ = load_eagle3(old)
    assert loaded.shape == shape and not loaded.shape.qk_norm and not hasattr(loaded.layer, "q_norm")
    again = tmp_path / "again"
    save_eagle3(again, loaded, {"kind": "eagle3", "gamma": 4}, target="tiny")
    for f in ("config.json", "model.safetensors"):
        assert (again / f).read_bytes() == (old / f).read_bytes()
    resumed = Eagle3Training(Eagle3TrainConfig(draft_vocab=40), llama)
    counts = torch.zeros(V, dtype=torch.long).index_fill_(0, loaded.vocab.ids, 1)  # data whose top 40 are its ids
    resumed.prepare(DataSummary(sequences=1, token_counts=counts))
    resumed.load(old)  # resuming the running training's checkpoint with this version
    assert all(torch.equal(a, b) for a, b in zip(resumed.module.model.state_dict().values(),
                                                  loaded.state_dict().values()))

    loaded.bind(SharedWeights.from_target(llama.runtime))
    state = loaded.state_dict()
    w = {theirs: state[ours] for ours, theirs in _NAMES.items()}
    w["layers.0.mlp.gate_proj.weight"], w["layers.0.mlp.up_proj.weight"] = state["layer.w13.weight"].chunk(2)
    w["embed_tokens.weight"] = llama.runtime.embed
    config = {**llama.hf_model.config.to_dict(), "head_dim": HD}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (14,), generator=gen)
    feats = torch.randn(10, len(shape.layers) * D, generator=gen)
    theirs = deepspec_ttt(config, w, ids, feats, 3)  # over the 40 draft ids: lm_head is [40, d]
    for a in (2, 10):
        torch.testing.assert_close(our_chain(loaded, ids, feats, a, 3), theirs[:, a - 1], rtol=1e-4, atol=1e-4)
    # and it drafts in the engine as a chain and a tree, with greedy parity
    host = PluginHost().load()
    plain = Engine(llama, host.create_verifier("greedy"), sampling=SamplingConfig(temperature=0.0, max_new_tokens=10),
                   engine=EngineConfig(max_batch=2, max_context=96)).generate(requests())
    for tree in (None, {"topk": 2, "nodes": 6}):
        d = Eagle3Drafter(Eagle3Config(checkpoint=str(old), gamma=3, tree=tree))
        outs = engine(llama, host, d).generate(requests())
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain] and sum(o.stats.drafted for o in outs)

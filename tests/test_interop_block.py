"""``specforge export`` / ``specforge import`` of the block drafters (``dspark``, ``dflash``) in
DeepSpec's ``Qwen3DSparkModel`` layout and vLLM's ``Qwen3DSparkForCausalLM`` /
``DFlashQwen3ForCausalLM`` layouts: exact round trips, a checkpoint written with DeepSpec's own
key names, the same drafts before and after, a reference forward written from the foreign key
names alone, and one clear error (nothing written) for every layout that cannot be exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specforge.interop import export_checkpoint, import_checkpoint
from specforge.runtime import TargetModel
from specforge.vocab import DraftVocab
from specforge.toolkit.confidence_head import DSparkConfidence, DSparkHeadConfig
from specforge.toolkit.heads import HEADS, HeadConfig
from specforge.toolkit.layers import SharedWeights
from specforge_plugins.drafters.block import MASK, BlockBackbone, BlockDrafterConfig
from specforge_plugins.drafters.block.checkpoint import save_drafter
from specforge_plugins.drafters.dflash import DFlashConfig, DFlashDrafter
from specforge_plugins.drafters.dspark import DSparkConfig, DSparkDrafter
from interop_cases import (PICKLE_REFUSED, assert_export_refused, assert_imports_refused, broken_copy,
                           pickle_only)
from tiny_models import save_tiny, tiny_model

V, L, R, TAPS, MASK_ID = 96, 8, 8, (1, 3, 5), 7


def make_target(directory: Path, dtype=torch.float32) -> TargetModel:
    return TargetModel(tiny_model("qwen3", seed=11, vocab=V, eos=None, layers=L), None, dtype, name=str(directory))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny Qwen3 (q/k-norm, untied LM head) saved as an HF folder: the target checkpoints record."""
    return save_tiny("qwen3", tmp_path_factory.mktemp("qwen3") / "target", seed=11, vocab=V, eos=None, layers=L)


@pytest.fixture(scope="module")
def target(target_dir):
    return make_target(target_dir)


# Drafters: method, correction head, confidence table ("head": tied to W1), MASK id (None: learned
# vector), draft vocabulary, qk-norm, tapped layers.
SPECS = {
    "markov": dict(),
    "vocab": dict(vocab=40),
    "bare-id": dict(head=None, conf=None, mask=MASK_ID),
    "gated-id": dict(head="gated", mask=MASK_ID),
    "rnn-id": dict(head="rnn", mask=MASK_ID),
    "dflash": dict(method="dflash", head=None, conf=None),
    "dflash-vocab-id": dict(method="dflash", head=None, conf=None, mask=MASK_ID, vocab=40),
    # refused
    "llama": dict(qk_norm=False, mask=MASK_ID),
    "own": dict(conf="own"),
    "dflash-markov": dict(method="dflash", conf=None),
    "last-layer": dict(taps=(1, L - 1)),
    "no-target": dict(recorded="/nowhere/target"),
}


def build(root: Path, name: str, target: TargetModel, target_dir: Path) -> Path:
    s = {"method": "dspark", "head": "markov", "conf": "head", "mask": None, "vocab": None, "qk_norm": True,
         "taps": TAPS, "recorded": str(target_dir), **SPECS[name]}
    dspark = s["method"] == "dspark"
    c = BlockDrafterConfig.from_model_args(target.args, draft_layers=2, gamma=4 if dspark else 5,
                                           predict_anchor=dspark, mask_token_id=s["mask"], target_layers=s["taps"],
                                           draft_vocab_size=s["vocab"], qk_norm=s["qk_norm"])
    vocab = None if s["vocab"] is None else DraftVocab.random(s["vocab"], V, seed=3)
    backbone = BlockBackbone(c, SharedWeights.from_target(target.runtime), seed=5, vocab=vocab)
    head = conf = None
    if s["head"]:
        head = HEADS[s["head"]](HeadConfig(rank=R, zero_init=False, seed=1))
    if s["conf"]:
        conf = DSparkConfidence(DSparkHeadConfig(rank=R, embedding=s["conf"], seed=2))
    for module in (head, conf):
        if module is not None:
            if vocab is not None:
                module.restrict(vocab.token_rows())
            module.bind(target)
    if conf is not None and s["conf"] == "head":
        conf.tie(head)
    gen = torch.Generator().manual_seed(list(SPECS).index(name))
    with torch.no_grad():  # trained-looking: no norm weight left at 1, no zero bias
        for module in (backbone, head, conf):
            for p in (module.parameters() if module is not None else ()):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    save_drafter(root / name, backbone, head, conf, {"kind": s["method"]}, method=s["method"], target=s["recorded"])
    return root / name


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, target, target_dir):
    root = tmp_path_factory.mktemp("drafters")
    return {name: build(root, name, target, target_dir) for name in SPECS}


def tensors_equal(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


ROUND_TRIPS = [("markov", "vllm"), ("vocab", "vllm"), ("bare-id", "vllm"), ("gated-id", "deepspec"),
               ("rnn-id", "deepspec"), ("bare-id", "deepspec"), ("dflash", "vllm"), ("dflash-vocab-id", "vllm")]


@pytest.mark.parametrize("name, fmt", ROUND_TRIPS)
def test_export_writes_the_layout_and_imports_back_bit_for_bit(drafters, target, target_dir, tmp_path, name, fmt):
    source = drafters[name]
    out = tmp_path / "out"
    export_checkpoint(source, fmt, out)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    mine = json.loads((target_dir / "config.json").read_text())
    assert config["rope_parameters"] == mine["rope_parameters"] and config["rms_norm_eps"] == mine["rms_norm_eps"]
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == L
    spec = {"method": "dspark", "mask": None, "vocab": None, **SPECS[name]}
    learned = spec["mask"] is None
    if spec["method"] == "dflash":
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 6
        assert config["dflash_config"] == {"mask_token_id": V if learned else MASK_ID, "target_layer_ids": list(TAPS)}
    else:
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
        assert config["target_layer_ids"] == list(TAPS) and config["mask_token_id"] == (V if learned else MASK_ID)
        assert ("num_anchors" in config) == (fmt == "deepspec")
    assert config["vocab_size"] == V + (learned and fmt == "vllm")
    if learned:  # the MASK vector is the extra row; the other rows are the target's
        assert torch.equal(tensors["embed_tokens.weight"][:V], target.runtime.embed)
    if fmt == "deepspec":
        assert torch.equal(tensors["lm_head.weight"], target.runtime.lm_head)
    if spec["vocab"]:
        ids = DraftVocab.from_maps(tensors["d2t"], tensors["t2d"]).ids
        assert config["draft_vocab_size"] == 40 and torch.equal(tensors["lm_head.weight"], target.runtime.lm_head[ids])
    if "markov_head.markov_w1.weight" in tensors:  # W1 over the target's ids, W2 over the draft's
        assert tensors["markov_head.markov_w1.weight"].shape == (config["vocab_size"], config["markov_rank"])
        assert tensors["markov_head.markov_w2.weight"].shape[0] == (spec["vocab"] or V)
    method, found, notes = import_checkpoint(out, tmp_path / "back", target=target)
    assert (method, found) == (spec["method"], fmt)
    assert tensors_equal(source, tmp_path / "back")
    export_checkpoint(tmp_path / "back", fmt, tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


# -- the same function: the plug-in before and after, and a reference written from the foreign names --


def ours(directory: Path, target: TargetModel, block: torch.Tensor, feats, pos, prev):
    """Hidden states, base and corrected logits and confidence logits of a checkpoint loaded
    through the dspark/dflash plug-in and bound to ``target``."""
    config = json.loads((directory / "config.json").read_text())
    cls, cfg = (DSparkDrafter, DSparkConfig) if config["method"] == "dspark" else (DFlashDrafter, DFlashConfig)
    drafter = cls(cfg(checkpoint=str(directory), dtype="float32"))
    drafter.bind(target)
    _, head, conf = drafter._loaded
    with torch.no_grad():
        hidden, logits = drafter.backbone(block, feats, pos)
        corrected = logits if head is None else head.forward_train(logits, prev, hidden)
        c = None if conf is None else conf.logits(hidden, prev)
    return hidden, logits, corrected, c


def reference(directory: Path, target: TargetModel, anchor, feats, pos, prev):
    """DeepSpec's Qwen3DSparkModel forward (modeling.py: k_norm over [context; block], RoPE at the
    context's and the block's positions, context strictly before the anchor) and its heads
    (markov_head.py, common.py), from the foreign key names and config alone; vLLM shares the
    target's embedding and LM head when the folder has none."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half

    config = json.loads((directory / "config.json").read_text())
    t = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    cfg = Qwen3Config(**config)
    dflash = "dflash_config" in config
    eps, hd, heads, kvh = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    mask_id = (config.get("dflash_config") or config)["mask_token_id"]
    rms = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)  # noqa: E731
    embed, lm_head = t.get("embed_tokens.weight", target.runtime.embed), t.get("lm_head.weight", target.runtime.lm_head)
    b, c_len, s = anchor.shape[0], feats.shape[1], config["block_size"]
    ids = torch.full((b, s), mask_id)
    ids[:, 0] = anchor
    x = embed[ids]
    ctx = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    positions = torch.cat([torch.arange(c_len).expand(b, c_len), pos[:, None] + torch.arange(s)], 1)
    cos, sin = (e[:, None] for e in Qwen3RotaryEmbedding(cfg)(x, positions))
    visible = torch.cat([(torch.arange(c_len)[None] < pos[:, None])[:, None].expand(b, s, c_len),
                         torch.ones(b, s, s, dtype=torch.bool)], -1)[:, None]
    for n in range(config["num_hidden_layers"]):
        w = {k[len(f"layers.{n}.self_attn."):]: v for k, v in t.items() if k.startswith(f"layers.{n}.self_attn.")}
        w.update({k[len(f"layers.{n}."):]: v for k, v in t.items() if k.startswith(f"layers.{n}.")})
        h = rms(x, w["input_layernorm.weight"])
        q = rms((h @ w["q_proj.weight"].T).view(b, s, heads, hd), w["q_norm.weight"]).transpose(1, 2)
        both = torch.cat([ctx, h], 1)  # K and V of [context; block], k-normed together
        k = rms((both @ w["k_proj.weight"].T).view(b, -1, kvh, hd), w["k_norm.weight"]).transpose(1, 2)
        v = (both @ w["v_proj.weight"].T).view(b, -1, kvh, hd).transpose(1, 2)
        q = q * cos[..., -s:, :] + rotate_half(q) * sin[..., -s:, :]
        k = (k * cos + rotate_half(k) * sin).repeat_interleave(heads // kvh, 1)
        scores = (q @ k.transpose(-1, -2) * hd ** -0.5).masked_fill(~visible, float("-inf"))
        o = (scores.softmax(-1) @ v.repeat_interleave(heads // kvh, 1)).transpose(1, 2).reshape(b, s, -1)
        x = x + o @ w["o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    hidden = rms(x, t["norm.weight"])[:, 1:] if dflash else rms(x, t["norm.weight"])
    logits = hidden @ lm_head.T
    if "markov_head.markov_w1.weight" not in t:
        corrected, e = logits, None
    else:
        e = t["markov_head.markov_w1.weight"][prev]
        kind = config.get("markov_head_type", "vanilla")
        if kind == "vanilla":
            code = e
        elif kind == "gated":
            code = torch.sigmoid(torch.cat([hidden, e], -1) @ t["markov_head.gate_proj.weight"].T
                                 + t["markov_head.gate_proj.bias"]) * e
        else:
            state, codes = torch.zeros_like(e[:, 0]), []
            for j in range(e.shape[1]):
                g, c, o = (torch.cat([state, e[:, j], hidden[:, j]], -1) @ t["markov_head.joint_proj.weight"].T
                           + t["markov_head.joint_proj.bias"]).chunk(3, -1)
                state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
                codes.append(torch.tanh(o))
            code = torch.stack(codes, 1)
        corrected = logits + code @ t["markov_head.markov_w2.weight"].T
    conf = None
    if "confidence_head.proj.weight" in t:
        features = torch.cat([hidden, e], -1) if config["confidence_head_with_markov"] else hidden
        conf = (features @ t["confidence_head.proj.weight"].T + t["confidence_head.proj.bias"]).squeeze(-1)
    return hidden, logits, corrected, conf


def inputs(seed: int = 0, b: int = 3, c_len: int = 12):
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.randint(0, V, (b,), generator=gen)
    feats = torch.randn(b, c_len, len(TAPS) * 64, generator=gen)
    pos = torch.tensor([3, 7, c_len])[:b]
    return anchor, feats, pos, gen


def block_of(directory: Path, anchor: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Our block ``[x_0, MASK, …]`` for a checkpoint, and previous tokens x_{k−1} (target ids, x_0 first)."""
    c = json.loads((directory / "config.json").read_text())["backbone"]
    block = torch.full((len(anchor), c["gamma"] + (not c["predict_anchor"])),
                       MASK if c["mask_token_id"] is None else c["mask_token_id"])
    block[:, 0] = anchor
    prev = torch.randint(0, V, (len(anchor), c["gamma"]), generator=gen)
    prev[:, 0] = anchor
    return block, prev


def assert_same_function(directory: Path, foreign: Path, target: TargetModel) -> None:
    """``directory`` (ours) drafts what the foreign folder computes: same hidden states, base and
    corrected logits, confidence; so the same tokens and probabilities."""
    anchor, feats, pos, gen = inputs()
    block, prev = block_of(directory, anchor, gen)
    mine = ours(directory, target, block, feats, pos, prev)
    theirs = reference(foreign, target, anchor, feats, pos, prev)
    for a, b in zip(mine, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(mine[2].argmax(-1), theirs[2].argmax(-1))  # the same greedy drafts
    torch.testing.assert_close(mine[2].softmax(-1), theirs[2].softmax(-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, fmt", [("markov", "vllm"), ("vocab", "vllm"), ("gated-id", "deepspec"),
                                       ("rnn-id", "deepspec"), ("dflash", "vllm"), ("dflash-vocab-id", "vllm")])
def test_the_export_computes_what_the_drafter_computes_and_the_import_drafts_the_same(drafters, target, tmp_path,
                                                                                       name, fmt):
    source = drafters[name]
    export_checkpoint(source, fmt, tmp_path / "out")
    assert_same_function(source, tmp_path / "out", target)
    import_checkpoint(tmp_path / "out", tmp_path / "back", target=target)
    anchor, feats, pos, gen = inputs(seed=1)
    block, prev = block_of(source, anchor, gen)
    before, after = (ours(d, target, block, feats, pos, prev) for d in (source, tmp_path / "back"))
    for a, b in zip(before, after):
        assert (a is None and b is None) or torch.equal(a, b)  # bit for bit: the same tokens and probabilities


# -- a checkpoint written with DeepSpec's own names (save_pretrained of Qwen3DSparkModel) ----------------


def deepspec_folder(root: Path, target_dir: Path, target: TargetModel, head: str | None, with_markov: bool | None,
                    dtype=torch.float32) -> Path:
    """config.json = a deep copy of the target's config plus build_draft_config's fields (DeepSpec
    qwen3/config.py); model.safetensors = Qwen3DSparkModel's state dict with its frozen copies of
    the target's embed_tokens and lm_head (DeepSpec trainer/ckpt_manager.py)."""
    config = json.loads((target_dir / "config.json").read_text())
    r = R if head else 0
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=L, num_hidden_layers=2, block_size=4,
                  tie_word_embeddings=False, layer_types=["full_attention"] * 2, mask_token_id=MASK_ID,
                  target_layer_ids=list(TAPS), num_anchors=512, enable_confidence_head=with_markov is not None,
                  markov_rank=r)
    if head:
        config["markov_head_type"] = head
    if with_markov is not None:
        config["confidence_head_with_markov"] = with_markov
    gen = torch.Generator().manual_seed(17)

    def rnd(*shape, scale=0.1, base=0.0):
        return (base + scale * torch.randn(*shape, generator=gen)).to(dtype)

    def norm(n):  # norm weights around 1, none exactly
        return rnd(n, base=1.0)

    d, hd, i = 64, 16, 128
    t = {"embed_tokens.weight": target.runtime.embed.to(dtype), "lm_head.weight": target.runtime.lm_head.to(dtype),
         "fc.weight": rnd(d, 3 * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for n in range(2):
        p = f"layers.{n}."
        t.update({p + "self_attn.q_proj.weight": rnd(4 * hd, d), p + "self_attn.k_proj.weight": rnd(2 * hd, d),
                  p + "self_attn.v_proj.weight": rnd(2 * hd, d), p + "self_attn.o_proj.weight": rnd(d, 4 * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  p + "mlp.gate_proj.weight": rnd(i, d), p + "mlp.up_proj.weight": rnd(i, d),
                  p + "mlp.down_proj.weight": rnd(d, i)})
    if head:
        t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"] = rnd(V, r, scale=1.0), rnd(V, r)
        if head == "gated":
            t["markov_head.gate_proj.weight"], t["markov_head.gate_proj.bias"] = rnd(r, d + r), rnd(r)
        if head == "rnn":
            t["markov_head.joint_proj.weight"], t["markov_head.joint_proj.bias"] = rnd(3 * r, 2 * r + d), rnd(3 * r)
    if with_markov is not None:
        t["confidence_head.proj.weight"], t["confidence_head.proj.bias"] = rnd(1, d + (r if with_markov else 0)), rnd(1)
    root.mkdir()
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("head, with_markov", [("vanilla", True), ("gated", False), ("rnn", True), (None, None)])
def test_a_deepspec_checkpoint_imports_drafts_the_same_and_exports_back_bit_for_bit(target_dir, target, tmp_path,
                                                                                     head, with_markov):
    foreign = deepspec_folder(tmp_path / "deepspec", target_dir, target, head, with_markov)
    method, fmt, notes = import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert (method, fmt) == ("dspark", "deepspec")  # DeepSpec's DFlash (markov_rank 0) is our dspark without a head
    assert any("embed_tokens.weight" in n and "checked equal" in n for n in notes)
    assert any("lm_head.weight" in n and "checked equal" in n for n in notes)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["backbone"]["mask_token_id"] == MASK_ID and config["backbone"]["gamma"] == 4
    assert (config["head"] is None) == (head is None) and (config["confidence"] is None) == (with_markov is None)
    assert_same_function(tmp_path / "ours", foreign, target)
    export_checkpoint(tmp_path / "ours", "deepspec", tmp_path / "again")
    assert tensors_equal(foreign, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    mine = json.loads((foreign / "config.json").read_text())
    assert {k: again[k] for k in mine} == mine


def test_a_bfloat16_deepspec_checkpoint_keeps_its_dtype(target_dir, tmp_path):
    target = make_target(target_dir, torch.bfloat16)  # DeepSpec's copies are of a bf16 target
    foreign = deepspec_folder(tmp_path / "deepspec", target_dir, target, "vanilla", True, dtype=torch.bfloat16)
    import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert load_file(str(tmp_path / "ours" / "model.safetensors"))["backbone.fc.weight"].dtype == torch.bfloat16
    export_checkpoint(tmp_path / "ours", "deepspec", tmp_path / "again")
    assert tensors_equal(foreign, tmp_path / "again")


# -- what cannot be exact is refused, with nothing written -------------------------------------------------


@pytest.mark.parametrize("name, fmt, message", [
    ("llama", "vllm", r"has no qk-norm .* an RMSNorm is not the identity"),
    ("llama", "deepspec", r"has no qk-norm"),
    ("markov", "deepspec", r"learned its own MASK vector, which no id carries — export --to vllm keeps it"),
    ("vocab", "deepspec", r"draft vocabulary of 40 — export --to vllm keeps it"),
    ("gated-id", "vllm", r"only the vanilla Markov head .* gated"),
    ("own", "vllm", r"drafter.confidence.embedding=head"),
    ("dflash-markov", "vllm", r"DFlashQwen3ForCausalLM has no correction head"),
    ("last-layer", "vllm", r"taps the target's last layer \(7\)"),
    ("no-target", "vllm", r"its target '/nowhere/target' cannot be read"),
    ("dflash", "deepspec", r"dflash exports to vllm, llama.cpp, hf, not 'deepspec'"),
])
def test_a_layout_that_cannot_be_exact_is_refused(drafters, tmp_path, name, fmt, message):
    assert_export_refused(drafters[name], fmt, tmp_path / "out", message)


def test_bad_input_is_one_error_naming_the_file_and_nothing_is_written(drafters, target, tmp_path):
    vllm, deepspec, vocab = tmp_path / "vllm", tmp_path / "deepspec", tmp_path / "vocab"
    export_checkpoint(drafters["bare-id"], "vllm", vllm)
    export_checkpoint(drafters["gated-id"], "deepspec", deepspec)
    export_checkpoint(drafters["vocab"], "vllm", vocab)

    def broken(good: Path, name: str, change) -> Path:
        return broken_copy(good, tmp_path / name, change)

    cases = [
        (broken(vllm, "missing", lambda c, t: t.pop("layers.1.self_attn.k_norm.weight")),
         r"model.safetensors: the tensor 'layers.1.self_attn.k_norm.weight' is missing"),
        (broken(deepspec, "misshaped", lambda c, t: t.update({"markov_head.markov_w2.weight": torch.ones(3, R)})),
         r"'markov_head.markov_w2.weight' has shape \(3, 8\), the config says \(96, 8\)"),
        (broken(vllm, "other-dim", lambda c, t: c.update(hidden_size=32)),
         r"made for another target — dim 32 \(target: 64\)"),
        (broken(vllm, "other-vocab", lambda c, t: c.update(vocab_size=97, draft_vocab_size=97)),
         r"made for another target — vocab_size 97 \(target: 96\)"),
        (broken(vllm, "other-depth", lambda c, t: c.update(num_target_layers=10)),
         r"made for another target — n_target_layers 10 \(target: 8\)"),
        (broken(vllm, "other-rope", lambda c, t: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                                           rope_theta=1e4)),
         r"RoPE base 10000.0 \(target: 1000000.0\)"),
        (broken(deepspec, "other-embedding", lambda c, t: t.update({"embed_tokens.weight": torch.zeros(V, 64)})),
         r"its 'embed_tokens.weight' is not the target's embedding"),
        (broken(vocab, "other-head", lambda c, t: t.update({"lm_head.weight": torch.zeros(40, 64)})),
         r"its 'lm_head.weight' is not the target's LM head"),
        (broken(vocab, "outside-rows", lambda c, t: t["markov_head.markov_w1.weight"][(~t["t2d"]).nonzero()[0, 0]]
                .add_(1.0)), r"markov_w1 gives tokens outside the draft vocabulary rows of their own"),
        (broken(vllm, "embedding-tap", lambda c, t: c.update(target_layer_ids=[-1, 3, 5])),
         r"config.json: it taps the target's embeddings \(target layer -1\)"),
        (broken(vllm, "sliding", lambda c, t: c.update(layer_types=["sliding_attention", "full_attention"])),
         r"config.json: sliding-window draft layers; specforge's dspark drafter cannot compute it exactly"),
        (broken(vllm, "sink", lambda c, t: t.update({"layers.0.self_attn.sinks": torch.zeros(4)})),
         r"model.safetensors: tensors vLLM's Qwen3DSparkForCausalLM does not have: layers.0.self_attn.sinks"),
        (broken(vllm, "unknown", lambda c, t: c.update(architectures=["MysteryModel"])),
         r"an unknown checkpoint layout"),
    ]
    cases.append((pickle_only(tmp_path / "pickled", {"architectures": ["Qwen3DSparkModel"]}), PICKLE_REFUSED))
    assert_imports_refused(cases, tmp_path, target)


def test_a_sharded_folder_is_read_through_its_index(drafters, target, tmp_path):
    """save_pretrained splits a large drafter (DeepSpec's holds two V×d copies) into shards."""
    out = tmp_path / "out"
    export_checkpoint(drafters["gated-id"], "deepspec", out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    keys = sorted(tensors)
    index = {"weight_map": {}}
    for part, chunk in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{part + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(out / name))
        index["weight_map"].update(dict.fromkeys(chunk, name))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    import_checkpoint(out, tmp_path / "back", target=target)
    assert tensors_equal(drafters["gated-id"], tmp_path / "back")


def test_a_target_that_scales_its_embeddings_is_refused(tmp_path):
    gemma_dir = save_tiny("gemma", tmp_path / "gemma", seed=11, vocab=V, eos=None, layers=L)
    gemma = TargetModel(tiny_model("gemma", seed=11, vocab=V, eos=None, layers=L), None, torch.float32,
                        name=str(gemma_dir))
    # SiLU so that the embedding scale is the one reason left (tiny Gemma's own MLP is GELU)
    c = BlockDrafterConfig.from_model_args(gemma.args, draft_layers=1, gamma=4, target_layers=TAPS, qk_norm=True,
                                           mask_token_id=MASK_ID, activation="silu")
    save_drafter(tmp_path / "d", BlockBackbone(c, SharedWeights.from_target(gemma.runtime), seed=5), None, None,
                 {"kind": "dspark"}, method="dspark", target=str(gemma_dir))
    for fmt in ("deepspec", "vllm"):
        assert_export_refused(tmp_path / "d", fmt, tmp_path / fmt,
                              r"its target \(gemma\) scales its embeddings by 8 .* unscaled")


# -- sgl-project SpecForge's DFlash checkpoint (DFlashDraftModel: its --to hf export, normalised) ----------


def specforge_dflash_folder(root: Path, stage: str, dtype=torch.float32, **config_changes) -> Path:
    """A folder as sgl-project SpecForge @ a6b6b023 writes a DFlash drafter of the tiny Qwen3.

    config.json: ``configs/qwen3-8b-dflash.json`` with the tiny sizes — ``stage="config"`` as
    shipped (what ``export --to hf`` writes under transformers 4: ``rope_theta``, ``rope_scaling:
    null``); ``"hf-export"`` as ``save_pretrained`` writes it under transformers 5
    (``rope_parameters``) plus the top-level ``rope_theta`` of ``apply_legacy_rope_scaling``
    (``specforge/export/checkpoint_io.py``); ``"normalized"`` that after
    ``scripts/gates/normalize_dflash_export.py`` (``architectures: [DFlashDraftModel]``, no
    ``auto_map``).  model.safetensors: ``DFlashDraftModel``'s state dict
    (``specforge/modeling/draft/dflash.py``: ``layers.{i}`` Qwen3 layers with q/k norm, ``fc``,
    ``hidden_norm``, ``norm``; ``rotary_emb`` not persistent; no embedding or LM head)."""
    config = {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 6, "bos_token_id": 0,
              "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(TAPS)},
              "dtype": str(dtype).removeprefix("torch."), "eos_token_id": 1, "head_dim": 16, "hidden_act": "silu",
              "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
              "layer_types": ["full_attention"] * 2, "max_position_embeddings": 40960, "max_window_layers": 2,
              "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
              "num_target_layers": L, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
              "vocab_size": V}
    if stage != "config":  # transformers 5: rope_parameters, and the legacy mirror of rope_theta
        del config["rope_scaling"]
        config.update(rope_parameters={"rope_theta": 1000000, "rope_type": "default"}, pad_token_id=None,
                      transformers_version="5.24.0")
    if stage == "normalized":  # normalize_export: projector_type dflash → the architecture, auto_map dropped
        config["architectures"] = ["DFlashDraftModel"]
        config.pop("auto_map")
    config.update(config_changes)
    gen = torch.Generator().manual_seed(23)

    def rnd(*shape, scale=0.1, base=0.0):
        return (base + scale * torch.randn(*shape, generator=gen)).to(dtype)

    d, hd, i = 64, 16, 128
    t = {"fc.weight": rnd(d, len(TAPS) * d), "hidden_norm.weight": rnd(d, base=1.0), "norm.weight": rnd(d, base=1.0)}
    for n in range(2):
        p = f"layers.{n}."
        t.update({p + "self_attn.q_proj.weight": rnd(4 * hd, d), p + "self_attn.k_proj.weight": rnd(2 * hd, d),
                  p + "self_attn.v_proj.weight": rnd(2 * hd, d), p + "self_attn.o_proj.weight": rnd(d, 4 * hd),
                  p + "self_attn.q_norm.weight": rnd(hd, base=1.0), p + "self_attn.k_norm.weight": rnd(hd, base=1.0),
                  p + "input_layernorm.weight": rnd(d, base=1.0),
                  p + "post_attention_layernorm.weight": rnd(d, base=1.0),
                  p + "mlp.gate_proj.weight": rnd(i, d), p + "mlp.up_proj.weight": rnd(i, d),
                  p + "mlp.down_proj.weight": rnd(d, i)})
    root.mkdir()
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


@pytest.mark.parametrize("stage", ["config", "hf-export", "normalized"])
def test_a_specforge_dflash_checkpoint_imports_drafts_the_same_and_exports_back_bit_for_bit(target, tmp_path, stage):
    """SpecForge's DFlashDraftModel is our dflash (the block formats' docstring): its spec_generate
    drafts ``[x0, MASK × (block_size − 1)]`` and samples the mask slots in place, over the context
    strictly before the anchor — what ``reference`` computes from the foreign names alone."""
    foreign = specforge_dflash_folder(tmp_path / "specforge", stage)
    method, fmt, notes = import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert (method, fmt) == ("dflash", "vllm")  # vLLM's DFlashQwen3ForCausalLM reads this same layout
    c = json.loads((tmp_path / "ours" / "config.json").read_text())["backbone"]
    assert c["gamma"] == 5 and c["mask_token_id"] == MASK_ID and not c["predict_anchor"]
    assert c["target_layers"] == list(TAPS) and c["draft_layers"] == 2 and c["draft_vocab_size"] is None
    assert_same_function(tmp_path / "ours", foreign, target)
    export_checkpoint(tmp_path / "ours", "vllm", tmp_path / "again")
    assert tensors_equal(foreign, tmp_path / "again")  # the same tensors back (SpecForge's keys)


def test_a_bfloat16_specforge_dflash_checkpoint_keeps_its_dtype(target, tmp_path):
    foreign = specforge_dflash_folder(tmp_path / "specforge", "normalized", dtype=torch.bfloat16)  # materialize_draft
    import_checkpoint(foreign, tmp_path / "ours", target=target)
    assert load_file(str(tmp_path / "ours" / "model.safetensors"))["backbone.fc.weight"].dtype == torch.bfloat16
    export_checkpoint(tmp_path / "ours", "vllm", tmp_path / "again")
    assert tensors_equal(foreign, tmp_path / "again")


def test_specforges_domino_and_sliding_window_drafters_are_refused(target, tmp_path):
    """Domino (``modeling/draft/domino.py``) is a DFlash backbone with a GRU logits head, and
    normalize_dflash_export.py gives it the DFlash architecture; qwen3.6-27b-dflash.json has
    sliding-window layers (whose block attention is causal, ``create_dflash_block_mask``)."""
    domino = {"projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16, "mask_token_id": MASK_ID,
              "target_layer_ids": list(TAPS)}
    cases = [
        (specforge_dflash_folder(tmp_path / "domino", "normalized", dflash_config=domino),
         r"config.json: dflash_config.projector_type 'domino': sgl-project SpecForge's Domino drafter, a DFlash "
         r"backbone with a logits head of its own .*; specforge's dflash drafter cannot compute it exactly"),
        (specforge_dflash_folder(tmp_path / "domino-hf", "hf-export", dflash_config=domino,
                                 architectures=["DominoDraftModel"]), r"an unknown checkpoint layout"),
        (specforge_dflash_folder(tmp_path / "sliding", "normalized", use_sliding_window=True, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"]),
         r"config.json: sliding-window draft layers; specforge's dflash drafter cannot compute it exactly"),
    ]
    assert_imports_refused(cases, tmp_path, target)

"""``specforge export --to llama.cpp``: block drafters (``dspark``, ``dflash``) as the GGUF file
llama.cpp runs them from (plugins/drafters/block/llamacpp.py, docs/llama-cpp.md).

Drafters for the embedded SmolLM2 (its GGUF gives the tokenizer), at random init with one draft
layer: ``gguf.GGUFReader`` reads back every tensor (names, shapes, values) and the metadata (tapped
layers as llama.cpp's layer-input ids, the mask token, the block size, the draft vocabulary map) of
what the drafter holds, llama.cpp's own loader (libllama, through llama-cpp-python) accepts the file,
and everything llama.cpp cannot compute exactly is refused in one sentence with nothing written.
The slow test runs the drafter in ``llama-speculative-simple`` (``make llama.cpp``): at T = 0 its
output equals llama.cpp's plain greedy output.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specforge.interop import export_checkpoint
from specforge.toolkit.confidence_head import DSparkConfidence, DSparkHeadConfig
from specforge.toolkit.formats import InteropError
from specforge.toolkit.heads import HEADS, HeadConfig
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.block import BlockBackbone, BlockDrafterConfig
from specforge_plugins.drafters.block.checkpoint import load_drafter, save_drafter
from specforge_plugins.drafters.block.llamacpp import read_metadata
from tiny_models import save_tiny

R, N = 8, 512  # Markov rank, draft vocabulary
SHIPPED = Path(__file__).resolve().parents[1] / "plugins" / "drafters" / "shipped" / "smollm2-135m-instruct"
NO_BINDING = "the llama.cpp binding (llama-cpp-python) is not installed: make install"


@pytest.fixture(scope="module")
def smollm2():
    """The embedded target: its GGUF, the converted checkpoint's ModelArgs, embedding and LM head."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from specforge.model_args import ModelArgs
    from specforge.model_files import converted_checkpoint, resolve_model

    directory, name = resolve_model("smollm2")
    converted = converted_checkpoint("smollm2")
    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(str(converted), local_files_only=True))
    with safe_open(str(next(converted.glob("*.safetensors"))), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    return {"gguf": directory / name, "args": args, "embed": embed}  # SmolLM2 ties its LM head to it


def build(root: Path, name: str, args, *, method="dspark", mask=None, vocab=None, head="markov", conf="head",
          qk_norm=True, taps=None, dtype=torch.float32, target="smollm2") -> Path:
    """A one-layer drafter at random init (weights shifted so that no norm is left at 1)."""
    dspark = method == "dspark"
    c = BlockDrafterConfig.from_model_args(args, draft_layers=1, gamma=4 if dspark else 5, predict_anchor=dspark,
                                           mask_token_id=mask, draft_vocab_size=vocab, qk_norm=qk_norm,
                                           target_layers=taps)
    v = None if vocab is None else DraftVocab.random(vocab, args.vocab_size, seed=3)
    backbone = BlockBackbone(c, seed=5, vocab=v)
    h = None if head is None else HEADS[head](HeadConfig(rank=R, vocab_size=args.vocab_size, dim=args.dim,
                                                         zero_init=False, seed=1))
    cf = None if conf is None else DSparkConfidence(DSparkHeadConfig(rank=R, vocab_size=args.vocab_size, dim=args.dim,
                                                                     embedding=conf, seed=2))
    for module in (h, cf):
        if module is not None and v is not None:
            module.restrict(v.token_rows())
    if cf is not None and conf == "head":
        cf.tie(h)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in (backbone, h, cf):
            for p in (module.parameters() if module is not None else ()):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
            if module is not None:
                module.to(dtype)
    return save_drafter(root / name, backbone, h, cf, {"kind": method}, method=method, target=target)


# The two drafters exported in full: a DSpark drafter with everything llama.cpp carries (learned MASK
# vector, draft vocabulary, Markov head, confidence head tied to it; bfloat16) and a bare DFlash one.
EXPORTED = {"dspark": dict(method="dspark", vocab=N, dtype=torch.bfloat16),
            "dflash": dict(method="dflash", mask=7, head=None, conf=None)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for name, spec in EXPORTED.items():
        source = build(root, name, smollm2["args"], **spec)
        export_checkpoint(source, "llama.cpp", root / f"{name}.gguf")
        out[name] = (source, root / f"{name}.gguf")
    return out


def _halves(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = w.chunk(2, dim=0)
    return a, b


def expected_tensors(source: Path, smollm2) -> dict[str, torch.Tensor]:
    """What the GGUF must hold, spelled out from the checkpoint itself (not through the exporter)."""
    backbone, head, conf, _ = load_drafter(source)
    meta = json.loads((source / "config.json").read_text())
    stored = load_file(str(source / "model.safetensors"))
    dtype = stored["backbone.fc.weight"].dtype
    c, v = backbone.config, backbone.vocab
    s = {k[len("backbone."):]: t for k, t in stored.items() if k.startswith("backbone.")}
    out = {"fc.weight": s["fc.weight"], "enc.output_norm.weight": s["ctx_norm.weight"],
           "output_norm.weight": s["norm.weight"]}
    for i in range(c.draft_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        k, vv = _halves(s[p + "wkv.weight"])
        gate, up = _halves(s[p + "w13.weight"])
        out.update({b + "attn_norm.weight": s[p + "attn_norm.weight"], b + "attn_q.weight": s[p + "wq.weight"],
                    b + "attn_k.weight": k, b + "attn_v.weight": vv, b + "attn_output.weight": s[p + "wo.weight"],
                    b + "attn_q_norm.weight": s[p + "q_norm.weight"], b + "attn_k_norm.weight": s[p + "k_norm.weight"],
                    b + "ffn_norm.weight": s[p + "mlp_norm.weight"], b + "ffn_gate.weight": gate,
                    b + "ffn_up.weight": up, b + "ffn_down.weight": s[p + "w2.weight"]})
    V = c.vocab_size
    learned = c.mask_token_id is None
    if learned:
        out["token_embd.weight"] = torch.cat([smollm2["embed"].to(dtype), s["mask_embed"][None]])
    if v is not None:
        out["d2t"] = v.ids.long()
        out["output.weight"] = smollm2["embed"][v.ids].to(dtype)
    elif learned:
        out["d2t"] = torch.arange(V)
        out["output.weight"] = smollm2["embed"].to(dtype)
    if head is not None:
        w1 = stored["head.w1"] if v is None else stored["head.w1"][v.token_rows()]
        rows = V + learned
        out["markov_w1.weight"] = torch.cat([w1, w1.new_zeros(rows - len(w1), R)])
        out["markov_w2.weight"] = stored["head.w2"].t()
    if conf is not None:
        out["conf_proj.weight"] = stored["confidence.proj.weight"]
        out["conf_proj.bias"] = stored["confidence.proj.bias"]
    assert meta["method"] in ("dspark", "dflash")
    return out


def test_gguf_reads_back_with_the_drafters_tensors_and_metadata(exported, smollm2):
    import gguf

    target = read_metadata(smollm2["gguf"])
    for name, (source, path) in exported.items():
        backbone, head, conf, _ = load_drafter(source)
        c = backbone.config
        reader = gguf.GGUFReader(str(path))
        f = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.merges")}
        assert f["general.architecture"] == "dflash" and f["dflash.block_count"] == 1
        assert f["dflash.embedding_length"] == 576 and f["dflash.attention.head_count"] == 9
        assert f["dflash.attention.head_count_kv"] == 3 and f["dflash.rope.freq_base"] == 100000.0
        # The off-by-one of SPEC §12: we tap layer *outputs*, llama.cpp extracts layer *inputs*.
        assert c.tap_layers == (1, 8, 14, 20, 27)
        assert f["dflash.target_layers"] == [2, 9, 15, 21, 28]
        assert f["dflash.block_size"] == (c.gamma if name == "dspark" else c.gamma + 1)
        tokens = target["tokenizer.ggml.tokens"][2]
        if name == "dspark":  # learned MASK: one token past the target's, [PAD49152]
            assert f["tokenizer.ggml.mask_token_id"] == 49152 and f["dflash.sample_from_anchor"] is True
            assert f["dflash.has_confidence_head"] is True
            assert f["tokenizer.ggml.tokens"] == [t.decode() for t in tokens] + ["[PAD49152]"]
            assert f["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED
        else:
            assert f["tokenizer.ggml.mask_token_id"] == 7 and "dflash.sample_from_anchor" not in f
            assert f["tokenizer.ggml.tokens"] == [t.decode() for t in tokens]
        assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.eos_token_id"] == 2

        want = expected_tensors(source, smollm2)
        got = {t.name: t for t in reader.tensors}
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for key, tensor in want.items():
            t = got[key]
            assert tuple(int(n) for n in t.shape) == tuple(reversed(tensor.shape)), key  # GGUF: innermost first
            if key == "d2t":  # the draft vocabulary map: absolute target ids
                assert t.tensor_type == gguf.GGMLQuantizationType.I64 and np.array_equal(t.data, tensor.numpy())
                continue
            one_dim = tensor.dim() == 1 or key.endswith("_norm.weight")
            kind = {torch.float32: "F32", torch.bfloat16: "BF16"}[tensor.dtype]
            assert t.tensor_type.name == ("F32" if one_dim else kind), key
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tensor.shape)
            assert np.array_equal(values, tensor.float().numpy()), key  # bit for bit


def test_llama_cpp_loads_the_exported_gguf(exported):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(NO_BINDING)

    import llama_cpp.llama_cpp as api

    api.llama_backend_init()
    params = api.llama_model_default_params()
    for name, (_, path) in exported.items():
        model = api.llama_model_load_from_file(str(path).encode(), params)
        assert model, f"libllama refused {path}"
        try:
            vocab = api.llama_model_get_vocab(model)
            assert api.llama_model_n_layer(model) == 1 and api.llama_model_n_embd(model) == 576
            assert api.llama_vocab_n_tokens(vocab) == (49153 if name == "dspark" else 49152)
            assert api.llama_vocab_mask(vocab) == (49152 if name == "dspark" else 7)
            buf = ctypes.create_string_buffer(64)
            assert api.llama_model_meta_val_str(model, b"general.architecture", buf, 64) > 0
            assert buf.value == b"dflash"
        finally:
            api.llama_model_free(model)


# -- llama.cpp computes what specforge computes ---------------------------------------------------

TEXT = b"<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\nThe"


def _binding():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(NO_BINDING)
    from specforge.runtime.llamacpp.libllama import load

    return load()


def _context(api, model, n: int = 256):
    p = api.llama_context_default_params()
    p.n_ctx = p.n_batch = p.n_ubatch = n
    p.n_threads = p.n_threads_batch = 2
    return p


def _target_features(b, gguf_path: Path, layers: list[int]) -> tuple[object, object, list[int], np.ndarray]:
    """llama.cpp's target on the prompt but its last token, extracting the inputs of ``layers``:
    ``(model, context, tokens, features [n − 1, len(layers) · d])``."""
    api = b.api
    model = api.llama_model_load_from_file(str(gguf_path).encode(), api.llama_model_default_params())
    ctx = api.llama_init_from_model(model, _context(api, model))
    for layer in layers:
        b.set_layer_inp(ctx, layer, True)
    buf = (api.llama_token * 128)()
    n = api.llama_tokenize(api.llama_model_get_vocab(model), TEXT, len(TEXT), buf, 128, False, True)
    tokens = list(buf[:n])
    assert api.llama_decode(ctx, api.llama_batch_get_one(buf, n - 1)) == 0
    dim = api.llama_model_n_embd(model)
    rows = [np.ctypeslib.as_array(b.get_layer_inp(ctx, layer), shape=(n - 1, dim)).copy() for layer in layers]
    return model, ctx, tokens, np.concatenate(rows, axis=1)


def test_llama_cpp_extracts_the_layer_outputs_we_tap(smollm2):
    """The +1 of dflash.target_layers: llama.cpp's input of layer t + 1 is our tap t (the output of
    layer t, Hugging Face's hidden_states[t + 1]), not a neighbour."""
    from transformers import AutoModelForCausalLM

    from specforge.model_files import converted_checkpoint

    b = _binding()
    taps = (1, 8, 14, 20, 27)
    model, ctx, tokens, features = _target_features(b, smollm2["gguf"], [t + 1 for t in taps])
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(converted_checkpoint("smollm2")), dtype=torch.float32)
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        for k, t in enumerate(taps):
            mine = features[:, k * 576:(k + 1) * 576]
            err = {s: float(np.linalg.norm(mine - states[s + 1][0].numpy()) / np.linalg.norm(states[s + 1][0].numpy()))
                   for s in (t - 1, t, t + 1)}
            assert err[t] < 0.02 and err[t] < 0.5 * min(err[t - 1], err[t + 1]), (t, err)  # Q4_1 vs dequantized
    finally:
        b.api.llama_free(ctx)
        b.api.llama_model_free(model)


@pytest.mark.parametrize("name", list(EXPORTED))
def test_llama_cpp_drafts_what_specforge_drafts_from_the_same_features(exported, smollm2, name):
    """One block drafted by llama.cpp from the exported GGUF (its own layer inputs injected, then
    ``[x_0, MASK, …]`` decoded non-causally, as its DSpark/DFlash speculator does) and by our
    drafter on the same features: the same logits up to llama.cpp's arithmetic (an f16 KV cache,
    bf16 or Q8_0 products), the same arg-max chain, −∞ outside the draft vocabulary."""
    from specforge.toolkit.layers import SharedWeights

    b = _binding()
    api = b.api
    source, path = exported[name]
    backbone, head, _, _ = load_drafter(source)
    backbone.float()
    c = backbone.config
    model, ctx, tokens, features = _target_features(b, smollm2["gguf"], [t + 1 for t in c.tap_layers])
    draft = api.llama_model_load_from_file(str(path).encode(), api.llama_model_default_params())
    params = _context(api, draft)
    params.ctx_other = ctx  # a draft without its own embedding and LM head reads the target's
    dctx = api.llama_init_from_model(draft, params)
    batch = api.llama_batch_ext_init(dctx)
    try:
        api.llama_set_causal_attn(dctx, False)
        n = len(tokens)
        rows = np.ascontiguousarray(features, dtype=np.float32)
        for i in range(n - 1):  # the context: the target's features at their positions
            e = api.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
            idx = api.llama_batch_ext_add_embd(batch, 0, e)
            api.llama_batch_ext_set_pos(batch, idx, (api.llama_pos * 4)(i, i, i, 0))
        assert api.llama_process(dctx, api.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        api.llama_batch_ext_clear(batch)
        mask = api.llama_vocab_mask(api.llama_model_get_vocab(draft))
        for j in range(c.block_len):  # the block: the anchor at its position, MASK after it
            i = api.llama_batch_ext_add_token(batch, 0, tokens[-1] if j == 0 else mask)
            api.llama_batch_ext_set_pos(batch, i, (api.llama_pos * 4)(n - 1 + j, 0, 0, 0))
            api.llama_batch_ext_set_output_logits(batch, i, True)
        assert api.llama_process(dctx, api.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(draft))
        theirs = np.stack([np.ctypeslib.as_array(api.llama_get_logits_ith(dctx, j), shape=(n_vocab,)).copy()
                           for j in range(c.first_prediction, c.block_len)])
    finally:
        api.llama_batch_ext_free(batch)
        for free, handle in ((api.llama_free, dctx), (api.llama_model_free, draft), (api.llama_free, ctx),
                             (api.llama_model_free, model)):
            free(handle)

    head_dim = c.head_dim
    inv_freq = 1.0 / 100000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)  # SmolLM2's RoPE base
    backbone.bind(SharedWeights(embed=smollm2["embed"], lm_head=smollm2["embed"], inv_freq=inv_freq))
    with torch.no_grad():
        _, base = backbone(backbone.make_block(torch.tensor([tokens[-1]])), torch.from_numpy(features)[None],
                           torch.tensor([n - 1]))
    base = base[0]
    vocab = backbone.vocab
    ids = vocab.ids if vocab is not None else torch.arange(c.vocab_size)
    ours, prev = [], tokens[-1]
    for k in range(base.shape[0]):  # the Markov chain on the arg-max, as llama.cpp's graph runs it
        row = base[k]
        if head is not None:
            rows_of = vocab.token_rows() if vocab is not None else torch.arange(c.vocab_size)
            row = row + head.w1.float()[rows_of[prev]] @ head.w2.float()
        ours.append(row)
        prev = int(ids[int(row.argmax())])
    ours = torch.stack(ours)
    outside = np.delete(theirs, ids.numpy(), axis=1)
    assert outside.size == 0 or np.isneginf(outside).all()
    theirs = torch.from_numpy(theirs)[:, ids]
    assert (ours - theirs).abs().max() < 0.25, (ours - theirs).abs().max()  # logits of magnitude ~10
    for k in range(len(ours)):
        top2 = ours[k].topk(2).values
        if top2[0] - top2[1] < 0.5:  # a near tie: llama.cpp's arithmetic may pick the other one
            break
        assert int(ours[k].argmax()) == int(theirs[k].argmax()), k


REFUSED = {
    "no-qk-norm": (dict(qk_norm=False, mask=7), r"no qk-norm .* retrain with drafter.qk_norm=true"),
    "gated": (dict(head="gated", mask=7), r"only the vanilla Markov head .* correction head is gated"),
    "rnn": (dict(head="rnn", mask=7), r"only the vanilla Markov head .* correction head is rnn"),
    "dflash-markov": (dict(method="dflash", mask=7, conf=None), r"this DFlash drafter has a markov one"),
    "dflash-conf": (dict(method="dflash", mask=7, head=None, conf="own"),
                    r"has no confidence head and this drafter has one"),
    "last-layer": (dict(mask=7, taps=(3, 29)), r"taps the target's last layer \(29\)"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_llama_cpp_cannot_compute_is_refused_and_nothing_written(tmp_path, smollm2, name):
    spec, message = REFUSED[name]
    source = build(tmp_path, name, smollm2["args"], **spec)
    out = tmp_path / "out.gguf"
    with pytest.raises(InteropError, match=message):
        export_checkpoint(source, "llama.cpp", out)
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))


def test_the_shipped_drafter_has_qk_norm_and_exports_by_name(tmp_path):
    """Retrained with q/k norm (docs/shipped-drafter.md), the shipped drafter is one llama.cpp runs."""
    from gguf import GGUFReader

    backbone, _, _, _ = load_drafter("shipped:smollm2-135m-instruct")
    assert json.loads((SHIPPED / "config.json").read_text())["backbone"]["qk_norm"] is True
    assert backbone.config.qk_norm is True and any("q_norm" in k for k in backbone.state_dict())
    export_checkpoint("shipped:smollm2-135m-instruct", "llama.cpp", tmp_path / "shipped.gguf")
    names = {t.name for t in GGUFReader(str(tmp_path / "shipped.gguf")).tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight", "markov_w1.weight", "conf_proj.weight", "d2t"} <= names


def test_a_target_that_is_not_a_gguf_and_a_bad_out_are_refused(tmp_path, smollm2, exported):
    from transformers import AutoConfig

    from specforge.model_args import ModelArgs

    tiny = save_tiny("qwen3", tmp_path / "qwen3", seed=1, vocab=96, eos=None, layers=6)
    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(str(tiny)))
    source = build(tmp_path, "hf-target", args, mask=7, target=str(tiny))
    with pytest.raises(InteropError, match=r"is a Hugging Face folder and llama.cpp runs the target.* from a GGUF"):
        export_checkpoint(source, "llama.cpp", tmp_path / "x.gguf")
    dspark, path = exported["dspark"]
    with pytest.raises(InteropError, match=r"give --out a file name ending in .gguf"):
        export_checkpoint(dspark, "llama.cpp", tmp_path / "folder")
    with pytest.raises(InteropError, match=r"exists; choose a new file"):
        export_checkpoint(dspark, "llama.cpp", path)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "folder").exists()


def test_block_drafters_have_qk_norm_by_default_and_record_it(smollm2):
    from specforge_plugins.drafters.block.training import BlockTrainConfig
    from specforge_plugins.drafters.dspark import DSparkConfig, DSparkDrafter

    args = smollm2["args"]
    assert not args.qk_norm  # SmolLM2's own layers have none; its drafters have it all the same
    assert BlockTrainConfig().qk_norm is True
    assert BlockDrafterConfig.from_model_args(args).qk_norm is True
    assert DSparkDrafter()._random_config(args).qk_norm is True
    assert DSparkDrafter(DSparkConfig(qk_norm=False))._random_config(args).qk_norm is False
    with pytest.raises(ValueError, match="qk_norm come from the checkpoint"):
        DSparkConfig(checkpoint="shipped:smollm2-135m-instruct", qk_norm=True)


# -- llama.cpp itself: llama-speculative-simple with our drafter (make llama.cpp) -----------------

PROMPTS = tuple(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                for q in ("What is the capital of France? Answer in one sentence.",
                          "Write a Python function that returns the sum of a list."))


def speculative_simple(exe: Path, target: Path, draft: Path, spec_type: str, n_max: int, prompt: str,
                       tokens: int = 48) -> tuple[str, str]:
    """``(stdout, stderr)`` of one greedy run; ``n_max`` 0 drafts nothing: llama.cpp's plain decoding."""
    cmd = [str(exe), "-m", str(target), "-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(n_max),
           "-p", prompt, "-n", str(tokens), "--temp", "0", "--top-k", "1", "-t", "2", "-c", "1024", "--seed", "0",
           "-lv", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPORTED))
def test_llama_speculative_simple_runs_the_drafter_losslessly(exported, smollm2, name):
    from specforge.peers.llamacpp_tools import missing_reason, tool

    reason = missing_reason("llama-speculative-simple")
    if reason:
        pytest.skip(reason)
    exe = tool("llama-speculative-simple")
    source, path = exported[name]
    gamma = load_drafter(source)[0].config.gamma
    for prompt in PROMPTS:
        plain, _ = speculative_simple(exe, smollm2["gguf"], path, f"draft-{name}", 0, prompt)
        spec, log = speculative_simple(exe, smollm2["gguf"], path, f"draft-{name}", gamma, prompt)
        assert f"adding speculative implementation 'draft-{name}'" in log
        assert "DFlash extract_layers = [2, 9, 15, 21, 28]" in log  # our taps + 1, as llama.cpp read them
        assert f"block_size={gamma if name == 'dspark' else gamma + 1}" in log
        assert int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1)) > 0
        assert spec == plain  # T = 0: the drafter changes nothing in what llama.cpp writes


def test_a_run_saved_without_qk_norm_resumes_only_as_it_was(tmp_path):
    """A training run from before q/k norm was the default stops with the fix, not a state-dict error."""
    from train_fixtures import tiny_config, tiny_target

    from specforge.toolkit.checkpoints import DrafterCheckpointError
    from specforge.training.config import TrainConfig

    golden = Path(__file__).parent / "data" / "training-golden"
    spec = json.loads((golden / "golden.json").read_text())["runs"]["markov"]["drafter"]
    target, base = tiny_target(), tiny_config(tmp_path, steps=1).to_dict()

    def method(qk_norm):
        config = TrainConfig.model_validate({**base, "drafter": {**base["drafter"], **spec, "qk_norm": qk_norm}})
        cls, options = config.training_method()
        return cls(options, target, "cpu")

    with pytest.raises(DrafterCheckpointError, match=r"without q/k norm .* resume with drafter.qk_norm=false"):
        method(True).load(golden / "drafter-markov")
    method(False).load(golden / "drafter-markov")
    method(None).load(golden / "drafter-markov")  # null: as the target's layers (none on a Llama), the old default


def test_the_black_box_tier_takes_a_drafter_checkpoint_and_exports_it(exported, tmp_path):
    """``specforge conformance --engine llama.cpp-dspark --drafter X``: X a GGUF is used as is, a
    checkpoint directory is exported beside --out first (the same file `specforge export` writes)."""
    from specforge.errors import ConfigError
    from specforge_conformance.cli import _drafter_gguf

    source, gguf = exported["dspark"]
    assert _drafter_gguf(str(gguf), tmp_path) == gguf
    written = _drafter_gguf(str(source), tmp_path)
    assert written.parent == tmp_path and written.suffix == ".gguf"
    assert written.read_bytes() == gguf.read_bytes()
    # the same command again (a rerun, or one killed while exporting) replaces it whole
    assert _drafter_gguf(str(source), tmp_path) == written and written.read_bytes() == gguf.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [written.name]  # no staging folder left
    with pytest.raises(ConfigError, match="neither a .gguf file nor a drafter checkpoint"):
        _drafter_gguf(str(tmp_path / "nothing"), tmp_path)

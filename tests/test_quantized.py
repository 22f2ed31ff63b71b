"""Native 4-bit weights (``target.weights=native``): GGUF Q4_0/Q4_1 blocks run through torch's
int4 kernel.  A tiny Llama is written out as a real GGUF file (with llama.cpp's q/k row order),
and its HF twin given exactly the weights the file decodes to."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from specforge.config import EngineConfig, SamplingConfig
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import PluginHost
from specforge.runtime import TargetModel, load_target
from specforge.passes import VarlenBatch
from specforge.toolkit.projection import pack_for_onednn
from specforge.runtime.torch.quantized import (
    HEAD_KERNEL_ROWS,
    KERNEL_ROWS,
    Int4Projection,
    NativeWeightsError,
    Q8Projection,
    read_q4,
    use_native_weights,
)

Q4 = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter: rotary halves of each head interleaved (what transformers undoes)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, model, kinds: dict[str, gguf.GGMLQuantizationType],
                head: gguf.GGMLQuantizationType | None = gguf.GGMLQuantizationType.Q8_0) -> None:
    """Quantize ``model``'s layer projections into a GGUF at ``path`` (``kinds``: by GGUF tensor
    suffix, default Q4_1; ``head``: the tied embedding's type, None to leave it out) and give
    ``model`` the weights the file decodes to."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for name, linear, heads in (("attn_q", a.q_proj, cfg.num_attention_heads),
                                    ("attn_k", a.k_proj, cfg.num_key_value_heads),
                                    ("attn_v", a.v_proj, 0), ("attn_output", a.o_proj, 0),
                                    ("ffn_gate", m.gate_proj, 0), ("ffn_up", m.up_proj, 0),
                                    ("ffn_down", m.down_proj, 0)):
            kind = kinds.get(name, Q4["Q4_1"])
            w = linear.weight.detach().numpy().astype(np.float32)
            stored = _permute(w, heads) if heads else w
            data = gguf.quants.quantize(stored, kind) if kind in Q4.values() else stored
            writer.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=kind if kind in Q4.values() else None)
            decoded = gguf.quants.dequantize(data, kind) if kind in Q4.values() else stored
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(_unpermute(decoded, heads) if heads else decoded))
    if head is not None:  # the tied embedding / LM head
        embed = model.model.embed_tokens.weight
        data = gguf.quants.quantize(embed.detach().numpy().astype(np.float32), head)
        writer.add_tensor("token_embd.weight", data, raw_dtype=head)
        with torch.no_grad():
            embed.copy_(torch.from_numpy(gguf.quants.dequantize(data, head)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # the inverse: back to the HF row order, as transformers' GGUF loader does
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture()
def native(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, {})
    dense = TargetModel(model, None, torch.bfloat16)
    quant = TargetModel(model, None, torch.bfloat16)
    with torch.no_grad():
        counts = use_native_weights(quant.runtime, model, path)
    return model, dense, quant, counts, path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_decode_to_the_files_values(tmp_path, kind):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (48, 96)).astype(np.float32)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("w", gguf.quants.quantize(w, Q4[kind]), raw_dtype=Q4[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    blocks = read_q4(tensor)
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert blocks.codes.shape == (48, 96) and int(blocks.codes.max()) <= 15
    assert torch.equal(blocks.dequantized(), torch.from_numpy(expected))  # bit for bit


def test_other_types_stay_dense(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "mixed.gguf"
    _write_gguf(path, model, {"ffn_down": gguf.GGMLQuantizationType.F32, "attn_v": gguf.GGMLQuantizationType.F32})
    target = TargetModel(model, None, torch.bfloat16)
    with torch.no_grad():
        counts = use_native_weights(target.runtime, model, path)
    # per layer: qkv (v is F32) and down stay dense, o and gate/up run natively; the head natively
    assert counts == {"native": 2 * 3 + 1, "dense": 2 * 3}
    layer = target.runtime.layers[0]
    assert isinstance(layer.o_proj, Int4Projection) and not isinstance(layer.qkv_proj, Int4Projection)


def test_native_projection_matches_its_dense_weights(native):
    _, _, quant, counts, _ = native
    assert counts == {"native": 4 * 3 + 1, "dense": 0}
    proj = quant.runtime.layers[1].up_proj
    torch.manual_seed(0)
    x = torch.randn(40, proj.in_features).bfloat16()
    expected = x.float() @ proj.weight().T
    scale = expected.abs().max()
    for rows in (1, 3, 40):
        got = proj(x[:rows]).float()
        # bf16 output: within a few units of the last place of the largest value
        assert torch.allclose(got, expected[:rows], atol=float(scale) * 2**-7, rtol=0)


def test_a_tokens_row_does_not_depend_on_the_batch(native):
    # Within the kernel's range bit for bit; bigger passes go through the dense bf16 copy, whose
    # weights are the kernel's rounded to bf16: within the bf16 rounding of the output.
    proj = native[2].runtime.layers[0].qkv_proj
    torch.manual_seed(1)
    x = torch.randn(70, proj.in_features).bfloat16()
    alone = torch.cat([proj(x[i:i + 1]) for i in range(70)])
    for rows in range(2, KERNEL_ROWS + 1):
        assert torch.equal(proj(x[:rows]), alone[:rows])
    if proj.dense is None:
        # No oneDNN bf16 packing on this CPU (AVX2 only): the kernel serves every pass, so every
        # row is bit for bit what it is alone, at any batch size.
        assert pack_for_onednn(torch.zeros(16, proj.in_features).bfloat16()) is None
        assert torch.equal(proj(x), alone)
        return
    exact = x.float() @ proj.weight().T
    err_kernel = (alone.float() - exact).abs().max().item()
    err_dense = (proj(x).float() - exact).abs().max().item()
    assert err_dense <= 2 * err_kernel and err_dense <= exact.abs().max().item() * 2**-7


def test_native_weights_stay_close_to_the_file(native):
    model, dense, quant, _, _ = native
    ids = torch.tensor([[0, 5, 17, 40, 3, 9, 22, 61, 7]])
    exact = model(ids).logits[0]
    batch = VarlenBatch.build([ids[0]], [0], [0])
    rows = torch.arange(ids.shape[1])
    d = dense.forward(batch, dense.new_cache(1, 32), rows).logits
    q = quant.forward(batch, quant.new_cache(1, 32), rows).logits
    # both are bf16 renderings of the float32 model; neither is much further from it than the other
    err_d, err_q = (d - exact).abs().max().item(), (q - exact).abs().max().item()
    assert err_q < 4 * err_d + 1e-3 and err_q < 0.1 * exact.abs().max().item()


def _decode_vs_verify(target, ids: list[int], split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``ids[split:]`` decoded one token a pass, and verified in one pass."""
    stepwise, cache = [], target.new_cache(1, 64)
    out = target.forward(VarlenBatch.build([ids[:split]], [0], [0]), cache, torch.tensor([split - 1]))
    for p in range(split, len(ids) - 1):
        out = target.forward(VarlenBatch.build([ids[p:p + 1]], [0], [p]), cache, torch.tensor([0]))
        stepwise.append(out.logits[0])
    cache = target.new_cache(1, 64)
    target.forward(VarlenBatch.build([ids[:split]], [0], [0]), cache)
    verified = target.forward(VarlenBatch.build([ids[split:-1]], [0], [split]), cache,
                              torch.arange(len(ids) - 1 - split)).logits
    return torch.stack(stepwise), verified


def test_a_verify_pass_gives_the_logits_of_step_by_step_decoding(native):
    # bf16 passes are not bit-for-bit batch-invariant (attention and the dense LM head block their
    # work by row count), dense or native; the native projections are (see above), so verifying a
    # block may differ from decoding it only as much as the dense runtime does.
    _, dense, quant, _, _ = native
    ids = [0, 5, 17, 40, 3, 5, 17, 40, 49, 60, 53, 6, 54, 19, 12, 18, 33]
    deviation = {}
    for name, target in (("dense", dense), ("native", quant)):
        stepwise, verified = _decode_vs_verify(target, ids, 8)
        deviation[name] = (stepwise - verified).abs().max().item()
        scale = stepwise.abs().max().item()
        assert deviation[name] < 0.05 * scale, (name, deviation[name], scale)  # bf16, 3 layers
    assert deviation["native"] < 2 * deviation["dense"] + 0.05


def test_speculative_decoding_runs_on_native_weights(native):
    # Greedy speculation on the native target follows its plain decoding; where the two part, the
    # plain decoding's top two logits were within bf16 noise of each other (a near tie).
    quant = native[2]
    host = PluginHost(autoload=False).load()
    prompts = [[0, 5, 17, 40, 3, 5, 17, 40], [0, 9, 9, 22, 61, 9, 9, 22]]

    def run(drafter):
        parts = {}
        if drafter:
            parts = dict(drafter=host.create_drafter("ngram", {"gamma": 4}),
                         confidence=host.create_confidence("constant", {}),
                         calibrator=host.create_calibrator("identity", {}),
                         scheduler=host.create_scheduler("fixed", {}))
        engine = Engine(quant, host.create_verifier("greedy"), **parts,
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=24),
                        engine=EngineConfig(max_batch=2, max_context=64))
        return engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=24, ignore_eos=True)
                                for p in prompts])

    for prompt, spec, plain in zip(prompts, run(True), run(False), strict=True):
        assert len(spec.token_ids) == len(plain.token_ids) == 24
        assert spec.stats.verified > 0 and plain.stats.verified == 0  # drafts went through the target
        parted = next((i for i, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids)) if a != b), None)
        if parted is not None:
            ids = prompt + plain.token_ids[:parted]
            logits = quant.forward(VarlenBatch.build([ids], [0], [0]), quant.new_cache(1, 64),
                                   torch.tensor([len(ids) - 1])).logits[0]
            top = logits.topk(2).values
            assert (top[0] - top[1]).item() <= 0.05 * logits.abs().max().item()


def test_a_row_order_mistake_is_refused_by_name(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, {})
    with torch.no_grad():  # the HF twin no longer holds what the file decodes to
        model.model.layers[2].self_attn.k_proj.weight[3, 0] += 1.0
    target = TargetModel(model, None, torch.bfloat16)
    with pytest.raises(NativeWeightsError, match=r"blk\.2\.attn_k\.weight.*layer 2"):
        with torch.no_grad():
            use_native_weights(target.runtime, model, path)


def test_native_weights_need_bfloat16_and_a_gguf(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, {})
    with pytest.raises(NativeWeightsError, match="dtype=bfloat16"):
        use_native_weights(TargetModel(model, None, torch.float32).runtime, model, path)
    from tiny_models import save_tiny

    directory = save_tiny("llama", tmp_path / "hf")
    with pytest.raises(NativeWeightsError, match="safetensors directory"):
        load_target(str(directory), dtype="bfloat16", weights="native", backend="torch")


def test_the_pipeline_config_has_the_switch():
    from specforge.config import TargetConfig

    assert TargetConfig().weights == "auto"
    assert TargetConfig(weights="native").weights == "native"
    with pytest.raises(ValueError, match="weights"):
        TargetConfig(weights="int4")


@pytest.mark.slow  # the real SmolLM2, end to end
def test_the_embedded_smollm2_runs_natively_and_close_to_float32():
    target = load_target("smollm2", dtype="bfloat16", weights="native", backend="torch")
    assert target.weights == {"native": 4 * target.args.n_layers + 1, "dense": 0}
    ids = target.encode("Write a Python function that reverses a list.")
    exact = target.reference_logits(ids)  # the float32 HF forward of the same file
    got = target.forward(VarlenBatch.build([ids], [0], [0]), target.new_cache(1, len(ids)),
                         torch.arange(len(ids))).logits
    agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_block_scale_and_zero_beat_rounding_each_to_the_nearest_bf16():
    from specforge.runtime.torch.quantized import Q4Blocks, bf16_scale_zero

    torch.manual_seed(3)
    n, k = 32, 256
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // 32) * 0.02 + 1e-3).half().float()
    offset = (-scale * 7.5 + torch.randn(n, k // 32) * 0.01).half().float()
    blocks = Q4Blocks(codes, scale, offset)
    exact = blocks.dequantized().view(n, k // 32, 32)
    levels = codes.view(n, k // 32, 32).float() - 8

    def block_error(s, z):
        return ((levels * s[..., None] + z[..., None] - exact) ** 2).sum(-1)

    chosen = bf16_scale_zero(blocks).float()
    nearest = block_error(scale.bfloat16().float(), (offset + 8 * scale).bfloat16().float())
    mine = block_error(chosen[..., 0], chosen[..., 1])
    assert torch.all(mine <= nearest) and mine.sum() < nearest.sum()


def test_fidelity_of_renderings_against_float32(native):
    from specforge.bench.fidelity import rendering_fidelity

    model, dense, quant, _, _ = native
    exact = TargetModel(model, None, torch.float32)  # the float32 runtime is the oracle's twin
    seqs = [[0, 5, 17, 40, 3, 9, 22, 61, 7], [0, 1, 2, 3, 4, 5]]
    got = rendering_fidelity({"fp32": exact, "dense": dense, "native": quant}, seqs, exact)
    assert got["positions"] == 15
    assert got["fp32"]["top1_agreement"] == 1.0 and got["fp32"]["mean_kl"] < 1e-6
    for name in ("dense", "native"):
        assert 0.5 <= got[name]["top1_agreement"] <= 1.0 and 0 <= got[name]["mean_kl"] < 0.05


def test_the_compiled_forward_calls_the_native_projections(native):
    # The int4 projections reach torch.compile through the same opaque op as the dense ones.
    from specforge.toolkit.compiled import compile_available

    if not compile_available():
        pytest.skip("no C++ compiler for inductor")
    model, _, quant, _, path = native
    fast = TargetModel(model, None, torch.bfloat16)
    with torch.no_grad():
        use_native_weights(fast.runtime, model, path)
    assert fast.runtime.compile()
    ids = [0, 5, 17, 40, 3, 9, 22, 61, 7]
    rows = torch.arange(len(ids))
    eager = quant.forward(VarlenBatch.build([ids], [0], [0]), quant.new_cache(1, 32), rows).logits
    cache = fast.new_cache(1, 32)
    got = fast.forward(VarlenBatch.build([ids], [0], [0]), cache, rows).logits
    assert fast.runtime.compiled.failed is None
    step = fast.forward(VarlenBatch.build([[11]], [0], [len(ids)]), cache, torch.tensor([0])).logits
    ref = quant.forward(VarlenBatch.build([ids + [11]], [0], [0]), quant.new_cache(1, 32),
                        torch.tensor([len(ids)])).logits
    scale = eager.abs().max().item()
    # fused kernels keep float32 intermediates where eager rounds to bf16: a few bf16 ulps
    assert (got - eager).abs().max().item() < 0.05 * scale
    assert (step - ref).abs().max().item() < 0.05 * scale


def test_native_weights_in_float32_are_refused_before_loading(monkeypatch):
    import specforge.runtime.load as loader

    def no_load(*a, **k):
        raise AssertionError("loaded the model before refusing")

    monkeypatch.setattr(loader, "load_hf", no_load)
    with pytest.raises(NativeWeightsError, match="dtype=bfloat16.*not float32"):
        load_target("smollm2", dtype="float32", weights="native", backend="torch")


@pytest.mark.slow  # profiles the real SmolLM2
def test_profile_cli_measures_the_native_target(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "prof"
    r = subprocess.run([sys.executable, "-m", "specforge", "profile", "--weights", "native", "--batches", "1", "12",
                        "--context", "16", "--requests", "2", "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    timings = json.loads((out / "timings.json").read_text())
    assert timings["weights"] == "native" and timings["compiled"] is False
    assert [rec["batch"] for rec in timings["records"]] == [1, 12]


@pytest.mark.parametrize("head", ["Q8_0", "Q4_1", None])
def test_the_lm_head_runs_natively_when_the_file_allows(tmp_path, head):
    kind = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_1": Q4["Q4_1"], None: None}[head]
    model = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, {}, head=kind)
    target = TargetModel(model, None, torch.bfloat16)
    with torch.no_grad():
        counts = use_native_weights(target.runtime, model, path)
    proj = target.runtime.head_projection
    assert counts["dense"] == (1 if head is None else 0)
    expected_type = {"Q8_0": Q8Projection, "Q4_1": Int4Projection, None: type(proj)}[head]
    assert isinstance(proj, expected_type)
    if head is None:
        return
    exact_head = model.get_output_embeddings().weight.detach().float()
    torch.manual_seed(2)
    x = torch.randn(2, 5, exact_head.shape[1]).bfloat16()  # drafters project [B, S, d]
    exact = x.float() @ exact_head.T
    scale = exact.abs().max().item()
    for rows in (x[:1, :1], x[:1, :2], x[:1], x):  # few rows through the kernel(s), more through the copy
        got = proj(rows).float()
        assert got.shape == (*rows.shape[:-1], exact_head.shape[0])
        assert (got - exact[: rows.shape[0], : rows.shape[1]]).abs().max().item() < scale * 2**-6
    limit = HEAD_KERNEL_ROWS if head == "Q8_0" else KERNEL_ROWS
    alone = torch.cat([proj(x[0, i:i + 1]) for i in range(limit)])
    assert torch.equal(proj(x[0, :limit]), alone)  # within the kernel's range, bit for bit


def test_a_wrong_lm_head_is_refused(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, model, {})
    with torch.no_grad():
        model.model.embed_tokens.weight[7, 3] += 0.5
    target = TargetModel(model, None, torch.bfloat16)
    with pytest.raises(NativeWeightsError, match="token_embd.weight.*LM head"):
        with torch.no_grad():
            use_native_weights(target.runtime, model, path)

"""The llama.cpp target backend on the embedded SmolLM2 GGUF: the pass contract the engine relies on.

Rollback, isolation of sequences in one pass, taps against Hugging Face's hidden states, token
trees, greedy parity with llama.cpp's own decoding, and the refusals.  Skipped, with the install
command, where the binding is not installed.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specforge.runtime.llamacpp.libllama import INSTALL, BindingError, load
from specforge.passes import VarlenBatch
from specforge.model_files import resolve_model

try:
    load()
    _MISSING = None
except BindingError as exc:
    _MISSING = str(exc)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"llama.cpp binding unavailable: {INSTALL}")

# llama.cpp multiplies the Q4_1 weights by Q8_1-quantized activations.  A token's logits do not
# depend on how many rows share its pass (bit-identical here), but they do depend on the order in
# which its attention sums the cached positions — the order of llama.cpp's KV cells, which a freed
# cell reused later or a token tree's pruned branch changes: the last-ulp change flips Q8_1
# roundings, and 30 layers amplify it.  Measured on SmolLM2 Q4_1: up to 0.6 on one logit, 0.07 RMS,
# against 0.12 RMS between either and the float32 reference — numerics, not a wrong prefix.
def assert_same_logits(ours, theirs, exact=False):
    if exact:
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()
        return
    diff = (ours - theirs).float()
    assert diff.abs().max() < 1.0 and diff.pow(2).mean().sqrt() < 0.15, (diff.abs().max(), diff.pow(2).mean().sqrt())


@pytest.fixture(scope="module")
def backend():
    from specforge.runtime.llamacpp.backend import LlamaCppBackend

    directory, name = resolve_model("smollm2")
    return LlamaCppBackend(directory / name, n_layers=30, dim=576, vocab=49152)


def _pass(backend, cache, runs, slots, starts, rows=None, taps=()):
    batch = VarlenBatch.build(runs, slots, starts)
    if rows is None:  # every row of every run
        rows = torch.arange(batch.num_tokens)
    return backend.forward(batch, cache, logits_rows=rows, taps=taps)


PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 19161, 253, 8396, 2063, 338, 6842, 3200, 253, 1230, 314, 4321]


def test_crop_then_decode_matches_a_fresh_prefill_of_the_kept_tokens(backend):
    cache = backend.new_cache(2, 256)
    slot = cache.allocate()
    n = len(PROMPT)
    _pass(backend, cache, [PROMPT], [slot], [0])
    cache.advance(slot, n)
    # A verification of 4 rows at n: anchor 42 and drafts 43, 44, 45; two survive, the rest are rolled back.
    _pass(backend, cache, [[42, 43, 44, 45]], [slot], [n])
    cache.advance(slot, n + 2)
    after = _pass(backend, cache, [[77, 78]], [slot], [n + 2]).logits

    fresh = backend.new_cache(1, 256)
    other = fresh.allocate()
    _pass(backend, fresh, [PROMPT + [42, 43]], [other], [0])
    fresh.advance(other, n + 2)
    reference = _pass(backend, fresh, [[77, 78]], [other], [n + 2]).logits
    assert_same_logits(after, reference, exact=True)  # the cells hold positions in order in both


def test_sequences_in_one_pass_do_not_see_each_other(backend):
    cache = backend.new_cache(3, 256)
    a, b = cache.allocate(), cache.allocate()
    other = [5, 6, 7, 8, 9, 10, 11]
    # A's rows next to two different B's in a pass of the same shape: A's logits do not move at all.
    first = _pass(backend, cache, [PROMPT, other], [a, b], [0, 0]).logits[: len(PROMPT)]
    cache.free(b)
    b = cache.allocate()
    second = _pass(backend, cache, [PROMPT, [99] * len(other)], [a, b], [0, 0]).logits[: len(PROMPT)]
    assert torch.equal(first, second)
    # Next to B's cached tokens, A's decode sees only its own prefix.
    cache.advance(a, len(PROMPT))
    cache.advance(b, len(other))
    together = _pass(backend, cache, [[42], [43]], [a, b], [len(PROMPT), len(other)]).logits[0]
    alone_cache = backend.new_cache(1, 256)
    c = alone_cache.allocate()
    _pass(backend, alone_cache, [PROMPT], [c], [0])
    alone_cache.advance(c, len(PROMPT))
    alone = _pass(backend, alone_cache, [[42]], [c], [len(PROMPT)]).logits[0]
    assert_same_logits(together, alone)


def test_logits_rows_come_back_in_the_order_asked_repeats_included(backend):
    cache = backend.new_cache(1, 128)
    slot = cache.allocate()
    everything = _pass(backend, cache, [PROMPT[:8]], [slot], [0]).logits
    cache.free(slot)
    slot = cache.allocate()
    asked = torch.tensor([3, 3, 1, 7, 7, 7])
    picked = _pass(backend, cache, [PROMPT[:8]], [slot], [0], rows=asked).logits
    assert picked.shape == (6, 49152)
    assert_same_logits(picked, everything[asked], exact=True)


def test_taps_are_each_layers_output_as_hugging_face_computes_it(backend):
    from specforge.model_files import load_hf

    hf, _ = load_hf("smollm2", torch.float32)
    layers = (0, 3, 14, 27, 28)
    cache = backend.new_cache(1, 128)
    slot = cache.allocate()
    out = _pass(backend, cache, [PROMPT], [slot], [0], rows=torch.tensor([len(PROMPT) - 1]), taps=layers)
    with torch.no_grad():
        hidden = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    for layer in layers:
        ours, theirs = out.taps[layer], hidden[layer + 1][0]
        assert ours.shape == (len(PROMPT), 576)
        # Q4_1 × Q8_1 against float32 dequantized weights: every row points the same way.
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        assert cosine.min() > 0.99, (layer, cosine.min())
    assert out.hidden is None


def test_the_last_layers_output_is_refused_by_name(backend):
    from specforge.runtime.contract import Needs
    from specforge.runtime.llamacpp.backend import BackendUnsupported

    assert "layer 29" in backend.lacks(Needs(taps=(3, 29)))
    assert "final hidden state" in backend.lacks(Needs(final_hidden=True))
    assert backend.lacks(Needs(taps=(3, 28))) is None
    cache = backend.new_cache(1, 64)
    with pytest.raises(BackendUnsupported, match="target.backend=torch"):
        backend.forward(VarlenBatch.build([PROMPT], [cache.allocate()], [0]), cache, taps=(3, 29))


def test_a_tree_pass_gives_each_branch_the_logits_of_its_own_prefix(backend):
    n = len(PROMPT)
    # anchor 42 → {43 → 45, 44}; node order: 42, 43, 44, 45 (parents -1, 0, 0, 1)
    cache = backend.new_cache(2, 256)
    slot = cache.allocate()
    _pass(backend, cache, [PROMPT], [slot], [0])
    cache.advance(slot, n)
    batch = VarlenBatch.build([[42, 43, 44, 45]], [slot], [n], parents=[[-1, 0, 0, 1]])
    tree = backend.forward(batch, cache, logits_rows=torch.arange(4)).logits

    def chain(tokens):
        fresh = backend.new_cache(1, 256)
        s = fresh.allocate()
        _pass(backend, fresh, [PROMPT], [s], [0])
        fresh.advance(s, n)
        return _pass(backend, fresh, [tokens], [s], [n]).logits[-1]

    for node, path in enumerate(([42], [42, 43], [42, 44], [42, 43, 45])):
        assert_same_logits(tree[node], chain(path))
    # Accept 43 → 45: the path joins the request's sequence, the branch with 44 is gone.
    cache.compact(slot, [n, n + 1, n + 3], n)
    cache.advance(slot, n + 3)
    after = _pass(backend, cache, [[46]], [slot], [n + 3]).logits[0]
    assert_same_logits(after, chain([42, 43, 45, 46]))
    assert not cache.branch and len(cache.spare) == 2 * 8


def test_a_tiny_hugging_face_llama_written_as_gguf_runs_its_own_law(tmp_path):
    """The writer the conformance suite's llama.cpp tier uses: same logits as the HF model (the
    float32 weights pass through; llama.cpp's float16 KV cache is the only rounding)."""
    from specforge.runtime.llamacpp.write_gguf import write_llama_gguf
    from specforge.runtime.llamacpp.backend import LlamaCppBackend
    from tiny_models import tiny_model

    model = tiny_model("llama", vocab=32)
    backend = LlamaCppBackend(write_llama_gguf(model, tmp_path / "tiny.gguf"), n_layers=3, dim=64, vocab=32)
    cache = backend.new_cache(2, 64)
    ids = [0, 5, 7, 9, 11, 3, 4]
    out = _pass(backend, cache, [ids], [cache.allocate()], [0], taps=(0, 1))
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    assert (out.logits - ref.logits[0]).abs().max() < 0.02
    for layer in (0, 1):
        assert (out.taps[layer] - ref.hidden_states[layer + 1][0]).abs().max() < 0.05


def test_auto_keeps_the_backend_measured_faster_and_says_so(tmp_path):
    from specforge.runtime import TargetModel
    from specforge.runtime.choice import BackendChoice, measure_backends
    from specforge.runtime.llamacpp.backend import LlamaCppBackend
    from specforge.runtime.llamacpp.write_gguf import write_llama_gguf
    from tiny_models import tiny_model

    model = tiny_model("llama", vocab=32)
    target = TargetModel(model, None, torch.float32, name="tiny")
    gguf = write_llama_gguf(model, tmp_path / "t.gguf")
    llama = LlamaCppBackend(gguf, target.args.n_layers, target.args.dim, target.vocab_size)
    choice = measure_backends({"torch": target.teacher(), "llama.cpp": llama}, vocab=32, reps=4)
    speed = choice.speedup()
    assert choice.for_load(None) == ("llama.cpp" if speed >= 1 else "torch")
    assert set(choice.seconds) == {"torch", "llama.cpp"} and all(s > 0 for by in choice.seconds.values()
                                                                  for s in by.values())
    assert BackendChoice.from_dict(choice.to_dict()).to_dict() == choice.to_dict()
    assert "decode-1" in choice.describe() and choice.for_load(None) in choice.describe()
    with pytest.raises(ValueError, match="not a backend record"):
        BackendChoice.from_dict({"backend": "torch"})


def test_auto_on_a_safetensors_directory_is_torch_with_the_reason(tmp_path):
    from specforge.runtime.choice import where_llamacpp_cannot_run

    assert "GGUF" in where_llamacpp_cannot_run(None)


def test_the_gguf_writer_refuses_other_families(tmp_path):
    from specforge.runtime.llamacpp.write_gguf import write_llama_gguf
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match="Llama-family"):
        write_llama_gguf(tiny_model("qwen3", vocab=32), tmp_path / "q.gguf")
    assert not list(tmp_path.iterdir())


def test_a_missing_binding_names_the_install_command(monkeypatch):
    load.cache_clear()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    try:
        with pytest.raises(BindingError, match="make install") as info:
            load()
        assert "target.backend=torch" in str(info.value)
    finally:
        monkeypatch.undo()
        load.cache_clear()
        load()


def test_a_binding_built_for_another_cpu_is_refused_before_it_loads(monkeypatch):
    import specforge.runtime.llamacpp.libllama as binding

    load.cache_clear()
    monkeypatch.setattr(binding, "installed_key", lambda: "another-cpu")
    try:
        with pytest.raises(BindingError, match="another CPU"):
            load()
    finally:
        monkeypatch.undo()
        load.cache_clear()
        load()


def test_a_safetensors_target_with_the_llama_cpp_backend_is_a_config_error(tmp_path):
    from specforge.runtime import load_target
    from specforge.runtime.llamacpp.backend import BackendUnsupported
    from tiny_models import save_tiny

    directory = save_tiny("llama", tmp_path)
    with pytest.raises(BackendUnsupported, match="target.backend=torch"):
        load_target(str(directory), dtype="float32", backend="llama.cpp")


# -- the engine on the backend, against llama.cpp's own decoding ---------------------------------

@pytest.fixture(scope="module")
def target():
    from specforge.runtime import load_target

    return load_target("smollm2", dtype="float32", backend="llama.cpp")


def llama_cpp_greedy(target, prompts, n):
    """llama-cpp-python's own ``Llama.generate`` at temperature 0 (its greedy sampler), with flash
    attention on as llama.cpp's default ``auto`` resolves it on a CPU (the binding's own default is off)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(target.backend.gguf), n_ctx=1024, n_threads=torch.get_num_threads(),
                          n_batch=512, flash_attn=True, verbose=False)
    outs = []
    for ids in prompts:
        llm.reset()
        out = []
        for token in llm.generate(ids, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n or token in target.eos_ids:
                break
        outs.append(out)
    return outs


def engine_outputs(target, prompts, n, preset=None):
    from specforge.config import EngineConfig, SamplingConfig
    from specforge.engine import Engine, GenerationRequest
    from specforge.plugins import PluginHost

    host = PluginHost().load()
    parts = {}
    if preset == "ngram":
        parts = dict(drafter=host.create_drafter("ngram", {"gamma": 5}), confidence=host.create_confidence("constant", {}),
                     calibrator=host.create_calibrator("identity", {}), scheduler=host.create_scheduler("fixed", {}))
    engine = Engine(target, host.create_verifier("greedy"), **parts, sampling=SamplingConfig(temperature=0.0),
                    engine=EngineConfig(max_batch=1, max_context=1024))
    outs = engine.generate([GenerationRequest(prompt_ids=ids, max_new_tokens=n) for ids in prompts])
    return [list(o.token_ids) for o in outs]


def _prompts(target, count):
    from specforge.evalsets import select_prompts

    return [target.encode(p.text) for p in select_prompts(["humaneval", "gsm8k", "mt-bench"], count)]


@pytest.mark.parametrize("preset", [None, "ngram"])
def test_the_engines_greedy_tokens_are_llama_cpps_own(target, preset):
    prompts = _prompts(target, 3)
    theirs = llama_cpp_greedy(target, prompts, 24)
    assert engine_outputs(target, prompts, 24, preset) == theirs


# Two logits that each move by up to 0.6 (above) can trade places when their margin is below 1.2.
NEAR_TIE = 1.2


def llama_cpp_margin(target, prompt, continuation, a, b):
    """llama.cpp's own logit of token ``a`` minus that of ``b`` after ``prompt + continuation``,
    reached as ``Llama.generate`` reaches it (the prompt in one pass, then one token a pass), and
    whether the two are its top two."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(target.backend.gguf), n_ctx=1024, n_threads=torch.get_num_threads(),
                          n_batch=512, flash_attn=True, logits_all=True, verbose=False)
    llm.eval(prompt)
    for token in continuation:
        llm.eval([token])
    logits = np.asarray(llm.scores[llm.n_tokens - 1])
    top2 = set(np.argsort(-logits)[:2].tolist())
    return float(logits[a] - logits[b]), top2 == {a, b}


@pytest.mark.slow
def test_greedy_parity_on_twelve_prompts_of_mixed_length(target):
    """Plain decoding gives llama.cpp's own greedy tokens exactly.  With drafts the verify passes
    have other shapes, whose Q8_1 numerics can flip a near-tie (docs/backends.md): every place the
    ngram arm leaves llama.cpp's text is such a tie — the two tokens are llama.cpp's top two there,
    closer than two logits' noise — and most prompts do not leave it at all."""
    prompts = _prompts(target, 12)
    theirs = llama_cpp_greedy(target, prompts, 128)
    assert engine_outputs(target, prompts, 128) == theirs
    drafted = engine_outputs(target, prompts, 128, "ngram")
    left = 0
    for ids, ours, plain in zip(prompts, drafted, theirs):
        if ours == plain:
            continue
        left += 1
        k = next((i for i, (x, y) in enumerate(zip(ours, plain)) if x != y), min(len(ours), len(plain)))
        assert k < min(len(ours), len(plain)), "one output stops early where the other goes on"
        margin, top_two = llama_cpp_margin(target, ids, plain[:k], plain[k], ours[k])
        assert top_two and 0 <= margin < NEAR_TIE, (k, plain[k], ours[k], margin)
    assert left <= len(prompts) // 4, f"{left} of {len(prompts)} prompts left llama.cpp's greedy text"


# -- the conformance suite with its target on llama.cpp ------------------------------------------

@pytest.mark.slow  # two cases of N = 20,000 (and the clean one's screen) through libllama: minutes
def test_conformance_certifies_a_combination_on_llama_cpp_and_still_rejects_a_control():
    """A Llama-family reference target written as a GGUF and decoded by libllama: the rejection
    verifier behind a random drafter keeps the exact law (every statistic of the suite, its two-
    stage rule), and the control that resamples the target after a rejection is caught."""
    from dataclasses import replace

    from specforge_conformance.backends import target_backend
    from specforge_conformance.exact import sampling_target
    from specforge_conformance.harness import check_case, run_case
    from specforge_conformance.power import control_case, control_host
    from specforge_conformance.suite import ALPHA

    host = control_host()
    control = control_case("resample-target", n=20_000, host=host)
    clean = replace(control, pipeline={**control.pipeline, "verifier": ("rejection", {})})
    assert clean.family == "llama"
    with target_backend("llama.cpp"):
        assert sampling_target(clean.reference).backend.name == "llama.cpp"
        certified = check_case(clean, host, ALPHA)
        caught = run_case(control, host)
    assert not certified.failed and certified.verified > 0, certified.rejected()
    assert caught.rejected(), {k: f.p_value for k, f in caught.tests.items()}
    assert sampling_target(clean.reference).backend.name == "torch"  # outside the block: torch again


def test_the_cache_size_is_llamacpps_own_up_front_allocation(backend):
    """float16 K and V for every layer (SmolLM2: 3 KV heads × 64), capped at MAX_CELLS cells."""
    from specforge.runtime.llamacpp.backend import MAX_CELLS

    assert backend.cache_bytes(2, 256) == 512 * 30 * 2 * 3 * 64 * 2
    assert backend.cache_bytes(4096, 4096) == MAX_CELLS * 30 * 2 * 3 * 64 * 2

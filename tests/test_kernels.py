"""specforge_kernels.varlen_attention: the torch twin against a per-token oracle, the Triton kernel
against the twin (under TRITON_INTERPRET=1, in a child process), validation and dispatch.

Triton decides at decoration time whether a kernel is compiled or interpreted, from
TRITON_INTERPRET as it is when the kernel module is first imported.  Setting it in this process
would leak into every other test file of the run, so the interpreter tests run in a child pytest
process over this same file, started with TRITON_INTERPRET=1 and _CHILD_FLAG set; in that child
only the ``test_interp_*`` tests are selected (they are defined only there).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specforge_kernels import planned_attention as pa
from specforge_kernels import varlen_attention as va

_CHILD_FLAG = "SPECFORGE_KERNELS_INTERPRET_CHILD"
IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"

F64 = torch.float64
# Tolerances of an output against the float64 oracle / against the twin, per dtype.  float32: a
# few ulps of softmax and of a D-term dot product.  Half types: their output rounding (bf16
# 2^-8, fp16 2^-11 relative) plus that of the probabilities fed to the P·V product.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    start_pos: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.cu_seqlens, self.slots, self.start_pos, self.scale)


def make_case(
    runs: list[tuple[int, int]],
    *,
    hq: int = 9,
    hkv: int = 3,
    d: int = 64,
    n_slots: int | None = None,
    capacity: int = 160,
    dtype: torch.dtype = torch.float32,
    slots: list[int] | None = None,
    meta_dtype: torch.dtype = torch.int64,
    strided_q: bool = False,
    cache_layout_sthd: bool = False,
    seed: int = 0,
) -> Case:
    """A batch of ``runs`` = [(n_r, start_r)], each request in its own slot.

    Every cache entry that no request may read — past each request's last position, and whole
    unused slots — is garbage that would show if it leaked: keys at the dtype's largest finite
    value (a leaked key dominates its softmax row), values NaN (a leaked value, even weighted by
    an exact zero, makes the output NaN).
    """
    gen = torch.Generator().manual_seed(seed)
    n_req = len(runs)
    n_slots = n_slots if n_slots is not None else n_req + 2
    if slots is None:
        # Non-contiguous, non-monotone slot order, with unused slots in between.
        order = list(range(n_slots))
        random.Random(seed).shuffle(order)
        slots = order[:n_req]
    big = torch.finfo(dtype).max
    shape = (n_slots, capacity, hkv, d) if cache_layout_sthd else (n_slots, hkv, capacity, d)
    k_store = torch.full(shape, big, dtype=dtype)
    v_store = torch.full(shape, float("nan"), dtype=dtype)
    if cache_layout_sthd:
        # A cache stored [S, T, Hkv, D] seen as [S, Hkv, T, D]: strides the kernel must honour.
        k_cache, v_cache = k_store.transpose(1, 2), v_store.transpose(1, 2)
    else:
        k_cache, v_cache = k_store, v_store
    for (n, start), slot in zip(runs, slots):
        length = start + n
        k_cache[slot, :, :length] = torch.randn(hkv, length, d, generator=gen).to(dtype)
        v_cache[slot, :, :length] = torch.randn(hkv, length, d, generator=gen).to(dtype)
    n_tokens = sum(n for n, _ in runs)
    if strided_q:
        # q as the leading columns of a fused projection output, as the runtime produces it.
        fused = torch.randn(n_tokens, hq + 2 * hkv, d, generator=gen).to(dtype)
        q = fused[:, :hq]
    else:
        q = torch.randn(n_tokens, hq, d, generator=gen).to(dtype)
    cu = [0]
    for n, _ in runs:
        cu.append(cu[-1] + n)
    return Case(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens=torch.tensor(cu, dtype=meta_dtype),
        slots=torch.tensor(slots, dtype=meta_dtype),
        start_pos=torch.tensor([s for _, s in runs], dtype=meta_dtype),
        scale=1.0 / math.sqrt(d),
    )


def random_tree_bits(runs: list[tuple[int, int]], seed: int = 0) -> torch.Tensor:
    """Per flat token, the bitmask of its ancestors-or-self in a random tree over its run (token 0
    the root, every parent before its child)."""
    rng = random.Random(seed)
    bits = []
    for n, _ in runs:
        own: list[int] = []
        for i in range(n):
            parent = rng.randrange(i) if i else -1
            own.append((own[parent] if parent >= 0 else 0) | (1 << i))
        bits += own
    return torch.tensor(bits, dtype=torch.int64)


def oracle(case: Case, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, per head: explicit softmax over keys 0..p of the request's slot (with ``tree``:
    the keys before the run and the token's ancestors-or-self), in float64."""
    q, k_cache, v_cache = case.q.to(F64), case.k_cache, case.v_cache
    n_tokens, hq, d = q.shape
    group = hq // k_cache.shape[1]
    out = torch.zeros(n_tokens, hq, d, dtype=F64)
    cu = case.cu_seqlens.tolist()
    for r, (slot, start) in enumerate(zip(case.slots.tolist(), case.start_pos.tolist())):
        for i in range(cu[r + 1] - cu[r]):
            row, pos = cu[r] + i, start + i
            seen = list(range(pos + 1)) if tree is None else (
                list(range(start)) + [start + j for j in range(i + 1) if (int(tree[row]) >> j) & 1])
            for h in range(hq):
                keys = k_cache[slot, h // group, seen].to(F64)
                values = v_cache[slot, h // group, seen].to(F64)
                scores = keys @ q[row, h] * case.scale
                weights = torch.exp(scores - scores.max())
                out[row, h] = (weights / weights.sum()) @ values
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "NaN in the output: garbage leaked"
    torch.testing.assert_close(actual.to(F64), expected.to(F64), **TOL[dtype])


def test_tree_attention_sees_ancestors_and_the_prefix_only():
    """A tree pass: each token attends every key before its run and its ancestors-or-self in it
    (the twin and the planned path agree with the float64 oracle; a chain's bits are causal)."""
    runs = [(5, 20), (1, 9), (16, 40), (8, 0), (3, 77)]
    case = make_case(runs)
    tree = random_tree_bits(runs, seed=1)
    out = va.varlen_attention_reference(*case.args(), tree)
    assert_close(out, oracle(case, tree), torch.float32)
    plan = pa.plan_varlen_attention(case.cu_seqlens, case.slots, case.start_pos, case.k_cache, case.q.shape[0],
                                    case.q.shape[1], tree=tree)
    assert plan.padded is None
    assert torch.equal(pa.varlen_attention_planned(case.q, case.k_cache, case.v_cache, plan, case.scale), out)
    chain = torch.cat([torch.tensor([(1 << (i + 1)) - 1 for i in range(n)]) for n, _ in runs])
    torch.testing.assert_close(va.varlen_attention_reference(*case.args(), chain),
                               va.varlen_attention_reference(*case.args()))
    with pytest.raises(ValueError, match="tree must be"):
        va.varlen_attention_reference(*case.args(), tree[:-1])


# Batches shared by the twin tests and the interpreter tests: (id, runs, make_case options).
DECODE = [(1, 37), (1, 0), (1, 100), (1, 12), (1, 63)]
VERIFY = [(5, 20), (1, 9), (16, 40), (8, 0), (3, 77)]
# The twin's three SDPA routes: a prefill from position 0 (is_causal), a chunked prefill behind a
# cached prefix (explicit offset mask), a single token (no mask).
PREFILL = [(100, 0), (120, 30), (1, 5)]

TWIN_CASES = [
    ("decode", DECODE, {}),
    ("verify", VERIFY, {}),
    ("verify-bf16", VERIFY, dict(dtype=torch.bfloat16)),
    ("verify-fp16", VERIFY, dict(dtype=torch.float16)),
    ("prefill", PREFILL, dict(capacity=160)),
    ("prefill-bf16", PREFILL, dict(dtype=torch.bfloat16)),
    ("mha-d24-fp16", [(4, 10), (1, 3), (7, 0)], dict(hq=4, hkv=4, d=24, dtype=torch.float16)),
    ("mqa", [(6, 2), (2, 50)], dict(hq=8, hkv=1, d=32)),
    ("empty-run", [(3, 4), (0, 9), (2, 0)], dict(hq=4, hkv=2, d=16)),
    ("int32-meta", VERIFY, dict(meta_dtype=torch.int32)),
    ("strided-q", VERIFY, dict(strided_q=True)),
    ("cache-sthd-layout", VERIFY, dict(cache_layout_sthd=True)),
    ("fills-capacity", [(4, 60), (1, 63)], dict(capacity=64)),
    ("shared-nothing-single-slot-cache", [(5, 11)], dict(n_slots=1)),
]


def _random_runs(seed: int) -> tuple[list[tuple[int, int]], dict]:
    rng = random.Random(seed)
    n_req = rng.randint(1, 6)
    runs = [(rng.choice([1, 1, 2, rng.randint(1, 16), rng.randint(17, 40)]), rng.randint(0, 60)) for _ in range(n_req)]
    hkv = rng.choice([1, 2, 3])
    group = rng.choice([1, 2, 3])
    return runs, dict(hq=hkv * group, hkv=hkv, d=rng.choice([16, 32, 64]), capacity=104, seed=seed)


# --------------------------------------------------------------------------------------------
# the torch twin against the per-token oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runs, opts", [(r, o) for _, r, o in TWIN_CASES], ids=[i for i, _, _ in TWIN_CASES])
def test_reference_matches_oracle(runs, opts):
    case = make_case(runs, **opts)
    out = va.varlen_attention_reference(*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, oracle(case), case.q.dtype)


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_oracle_random_shapes(seed):
    runs, opts = _random_runs(seed)
    case = make_case(runs, **opts)
    assert_close(va.varlen_attention_reference(*case.args()), oracle(case), torch.float32)


def test_reference_no_requests():
    case = make_case([], hq=4, hkv=2, d=16, n_slots=2)
    out = va.varlen_attention_reference(*case.args())
    assert out.shape == (0, 4, 16)


def test_reference_token_output_independent_of_run_split():
    # A token's output depends only on its own position and the cache: verifying 6 tokens in
    # one run equals feeding them one per request-pass (the engine relies on this equivalence).
    case = make_case([(6, 30)], hq=6, hkv=2, d=32)
    whole = va.varlen_attention_reference(*case.args())
    for i in range(6):
        single = va.varlen_attention_reference(
            case.q[i : i + 1], case.k_cache, case.v_cache, torch.tensor([0, 1]), case.slots,
            case.start_pos + i, case.scale,
        )
        torch.testing.assert_close(single, whole[i : i + 1], atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _bad(mutate):
    case = make_case([(2, 3), (1, 7)], hq=4, hkv=2, d=16, n_slots=3, capacity=16, slots=[2, 0])
    mutate(case)
    return case


BAD_INPUTS = [
    ("q-2d", lambda c: setattr(c, "q", c.q[:, 0]), "q must be"),
    ("cache-3d", lambda c: setattr(c, "k_cache", c.k_cache[0]), "k_cache must be"),
    ("v-shape", lambda c: setattr(c, "v_cache", c.v_cache[:, :, :8]), "v_cache shape"),
    ("head-dim", lambda c: setattr(c, "q", torch.zeros(3, 4, 8)), "head dim"),
    ("gqa-ratio", lambda c: setattr(c, "q", torch.zeros(3, 3, 16)), "multiple of kv heads"),
    ("dtype-mix", lambda c: setattr(c, "q", c.q.double()), "share a dtype"),
    ("int-q", lambda c: setattr(c, "q", c.q.long()), "floating-point"),
    ("meta-float", lambda c: setattr(c, "slots", c.slots.float()), "int32 or int64"),
    ("meta-2d", lambda c: setattr(c, "start_pos", c.start_pos[None]), "1-D"),
    ("cu-empty", lambda c: setattr(c, "cu_seqlens", c.cu_seqlens[:0]), "at least one entry"),
    ("cu-start", lambda c: setattr(c, "cu_seqlens", torch.tensor([1, 2, 3])), "from 0 to N"),
    ("cu-end", lambda c: setattr(c, "cu_seqlens", torch.tensor([0, 2, 2])), "from 0 to N"),
    ("cu-decreasing", lambda c: setattr(c, "cu_seqlens", torch.tensor([0, 4, 3])), "non-decreasing"),
    ("slots-len", lambda c: setattr(c, "slots", c.slots[:1]), "slots has 1"),
    ("start-len", lambda c: setattr(c, "start_pos", torch.tensor([0, 0, 0])), "start_pos 3"),
    ("slot-range", lambda c: setattr(c, "slots", torch.tensor([3, 0])), "outside the cache"),
    ("slot-negative", lambda c: setattr(c, "slots", torch.tensor([-1, 0])), "outside the cache"),
    ("start-negative", lambda c: setattr(c, "start_pos", torch.tensor([-1, 7])), "negative start"),
    ("beyond-capacity", lambda c: setattr(c, "start_pos", torch.tensor([3, 16])), "exceed the cache capacity"),
]


@pytest.mark.parametrize("mutate, match", [(m, s) for _, m, s in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
def test_validation_errors(mutate, match):
    case = _bad(mutate)
    with pytest.raises(ValueError, match=match):
        va.varlen_attention(*case.args())


def test_validation_accepts_the_unmutated_case():
    case = _bad(lambda c: None)
    assert_close(va.varlen_attention(*case.args()), oracle(case), torch.float32)


# --------------------------------------------------------------------------------------------
# dispatch (in this process: the kernel was built compiled, not interpreted)
# --------------------------------------------------------------------------------------------


def _spy(monkeypatch, name):
    calls = []
    real = getattr(va, name)

    def spy(*args):
        calls.append(name)
        return real(*args)

    monkeypatch.setattr(va, name, spy)
    return calls


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dispatch_cpu_runs_the_twin(monkeypatch, backend):
    case = make_case(VERIFY)
    calls = _spy(monkeypatch, "varlen_attention_reference")
    out = va.varlen_attention(*case.args(), backend=backend)
    assert calls == ["varlen_attention_reference"]
    assert torch.equal(out, va.varlen_attention_reference(*case.args()))


def test_dispatch_rejects_unknown_backend():
    case = make_case(DECODE)
    with pytest.raises(ValueError, match="backend must be"):
        va.varlen_attention(*case.args(), backend="cuda")


@pytest.mark.skipif(va._KERNEL_INTERPRETED, reason="this process imported the kernel under TRITON_INTERPRET=1")
def test_triton_on_cpu_without_interpreter_says_how():
    case = make_case(DECODE)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        va.varlen_attention(*case.args(), backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        va.varlen_attention_triton(*case.args())


# --------------------------------------------------------------------------------------------
# the kernel compiles for the GPU (no GPU needed: Triton's NVIDIA backend runs on the host)
# --------------------------------------------------------------------------------------------


# Per-block shared-memory limits (bytes) of the compute capabilities checked below.
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@pytest.mark.skipif(va.triton is None or va._KERNEL_INTERPRETED, reason="needs the compiled (JIT) kernel")
# Triton 3.9 warns that its FP-fusion default will flip in 3.10; the launch gets the same default.
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    "dtype, head_dim, max_n, capability",
    [
        (torch.float32, 64, 1, 90),
        (torch.bfloat16, 64, 300, 90),
        (torch.float16, 24, 16, 90),
        (torch.float32, 128, 1000, 80),  # big float32 tiles, on the smaller A100 budget
    ],
    ids=["fp32-decode-sm90", "bf16-prefill-sm90", "fp16-d24-sm90", "fp32-d128-prefill-sm80"],
)
def test_kernel_compiles_for_gpu(monkeypatch, tmp_path, dtype, head_dim, max_n, capability):
    """Lower the launch the wrapper would make on an A100/H100/H200 down to a cubin.

    The interpreter skips Triton's type checker and code generator; this catches what it cannot
    (constexpr misuse, dtype mismatches in tl.dot, shared-memory overruns) without a GPU.
    """
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compile, not a cache hit
    fn = va._varlen_attn_fwd
    meta = va._launch_meta(dtype, head_dim, 3, max_n, interpreted=False)
    meta["HAS_TREE"] = max_n == 16  # the verify-sized launch also compiles with the tree mask
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    signature = {}
    for name in fn.arg_names:
        if name in meta:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "O"):
            signature[name] = ptr
        elif name in ("CU", "SLOTS", "START", "TREE"):
            signature[name] = "*i64"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i64"  # strides
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items()}
    src = compiler.ASTSource(fn, signature=signature, constexprs=constexprs)
    kernel = va.triton.compile(src, target=backends.GPUTarget("cuda", capability, 32), options=options)
    assert kernel.asm.get("cubin")
    assert kernel.metadata.shared <= SMEM_LIMIT[capability]


# --------------------------------------------------------------------------------------------
# the Triton kernel against the twin, under the interpreter (child process)
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_triton_kernel_matches_twin_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_FLAG: "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_interp_"],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report


if IN_CHILD:
    INTERP_CASES = [
        ("decode", DECODE, {}),
        ("verify", VERIFY, dict(meta_dtype=torch.int32)),
        ("verify-bf16", VERIFY, dict(dtype=torch.bfloat16)),
        ("verify-fp16", VERIFY, dict(dtype=torch.float16)),
        # 70 tokens: two query blocks of 64, the second ending mid-block; a cached prefix of 5.
        ("multi-block", [(70, 5), (2, 30)], dict(hq=4, hkv=2, d=32, capacity=80)),
        ("mha-d24-fp16", [(4, 10), (1, 3), (7, 0)], dict(hq=4, hkv=4, d=24, dtype=torch.float16)),
        ("mqa-d16", [(6, 2), (2, 50)], dict(hq=4, hkv=1, d=16)),
        ("empty-run", [(3, 4), (0, 9), (2, 0)], dict(hq=4, hkv=2, d=16)),
        ("strided-q-sthd-cache", VERIFY, dict(strided_q=True, cache_layout_sthd=True)),
        ("fills-capacity", [(4, 60), (1, 63)], dict(hq=6, hkv=3, d=32, capacity=64)),
    ]

    def test_interp_kernel_is_interpreted():
        assert va._KERNEL_INTERPRETED

    @pytest.mark.parametrize("runs, opts", [(r, o) for _, r, o in INTERP_CASES], ids=[i for i, _, _ in INTERP_CASES])
    def test_interp_triton_matches_twin(runs, opts):
        case = make_case(runs, **opts)
        out = va.varlen_attention_triton(*case.args())
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        assert_close(out, va.varlen_attention_reference(*case.args()), case.q.dtype)

    @pytest.mark.parametrize("seed", range(3))
    def test_interp_triton_matches_twin_random_shapes(seed):
        runs, opts = _random_runs(100 + seed)
        case = make_case(runs, **opts)
        assert_close(va.varlen_attention_triton(*case.args()), va.varlen_attention_reference(*case.args()), torch.float32)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_interp_triton_tree_matches_twin(dtype):
        runs = [(5, 20), (1, 9), (16, 40), (8, 0), (3, 77)]
        case = make_case(runs, dtype=dtype)
        tree = random_tree_bits(runs, seed=2)
        assert_close(va.varlen_attention_triton(*case.args(), tree), va.varlen_attention_reference(*case.args(), tree),
                     dtype)

    def test_interp_triton_matches_oracle():
        # Transitivity aside, one direct check against the float64 oracle.
        case = make_case(VERIFY, hq=6, hkv=2, d=32)
        assert_close(va.varlen_attention_triton(*case.args()), oracle(case), torch.float32)

    def test_interp_triton_no_requests():
        case = make_case([], hq=4, hkv=2, d=16, n_slots=2)
        assert va.varlen_attention_triton(*case.args()).shape == (0, 4, 16)

    def test_interp_triton_validates():
        case = _bad(lambda c: setattr(c, "start_pos", torch.tensor([3, 16])))
        with pytest.raises(ValueError, match="exceed the cache capacity"):
            va.varlen_attention_triton(*case.args())
        case = _bad(lambda c: setattr(c, "slots", c.slots.to("meta")))
        with pytest.raises(ValueError, match="must be on q's device"):
            va.varlen_attention_triton(*case.args())

    def test_interp_dispatch(monkeypatch):
        case = make_case([(3, 4), (1, 9)], hq=4, hkv=2, d=16)
        triton_calls = _spy(monkeypatch, "varlen_attention_triton")
        torch_calls = _spy(monkeypatch, "varlen_attention_reference")
        # Asked for, the interpreted kernel runs on CPU tensors ...
        out = va.varlen_attention(*case.args(), backend="triton")
        assert triton_calls == ["varlen_attention_triton"] and torch_calls == []
        # ... but "auto" still picks the twin for CPU tensors: the interpreter is a test device.
        ref = va.varlen_attention(*case.args())
        assert torch_calls == ["varlen_attention_reference"] and len(triton_calls) == 1
        assert_close(out, ref, torch.float32)

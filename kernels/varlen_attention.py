"""Causal attention over a flattened variable-length batch, reading K/V from a slotted cache.

All new tokens of all requests form one token dimension ``N`` (no padding).  Request ``r`` owns
rows ``cu_seqlens[r]:cu_seqlens[r+1]`` of ``q`` (``[N, Hq, D]``), which sit at absolute positions
``start_pos[r] + i``; its keys and values are ``k_cache[slots[r], :, :start_pos[r] + n_r]`` of
``k_cache, v_cache: [S, Hkv, T, D]`` (the new tokens' K/V are already written there).  The token
at position ``p`` attends keys ``0..p`` of its own slot; query head ``h`` reads kv head
``h // (Hq // Hkv)`` (GQA).  A *tree* pass (a token tree verified at once) replaces the causal
rule inside each run: ``tree[i]`` is a bitmask over the run's own tokens and token i sees bit j's
token iff it is set (its ancestors and itself), and every key before the run.  Nothing past a
request's last written position is ever attended to,
so the rest of a slot may hold anything (stale entries after a rollback, another request's
leftovers) — finite values only for the padded path of the planned attention, which
reads them under a mask.

Three implementations compute this same function:

* :func:`varlen_attention_reference` — pure torch, one SDPA call per request on views of the
  cache.  It is the oracle of the Triton kernel.
* :func:`specforge_kernels.planned_attention.varlen_attention_planned` — the production CPU path
  (its own module, beside this one): the same per-request calls with the metadata checked once
  per pass, or, for short runs, padded masked SDPAs over groups of neighbouring cache slots of
  similar lengths.
* :func:`varlen_attention_triton` — a flash-attention style Triton kernel (online softmax,
  float32 accumulation) for CUDA devices; on a CPU it runs only under ``TRITON_INTERPRET=1``.

:func:`varlen_attention` picks the reference or the kernel; the runtime calls the planned path on CPU.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twin must keep working where Triton is not installed
    triton = None
    tl = None

__all__ = [
    "tree_mask",
    "varlen_attention",
    "varlen_attention_reference",
    "varlen_attention_triton",
]

Backend = Literal["auto", "torch", "triton"]


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
) -> tuple[list[int], list[int], list[int]]:
    """Validate the call and return the launch metadata as host lists ``(cu, slots, start)``.

    The metadata is copied to the host once, in one transfer, because both implementations need
    it there anyway (the torch twin to slice per request, the kernel to size its grid).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [N, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [S, Hkv, T, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    n_tokens, hq, d = q.shape
    n_slots, hkv, capacity, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the cache ({dk}) differ")
    if d == 0:
        raise ValueError("head dim must be positive")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError("q, k_cache and v_cache must be on the same device")
    for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots), ("start_pos", start_pos)):
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    n_req = cu_seqlens.shape[0] - 1
    if n_req < 0:
        raise ValueError("cu_seqlens must hold at least one entry (R + 1 boundaries)")
    if slots.shape[0] != n_req or start_pos.shape[0] != n_req:
        raise ValueError(
            f"cu_seqlens describes {n_req} requests but slots has {slots.shape[0]} and "
            f"start_pos {start_pos.shape[0]} entries"
        )

    return host_meta(n_tokens, n_slots, capacity, cu_seqlens, slots, start_pos)


def host_meta(
    n_tokens: int, n_slots: int, capacity: int, cu_seqlens: Tensor, slots: Tensor, start_pos: Tensor
) -> tuple[list[int], list[int], list[int]]:
    """Copy the metadata to the host in one transfer and check it against the cache's shape."""
    n_req = cu_seqlens.shape[0] - 1
    parts = [cu_seqlens.long(), slots.long(), start_pos.long()]
    if cu_seqlens.device == slots.device == start_pos.device:
        meta = torch.cat(parts).tolist()  # one device-to-host transfer, not three
    else:
        meta = [x for t in parts for x in t.tolist()]
    cu, sl, sp = meta[: n_req + 1], meta[n_req + 1 : 2 * n_req + 1], meta[2 * n_req + 1 :]
    if cu[0] != 0 or cu[-1] != n_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to N={n_tokens}, got {cu[0]}..{cu[-1]}")
    for r in range(n_req):
        n = cu[r + 1] - cu[r]
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing (request {r}: {cu[r]} -> {cu[r + 1]})")
        if not 0 <= sl[r] < n_slots:
            raise ValueError(f"request {r}: slot {sl[r]} outside the cache's {n_slots} slots")
        if sp[r] < 0:
            raise ValueError(f"request {r}: negative start position {sp[r]}")
        if sp[r] + n > capacity:
            raise ValueError(
                f"request {r}: positions {sp[r]}..{sp[r] + n - 1} exceed the cache capacity T={capacity}"
            )
    return cu, sl, sp


# --------------------------------------------------------------------------------------------
# the torch twin
# --------------------------------------------------------------------------------------------


def varlen_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    scale: float,
    tree: Tensor | None = None,
) -> Tensor:
    """Pure-torch varlen causal attention: ``[N, Hq, D]`` in ``q``'s dtype.

    One ``scaled_dot_product_attention`` per request on 4-D views of its slot — the cache is
    never copied.  4-D matters: torch's CPU flash kernel takes only 4-D inputs (3-D ones fall
    back to the unfused math path, measured ~2x slower on these shapes), and with
    ``enable_gqa`` it maps query heads to kv heads itself, without expanding K/V (the math path
    would repeat them).  A single-token run attends every key of
    its slice, so it needs no mask at all.
    """
    cu, sl, sp = _check(q, k_cache, v_cache, cu_seqlens, slots, start_pos)
    return attend_per_request(q, k_cache, v_cache, cu, sl, sp, scale, tree_bits(tree, q.shape[0]))


def tree_bits(tree: Tensor | None, n_tokens: int) -> Tensor | None:
    if tree is None:
        return None
    if tree.shape != (n_tokens,) or tree.dtype != torch.int64:
        raise ValueError(f"tree must be [N={n_tokens}] int64 bitmasks, got {tuple(tree.shape)} {tree.dtype}")
    return tree


def tree_mask(bits: Tensor, n: int, start: int) -> Tensor:
    """``[n, start + n]`` bool: every key before the run, then run token j where bit j is set."""
    own = ((bits[:, None] >> torch.arange(n, device=bits.device)[None, :]) & 1).bool()
    return torch.cat([own.new_ones(n, start), own], 1)


def attend_per_request(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu: list[int], sl: list[int], sp: list[int], scale: float,
    tree: Tensor | None = None,
) -> Tensor:
    n_tokens, hq, d = q.shape
    gqa = bool(hq != k_cache.shape[1])  # a plain bool also under torch.compile's symbolic shapes
    out = torch.empty((n_tokens, hq, d), dtype=q.dtype, device=q.device)
    for r in range(len(sl)):
        a, b = cu[r], cu[r + 1]
        n = b - a
        if n == 0:
            continue
        length = sp[r] + n  # keys 0..length-1 are this request's
        # [1, Hkv, L, D] views; a slice rather than an index keeps the slot symbolic under
        # torch.compile (an index would be specialised: one graph per slot)
        k = k_cache[sl[r] : sl[r] + 1, :, :length]
        v = v_cache[sl[r] : sl[r] + 1, :, :length]
        qr = q[a:b].transpose(0, 1)[None]  # [1, Hq, n, D]
        if tree is not None and n > 1:  # a token tree: each node sees its ancestors (and the prefix)
            mask = tree_mask(tree[a:b].to(q.device), n, sp[r])
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        elif n == 1:
            o = F.scaled_dot_product_attention(qr, k, v, scale=scale, enable_gqa=gqa)
        elif length == n:
            # A prefill from position 0: SDPA's top-left aligned causal mask is exactly ours,
            # and is_causal lets the flash kernel skip the masked blocks without building a mask.
            o = F.scaled_dot_product_attention(qr, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # is_causal would align the diagonal top-left (query i sees keys 0..i), but behind a
            # cached prefix query i must see keys 0..start+i: an explicit mask it is.
            mask = _causal_mask(n, length, q.device)
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[a:b] = o[0].transpose(0, 1)
    return out


def _causal_mask(n: int, length: int, device: torch.device) -> Tensor:
    """``[n, length]`` bool, True where query ``i`` (at position ``length - n + i``) may look."""
    start = length - n
    keys = torch.arange(length, device=device)
    queries = torch.arange(start, length, device=device)
    return keys[None, :] <= queries[:, None]


# --------------------------------------------------------------------------------------------
# the Triton kernel
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _varlen_attn_fwd(
        Q, K, V, O, CU, SLOTS, START, TREE,
        qk_scale,  # softmax scale * log2(e): the kernel exponentiates in base 2
        stride_qn, stride_qh, stride_qd,
        stride_ks, stride_kh, stride_kt, stride_kd,
        stride_vs, stride_vh, stride_vt, stride_vd,
        stride_on, stride_oh, stride_od,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        HAS_TREE: tl.constexpr,
    ):
        req = tl.program_id(0)
        m_block = tl.program_id(1)
        head = tl.program_id(2)

        # int64 throughout the address arithmetic: slot * stride_ks overflows int32 for large
        # caches (64 slots x 8 heads x 32k positions x 128 dims is 2^31 elements per layer).
        row0 = tl.load(CU + req).to(tl.int64)
        n = tl.load(CU + req + 1).to(tl.int64) - row0
        m_start = m_block * BLOCK_M
        # The grid is sized for the longest run; shorter runs leave their tail programs idle.
        if m_start >= n:
            return
        slot = tl.load(SLOTS + req).to(tl.int64)
        start = tl.load(START + req).to(tl.int64)

        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < n
        d_ok = offs_d < HEAD_DIM  # BLOCK_D pads a head dim that is not a power of two

        q_ptrs = Q + (row0 + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        kv_head = head // GROUP
        k_base = K + slot * stride_ks + kv_head * stride_kh
        v_base = V + slot * stride_vs + kv_head * stride_vh
        q_pos = start + offs_m
        # Keys beyond the last query of this block are masked for every row: stop there.  The
        # bound never passes start + n, so nothing beyond the request's written positions is
        # loaded (masked loads give 0, which cannot turn into NaN the way garbage would).
        kv_end = start + tl.minimum(n, m_start + BLOCK_M)
        if HAS_TREE:
            # a node's ancestors precede it in the run, so the causal bound above still holds;
            # padding rows read all bits set (they see every key, like the causal padding rows)
            bits = tl.load(TREE + row0 + offs_m, mask=m_ok, other=-1)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            kt = tl.load(
                k_base + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N], K transposed
            if DOT_IN_FP32:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            # Padding rows (offs_m >= n) sit past every key and so see all of them: no row is
            # ever fully masked, and key 0 in the first block keeps m_i finite from then on.
            if HAS_TREE:
                rel = tl.maximum(offs_n - start, 0).to(tl.int64)
                own = ((bits[:, None] >> rel[None, :]) & 1) == 1
                visible = (offs_n[None, :] < start) | own
            else:
                visible = offs_n[None, :] <= q_pos[:, None]
            s = tl.where(visible & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if DOT_IN_FP32:
                v = v.to(tl.float32)
            # p is rounded to the K/V dtype for the tensor-core dot, as flash-attention does.
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        o_ptrs = O + (row0 + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    # triton.jit decides at decoration time whether this is a compiled or an interpreted
    # function (TRITON_INTERPRET read when this module is imported); record which it became.
    _KERNEL_INTERPRETED = type(_varlen_attn_fwd).__name__ == "InterpretedFunction"
else:
    _KERNEL_INTERPRETED = False

_LOG2E = 1.4426950408889634


def _launch_meta(dtype: torch.dtype, head_dim: int, group: int, max_n: int, interpreted: bool) -> dict:
    """Compile-time parameters and ``num_warps`` of one launch (shared with the compile test)."""
    # 16 is tl.dot's smallest tile; decode/verify runs (1..16 tokens) fit one block, prefill
    # gets the usual 64 x 64 flash tiles.
    block_m = 16 if max_n <= 16 else (32 if max_n <= 32 else 64)
    # Triton's interpreter multiplies the raw uint16 bit patterns in a bfloat16 tl.dot
    # (triton-lang/triton#11584, unsupported upstream): there the operands are upcast first.
    # Compiled kernels keep bfloat16 tensor-core dots.
    dot_in_fp32 = interpreted and dtype == torch.bfloat16
    fp32 = dtype == torch.float32
    block_d = max(16, 1 << (head_dim - 1).bit_length())  # dot tiles need a power of two >= 16
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        # float32 tiles take twice the shared memory of half ones, and the default 3-stage
        # pipeline of K/V loads would need up to 205 KB for big heads (over sm_80's 163 KB);
        # smaller key blocks and 2 stages keep every head dim <= 256 within it.
        BLOCK_N=32 if (fp32 and block_d > 64) or block_d > 128 else 64,
        BLOCK_D=block_d,
        # float32 inputs get IEEE dots: TF32 would cost ~1e-3 relative error against the twin.
        DOT_PRECISION="ieee" if fp32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        num_warps=4,
        num_stages=2 if fp32 else 3,
    )


def _require_runnable_kernel(q: Tensor) -> None:
    if triton is None:
        raise RuntimeError("varlen_attention_triton needs the `triton` package, which is not installed")
    if not q.is_cuda and not _KERNEL_INTERPRETED:
        raise RuntimeError(
            "varlen_attention_triton runs on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "before specforge_kernels.varlen_attention (and triton) are first imported, or use "
            "backend='torch'"
        )


def varlen_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    scale: float,
    tree: Tensor | None = None,
) -> Tensor:
    """Triton varlen causal (or tree) attention; same contract as :func:`varlen_attention_reference`.

    One program per (request, block of ``BLOCK_M`` queries, query head), streaming key blocks of
    the request's slot up to the block's causal limit with an online softmax accumulated in
    float32.  float32 inputs use IEEE-precision dots (no TF32), so the result stays within
    float32 rounding of the twin.  Any head dim works (it is padded to a power of two ≥ 16 and
    masked).  Validation copies the metadata to the host once (one device sync per call).
    """
    _require_runnable_kernel(q)
    for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots), ("start_pos", start_pos)):
        if t.device != q.device:  # the kernel dereferences them as device pointers
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    cu, _, _ = _check(q, k_cache, v_cache, cu_seqlens, slots, start_pos)
    tree = tree_bits(tree, q.shape[0])
    if tree is not None and tree.device != q.device:
        raise ValueError(f"tree must be on q's device ({q.device}), got {tree.device}")
    n_tokens, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty((n_tokens, hq, d), dtype=q.dtype, device=q.device)
    n_req = len(cu) - 1
    max_n = max((cu[r + 1] - cu[r] for r in range(n_req)), default=0)
    if max_n == 0:
        return out

    meta = _launch_meta(q.dtype, d, hq // hkv, max_n, _KERNEL_INTERPRETED)
    grid = (n_req, triton.cdiv(max_n, meta["BLOCK_M"]), hq)
    _varlen_attn_fwd[grid](
        q, k_cache, v_cache, out, cu_seqlens, slots, start_pos, cu_seqlens if tree is None else tree,
        float(scale) * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        HAS_TREE=tree is not None,
        **meta,
    )
    return out


# --------------------------------------------------------------------------------------------
# dispatcher
# --------------------------------------------------------------------------------------------


def varlen_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    scale: float,
    backend: Backend = "auto",
    tree: Tensor | None = None,
) -> Tensor:
    """Varlen causal (or tree) attention over a slotted KV cache (see the module docstring).

    ``backend="auto"`` runs the Triton kernel for CUDA tensors and the torch twin otherwise;
    ``"torch"`` and ``"triton"`` force one.  ``"triton"`` on CPU tensors works only when the
    kernel was built under ``TRITON_INTERPRET=1`` (tests), and says so otherwise.
    """
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton is not None else "torch"
    if backend == "torch":
        return varlen_attention_reference(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale, tree)
    if backend == "triton":
        return varlen_attention_triton(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale, tree)
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")

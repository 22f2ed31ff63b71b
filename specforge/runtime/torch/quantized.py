"""A GGUF target's 4-bit blocks run as they are stored (``target.weights=native``).

The embedded SmolLM2 is a Q4_1 GGUF: every projection is stored as blocks of 32 four-bit codes
with a scale and an offset, 0.625 bytes a weight.  Loading it through transformers expands those
to float32 (and the runtime then rounds them to bf16, 2 bytes a weight).  On a CPU a decoding step
is a stream of the weights through memory, so a step that reads the 4-bit blocks directly reads
about 3x fewer bytes.  torch ships the kernel: ``_weight_int4pack_mm_for_cpu`` (AVX-512/AVX2),
which takes bf16 activations and computes ``(code - 8) * scale + zero`` per block in float32.

What this changes numerically, stated plainly: the dense bf16 runtime rounds each weight to bf16;
the native one keeps each block's 16 levels exact and rounds the block's scale and offset to bf16
instead (what the kernel takes).  Neither is the float32 model; both are bf16-class renderings of
the same file, about equally close to it (:mod:`specforge.bench.fidelity` measures both;
``specforge bench engine --weights native`` reports it).  Speculative decoding stays lossless with
respect to whichever one the engine runs.

Layer projections stored as Q4_0 or Q4_1 run natively, and so does the LM head stored as Q4_0,
Q4_1 or Q8_0 (as two 4-bit halves, :class:`Q8Projection`); a matrix stored in any other type,
split across types, or with a row count the kernel cannot pack (it needs a multiple of 16) stays
dense.  Every native matrix is checked at load against the weights transformers decoded from the
same file — bit for bit in float32 — so a wrong tensor name or row order is an error naming the
tensor, never a silently different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specforge.toolkit.compiled import register_projection
from specforge.model_files import TargetLoadError
from specforge.toolkit.projection import onednn_linear, pack_for_onednn

__all__ = ["GROUP", "HEAD_KERNEL_ROWS", "KERNEL_ROWS", "Int4Projection", "NativeWeightsError", "Q4Blocks",
           "Q8Projection", "bf16_scale_zero", "read_q4", "read_q8", "require_bfloat16", "use_native_weights"]

GROUP = 32  # weights per block in Q4_0/Q4_1, and the kernel's group size
KERNEL_ROWS = 8  # passes up to this many rows use the int4 kernel (see Int4Projection)
HEAD_KERNEL_ROWS = 2  # the same for a Q8_0 head, which takes two kernel calls (see Q8Projection)


class NativeWeightsError(TargetLoadError):
    """The target cannot run its GGUF blocks natively; the message says why."""


@dataclass(frozen=True)
class Q4Blocks:
    """One matrix in 4-bit blocks: ``w[n, k] = codes[n, k] * scale[n, k // 32] + offset[…]``, with
    ``scale`` and ``offset`` as the file stores them (fp16, held as float32)."""

    codes: Tensor  # [N, K] uint8 in 0..15
    scale: Tensor  # [N, K // 32] float32
    offset: Tensor  # [N, K // 32] float32

    def dequantized(self) -> Tensor:
        """Float32 weights exactly as the file defines them (and transformers decodes them)."""
        n, k = self.codes.shape
        levels = self.codes.view(n, k // GROUP, GROUP).float()
        return (levels * self.scale[..., None] + self.offset[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset")))

    def rows(self, index: Tensor) -> Q4Blocks:
        return Q4Blocks(self.codes[index], self.scale[index], self.offset[index])


def _raw_blocks(tensor: Any, block_bytes: int) -> Tensor:
    """A quantized GGUF tensor's bytes as ``[N, K / 32, block_bytes]`` uint8 (a copy: the reader's
    memory map is read-only).  GGUF lists the contiguous dimension first."""
    k, n = (int(s) for s in tensor.shape[:2])
    return torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True)).view(n, k // GROUP, block_bytes)


def _fp16(pair: Tensor) -> Tensor:
    """``[..., 2]`` little-endian bytes of fp16 values → float32 ``[...]``."""
    return pair.contiguous().view(torch.float16).float()[..., 0]


def read_q4(tensor: Any) -> Q4Blocks | None:
    """Decode a GGUF tensor (``gguf.ReaderTensor``) stored as Q4_0 or Q4_1; ``None`` for any other
    type.  Blocks: fp16 d, (Q4_1: fp16 m,) 16 bytes of codes — low nibbles are weights 0-15,
    high nibbles 16-31 — and the weight is ``d * q + m`` (Q4_1) or ``d * (q - 8)`` (Q4_0)."""
    import gguf

    kind = tensor.tensor_type
    if kind not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return None
    block = 18 if kind == gguf.GGMLQuantizationType.Q4_0 else 20
    raw = _raw_blocks(tensor, block)
    n, k = raw.shape[0], raw.shape[1] * GROUP
    d = _fp16(raw[..., 0:2])
    if block == 18:
        m, packed = -8 * d, raw[..., 2:]
    else:
        m, packed = _fp16(raw[..., 2:4]), raw[..., 4:]
    # Q4_0's d * (q - 8) as d * q + (-8 d): both products are exact in float32, and so is their
    # sum (it equals the exact d * (q - 8)), so this is the file's value bit for bit.
    return Q4Blocks(torch.cat([packed & 15, packed >> 4], dim=-1).reshape(n, k), d, m)


def bf16_scale_zero(blocks: Q4Blocks) -> Tensor:
    """``[N, K / 32, 2]`` bf16 (scale, zero) per block for the kernel's ``(q - 8) * scale + zero``,
    chosen among the bf16 neighbours of the best real pair to minimise the block's squared error
    against the file's weights.  Rounding scale and zero separately to the nearest bf16 leaves a
    shared offset on all 32 weights of a block (the zero's rounding, plus the scale's times the
    block's mean level); picking the pair on the block's own codes cancels most of it.  Measured on
    SmolLM2, teacher-forced over 2,188 positions: mean KL to the float32 model 1.8e-3 with
    nearest rounding, 1.3e-3 with this choice, 1.2e-3 for dense bf16 weights."""
    n, k = blocks.codes.shape
    levels = blocks.codes.view(n, k // GROUP, GROUP).float() - 8
    exact = levels * blocks.scale[..., None] + (blocks.offset + 8 * blocks.scale)[..., None]

    def neighbours(x: Tensor) -> tuple[Tensor, Tensor]:
        down = x.bfloat16().float()
        step = torch.where(down > x, -1, 1)  # the other neighbour is one bf16 ulp away
        other = (down.bfloat16().view(torch.int16) + torch.where(down < 0, -step, step).to(torch.int16))
        return down, other.view(torch.bfloat16).float()

    best_err = best_s = best_z = None
    for s in neighbours(blocks.scale):
        # for this scale, the zero that minimises the squared error is the mean residual
        for z in neighbours((exact - levels * s[..., None]).mean(-1)):
            err = ((levels * s[..., None] + z[..., None] - exact) ** 2).sum(-1)
            if best_err is None:
                best_err, best_s, best_z = err, s, z
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return torch.stack([best_s, best_z], dim=-1).bfloat16()


class Int4Projection:
    """``y = x Wᵀ (+ b)`` over 4-bit blocks: torch's int4 kernel for passes of up to
    :data:`KERNEL_ROWS` rows (decoding and verifying a few requests), oneDNN over a dense bf16
    copy of the same weights for bigger ones (prefills, many requests).

    The kernel decodes the blocks in registers and reads 3x fewer bytes than dense bf16, but it
    decodes them again for every four rows, so its cost grows with the rows while a bf16 matmul's
    stays flat until the pass is compute-bound.  SmolLM2's 120 layer projections, 2 threads
    (``scripts/native_rows.py``): 1 row 6.0 ms through the kernel against 17.5 ms dense, 4 rows
    9.9 vs 21.4, 8 rows 17.7 vs 21.9, 16 rows 32.2 vs 20.9, 64 rows 114 vs 19.  The dense copy
    holds the kernel's weights rounded once more, to bf16 — a difference below the bf16 rounding
    of the output (tested) — so a pass's rows come out as from one model whatever path it takes,
    to a few bf16 ulps.  Within the
    kernel's range a token's projections do not depend on the rows beside it, bit for bit.
    Holding both costs about 3 bytes a weight, less than the dense runtime's 4 (its bf16 weights
    and their oneDNN-packed copy).
    """

    def __init__(self, blocks: Q4Blocks, bias: Tensor | None = None) -> None:
        self.out_features, self.in_features = blocks.codes.shape
        self.bias = bias
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.int(), 1)
        # The kernel computes (q - 8) * scale + zero, reading [K / 32, N, 2] in bf16.
        self.scale_zero = bf16_scale_zero(blocks).transpose(0, 1).contiguous()
        self.nibbles = blocks.codes[:, 0::2] | (blocks.codes[:, 1::2] << 4)  # for weight()
        self.dense = pack_for_onednn(self.weight().bfloat16())  # None: the kernel for every pass
        self.key = register_projection(self)

    def weight(self) -> Tensor:
        """``[N, K]`` float32: the weights the kernel computes with (scale and zero in bf16)."""
        n, k = self.out_features, self.in_features
        codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(n, k // GROUP, GROUP)
        scale, zero = self.scale_zero.float().transpose(0, 1).unbind(-1)
        return ((codes.float() - 8) * scale[..., None] + zero[..., None]).view(n, k)

    def packed_linear(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # drafters project [B, S, d] through the target's head
        if rows.shape[0] > KERNEL_ROWS and self.dense is not None:
            y = onednn_linear(rows, self.dense, self.bias)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP, self.scale_zero)
            y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def __call__(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.specforge.linear(x, self.key)
        return self.packed_linear(x)


def read_q8(tensor: Any) -> tuple[Tensor, Tensor] | None:
    """``(codes [N, K] int8, scale [N, K // 32] float32)`` of a GGUF tensor stored as Q8_0
    (blocks of fp16 d and 32 int8 codes; the weight is ``d * q``); ``None`` for any other type."""
    import gguf

    if tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    raw = _raw_blocks(tensor, 34)
    return raw[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1), _fp16(raw[..., 0:2])


def _scaled(codes: Tensor, scale: Tensor) -> Tensor:
    """``[N, K]`` float32 ``codes * scale`` with one scale per block of 32 (Q8_0's weights)."""
    n, k = codes.shape
    return (codes.view(n, k // GROUP, GROUP).float() * scale.float()[..., None]).view(n, k)


class Q8Projection:
    """A Q8_0 matrix (SmolLM2's tied embedding and LM head) through the same int4 kernel, as two
    4-bit halves: ``q = 16 h + l`` with ``h = q >> 4`` in -8..7 and ``l = q & 15``, so
    ``d q = (h + 8 - 8) · 16d + (l - 8) · d + 8d`` — two kernel calls whose outputs add up, reading
    1.1 bytes a weight instead of bf16's 2.  The scale is rounded to bf16 (``16d`` and ``8d`` are
    then exact too).  Two calls pay off only for the fewest rows (SmolLM2's 49,152 × 576 head,
    2 threads, against dense bf16: 1 row 3.2 vs 4.7 ms, 2 rows 3.8 vs 4.6, 3 rows 4.5 vs 4.5,
    4 rows 5.2 vs 4.6), so more than :data:`HEAD_KERNEL_ROWS` rows use a bf16 copy, as
    :class:`Int4Projection` does past its own limit.  The kernel path returns float32 (the sum of
    two bf16 outputs)."""

    def __init__(self, codes: Tensor, scale: Tensor) -> None:
        self.out_features, self.in_features = codes.shape
        s = scale.bfloat16()
        zero = torch.zeros_like(s)
        self.halves = [
            (torch.ops.aten._convert_weight_to_int4pack_for_cpu(((codes >> 4) + 8).int(), 1),
             torch.stack([s * 16, zero], dim=-1).transpose(0, 1).contiguous()),
            (torch.ops.aten._convert_weight_to_int4pack_for_cpu((codes & 15).int(), 1),
             torch.stack([s, s * 8], dim=-1).transpose(0, 1).contiguous()),
        ]
        self.codes, self.scale = codes, s
        self.dense = pack_for_onednn(self.weight().bfloat16())

    def weight(self) -> Tensor:
        """``[N, K]`` float32: the weights the two kernel calls compute with."""
        return _scaled(self.codes, self.scale)

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if rows.shape[0] > HEAD_KERNEL_ROWS and self.dense is not None:
            y = onednn_linear(rows, self.dense)
        else:
            y = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, GROUP, sz).float()
                    for packed, sz in self.halves)
        return y.view(*x.shape[:-1], y.shape[-1])


# projection attribute of a runtime Layer -> the dense weight parameter it was built from
DENSE_WEIGHT = {"qkv_proj": "wqkv", "o_proj": "wo", "up_proj": "w13", "down_proj": "w2"}


def _unpermute_rows(n_rows: int, n_head: int) -> Tensor:
    # llama.cpp's converter interleaves the two rotary halves of each q/k head; transformers'
    # GGUF loader undoes it for the "llama" architecture.  The same as a row index.
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def require_bfloat16(dtype: torch.dtype) -> None:
    """Refuse any other dtype: torch's int4 kernel takes bf16 activations."""
    if dtype != torch.bfloat16:
        raise NativeWeightsError("native 4-bit weights need target.dtype=bfloat16 (torch's int4 kernel "
                                 f"takes bf16 activations), not {str(dtype).removeprefix('torch.')}")


def use_native_weights(runtime: Any, hf_model: Any, gguf_path: Path) -> dict[str, int]:
    """Swap ``runtime``'s layer projections and LM head for native ones over ``gguf_path``'s
    blocks where the file's types allow.  Returns counts of native and dense matrices."""
    import gguf

    require_bfloat16(runtime.dtype)
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") or runtime.embed.device.type != "cpu":
        raise NativeWeightsError("native 4-bit weights need torch's CPU int4 kernel "
                                 "(aten._weight_int4pack_mm_for_cpu) and a CPU target")
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    a = runtime.args
    counts = {"native": 0, "dense": 0}
    for i, (layer, hf_layer) in enumerate(zip(runtime.layers, hf_model.model.layers, strict=True)):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        groups = {
            "qkv_proj": (("attn_q", attn.q_proj, a.n_heads), ("attn_k", attn.k_proj, a.n_kv_heads),
                         ("attn_v", attn.v_proj, 0)),
            "o_proj": (("attn_output", attn.o_proj, 0),),
            "up_proj": (("ffn_gate", mlp.gate_proj, 0), ("ffn_up", mlp.up_proj, 0)),
            "down_proj": (("ffn_down", mlp.down_proj, 0),),
        }
        for attr, parts in groups.items():
            blocks = []
            for name, hf_linear, heads in parts:
                full = f"blk.{i}.{name}.weight"
                found = tensors.get(full)
                b = read_q4(found) if found is not None else None
                if b is None:
                    break
                if heads and arch == "llama":
                    b = b.rows(_unpermute_rows(b.codes.shape[0], heads))
                if not torch.equal(b.dequantized(), hf_linear.weight.detach().float()):
                    raise NativeWeightsError(
                        f"{gguf_path.name}: {full} decoded natively differs from the weight "
                        f"transformers loaded for layer {i} ({attr}); refusing to run a different model")
                blocks.append(b)
            # the kernel's packing needs a multiple of 16 output rows
            if len(blocks) < len(parts) or sum(b.codes.shape[0] for b in blocks) % 16:
                counts["dense"] += 1
                continue
            bias = getattr(layer, "bqkv", None) if attr == "qkv_proj" else None
            setattr(layer, attr, Int4Projection(Q4Blocks.cat(blocks), bias))
            setattr(layer, DENSE_WEIGHT[attr], None)  # the dense bf16 copy is no longer read
            counts["native"] += 1
    _native_head(runtime, hf_model, tensors, gguf_path, counts)
    return counts


def _native_head(runtime: Any, hf_model: Any, tensors: dict[str, Any], gguf_path: Path,
                 counts: dict[str, int]) -> None:
    # The LM head: "output.weight", or the tied "token_embd.weight" when the file has none.  The
    # embedding lookups keep the dense table (a row gather reads next to nothing).
    name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    found = tensors.get(name)
    hf_head = hf_model.get_output_embeddings().weight.detach().float()
    head: Int4Projection | Q8Projection | None = None
    if found is not None and hf_head.shape[0] % 16 == 0:
        blocks, q8 = read_q4(found), read_q8(found)
        if blocks is not None or q8 is not None:
            decoded = blocks.dequantized() if blocks is not None else _scaled(*q8)
            if not torch.equal(decoded, hf_head):
                raise NativeWeightsError(f"{gguf_path.name}: {name} decoded natively differs from the LM head "
                                         "transformers loaded; refusing to run a different model")
            head = Int4Projection(blocks) if blocks is not None else Q8Projection(*q8)
    counts["native" if head is not None else "dense"] += 1
    if head is not None:
        runtime.head_projection = head

"""The runtime transformer: a compact decoder over flattened variable-length batches.

Weights come from a loaded Hugging Face model (whose own forward stays available as the reference
oracle).  Projections are fused — q/k/v into one matrix, gate/up into another — so a layer is four
matmuls over all N new tokens of the batch, whatever request they belong to.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specforge.model_args import ModelArgs
from specforge.passes import VarlenBatch
from specforge.runtime.contract import ForwardOutput
from specforge.runtime.torch.cache import KVCache
from specforge.toolkit.compiled import Attend, CompiledTrunk, compile_available
from specforge.runtime.torch.kv_dtype import resolve_kv_dtype
from specforge.toolkit.linear_plan import LinearPlan
from specforge.toolkit.projection import Projection
from specforge_kernels.planned_attention import VarlenPlan, plan_varlen_attention, varlen_attention_planned
from specforge_kernels.varlen_attention import varlen_attention

__all__ = ["Transformer"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # The fused kernel accumulates reduced-precision input in float32 itself, so no casts (each
    # would be one more pass over the activations on every layer).
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding in the "rotate half" layout of Hugging Face checkpoints."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _norm_weight(norm: nn.Module, args: ModelArgs, dtype: torch.dtype) -> nn.Parameter:
    # Gemma's (1 + w) is folded in float32 before the cast to the model dtype.
    return nn.Parameter((norm.weight.detach().float() + args.norm_offset).to(dtype), requires_grad=False)


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, hf_layer: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.attn_norm = _norm_weight(hf_layer.input_layernorm, args, dtype)
        self.mlp_norm = _norm_weight(hf_layer.post_attention_layernorm, args, dtype)
        self.wqkv = nn.Parameter(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().to(dtype), requires_grad=False)
        self.bqkv = None
        if args.qkv_bias:
            self.bqkv = nn.Parameter(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().to(dtype), requires_grad=False)
        self.wo = nn.Parameter(attn.o_proj.weight.detach().to(dtype), requires_grad=False)
        if args.qk_norm:
            self.q_norm = _norm_weight(attn.q_norm, args, dtype)
            self.k_norm = _norm_weight(attn.k_norm, args, dtype)
        self.w13 = nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().to(dtype), requires_grad=False)
        self.w2 = nn.Parameter(mlp.down_proj.weight.detach().to(dtype), requires_grad=False)
        self.qkv_proj = Projection(self.wqkv, self.bqkv)
        self.o_proj = Projection(self.wo)
        self.up_proj = Projection(self.w13)
        self.down_proj = Projection(self.w2)

    def forward(self, x: Tensor, layer: int, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        a = self.args
        n = x.shape[0]
        h = rms_norm(x, self.attn_norm, a.norm_eps)
        qkv = self.qkv_proj(h)
        q_size, kv_size = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        v = qkv[:, q_size + kv_size :].view(n, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q = rms_norm(qkv[:, :q_size].view(n, a.n_heads, a.head_dim), self.q_norm, a.norm_eps)
            k = rms_norm(qkv[:, q_size : q_size + kv_size].view(n, a.n_kv_heads, a.head_dim), self.k_norm, a.norm_eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        else:
            # q and k heads side by side in one view: a single set of rotation kernels for both.
            qk = rotate(qkv[:, : q_size + kv_size].view(n, a.n_heads + a.n_kv_heads, a.head_dim), cos, sin)
            q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]
        o = attend(q, k, v, layer)
        x = x + self.o_proj(o.reshape(n, q_size))
        h = rms_norm(x, self.mlp_norm, a.norm_eps)
        gate, up = self.up_proj(h).chunk(2, dim=-1)
        act = F.silu(gate) if a.activation == "silu" else F.gelu(gate, approximate="tanh")
        return x + self.down_proj(act * up)


class Transformer(nn.Module):
    """Decoder over :class:`VarlenBatch` passes with an explicit :class:`KVCache`."""

    def __init__(self, args: ModelArgs, hf_model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        self.dtype = dtype
        body = hf_model.model
        self.embed = nn.Parameter(body.embed_tokens.weight.detach().to(dtype), requires_grad=False)
        self.layers = nn.ModuleList(Layer(args, layer, dtype) for layer in body.layers)
        self.norm = _norm_weight(body.norm, args, dtype)
        head = hf_model.get_output_embeddings().weight
        self.lm_head = self.embed if head is body.embed_tokens.weight else \
            nn.Parameter(head.detach().to(dtype), requires_grad=False)
        # The LM head is the largest matrix a decoding step reads (V×d); packed for oneDNN it
        # runs about 2× faster for the few rows a round projects (a second, blocked copy).
        self.head_projection = Projection(self.lm_head)
        rotary = body.rotary_emb  # the checkpoint's own RoPE variant (default, llama3, yarn, …)
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.embed_scale = torch.tensor(args.embed_scale, dtype=dtype)
        # Attention of many short runs in one padded SDPA (see plan_varlen_attention): None lets
        # the planner decide (bf16/fp16 only), False keeps one SDPA per request, which is
        # batch-invariant bit for bit, True forces the padded path.
        self.batched_attention: bool | None = None
        # The KV cache's dtype (specforge.runtime.torch.kv_dtype): "auto" measures whether float32
        # decode attention beats the model's dtype on this CPU; "model" or "float32" force one.
        self.kv_dtype = "auto"
        self.compiled: CompiledTrunk | None = None  # see compile()

    def projections(self) -> list[Projection]:
        """Every dense projection of the runtime (the 4-bit ones of :mod:`.quantized` excluded)."""
        found = [getattr(layer, name) for layer in self.layers for name in ("qkv_proj", "o_proj", "up_proj", "down_proj")]
        return [p for p in (*found, self.head_projection) if isinstance(p, Projection)]

    def set_linear_plan(self, plan: LinearPlan) -> None:
        """Run every dense projection's matmuls by ``plan`` (rows → kernel)."""
        for projection in self.projections():
            projection.use(plan)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None, :]
        return cos, sin

    def new_cache(self, slots: int, capacity: int, device: torch.device | str = "cpu") -> KVCache:
        a = self.args
        return KVCache(a.n_layers, slots, a.n_kv_heads, capacity, a.head_dim, self.cache_dtype(device), device)

    def cache_dtype(self, device: torch.device | str = "cpu") -> torch.dtype:
        """The dtype a new cache on ``device`` stores K/V in (``kv_dtype`` resolved)."""
        a = self.args
        return resolve_kv_dtype(self.kv_dtype, self.dtype, device, a.n_heads, a.n_kv_heads, a.head_dim)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = F.embedding(tokens, self.embed)
        return x * self.embed_scale if self.args.embed_scale != 1.0 else x

    def project(self, hidden: Tensor) -> Tensor:
        """Final hidden states → float32 logits (the frozen LM head)."""
        return self.head_projection(hidden).float()

    def forward(
        self,
        batch: VarlenBatch,
        cache: KVCache,
        logits_rows: Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run one pass: write the batch's K/V into ``cache`` and return what was asked for.

        ``logits_rows`` selects the flat rows whose logits are needed (``None``: none), so a
        prefill never pays for the LM head.  ``taps`` lists layers whose outputs to return.
        The caller advances the cache lengths once it knows which tokens it keeps.
        """
        plan = None
        if not batch.tokens.is_cuda:
            # The attention metadata is the same for every layer: check it and copy it to the
            # host once per pass (the Triton kernel on CUDA reads it on the device instead).
            plan = plan_varlen_attention(batch.cu_seqlens, batch.slots, batch.start_pos, cache.k[0],
                                         batch.num_tokens, self.args.n_heads, self.batched_attention, batch.tree,
                                         exact=self.dtype == torch.float32)
            cache.note_written(plan.slots, [s + plan.cu[r + 1] - plan.cu[r] for r, s in enumerate(plan.start)])
        attend = _PassAttention(self.args.attention_scale, batch, cache, plan)
        trunk = self.trunk
        if self.compiled is not None:
            cache.mark_static()
            trunk = self.compiled
        rope = batch.positions if batch.rope_positions is None else batch.rope_positions
        hidden, tapped = trunk(batch.tokens, rope, tuple(taps), attend)
        return ForwardOutput(logits=None if logits_rows is None else self._logits(hidden, logits_rows),
                             hidden=hidden, taps=tapped)

    def _logits(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """Logits of ``rows``, each distinct row projected once.  The engine's ``[R, γ+1]`` layout
        repeats a request's last row past its verified drafts: at 16 requests with ≈ 11 drafts
        verified in all, 85 of the 112 rows were repeats, and SmolLM2's 4-bit head over its 49k
        tokens took 17.0 ms for the 112 rows against 4.9 ms for the 27 distinct ones (AMD EPYC,
        2 threads)."""
        unique, inverse = torch.unique(rows, return_inverse=True)
        if len(unique) == len(rows):
            return self.project(hidden[rows])
        return self.project(hidden[unique])[inverse]

    def trunk(self, tokens: Tensor, positions: Tensor, taps: Collection[int],
              attend: Attend) -> tuple[Tensor, dict[int, Tensor]]:
        """Embedding → layers → final norm of one pass: tensors in, tensors out, attention (and
        with it every cache access) behind ``attend``; the part :class:`CompiledTrunk` compiles."""
        cos, sin = self.rope(positions)
        x = self.embed_tokens(tokens)
        tapped: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cos, sin, attend)
            if i in taps:
                tapped[i] = x
        return rms_norm(x, self.norm, self.args.norm_eps), tapped

    def compile(self, enabled: bool = True) -> bool:
        """Run passes through :class:`CompiledTrunk` (``False``: back to eager).  Returns whether
        the compiled path is on; a machine without a C++ compiler keeps the eager one and warns."""
        if not enabled:
            self.compiled = None
            return False
        if not compile_available():
            warnings.warn("torch.compile needs a C++ compiler for CPU kernels and none was found; "
                          "the target runs eagerly", RuntimeWarning, stacklevel=2)
            return False
        self.compiled = CompiledTrunk(self)
        return True


class _PassAttention:
    """One pass's attention: the cache write and the varlen attention of every layer."""

    def __init__(self, scale: float, batch: VarlenBatch, cache: KVCache, plan: VarlenPlan | None) -> None:
        self.scale, self.batch, self.cache, self.plan = scale, batch, cache, plan
        # One SDPA per layer — a single request decoding one token, or the padded layout of
        # short decode/verify runs (bf16/fp16) — is traced into CompiledTrunk's graph with the
        # cache write.  The per-request path (prefills, float32 batches) unrolls a Python loop
        # per request and would recompile for every batch size: it stays behind the opaque op.
        self.traceable = plan is not None and (plan.padded is not None or plan.cu == [0, 1])

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        b, cache = self.batch, self.cache
        dtype = q.dtype
        kv = cache.k[layer].dtype
        if kv != dtype:  # a float32 cache under a bf16 model (specforge.runtime.torch.kv_dtype)
            q, k, v = q.to(kv), k.to(kv), v.to(kv)
        cache.update(layer, b.token_slots, b.positions, k, v)
        if self.plan is not None:
            o = varlen_attention_planned(q, cache.k[layer], cache.v[layer], self.plan, self.scale)
        else:
            o = varlen_attention(q, cache.k[layer], cache.v[layer], b.cu_seqlens, b.slots, b.start_pos, self.scale,
                                 tree=b.tree)
        return o.to(dtype)

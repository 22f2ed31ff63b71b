"""The EAGLE-3 draft model (Li et al., 2025; docs/design/drafters.md#eagle3) and its checkpoint.

Three target layers are fused into g_t = W_fc [l_t ; m_t ; h_t] (3d → d, no bias).  One decoder
layer of the target's shape reads, at position t, the pair (token x_{t+1}, hidden state s_t):

    a_t = [ RMSNorm(emb(x_{t+1})) ; RMSNorm(s_t) ]          (2d wide: q, k, v project from it)
    o_t = s_t + W_o · Attention(a_t, a_≤t)                    (the residual is the hidden state)
    y_t = o_t + MLP(RMSNorm(o_t)),    logits = lm_head(RMSNorm(y_t))   → x_{t+2}

For committed positions s_t = g_t (the target's fused features); for its own drafts the model
feeds back y of the previous step — which is what training-time test teaches it.  The embedding is
the target's, frozen and shared; the LM head is the drafter's own, over a draft vocabulary when
there is one (initialised from the target's rows).  With ``qk_norm`` (Qwen3's layers; DeepSpec's
``Qwen3Eagle3Model``) queries and keys are RMS-normalised per head before RoPE; without it (the
default, and every checkpoint that does not record it) they are not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from specforge.toolkit.checkpoints import (
    DrafterCheckpointError,
    read_checkpoint,
    read_vocab,
    vocab_tensors,
    write_checkpoint,
)
from specforge.toolkit.drafting import TargetShape, check_draft_vocab_size
from specforge.toolkit.layers import DraftLayerBase, DraftNetwork, RMSNorm, SharedWeights, attend, rotate
from specforge.vocab import DraftVocab

__all__ = ["FORMAT", "VERSION", "Eagle3Model", "Eagle3Shape", "eagle3_layers", "load_eagle3", "rope_base",
           "save_eagle3"]

FORMAT, VERSION = "specforge-eagle3", 1


def eagle3_layers(n_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's fused layers: the outputs of layers 1, L/2 − 1 and L − 4 (0-based), clamped
    into a shallow target's depth; a repeat is dropped (the fusion is then narrower), since a
    duplicate tap adds no information."""
    top = n_target_layers - 1
    return tuple(sorted({min(max(i, 0), top) for i in (1, n_target_layers // 2 - 1, n_target_layers - 4)}))


class Eagle3Shape(TargetShape):
    """Everything needed to rebuild the model (stored in the checkpoint's config.json): the target
    layer's shape, which the decoder layer copies, then the drafter's own fields."""

    # The target's RoPE base and context (what an exported config must state; the model itself
    # reads the target's frequencies when bound).  None: not recorded, or a scaled RoPE.
    rope_theta: float | None = None
    max_positions: int = Field(8192, ge=1)
    layers: tuple[int, ...] = Field(description="the fused target layers (0-based outputs)")
    draft_vocab_size: int | None = Field(None, ge=1)
    qk_norm: bool = Field(False, description="per-head RMSNorm of queries and keys before RoPE (Qwen3)")

    @model_validator(mode="after")
    def _check(self) -> Eagle3Shape:
        bad = [i for i in self.layers if not 0 <= i < self.n_target_layers]
        if bad or not self.layers:
            raise ValueError(f"fused layers {list(self.layers)} must lie in the target's {self.n_target_layers} layers")
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        return self

    @classmethod
    def from_model_args(cls, args: Any, runtime: Any = None, **overrides: Any) -> Eagle3Shape:
        """The shape for a target (``args``; ``runtime``: its RoPE base is read from it)."""
        shape = {**cls.target_fields(args), "layers": eagle3_layers(args.n_layers), "max_positions": args.max_positions,
                 "rope_theta": None if runtime is None else rope_base(runtime, args.head_dim)}
        return cls(**{**shape, **{k: v for k, v in overrides.items() if v is not None}})


def rope_base(runtime: Any, head_dim: int) -> float | None:
    """θ of the target's RoPE, inv_freq_k = θ^(−2k/hd), read back from its frequencies; None when
    they follow no such θ (a scaled RoPE), which no EAGLE-3 config field could state."""
    inv = getattr(runtime, "inv_freq", None)
    if inv is None or inv.numel() < 2 or getattr(runtime, "rope_scaling", 1.0) != 1.0:
        return None
    theta = float(inv[1].double() ** (-head_dim / 2))
    again = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    theta = float(f"{theta:.6g}")  # the frequencies are float32: θ is good to ~7 digits
    return theta if torch.allclose(again, inv.double(), rtol=1e-5) else None


class Eagle3Layer(DraftLayerBase):
    """The decoder layer over [RMSNorm(emb) ; RMSNorm(hidden)] (see the module docstring)."""

    def __init__(self, s: Eagle3Shape) -> None:
        super().__init__()
        d, hd = s.dim, s.head_dim
        self.s = s
        self.input_norm = RMSNorm(d, s.norm_eps)
        self.hidden_norm = RMSNorm(d, s.norm_eps)
        self.wq = nn.Linear(2 * d, s.n_heads * hd, bias=False)
        self.wk = nn.Linear(2 * d, s.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(2 * d, s.n_kv_heads * hd, bias=False)
        self.add_output(s, s.qk_norm)

    def project(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[..., d]`` each → rotated q ``[..., H, hd]``, k and v ``[..., KV, hd]``."""
        lead, s = emb.shape[:-1], self.s
        a = torch.cat([self.input_norm(emb), self.hidden_norm(hidden)], -1)
        q = self.wq(a).view(*lead, s.n_heads, s.head_dim)
        k = self.wk(a).view(*lead, s.n_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), self.wv(a).view(*lead, s.n_kv_heads, s.head_dim)


class Eagle3Model(DraftNetwork):
    """Fusion, the decoder layer, final norm and the drafter's own LM head."""

    def __init__(self, shape: Eagle3Shape, seed: int = 0, vocab: DraftVocab | None = None) -> None:
        super().__init__()
        if (vocab is None) != (shape.draft_vocab_size is None) or (vocab is not None and vocab.size != shape.draft_vocab_size):
            raise ValueError("the draft vocabulary must match draft_vocab_size")
        self.shape, self.vocab = shape, vocab
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc = nn.Linear(len(shape.layers) * shape.dim, shape.dim, bias=False)
            self.layer = Eagle3Layer(shape)
            self.norm = RMSNorm(shape.dim, shape.norm_eps)
            self.lm_head = nn.Linear(shape.dim, shape.draft_vocab_size or shape.vocab_size, bias=False)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
        self.own_rope(shape.head_dim, shape.rope_theta or 10000.0)
        self.shared: SharedWeights | None = None

    def bind(self, shared: SharedWeights, init_head: bool = False) -> Eagle3Model:
        """Read the target's frozen embedding (and RoPE) by reference; ``init_head`` copies the
        target's LM-head rows of the draft vocabulary into the drafter's own head (a new run)."""
        if shared.embed.shape != (self.shape.vocab_size, self.shape.dim):
            raise ValueError(f"the target's embedding is {tuple(shared.embed.shape)}; the model was built for "
                             f"({self.shape.vocab_size}, {self.shape.dim})")
        self.shared = shared
        if init_head:
            rows = shared.lm_head if self.vocab is None else shared.lm_head[self.vocab.ids.to(shared.lm_head.device)]
            with torch.no_grad():
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
        return self

    def fuse(self, features: Tensor) -> Tensor:
        """``[..., m·d]`` concatenated tapped target states → g ``[..., d]``."""
        return self.fc(features.to(self.dtype))

    def logits(self, y: Tensor) -> Tensor:
        """``[..., d]`` layer outputs → float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(y)).float()

    def step(self, emb: Tensor, hidden: Tensor, positions: Tensor, keys: Tensor, values: Tensor, mask: Tensor,
             self_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One pass of the layer for T new rows of B sequences, shared by the chain and the tree.

        ``emb``/``hidden [B, T, d]`` at ``positions [B, T]`` attend to the earlier keys/values
        ``[B, S, KV, hd]`` where ``mask [B, T, S]`` and to each other where ``self_mask [B, T, T]``
        (None: not at all — a row whose own K/V is already among the earlier keys).  Returns
        ``y [B, T, d]``, logits ``[B, T, N]`` and the new rows' ``k``, ``v [B, T, KV, hd]``.
        """
        cos, sin = self.rope(positions)
        q, k, v = self.layer.project(emb, hidden, cos, sin)
        if self_mask is not None:
            keys, values, mask = torch.cat([keys, k], 1), torch.cat([values, v], 1), torch.cat([mask, self_mask], 2)
        y = self.layer.finish(hidden, attend(q, keys, values, mask))
        return y, self.logits(y), k, v

    def chain(self, emb0: Tensor, hidden0: Tensor, pos0: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_ok: Tensor,
              steps: int, next_emb) -> tuple[Tensor, Tensor]:
        """``steps`` autoregressive steps for B chains, shared by training-time test and drafting.

        Step 1 reads (``emb0``, ``hidden0``) ``[B, d]`` at ``pos0 [B]`` — a committed position
        whose K/V is already among the context keys ``ctx_k``/``ctx_v [B, C, KV, hd]`` (visible
        where ``ctx_ok [B, C]``); step j > 1 reads (``next_emb(j - 1, logits of step j − 1)``,
        y of step j − 1) at ``pos0 + j − 1`` and attends to the context and to its own chain.
        Returns ``y [B, steps, d]`` and logits ``[B, steps, N]``.
        """
        b = emb0.shape[0]
        ys, outs = [], []
        keys, values, mask = ctx_k, ctx_v, ctx_ok[:, None]
        emb, hidden = emb0[:, None], hidden0[:, None].to(self.dtype)
        own = mask.new_ones(b, 1, 1)
        for j in range(steps):
            y, logits, k, v = self.step(emb, hidden, (pos0 + j)[:, None], keys, values, mask, own if j else None)
            if j:  # step 1's own key is the context row of pos0
                keys, values, mask = torch.cat([keys, k], 1), torch.cat([values, v], 1), torch.cat([mask, own], 2)
            ys.append(y[:, 0])
            outs.append(logits[:, 0])
            if j + 1 < steps:
                emb, hidden = next_emb(j, logits[:, 0])[:, None], y
        return torch.stack(ys, 1), torch.stack(outs, 1)

    def context_kv(self, features: Tensor, next_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """K/V of committed rows: ``features [..., T, m·d]`` with the token after each row
        ``next_ids [..., T]`` at ``positions [..., T]`` → (k, v ``[..., T, KV, hd]``, g ``[..., T, d]``)."""
        g = self.fuse(features)
        cos, sin = self.rope(positions)
        _, k, v = self.layer.project(self.embed(next_ids), g, cos, sin)
        return k, v, g


def save_eagle3(directory: str | Path, model: Eagle3Model, config: dict[str, Any] | None = None, *,
                target: str | None = None) -> Path:
    """Write ``model`` (+ free-form drafter ``config``: provenance) as an ``eagle3`` checkpoint."""
    shape = model.shape.model_dump(mode="json")
    if not shape["qk_norm"]:  # written only when set: without it the config is the one earlier versions read
        del shape["qk_norm"]
    meta = {"format": FORMAT, "version": VERSION, "method": "eagle3", "target": target,
            "eagle3": shape, "drafter": config or {}}
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update(vocab_tensors(model.vocab))
    return write_checkpoint(directory, meta, tensors)


def load_eagle3(directory: str | Path) -> tuple[Eagle3Model, dict[str, Any]]:
    """Read a checkpoint written by :func:`save_eagle3`: ``(model, drafter config)``."""
    meta, tensors = read_checkpoint(directory, FORMAT, VERSION, "eagle3")
    vocab = read_vocab(tensors, directory)
    try:
        model = Eagle3Model(Eagle3Shape.model_validate(meta["eagle3"]), vocab=vocab)
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    except (KeyError, ValueError, RuntimeError) as exc:
        raise DrafterCheckpointError(f"{directory}: not a usable eagle3 checkpoint ({exc})") from None
    return model, meta.get("drafter", {})

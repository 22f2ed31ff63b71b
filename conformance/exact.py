"""The exact reference: a tiny target of a real model family whose sequence law is enumerated.

The target is a Hugging Face model (Llama, Qwen3 or Gemma architecture) with a vocabulary of
8–32 tokens and random weights, large enough that next-token laws are peaked.  The engine under
test runs it through the specforge runtime in float32; the reference law is computed here from the
*Hugging Face* forward in float64 with an independent implementation of the warp (temperature,
top-k, top-p), so a bug shared by the runtime and :mod:`specforge.sampling` cannot cancel out.

For a prompt and a horizon L the law of the L generated tokens is the product of the warped
next-token laws along each of the V^L continuations, computed level by level over all V^t
prefixes (at most a few thousand forwards of a few tokens).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FAMILIES", "ExactLaw", "ReferenceSpec", "exact_law", "reference_hf_model", "reference_target",
           "reference_warp", "sampling_target"]

FAMILIES = ("llama", "qwen3", "gemma")

# fp32 (engine) and fp64 (reference) logits differ by ~1e-6; a top-k/top-p/arg-max decision closer
# than this to its boundary could go either way, so such cases are not used.
MARGIN = 1e-4
ENTROPY = 1.4  # nats: mean next-token entropy of a reference target at T = 1 (see _calibrate)


@dataclass(frozen=True)
class ReferenceSpec:
    """Which tiny target: family, vocabulary size and weight seed."""

    family: str = "llama"
    vocab: int = 16
    seed: int = 0
    eos: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; choose from {', '.join(FAMILIES)}")
        if not 8 <= self.vocab <= 32:
            raise ValueError(f"the reference vocabulary must have 8–32 tokens, got {self.vocab}")


def _config(spec: ReferenceSpec):
    from transformers import GemmaConfig, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=spec.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        eos_token_id=spec.eos, bos_token_id=None, pad_token_id=None,
    )
    if spec.family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if spec.family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return GemmaConfig(**common, hidden_activation="gelu_pytorch_tanh")


@functools.lru_cache(maxsize=16)
def reference_hf_model(spec: ReferenceSpec):
    """The float32 Hugging Face model of ``spec`` (cached; treat it as read-only)."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(_config(spec), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.35)
        _calibrate(model, spec, gen)
    return model.eval()


def _calibrate(model, spec: ReferenceSpec, gen: torch.Generator) -> None:
    """Scale the final norm so the mean next-token entropy at T = 1 is :data:`ENTROPY` nats.

    Raw random weights give laws anywhere from one-hot to flat depending on family and seed.  A
    one-hot law makes every sequence test vacuous; a flat one spreads N samples over V^L cells
    too thin to resolve.  About 1.4 nats per token puts the mass of a 3-token law on a few dozen
    to a few hundred sequences — what N = 2·10⁴ resolves.  Scaling the final norm scales the
    logits, so the architecture is untouched.
    """
    ids = torch.randint(0, spec.vocab, (64, 6), generator=gen)
    logits = model(input_ids=ids, use_cache=False).logits.double()

    def entropy(scale: float) -> float:
        return float(torch.special.entr(torch.softmax(logits * scale, -1)).sum(-1).mean())

    lo, hi = -12.0, 12.0  # log2 of the scale
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(2.0 ** mid) > ENTROPY else (lo, mid)
    scale = 2.0 ** ((lo + hi) / 2)
    norm = model.model.norm.weight
    if spec.family == "gemma":  # Gemma's RMSNorm multiplies by (1 + weight)
        norm.copy_((1 + norm) * scale - 1)
    else:
        norm.mul_(scale)


@functools.lru_cache(maxsize=16)
def _hf64(spec: ReferenceSpec):
    return copy.deepcopy(reference_hf_model(spec)).to(torch.float64)


@functools.lru_cache(maxsize=16)
def reference_target(spec: ReferenceSpec):
    """The engine's view of the same model: a float32 :class:`~specforge.runtime.TargetModel`."""
    from specforge.runtime import TargetModel

    return TargetModel(reference_hf_model(spec), None, torch.float32, name=f"reference-{spec.family}")


def sampling_target(spec: ReferenceSpec):
    """The same target for the statistical runs: attention of a pass in one padded SDPA (the path
    bf16 serving takes) instead of one per request, ~30 % faster on these tiny shapes.  Its
    logits depend on batch-mates at the ulp level, which the statistics cannot see; the
    deterministic checks, which compare token for token, keep :func:`reference_target`.  Inside
    :func:`~specforge_conformance.backends.target_backend` ``("llama.cpp")`` a Llama-family target
    decodes on llama.cpp instead."""
    from specforge_conformance.backends import current_backend

    if current_backend() == "llama.cpp" and spec.family == "llama":
        return _llamacpp_sampling_target(spec)
    return _torch_sampling_target(spec)


@functools.lru_cache(maxsize=8)
def _llamacpp_sampling_target(spec: ReferenceSpec):
    from specforge_conformance.backends import gguf_target

    return gguf_target(reference_hf_model(spec), f"reference-{spec.family}-{spec.vocab}-{spec.seed}")


@functools.lru_cache(maxsize=16)
def _torch_sampling_target(spec: ReferenceSpec):
    from specforge.runtime import TargetModel

    target = TargetModel(reference_hf_model(spec), None, torch.float32, name=f"reference-{spec.family}")
    target.runtime.batched_attention = True
    return target


def reference_warp(logits: Tensor, temperature: float, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """Warped law of float64 logits ``[N, V]`` and the distance of each row's decisions from
    their boundaries ``[N]`` (written independently of :func:`specforge.sampling.warp`).

    Temperature 0 is greedy (lowest id among equal maxima).  Otherwise the tokens are ranked by
    scaled logit (ties: lower id first); top-k keeps the first k; top-p keeps tokens while the
    mass ranked before them is below top_p (the first always stays).
    """
    logits = logits.to(torch.float64)
    n, v = logits.shape
    # Ascending stable sort of the negated logits: equal values keep id order.
    order = torch.sort(-logits, dim=1, stable=True).indices
    ranked = logits.gather(1, order)
    margin = torch.full((n,), float("inf"), dtype=torch.float64)
    if temperature == 0:
        out = torch.zeros_like(logits).scatter_(1, order[:, :1], 1.0)
        if v > 1:
            margin = ranked[:, 0] - ranked[:, 1]
        return out, margin
    z = ranked / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < v:
        keep[:, top_k:] = False
        margin = torch.minimum(margin, z[:, top_k - 1] - z[:, top_k])
    w = torch.where(keep, torch.exp(z - z[:, :1]), torch.zeros_like(z))
    p = w / w.sum(1, keepdim=True)
    if top_p < 1:
        before = torch.cumsum(p, 1) - p
        inside = before < top_p
        inside[:, 0] = True
        # Only rows past the first can flip, and only where they are still in the top-k set.
        gap = (before - top_p).abs().masked_fill(~keep, float("inf"))
        gap[:, 0] = float("inf")
        margin = torch.minimum(margin, gap.min(1).values)
        p = torch.where(inside, p, torch.zeros_like(p))
        p = p / p.sum(1, keepdim=True)
    out = torch.zeros_like(p).scatter_(1, order, p)
    return out, margin


@dataclass(frozen=True)
class ExactLaw:
    """Law of the ``horizon`` tokens after ``prompt``: ``probs[i]`` is the probability of the
    continuation whose ids are the base-V digits of i (first token most significant)."""

    probs: Tensor  # [V ** horizon] float64
    vocab: int
    horizon: int
    margin: float  # smallest distance of a warp decision from its boundary, on reachable prefixes

    @property
    def well_conditioned(self) -> bool:
        return self.margin >= MARGIN

    def index(self, tokens: Tensor) -> Tensor:
        """``[N, horizon]`` ids → ``[N]`` cell indices."""
        weights = self.vocab ** torch.arange(self.horizon - 1, -1, -1)
        return (tokens.to(torch.long) * weights).sum(-1)


@functools.lru_cache(maxsize=256)
@torch.inference_mode()
def exact_law(spec: ReferenceSpec, prompt: tuple[int, ...], horizon: int, temperature: float,
              top_k: int = 0, top_p: float = 1.0) -> ExactLaw:
    """Enumerate the law of ``horizon`` sampled tokens after ``prompt`` (EOS ignored)."""
    if not 1 <= horizon <= 4:
        raise ValueError(f"the horizon must be 1–4 tokens, got {horizon}")
    model, v = _hf64(spec), spec.vocab
    law = torch.ones(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    margin = float("inf")
    base = torch.tensor(prompt, dtype=torch.long)
    for _ in range(horizon):
        ids = torch.cat([base.expand(prefixes.shape[0], -1), prefixes], 1)
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        p, m = reference_warp(logits, temperature, top_k, top_p)
        reachable = law > 0
        if bool(reachable.any()):
            margin = min(margin, float(m[reachable].min()))
        law = (law[:, None] * p).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(v, 0), torch.arange(v).repeat(prefixes.shape[0])[:, None]], 1)
    return ExactLaw(law, v, horizon, margin)

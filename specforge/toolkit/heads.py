"""Trainable correction heads of DSpark's sequential stage (paper §3.1 eq. 4–6; docs/design/drafters.md).

Each head adds a prefix-dependent bias B_k to the parallel backbone's base logits U_k:
``p_k(v | x_0, x_<k) ∝ exp(U_k(v) + B_k(x_0, x_<k, v))``.  All three share a low-rank pair
W1 ∈ R^{V×r} (an embedding of the previous token) and W2 ∈ R^{r×V} (a logit projection):

* ``markov``: B(x_{k−1}, ·) = W1[x_{k−1}] W2 (eq. 5),
* ``gated``:  B_k = W2(σ(Linear([h_k ; W1[x_{k−1}]])) ⊙ W1[x_{k−1}]),
* ``rnn``:    z_k = [s_{k−1}; W1[x_{k−1}]; h_k], (g, c, o) = Linear(z_k),
  s_k = σ(g)⊙s_{k−1} + (1−σ(g))⊙tanh(c), s_0 = 0, B_k = W2 tanh(o) (eq. 6).

x_0 is the anchor.  Every head offers the engine's left-to-right :meth:`step` (the
:class:`~specforge.components.CorrectionHead` protocol) and a teacher-forced :meth:`forward_train`
over whole blocks for training; the two agree on the same tokens (tested).

The networks live in the toolkit because two plug-ins build them: the correction-head components
that serve them, and the block drafters that train them with their backbone and save them in
their checkpoints (:data:`HEADS` names the ones a checkpoint can hold).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specforge.components import ComponentWeights
from specforge.errors import ConfigError
from specforge.toolkit.projection import Projection

__all__ = ["HEADS", "GatedHead", "HeadConfig", "MarkovHead", "RnnHead", "load_trained"]


def load_trained(module: nn.Module, weights: ComponentWeights, slot: str) -> None:
    """Load ``weights`` into a built low-rank ``module`` of pipeline ``slot`` unless its config names
    a weights file of its own; a rank that does not fit is one config error naming the key."""
    if getattr(module.config, "weights", None):  # the pipeline names its own weights: they win
        return
    rows = weights.state.get("token_rows")
    if rows is not None:  # trained over a draft vocabulary: take its shape before its values
        module.restrict(rows)
    try:
        module.load_state_dict(weights.state)
    except RuntimeError as exc:
        rank = next((t.shape[-1] for k, t in weights.state.items() if k in ("w1", "embed")), None)
        first = str(exc).strip().splitlines()[0]
        raise ConfigError([f"{slot}.rank: the weights in {weights.source} do not fit "
                           + (f"(trained with rank {rank}; set {slot}.rank={rank})" if rank else f"({first})")]) from None


class HeadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = Field(256, ge=1, description="r: width of the W1 embedding and of W2's input")
    vocab_size: int | None = Field(None, ge=1, description="V; None: taken from the target at bind()")
    dim: int | None = Field(None, ge=1, description="backbone hidden size d; None: from the target at bind()")
    weights: str | None = Field(None, description="safetensors file with the head's weights; None: random init")
    seed: int = Field(0, description="seed of the random initialisation")
    zero_init: bool = Field(True, description="W2 = 0 at init: the head starts as the identity")


class _LowRankHead(nn.Module, ABC):
    """W1/W2 plumbing, lazy building (V and d are often known only from the target) and I/O."""

    config_model = HeadConfig
    needs_hidden = True  # markov reads only x_{k−1}; gated and rnn also read h_k

    def __init__(self, config: HeadConfig | None = None) -> None:
        super().__init__()
        self.config = config or HeadConfig()
        self.built = False
        # Inference copy of W2 in the bound target's half dtype, pre-packed on CPU (see project()).
        self._fast_dtype: torch.dtype | None = None
        self._fast: tuple[tuple[int, int], Any] | None = None
        self._columns_cache: tuple[tuple[int, int], Tensor] | None = None
        if self.config.vocab_size is not None and (self.config.dim is not None or not self.needs_hidden):
            self._build(self.config.vocab_size, self.config.dim or 0)

    def bind(self, target: Any) -> None:
        """Size the head from the target (an adapter or a Transformer exposing ``args``)."""
        args = getattr(target, "args", target)
        if not self.built:
            self._build(self.config.vocab_size or args.vocab_size, self.config.dim or args.dim)
        dtype = getattr(target, "dtype", None)
        self._fast_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None

    def restrict(self, token_rows: Tensor) -> None:
        """Work over a draft vocabulary (:class:`specforge.vocab.DraftVocab`): ``token_rows [V]``
        maps each target id to its draft id, or to N for a token outside the N-token vocabulary.
        W2's columns (the bias) cover the N draft ids; W1 has a row per draft id plus one shared
        by every other previous token (only an anchor can be one).  Rebuilds a built head."""
        rows = token_rows.to(torch.long)
        self._rows = rows
        n = int(rows.max())  # the "outside" row index is N
        self.config = self.config.model_copy(update={"vocab_size": n})
        if self.built:
            self._build(n, self.config.dim or 0)

    def _build(self, vocab: int, dim: int) -> None:
        # Record the sizes in the config, so that a checkpoint's config rebuilds the head alone.
        self.config = self.config.model_copy(update={"vocab_size": vocab, "dim": dim or None})
        r = self.config.rank
        gen = torch.Generator().manual_seed(self.config.seed)
        rows = getattr(self, "_rows", None)
        # W1 is an embedding (unit-variance rows); W2 sets the bias scale, zero by default so
        # that training starts from the backbone's own distribution.
        self.w1 = nn.Parameter(torch.randn(vocab + (rows is not None), r, generator=gen))
        self.w2 = nn.Parameter(torch.zeros(r, vocab) if self.config.zero_init
                               else torch.randn(r, vocab, generator=gen) / r ** 0.5)
        if rows is not None:
            self.register_buffer("token_rows", rows.clone())
        self._build_extra(dim, gen)
        self.built = True
        self._fast = self._columns_cache = None
        if self.config.weights:
            self.load_state_dict(load_file(self.config.weights))

    def embed_previous(self, prev: Tensor) -> Tensor:
        """W1's rows for the previous tokens ``prev`` (target ids): the e of every head's rule,
        and the table a ``dspark-head`` confidence head may share (``embedding="head"``)."""
        rows = getattr(self, "token_rows", None)
        return self.w1[prev if rows is None else rows[prev]]

    def _build_extra(self, dim: int, gen: torch.Generator) -> None:
        pass

    def _linear(self, fan_in: int, fan_out: int, gen: torch.Generator) -> nn.Linear:
        lin = nn.Linear(fan_in, fan_out)
        bound = fan_in ** -0.5  # nn.Linear's default range, drawn from the head's own generator
        with torch.no_grad():
            lin.weight.uniform_(-bound, bound, generator=gen)
            lin.bias.uniform_(-bound, bound, generator=gen)
        return lin

    def save(self, path: str) -> None:
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, path)

    def load_weights(self, weights: ComponentWeights) -> None:
        """Trained weights handed over by the engine (a drafter checkpoint's head); a head that
        names its own ``weights`` file keeps those."""
        load_trained(self, weights, "correction_head")

    def _check(self, hidden: Tensor | None) -> None:
        if not self.built:
            raise RuntimeError(f"{type(self).__name__}: bind() it to a target (or give vocab_size/dim) first")
        if self.needs_hidden and hidden is None:
            raise ValueError(f"{type(self).__name__} needs the backbone hidden states h_k")

    def project(self, u: Tensor) -> Tensor:
        """``[..., r]`` → bias ``[..., V]`` through W2 ∈ R^{r×V}.

        Drafting reads all of W2 once per draft position, sequentially — on a CPU that is most
        of the head's cost — so without gradients and beside a bf16/fp16 target it reads a
        half-precision, oneDNN-packed copy (refreshed whenever W2 changes).  Only q changes,
        and q is reported exactly as sampled, so this never touches losslessness.
        """
        if self._fast_dtype is None or torch.is_grad_enabled() or self.w2.device.type != "cpu":
            return u @ self.w2
        key = (self.w2.data_ptr(), self.w2._version)
        if self._fast is None or self._fast[0] != key:
            self._fast = (key, Projection(self.w2.detach().t().contiguous().to(self._fast_dtype)))
        return self._fast[1](u.to(self._fast_dtype)).to(u.dtype)

    # -- the CorrectionHead protocol and training ---------------------------------------------

    def init_state(self, batch: int) -> Any:
        return None

    def step(self, logits: Tensor, prev_token: Tensor, hidden: Tensor | None, state: Any) -> tuple[Tensor, Any]:
        """Slot k: ``logits [R, V]`` (U_k), ``prev_token [R]`` (x_{k−1}), ``hidden [R, d]`` (h_k)."""
        self._check(hidden)
        code, state = self._code(prev_token, hidden, state)
        return logits + self.project(code).to(logits.dtype), state

    def step_on(self, logits: Tensor, support: Tensor, prev_token: Tensor, hidden: Tensor | None,
                state: Any) -> tuple[Tensor, Any]:
        """:meth:`step` restricted to ``support [R, K]`` token ids (``logits [R, K]`` are U_k there):
        B_k is computed on those K columns of W2 only — r·K weights read instead of r·V."""
        self._check(hidden)
        code, state = self._code(prev_token, hidden, state)
        # [R, K, r]: the W2 columns of the candidates, gathered as embedding rows (a row lookup
        # that stays single-threaded for a few rows), then an elementwise product and a sum —
        # a [1, K, r] × [1, r, 1] bf16 bmm takes oneDNN milliseconds on a CPU, this microseconds.
        columns = F.embedding(support, self._columns()).float()
        bias = (columns * code.float()[:, None, :]).sum(-1)
        return logits + bias.to(logits.dtype), state

    def forward_train(self, base_logits: Tensor, prev_tokens: Tensor, hidden: Tensor | None) -> Tensor:
        """Teacher-forced: ``U [B, S, V]``, ``prev_tokens [B, S]`` (column 0 = anchor, column k =
        x_k), ``hidden [B, S, d]`` → corrected logits ``[B, S, V]``."""
        self._check(hidden)
        return base_logits + self._bias_all(prev_tokens, hidden).to(base_logits.dtype)

    @abstractmethod
    def _code(self, prev: Tensor, hidden: Tensor | None, state: Any) -> tuple[Tensor, Any]:
        """``(u [..., r], new state)`` of one slot, each head's own rule; its bias is u·W2."""

    def _bias_all(self, prev: Tensor, hidden: Tensor | None) -> Tensor:
        # Stateless heads act position-wise, so the step rule applies to [B, S] as to [R].
        return self.project(self._code(prev, hidden, None)[0])

    def _columns(self) -> Tensor:
        """W2ᵀ ∈ R^{V×r}, contiguous (a row per token), for gathering a candidate set's columns;
        refreshed whenever W2 changes, in the bound target's half dtype on CPU (as project())."""
        key = (self.w2.data_ptr(), self.w2._version)
        if self._columns_cache is None or self._columns_cache[0] != key:
            dtype = self._fast_dtype if self._fast_dtype is not None and self.w2.device.type == "cpu" else self.w2.dtype
            self._columns_cache = (key, self.w2.detach().t().contiguous().to(dtype))
        return self._columns_cache[1]


class MarkovHead(_LowRankHead):
    """First-order transition bias B(x_{k−1}, ·) = W1[x_{k−1}] W2 (paper eq. 5)."""

    needs_hidden = False

    def _code(self, prev: Tensor, hidden: Tensor | None, state: Any) -> tuple[Tensor, Any]:
        return self.embed_previous(prev), state


class GatedHead(_LowRankHead):
    """The Markov embedding gated by the backbone state: W2(σ(Linear([h_k ; e])) ⊙ e), e = W1[x_{k−1}]."""

    def _build_extra(self, dim: int, gen: torch.Generator) -> None:
        self.gate = self._linear(dim + self.config.rank, self.config.rank, gen)

    def _code(self, prev: Tensor, hidden: Tensor | None, state: Any) -> tuple[Tensor, Any]:
        e = self.embed_previous(prev)
        g = torch.sigmoid(self.gate(torch.cat([hidden.to(e.dtype), e], dim=-1)))
        return g * e, state


class RnnHead(_LowRankHead):
    """A gated recurrence over the block's prefix (paper eq. 6); state s_k ∈ R^r, s_0 = 0."""

    def _build_extra(self, dim: int, gen: torch.Generator) -> None:
        self.cell = self._linear(2 * self.config.rank + dim, 3 * self.config.rank, gen)

    def init_state(self, batch: int) -> Tensor:
        if not self.built:
            raise RuntimeError("RnnHead: bind() it to a target (or give vocab_size/dim) first")
        return torch.zeros(batch, self.config.rank, dtype=self.w1.dtype, device=self.w1.device)

    def _code(self, prev: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor]:
        e = self.embed_previous(prev)
        s = torch.zeros_like(e) if state is None else state
        g, c, o = self.cell(torch.cat([s, e, hidden.to(e.dtype)], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        s = g * s + (1 - g) * torch.tanh(c)
        return torch.tanh(o), s

    def _bias_all(self, prev: Tensor, hidden: Tensor | None) -> Tensor:
        # The recurrence is inherently sequential; S = γ is small, so a Python loop is cheap.
        state = self.init_state(prev.shape[0])
        codes = []
        for k in range(prev.shape[1]):
            code, state = self._code(prev[:, k], hidden[:, k], state)
            codes.append(code)
        return self.project(torch.stack(codes, dim=1))


#: The trainable correction heads by registered name: what a block drafter trains and saves.
HEADS: dict[str, type[_LowRankHead]] = {"markov": MarkovHead, "gated": GatedHead, "rnn": RnnHead}

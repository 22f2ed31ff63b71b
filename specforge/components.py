"""The contracts between the engine and the six kinds of component.

Every shipped or third-party component implements one of the protocols below.  They are plain
functions from tensors to tensors wherever the maths allows it; state that must live across rounds
(a scheduler's history, a head's recurrent state) is explicit.

Shapes used throughout:

* ``R`` — requests in the batch, ``G`` — the largest draft block in the batch (γ),
* ``V`` — vocabulary size, ``d`` — hidden size.

Positions are 1-based in prose (x_1 … x_γ are draft tokens, x_0 is the anchor) and 0-based in
tensors: ``draft_tokens[r, k]`` is x_{k+1} of request ``r``.

**One owner, one lifecycle.**  The engine owns every component of a pipeline and is the only
caller of the steps below, in this order; no component hands another one around.

1. ``bind(target)`` — each component that has it (any kind) is sized from the target (vocabulary,
   hidden size, depth) and takes the target's frozen tensors it reads; a hardware-aware
   scheduler reads the target's step curve on this machine.  Once the engine is built, a
   scheduler with ``bind_draft_cost(measure)`` is offered what drafting costs this pipeline on
   this machine (``measure()`` returns a :class:`specforge.hardware.DraftCost`, measured once on
   an engine of its own and cached; call it only if you need it).  The optional methods named
   here are small protocols (:mod:`specforge.protocols`), checked when the engine binds.
2. *Weights* — a drafter whose checkpoint also trained other components of the round lists them
   in ``companion_weights()`` (:class:`ComponentWeights` per pipeline slot); the engine gives each
   to that slot's component through its ``load_weights``.  A slot whose component is of another
   kind and has weights of its own (``load_weights``) is an error — its random weights would
   silently stand in for trained ones; a component without weights (``none``, ``constant``) just
   runs without them.  Then a confidence estimator with ``share(correction_head)`` may take
   tables of the (now loaded) correction head.
3. *Rounds* — first a scheduler with ``draft_gate(num_requests)`` may answer ``False``: the round
   then runs plain (nothing is drafted; the target's features of the committed token wait for the
   next draft).  Otherwise ``drafter.draft(ctx)``: the drafter runs ``ctx.correction_head`` (the pipeline's,
   which stays the engine's) in its sequential stage; the engine then calls the confidence
   estimator, the calibrator, the scheduler and the verifier.  Every per-request random number
   comes from :func:`specforge.sampling.draw_uniforms` (``ctx.uniforms`` for a drafter).  Once
   a chain round is verified, a calibrator with ``observe(outcome)`` is told what happened
   (:class:`RoundOutcome`) — after the round, so nothing it learns reaches that round's decisions.
4. ``release(request_id)`` — when a request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from specforge.sampling import SamplingParams, draw_uniforms

__all__ = [
    "CalibrationData",
    "ComponentWeights",
    "DraftContext",
    "Calibrator",
    "ConfidenceEstimator",
    "CorrectionHead",
    "DraftBlock",
    "Drafter",
    "Scheduler",
    "TargetFeatures",
    "RoundOutcome",
    "Verifier",
    "VerifyOutput",
]


@dataclass(frozen=True)
class DraftBlock:
    """What a drafter hands to the rest of the round for R requests.

    Attributes:
        tokens: ``[R, G]`` drafted ids x_1..x_G.
        probs: ``[R, G, V]`` the law each token was *actually* drawn from (warped exactly as the
            drafter sampled it).  ``None`` means the drafter is deterministic: q is one-hot.
        lengths: ``[R]`` how many of the G slots are real for each request (≤ G).
        logits: ``[R, G, V]`` the drafter's raw (pre-warp, post-correction) logits, when it has
            them; confidence estimators may read them because they are pre-token.
        hidden: ``[R, G, d]`` the backbone hidden state h_k of each slot, when there is one.
        anchor: ``[R]`` x_0, the last committed token.
        parents: ``[R, G]`` for a token *tree*: the slot of each node's parent (−1: a child of
            x_0), every parent before its children, at most 63 nodes; ``probs[r, j]`` is then the
            law node j was drawn from given its path and the siblings drawn before it.  ``None``:
            a chain (slot k's parent is k − 1).  The first ℓ_r slots the scheduler keeps must
            still form a tree — they do, since parents come first.
        confidence: ``[R, G]`` pre-token survival estimates in (0, 1) that the drafter computed
            itself, when it has a signal of its own that no estimator could read off the other
            fields (an n-gram match length; a composition's members' own estimates).  Like any
            confidence, c_k may depend on what is known before x_k is drawn, never on x_k.  The
            ``reported`` confidence estimator hands them to the calibrator.
    """

    tokens: Tensor
    lengths: Tensor
    probs: Tensor | None = None
    logits: Tensor | None = None
    hidden: Tensor | None = None
    anchor: Tensor | None = None
    parents: Tensor | None = None
    confidence: Tensor | None = None


@dataclass(frozen=True)
class VerifyOutput:
    """Result of verifying one round for R requests.

    The tokens a request commits this round are ``draft_tokens[r, :num_accepted[r]]`` followed by
    ``next_token[r]`` — the correction after the first rejection, or the bonus token when every
    verified draft token was accepted.  The engine then applies stop conditions (EOS, stop strings,
    token limits) to that sequence.
    """

    num_accepted: Tensor  # [R] int64, 0 ≤ n_r ≤ ℓ_r
    next_token: Tensor  # [R] int64
    # [R, G] int64 node indices of the accepted path of a *tree* draft (−1 past num_accepted);
    # None for a chain, whose accepted drafts are its first num_accepted slots.
    path: Tensor | None = None


@runtime_checkable
class Verifier(Protocol):
    """Accepts a prefix of each request's draft and emits one more token from the target.

    **Non-finite input.**  NaN or ±inf in a row the verifier uses — target logits rows 0..ℓ_r,
    draft probabilities of slots 0..ℓ_r−1, or a warped row that overflows — must raise
    :class:`specforge.sampling.NonFiniteError` with ``request`` (the batch row) and ``position``
    (the row index) of the first bad row; the engine then fails that request alone and verifies
    the rest.  The same garbage in rows past ℓ_r must be ignored (they are padding).
    :func:`specforge.sampling.check_logits` and :func:`~specforge.sampling.check_probs` do both.
    The conformance suite checks it (docs/conformance.md).

    **Declared per-position law (optional).**  A verifier whose rule is per position — accept draft
    x_k with some probability, else emit a sample of a residual law — may state that rule as two
    methods on warped laws (``p`` from :func:`specforge.sampling.warp` of the target logits, ``q``
    the draft law or ``None`` for one-hot, ``x`` the draft ids; leading dimensions broadcast):

    * ``accept_probability(p [..., V], q [..., V] | None, x [...]) -> [...]``;
    * ``residual(p, q, x) -> [..., V]``, the law of the emitted token given that x was rejected.

    The conformance suite then checks that the stated rule is lossless (exactly, on stress laws)
    and that ``verify`` realises it round by round (acceptance rates and the law of each emitted
    token), which detects much smaller mistakes than the law of the output alone.  Every shipped
    verifier states its rule (their common base class defines ``verify`` from the two methods).
    """

    def verify(
        self,
        target_logits: Tensor,
        draft_tokens: Tensor,
        draft_probs: Tensor | None,
        lengths: Tensor,
        sampling: SamplingParams,
        uniforms: Tensor,
    ) -> VerifyOutput:
        """Verify a batch whose requests check different numbers of tokens.

        A verifier that also verifies token trees takes a keyword ``parents`` (``[R, G]``, see
        :class:`DraftBlock`); row j + 1 of ``target_logits`` is then the target's law after
        node j's path, and it returns the accepted path in :attr:`VerifyOutput.path`.  The
        engine hands a tree only to a verifier whose ``verify`` has that parameter.

        Args:
            target_logits: ``[R, G+1, V]`` raw target logits; row ``j`` is the target's
                distribution for the token after x_0..x_j (so row ``ℓ_r`` is the bonus row).
                Rows past ``ℓ_r`` are ignored.
            draft_tokens: ``[R, G]`` x_1..x_G.
            draft_probs: ``[R, G, V]`` q, or ``None`` for deterministic (one-hot) drafts.
            lengths: ``[R]`` ℓ_r, the number of draft tokens to verify (0 ≤ ℓ_r ≤ G).
            sampling: per-request temperature / top-k / top-p for warping the target.
            uniforms: ``[R, G+1, 2]`` fresh U[0,1) numbers, one pair per position: ``[..., 0]``
                decides acceptance, ``[..., 1]`` drives sampling of an emitted token.
        """
        ...


@runtime_checkable
class Scheduler(Protocol):
    """Chooses how many drafted tokens of each request the target verifies this round.

    Optional lifecycle methods (module docstring): ``bind(target)``, e.g. to read the target's step
    curve on this machine; ``bind_draft_cost(measure)`` to be offered what drafting costs;
    ``draft_gate(num_requests) -> bool``, asked before each round is drafted — ``False`` runs the
    round plain.  The gate is called before anything of its round exists, so it can only depend on
    earlier rounds: it is causal whatever it does
    (docs/design/calibration-scheduling.md#what-drafting-costs-and-the-draft-gate).
    """

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        """Return ``[R]`` int64 verify lengths ℓ_r with 0 ≤ ℓ_r ≤ available_r.

        Args:
            confidence: ``[R, G]`` calibrated *pre-token* conditional survival estimates c_k:
                c_k may depend on x_<k but never on x_k (docs/design/verification.md#causality).
            available: ``[R]`` number of drafted tokens each request actually has.
        """
        ...


@dataclass(frozen=True)
class CalibrationData:
    """Held-out rounds for fitting a calibrator.

    Attributes:
        confidence: ``[N, G]`` raw conditional confidences c_k of N rounds.
        accepted: ``[N]`` accepted draft tokens per round (bonus excluded).
        verified: ``[N]`` verified draft tokens per round; positions past it are unobserved and
            are left out of every statistic.  Defaults to G (the whole block was verified).
    """

    confidence: Tensor
    accepted: Tensor
    verified: Tensor | None = None

    def verified_lengths(self) -> Tensor:
        if self.verified is not None:
            return self.verified
        n, g = self.confidence.shape
        return torch.full((n,), g, dtype=torch.long)


@dataclass(frozen=True)
class RoundOutcome:
    """What one verified chain round showed, for R' requests (those verified, in batch order).

    Attributes:
        request_ids: the requests.
        confidence: ``[R', G]`` the raw conditional confidences c_k of the round, before calibration.
        available: ``[R']`` drafted tokens per request.
        verified: ``[R']`` verified draft tokens ℓ (positions past it observed nothing).
        accepted: ``[R']`` accepted draft tokens n ≤ ℓ.
        temperature: ``[R']`` each request's sampling temperature.
    """

    request_ids: list[int]
    confidence: Tensor
    available: Tensor
    verified: Tensor
    accepted: Tensor
    temperature: Tensor

@runtime_checkable
class Calibrator(Protocol):
    """Maps raw confidences to calibrated ones; order-preserving at each position.

    Optional: ``observe(outcome: RoundOutcome)``, called by the engine after each verified chain
    round (never before its own round's scheduling), for a calibrator that keeps learning while
    serving.
    """

    def fit(self, data: CalibrationData) -> dict[str, Any]:
        """Fit on held-out rounds; return a report of metrics before and after."""
        ...

    def apply(self, confidence: Tensor) -> Tensor:
        """``[..., G]`` raw conditional confidences → calibrated ones, same shape."""
        ...

    def save(self, path: str) -> None:
        """Write fitted parameters (safetensors)."""
        ...

    def load(self, path: str) -> None:
        """Read parameters written by :meth:`save`."""
        ...


@runtime_checkable
class ConfidenceEstimator(Protocol):
    """Estimates c_k = P(x_k accepted | x_<k accepted) before x_k is known.

    Optional lifecycle methods (module docstring): ``bind(target)``,
    ``load_weights(weights: ComponentWeights)`` for a trained estimator, and
    ``share(correction_head)`` for one that reads the correction head's tables.
    """

    def estimate(self, block: DraftBlock) -> Tensor:
        """Return ``[R, G]`` values in (0, 1).  May read ``tokens[:, :k]``, ``probs[:, k]``,
        ``logits[:, k]`` and ``hidden[:, k]`` for position k, never ``tokens[:, k]``."""
        ...


@runtime_checkable
class CorrectionHead(Protocol):
    """Sequential (left-to-right) bias on a parallel drafter's logits.

    Optional lifecycle methods (module docstring): ``bind(target)`` and
    ``load_weights(weights: ComponentWeights)`` for a trained head.
    """

    def init_state(self, batch: int) -> Any:
        """Fresh per-block state for ``batch`` requests (``None`` when stateless)."""
        ...

    def step(
        self, logits: Tensor, prev_token: Tensor, hidden: Tensor | None, state: Any
    ) -> tuple[Tensor, Any]:
        """Bias the ``[R, V]`` logits of slot k given x_{k-1} (``[R]``) and h_k (``[R, d]``)."""
        ...


@dataclass(frozen=True)
class TargetFeatures:
    """Tapped target hidden states of the positions R requests committed since they last drafted.

    Flattened like the target's varlen pass (no padding): request r owns flat rows
    ``cu_seqlens[r] : cu_seqlens[r + 1]``, in position order.  Those rows are exactly the tokens
    the target's KV cache gained for that request — after admission, every prompt token but the
    anchor (positions ``0 … P−2``; none for a one-token prompt); after a verify pass, the previous
    anchor and the accepted drafts (``a … a+n``, where ``a`` is that anchor's position and ``n``
    the accepted count).  Positions of a request are therefore consecutive across rounds and end
    just before the current anchor, so a drafter that appends each round's rows to its own
    per-request context holds the features of every committed token strictly before x_0.

    Attributes:
        layers: the tapped target layers (the drafter's ``feature_layers``), 0-based; the output
            (residual stream) after each layer is what is tapped.
        states: ``[N, m, d]`` in the target's dtype; ``states[i, j]`` is layer ``layers[j]``'s
            output at flat row i, so ``states.flatten(1)`` is ``[H(l1); …; H(lm)]`` per row.
        positions: ``[N]`` int64 absolute position of each row.
        cu_seqlens: ``[R+1]`` int64 row boundaries per request (R = the context's requests).
    """

    layers: tuple[int, ...]
    states: Tensor
    positions: Tensor
    cu_seqlens: Tensor

    def request(self, r: int) -> tuple[Tensor, Tensor]:
        """``(positions [n_r], states [n_r, m, d])`` of request r (``n_r`` may be 0)."""
        lo, hi = int(self.cu_seqlens[r]), int(self.cu_seqlens[r + 1])
        return self.positions[lo:hi], self.states[lo:hi]


@dataclass(frozen=True)
class ComponentWeights:
    """Trained weights a drafter's checkpoint carries for another component of the round.

    Attributes:
        kind: the class the weights were trained as; the pipeline's component must be of it.
        state: its ``state_dict``.
        source: where they come from (the checkpoint directory), for messages.
    """

    kind: type
    state: dict[str, Tensor]
    source: str


@dataclass(frozen=True)
class DraftContext:
    """What the engine tells a drafter about the R requests it drafts for this round.

    Attributes:
        request_ids: stable ids, for drafters that keep per-request state.
        histories: each request's committed tokens (prompt and output), ending with the anchor
            x_0 — the last committed token, which the target has not consumed yet.
        max_tokens: ``[R]`` the most draft tokens worth proposing for each request (≤ γ; smaller
            near a token or context limit).  A drafter may propose fewer.  For a token tree it
            bounds the depth; the engine caps the node count by the room left in the cache.
        sampling: each request's temperature / top-k / top-p; a sampling drafter draws x_k from
            ``warp(logits_k, sampling)`` and reports that law as ``probs``.
        generators: one seeded generator per request for the drafter's own randomness.
        features: a :class:`TargetFeatures` with the layers the drafter asked for through
            ``feature_layers``, for the positions each request committed since its previous
            draft (the admission prefill, then each verify pass); ``None`` when it asked for none.
            The anchor x_0 is never among them: the target has not consumed it yet.
        correction_head: the pipeline's :class:`CorrectionHead` for a drafter that runs one in
            its sequential stage (``None`` when the pipeline has none).  It belongs to the
            engine: use it this round, do not keep it.
    """

    request_ids: list[int]
    histories: list[Tensor]
    max_tokens: Tensor
    sampling: SamplingParams
    generators: list[torch.Generator]
    features: TargetFeatures | None = None
    correction_head: Any = None

    def uniforms(self, count: int) -> Tensor:
        """``[R, count]`` float64 U[0, 1) numbers, each request from its own generator (see
        :func:`~specforge.sampling.draw_uniforms`): draw a fixed count per round, so that a seeded
        request's stream does not depend on its batch-mates."""
        return draw_uniforms(self.generators, count, width=1)[..., 0]

    @property
    def anchor(self) -> Tensor:
        return torch.stack([h[-1] for h in self.histories]) if self.histories else torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.request_ids)


@runtime_checkable
class Drafter(Protocol):
    """Proposes a block of up to γ draft tokens per request, with the law each was drawn from."""

    gamma: int
    #: target layers whose outputs the drafter consumes (empty for model-free drafters)
    feature_layers: tuple[int, ...]

    def bind(self, target: Any) -> None:
        """Called once with the target adapter before the first round (shared embeddings, vocab).
        ``feature_layers`` is read after this call, so a drafter may choose its layers from the
        target's depth here.

        What a drafter may read from ``target`` (a :class:`specforge.runtime.TargetModel`):
        ``vocab_size``, ``max_positions``, ``dtype``, ``eos_ids``, ``name``, ``args`` (the
        architecture: ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, …),
        ``runtime`` (the runtime transformer, for its frozen token embedding and LM head — share
        them, never train or modify them), ``hf_model`` (the float32 Hugging Face model, for
        oracles and tests; slow) and ``encode``/``decode``.  Nothing may be written to the
        target, and no forward pass of it belongs in ``bind``: the target's hidden states reach a
        drafter through ``feature_layers`` and :class:`DraftContext.features` only.

        A drafter whose checkpoint also holds trained weights of other components of the round (a
        correction head, a confidence head) may define ``companion_weights() -> dict[str,
        ComponentWeights]`` keyed by pipeline slot (``"correction_head"``, ``"confidence"``);
        the engine calls it after ``bind`` and loads them into those components (see the module
        docstring)."""
        ...

    def draft(self, ctx: DraftContext) -> DraftBlock:
        """Propose ``DraftBlock(tokens [R, G], lengths [R] ≤ ctx.max_tokens, probs or None)``."""
        ...

    def release(self, request_id: int) -> None:
        """Forget any state held for a finished request."""
        ...

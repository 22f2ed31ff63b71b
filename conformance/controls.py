"""Negative controls: deliberately lossy components that the conformance suite must reject.

None of them is reachable through an entry point; the suite registers this module by hand when it
proves its power (``specforge conformance --controls``)::

    host = PluginHost(autoload=False)
    host.add_plugin(specforge_conformance.controls, "controls")

Every control *claims* to be correct (a lossless verifier, a pre-token confidence) — the bug is in
the mechanism, where only the statistics can see it.  Each simulates a mistake that real
speculative-decoding code has made, and :data:`CONTROL_CASES` names the pipeline in which it is
run: the smallest one that contains the bug.  The *subtle* controls (:data:`SUBTLE`) are small
versions of plausible third-party bugs, one per bug class; each is run in the probe case of its
kind (:mod:`specforge_conformance.probes`) and :data:`CLAIMS` names the statistic meant to catch it.
The two that misroute per-request sampling settings (:data:`MIXED`) run in their kind's *mixed*
probe, whose batches hold requests at several settings: in a batch of one setting they are exact.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from specforge import hookimpl
from specforge.components import DraftBlock, VerifyOutput
from specforge.config import DEFAULT_COMPONENTS
from specforge.registry import ComponentKind
from specforge.sampling import SamplingParams, sample_with_uniform
from specforge.toolkit.admission import admission_path, global_count
from specforge.toolkit.verification import VerifyInputs, accepted_prefix, gather_at, prepare
from specforge_conformance.drafters import RandomDrafter, RandomDrafterConfig
from specforge_conformance.probes import NEAR_ONE
from specforge_conformance.tree_controls import TREE_CONTROLS, TreeWalkControl
from specforge_plugins.schedulers import HardwareConfig
from specforge_plugins.verifiers import RejectionConfig, RejectionVerifier

__all__ = [
    "CLAIMS",
    "CONTROL_CASES",
    "SUBTLE",
    "SUBTLE_PROBE",
    "BatchSharedVerifier",
    "BonusDroppedVerifier",
    "CoolDrafter",
    "MIXED",
    "NearOneVerifier",
    "OneRowSettingsVerifier",
    "OverAcceptVerifier",
    "PeekNextScheduler",
    "ResidualOffByOneVerifier",
    "BonusWrongRowVerifier",
    "GlobalSearchScheduler",
    "ResampleTargetVerifier",
    "SampledTokenConfidence",
    "SharedUniformVerifier",
    "SwappedSettingsVerifier",
    "WrongTemperatureDrafter",
]


# --- verifiers --------------------------------------------------------------------------------


class ResampleTargetVerifier(RejectionVerifier):
    """After a rejection, emits a fresh sample of p instead of norm(max(p − q, 0)).

    Tokens the drafter over-proposes are then emitted twice over: once when accepted and again
    from p after someone else's rejection.
    """

    control = ("resample-target", "samples p instead of the residual after a rejection")

    def residual(self, p: Tensor, q: Tensor | None, x: Tensor) -> Tensor:
        return p


class _RejectionMechanics(RejectionVerifier):
    """The rejection rule written out from the public building blocks of a verifier, so that
    controls can break one step of it."""

    def accept_uniforms(self, inputs: VerifyInputs) -> Tensor:
        return inputs.uniforms[:, : inputs.gamma, 0]

    def decide(self, u: Tensor, a: Tensor) -> Tensor:
        """Which drafts are accepted, given their uniforms and acceptance probabilities."""
        return u < a

    def emission(self, p: Tensor, inputs: VerifyInputs, n: Tensor) -> tuple[Tensor, Tensor]:
        """(accepted count, law of the emitted token) given the accepted prefix length ``n``."""
        rows = torch.arange(p.shape[0])
        law = p[rows, n]
        if inputs.gamma > 0:
            k = n.clamp(max=inputs.gamma - 1)
            q = None if inputs.probs is None else inputs.probs[rows, k]
            rejected = (n < inputs.lengths).unsqueeze(-1)
            law = torch.where(rejected, self.residual(law, q, inputs.tokens[rows, k]), law)
        return n, law

    def verify(self, target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, lengths: Tensor,
               sampling: SamplingParams, uniforms: Tensor) -> VerifyOutput:
        inputs = prepare(target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms)
        p = self.target_probs(inputs, sampling)
        g = inputs.gamma
        a = self.accept_probability(p[:, :g], inputs.probs, inputs.tokens)
        n = accepted_prefix(self.decide(self.accept_uniforms(inputs), a), inputs.valid)
        n, law = self.emission(p, inputs, n)
        return VerifyOutput(num_accepted=n, next_token=sample_with_uniform(law, self.emission_uniforms(inputs, n)))

    def emission_uniforms(self, inputs: VerifyInputs, n: Tensor) -> Tensor:
        """The uniform each request's emitted token is drawn with."""
        return inputs.uniforms[torch.arange(inputs.tokens.shape[0]), n, 1]


class SharedUniformVerifier(_RejectionMechanics):
    """Uses one uniform for every position of a block: acceptances become correlated (a request
    that accepted x_1 with a small u accepts x_2 too), so the joint law of the block is wrong even
    though each position's marginal acceptance probability is right."""

    control = ("shared-uniform", "one acceptance uniform for all positions of a block")

    def accept_uniforms(self, inputs: VerifyInputs) -> Tensor:
        return inputs.uniforms[:, :1, 0].expand(-1, inputs.gamma)


class BonusWrongRowVerifier(_RejectionMechanics):
    """When every verified draft is accepted, draws the bonus from row ℓ−1 (the law of x_ℓ)
    instead of row ℓ (the law after x_ℓ): an off-by-one in the flattened logits."""

    control = ("bonus-wrong-row", "bonus token from row ℓ−1 instead of ℓ")

    def emission(self, p: Tensor, inputs: VerifyInputs, n: Tensor) -> tuple[Tensor, Tensor]:
        n, law = super().emission(p, inputs, n)
        rows = torch.arange(p.shape[0])
        wrong = (n == inputs.lengths) & (n > 0)
        return n, torch.where(wrong.unsqueeze(-1), p[rows, (n - 1).clamp(min=0)], law)


class BonusDroppedVerifier(_RejectionMechanics):
    """Never emits a bonus: a fully accepted block gives back its last draft and ends with a
    residual draw at that position, as if it had been rejected."""

    control = ("bonus-dropped", "no bonus token; a full block ends with a residual draw")

    def emission(self, p: Tensor, inputs: VerifyInputs, n: Tensor) -> tuple[Tensor, Tensor]:
        full = (n == inputs.lengths) & (n > 0)
        n = torch.where(full, n - 1, n)
        rows = torch.arange(p.shape[0])
        _, law = super().emission(p, inputs, n)
        k = n.clamp(max=max(inputs.gamma - 1, 0))
        if inputs.gamma > 0:
            q = None if inputs.probs is None else inputs.probs[rows, k]
            dropped = self.residual(p[rows, n], q, inputs.tokens[rows, k])
            law = torch.where(full.unsqueeze(-1), dropped, law)
        return n, law


class ResidualOffByOneVerifier(_RejectionMechanics):
    """After a rejection at position k ≥ 2, builds the residual from the draft law of position
    k − 1: an off-by-one in a per-position loop over a flattened q."""

    control = ("residual-off-by-one", "residual after a rejection at k ≥ 2 built from q_{k-1}")

    def emission(self, p: Tensor, inputs: VerifyInputs, n: Tensor) -> tuple[Tensor, Tensor]:
        rows = torch.arange(p.shape[0])
        law = p[rows, n]
        if inputs.gamma > 0:
            k = n.clamp(max=inputs.gamma - 1)
            wrong = (k - 1).clamp(min=0)
            q = None if inputs.probs is None else inputs.probs[rows, wrong]
            rejected = (n < inputs.lengths).unsqueeze(-1)
            law = torch.where(rejected, self.residual(law, q, inputs.tokens[rows, k]), law)
        return n, law


class OverAcceptConfig(RejectionConfig):
    factor: float = Field(1.05, gt=1, description="acceptance ratio multiplied by this")


class OverAcceptVerifier(_RejectionMechanics):
    """Accepts with probability min(1, factor · p(x)/q(x)): u/factor is compared where u should
    be — e.g. a tolerance meant for float error put on the wrong side."""

    control = ("over-accept", "accepts with probability min(1, 1.05·p/q)")
    config_class = OverAcceptConfig

    def __init__(self, config: OverAcceptConfig | None = None) -> None:
        super().__init__(config or OverAcceptConfig())

    def accept_uniforms(self, inputs: VerifyInputs) -> Tensor:
        return inputs.uniforms[:, : inputs.gamma, 0] / self.config.factor


class NearOneConfig(RejectionConfig):
    tolerance: float = Field(0.05, gt=0, lt=1, description="drafts with p/q within this of 1 are accepted outright")


class NearOneVerifier(_RejectionMechanics):
    """Accepts every draft whose ratio p/q is within ``tolerance`` of 1 outright, and follows the
    rule elsewhere — "close enough to 1" written into the comparison, e.g. a tolerance meant for
    float error that is far too wide.  At p/q = 0.95 the draft is accepted with probability 1
    instead of 0.95: the acceptance rate just below 1 moves by up to 5 %, the law of the output
    by little, since such drafts are nearly always accepted anyway."""

    control = ("near-one", "accepts outright where p/q ≥ 0.95")
    config_class = NearOneConfig

    def __init__(self, config: NearOneConfig | None = None) -> None:
        super().__init__(config or NearOneConfig())

    def decide(self, u: Tensor, a: Tensor) -> Tensor:
        return (u < a) | (a >= 1 - self.config.tolerance)


class BatchSharedVerifier(_RejectionMechanics):
    """Draws request r's bonus token with request r + 1's first sampling uniform (an off-by-one in
    the row of a per-request stream): each request's own law is still exact, but neighbouring
    requests of a batch are no longer independent."""

    control = ("batch-shared", "request r's bonus token drawn with request r + 1's uniform")

    def emission_uniforms(self, inputs: VerifyInputs, n: Tensor) -> Tensor:
        rows = torch.arange(inputs.tokens.shape[0])
        own = inputs.uniforms[rows, n, 1]
        neighbour = inputs.uniforms[(rows + 1) % rows.numel(), 0, 1]
        return torch.where(n == inputs.lengths, neighbour, own)


class _MisroutedSettings(RejectionVerifier):
    """The shipped rejection rule handed the batch's per-request settings routed to the wrong
    rows (:meth:`route`) — the class of vllm#55005, where the settings of draft positions were
    never written and belonged to nobody.  Every row is still verified by a lossless rule, under
    settings that are some request's: only a batch whose rows differ shows it."""

    def route(self, rows: int) -> list[int]:
        """Whose settings each row of a batch of ``rows`` is warped with."""
        raise NotImplementedError

    def verify(self, target_logits, draft_tokens, draft_probs, lengths, sampling, uniforms, parents=None):
        return super().verify(target_logits, draft_tokens, draft_probs, lengths,
                              sampling.rows(self.route(len(sampling))), uniforms, parents)


class OneRowSettingsVerifier(_MisroutedSettings):
    """Warps every row with the first row's settings: one temperature, top-k and top-p for the
    whole batch, read from its first request (what an engine written for homogeneous batches
    does)."""

    control = ("one-row-settings", "warps every row with the settings of the batch's first row")

    def route(self, rows: int) -> list[int]:
        return [0] * rows


class SwappedSettingsVerifier(_MisroutedSettings):
    """Warps the batch's first two rows each with the other's settings (an off-by-one when a
    finished request's slot is refilled and the settings tensor is permuted apart from the
    logits); every other row is right."""

    control = ("swapped-settings", "warps rows 0 and 1 each with the other's settings")

    def route(self, rows: int) -> list[int]:
        return [1, 0, *range(2, rows)] if rows >= 2 else list(range(rows))


# --- drafters ---------------------------------------------------------------------------------


class WrongTemperatureConfig(RandomDrafterConfig):
    draw_temperature: float = Field(2.0, gt=0, description="temperature the tokens are really drawn at")


class WrongTemperatureDrafter(RandomDrafter):
    """Samples at one temperature and reports q at another (here: at 1): the verifier then
    corrects for the wrong proposal law."""

    def __init__(self, config: WrongTemperatureConfig | None = None) -> None:
        super().__init__(config or WrongTemperatureConfig())

    def draw_law(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits / self.config.draw_temperature, -1)


class CoolConfig(RandomDrafterConfig):
    cooling: float = Field(0.95, gt=0, description="the tokens are drawn at this times the temperature of q")


class CoolDrafter(RandomDrafter):
    """Draws at a slightly lower temperature than the law it reports (the classic "reported q ≠
    sampled q": e.g. a temperature applied before sampling and forgotten in the reported law)."""

    def __init__(self, config: CoolConfig | None = None) -> None:
        super().__init__(config or CoolConfig())

    def draw_law(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits / self.config.cooling, -1)


# --- confidence estimators --------------------------------------------------------------------


class SampledTokenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SampledTokenConfidence:
    """c_k = q_k(x_k), the draft probability of the token actually sampled.  It reads x_k, so a
    scheduler that stops on it verifies x_k more often when x_k is a likely draft — which biases
    the output toward the drafter."""

    def __init__(self, config: SampledTokenConfig | None = None) -> None:
        self.config = config

    def estimate(self, block: DraftBlock) -> Tensor:
        if block.probs is None:
            raise ValueError("sampled-q needs the draft law")
        return gather_at(block.probs, block.tokens).clamp(1e-6, 1 - 1e-6)


# --- schedulers -------------------------------------------------------------------------------


class GlobalSearchScheduler:
    """The retrospective scheduler of paper Appendix A: Algorithm 1 *without* the break.

    It walks the whole admission path of the current round and returns the arg-max of Θ.  Since
    c_{k+1} is computed from x_k, the decision to verify x_k then depends on x_k itself: tokens
    that lead to confident continuations are favoured.  With p = (0.7, 0.3), q = (0.5, 0.5) and
    SPS(1..3) = 1, 0.5, 0.45 the first output token follows (0.85, 0.15) instead of (0.7, 0.3).
    """

    def __init__(self, config: HardwareConfig) -> None:
        self.config = config
        self.profile = config.hardware_profile()

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        path = admission_path(confidence, available)
        return path.lengths(global_count(path.throughput(self.profile)))


class PeekNextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    theta: float = Field(0.5, ge=0, le=1)


class PeekNextScheduler:
    """Verifies the leading slots whose confidence, smoothed with the next slot's —
    (c_k + c_{k+1}) / 2 — is at least θ.  Smoothing reads like robustness, but for a sequential
    drafter c_{k+1} is computed from x_k, so slot k is verified depending on its own token."""

    def __init__(self, config: PeekNextConfig | None = None) -> None:
        self.config = config or PeekNextConfig()

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        r, g = confidence.shape
        k = torch.arange(g)[None, :]
        nxt = torch.minimum(k + 1, (available[:, None] - 1).clamp(min=0))
        smooth = (confidence + confidence.gather(1, nxt.expand(r, g))) / 2
        keep = (smooth >= self.config.theta) & (k < available[:, None])
        return torch.cumprod(keep.to(torch.long), 1).sum(1)


# --- the case each control runs in -----------------------------------------------------------

# Each entry: the pipeline (slot -> (name, params)) plus any Case settings that differ from the
# defaults (T = 1, vocabulary 16, batch 64).  The retrospective scheduler is global over the
# batch, so a request's own x_1 only sways its admission when it is alone: it runs at batch 1 on
# Appendix A's step curve, with confidences high enough that admitting two tokens can pay.
_PROBE = ("random", {"gamma": 3})
# The slots a control does not exercise hold their pipeline defaults.
_REST = {kind.value: (DEFAULT_COMPONENTS[kind], {}) for kind in (
    ComponentKind.CORRECTION_HEAD, ComponentKind.CONFIDENCE, ComponentKind.CALIBRATOR, ComponentKind.SCHEDULER)}

CONTROL_CASES: dict[str, dict] = {
    "resample-target": {"pipeline": {**_REST, "drafter": _PROBE, "verifier": ("resample-target", {})}},
    "wrong-temperature": {"pipeline": {**_REST, "drafter": ("wrong-temperature", {"gamma": 3}),
                                       "verifier": ("rejection", {})}},
    "bonus-wrong-row": {"pipeline": {**_REST, "drafter": ("shadow", {"gamma": 2}),
                                     "verifier": ("bonus-wrong-row", {})}},
    "bonus-dropped": {"pipeline": {**_REST, "drafter": ("shadow", {"gamma": 2}),
                                   "verifier": ("bonus-dropped", {})}},
    # Correlated acceptances only show where acceptance is neither rare nor certain: a small
    # vocabulary keeps the random probe in that range and the test's degrees of freedom low.
    "shared-uniform": {"pipeline": {**_REST, "drafter": _PROBE, "verifier": ("shared-uniform", {})}, "vocab": 8},
    "sampled-q": {"pipeline": {**_REST, "drafter": _PROBE, "confidence": ("sampled-q", {}),
                               "scheduler": ("threshold", {"theta": 0.3}), "verifier": ("rejection", {})}},
    "retrospective-global": {
        "pipeline": {**_REST, "drafter": ("random", {"gamma": 2, "sharpness": 3.0}),
                     "confidence": ("entropy", {"scale": 2.5}),
                     "scheduler": ("retrospective-global", {"sps": [1.0, 0.5, 0.45]}),
                     "verifier": ("rejection", {})},
        "batch": 1, "vocab": 8,
    },
    "typical": {"pipeline": {**_REST, "drafter": _PROBE, "verifier": ("typical", {})}, "vocab": 8},
    # Trees of three iid children each with two: siblings are rejected and subtrees exist.
    "tree-stale-residual": {"pipeline": {**_REST, "drafter": ("random-tree", {"branching": [3, 2], "sharpness": 0.5}),
                                         "verifier": ("tree-stale-residual", {})}, "vocab": 8},
    "tree-rejected-subtree": {"pipeline": {**_REST, "drafter": ("random-tree", {"branching": [3, 2], "sharpness": 0.5}),
                                           "verifier": ("tree-rejected-subtree", {})}, "vocab": 8},
}

# The subtle controls run in the probe case of the kind they belong to (probes.probe_cases), so
# that they prove the power of what the suite runs on a third party's component of that kind.
SUBTLE: dict[str, tuple[ComponentKind, dict]] = {
    "cool-drafter": (ComponentKind.DRAFTER, {"gamma": 3}),
    "residual-off-by-one": (ComponentKind.VERIFIER, {}),
    "over-accept": (ComponentKind.VERIFIER, {}),
    "near-one": (ComponentKind.VERIFIER, {}),
    "batch-shared": (ComponentKind.VERIFIER, {}),
    "peek-next": (ComponentKind.SCHEDULER, {"theta": 0.5}),
    # Tree walks: run in the verifier's tree probe (probes.probe_cases), the shipped walk with
    # the wrong randomness for some nodes, a rule off for late siblings, a residual half-updated.
    "tree-sibling-echo": (ComponentKind.VERIFIER, {}),
    "tree-late-sibling": (ComponentKind.VERIFIER, {}),
    "tree-leaky-residual": (ComponentKind.VERIFIER, {}),
    # Misrouted settings: run in the verifier's mixed probe (MIXED).
    "one-row-settings": (ComponentKind.VERIFIER, {}),
    "swapped-settings": (ComponentKind.VERIFIER, {}),
}
# A subtle control that runs in another probe case of its kind than the first: the drafter of that
# case (an error just below p/q = 1 lives where the tilted shadow puts its drafts).
SUBTLE_PROBE = {"near-one": NEAR_ONE}
# The subtle controls that run in the mixed probe of their kind (requests at several settings).
MIXED = frozenset({"one-row-settings", "swapped-settings"})
# The statistic each subtle control is meant to be caught by.
CLAIMS = {"cool-drafter": "draft law", "residual-off-by-one": "emission", "over-accept": "acceptance",
          "near-one": "acceptance",
          "batch-shared": "cross-request", "peek-next": "selection", "tree-sibling-echo": "acceptance",
          "tree-late-sibling": "acceptance", "tree-leaky-residual": "emission",
          "one-row-settings": "emission", "swapped-settings": "emission"}


# Each names itself and its bug (``control``), and its config where it has parameters.
_VERIFIERS = (ResampleTargetVerifier, SharedUniformVerifier, BonusWrongRowVerifier, BonusDroppedVerifier,
              ResidualOffByOneVerifier, OverAcceptVerifier, NearOneVerifier, BatchSharedVerifier,
              OneRowSettingsVerifier, SwappedSettingsVerifier, *TREE_CONTROLS)


@hookimpl
def specforge_register_verifiers(register):
    # every one claims to be lossless; the tree walks verify trees
    for cls in _VERIFIERS:
        name, bug = cls.control
        register(name, cls, config=getattr(cls, "config_class", RejectionConfig), lossless=True,
                 trees=issubclass(cls, TreeWalkControl), description=f"NEGATIVE CONTROL: {bug}")


@hookimpl
def specforge_register_drafters(register):
    register("wrong-temperature", WrongTemperatureDrafter, config=WrongTemperatureConfig,
             provides=("probs", "logits"),
             description="NEGATIVE CONTROL: samples at one temperature, reports q at another")
    register("cool-drafter", CoolDrafter, config=CoolConfig, provides=("probs", "logits"),
             description="NEGATIVE CONTROL: draws at 0.95 × the temperature of the q it reports")


@hookimpl
def specforge_register_confidence_estimators(register):
    register("sampled-q", SampledTokenConfidence, config=SampledTokenConfig, pre_token=True,
             needs_any=("probs",),
             description="NEGATIVE CONTROL: c_k = q(x_k) reads the sampled token")


@hookimpl
def specforge_register_schedulers(register):
    register("retrospective-global", GlobalSearchScheduler, config=HardwareConfig,
             reads=("confidence", "hardware_profile"),
             examples=({"sps": [1.0, 0.5, 0.45]}, {"sps": [1.0, 0.8, 0.6, 0.5, 0.42, 0.36, 0.3, 0.25]}),
             description="NEGATIVE CONTROL (lossy): Algorithm 1 without the early-stopping break")
    register("peek-next", PeekNextScheduler, config=PeekNextConfig, reads=("confidence",),
             description="NEGATIVE CONTROL: verifies slot k while (c_k + c_{k+1}) / 2 ≥ θ")

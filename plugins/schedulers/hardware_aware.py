"""Hardware-aware schedulers: ``hw-prefix`` (paper Algorithm 1) and ``async-topk`` (paper §5.2)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator
from torch import Tensor

from specforge.components import RoundOutcome
from specforge.hardware import DraftCost, HardwareProfile
from specforge.toolkit.admission import admission_path, causal_count, global_count, round_seconds
from specforge.toolkit.step_curve import machine_profile

__all__ = ["AsyncTopKConfig", "AsyncTopKScheduler", "HardwareConfig", "HwPrefixScheduler"]


class HardwareConfig(BaseModel):
    """Where the step curve SPS(B) comes from: inline values, a profile file, or ``auto`` (this
    machine's curve for the bound target, measured on first use and cached), exactly one."""

    model_config = ConfigDict(extra="forbid")
    sps: list[PositiveFloat] | None = Field(
        default=None, min_length=1, description="SPS(B) for B = 1, 2, ... (inline step curve)"
    )
    profile: Literal["auto"] | Path | None = Field(
        default=None, description="JSON hardware profile written by `specforge profile`, or 'auto': this "
                                  "machine's, measured once for the bound target and cached"
    )
    draft_cost: Literal["auto"] | NonNegativeFloat | None = Field(
        default=None, description="what drafting a round costs, in plain steps of the same requests (ρ): a number, "
                                  "'auto' (this pipeline's, measured by the engine on this machine once and cached), "
                                  "or null: 'auto' with profile: auto, else 0 (drafting hidden behind verification, "
                                  "the paper's rule)"
    )
    judge_after: PositiveInt = Field(
        default=64, description="request-rounds (requests × verified rounds) the engine must have reported before "
                                "the draft gate scales what rounds' confidences promise by how those promises held "
                                "(tokens committed ÷ tokens promised)"
    )
    probe_every: PositiveInt = Field(
        default=16, description="once drafting stopped paying at some load, rounds without drafting before one "
                                "round drafts again to look; doubled after each look that finds it still does not "
                                "pay, up to 16 times this"
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> HardwareConfig:
        if (self.sps is None) == (self.profile is None):
            raise ValueError("give exactly one of 'sps' (inline SPS(B) list) or 'profile' (JSON file)")
        return self

    def hardware_profile(self) -> HardwareProfile | None:
        """The step curve, or None for ``auto`` (known once the scheduler is bound to a target)."""
        if self.sps is not None:
            return HardwareProfile(self.sps, device="inline")
        assert self.profile is not None
        return None if self.profile == "auto" else HardwareProfile.load(self.profile)


class _HardwareAware:
    """The step curve of a hardware-aware scheduler (``auto`` is resolved at bind()), the drafting
    cost ρ(R), and the draft gate.

    **The gate.**  Where drafting is not free (ρ > 0, a CPU runs drafter and target one after the
    other), a round may cost more than it brings: at a load where the step curve leaves no room
    for drafts, the drafting alone makes speculation slower than plain decoding.  Before anything
    is drafted the engine asks :meth:`draft_gate`; the answer compares, over the last drafted
    rounds at about the same load (R in the same power-of-two band; max(4, ⌈256 / R⌉) rounds),
    the throughput of the rounds the scheduler chose (drafting included) with plain decoding's
    (a band not reached yet goes by the band above).  A round's throughput is the one its
    confidences promise, scaled by how the promises of recent rounds held: the engine reports
    each verified round (``observe``), and once those reports cover ``judge_after``
    request-rounds, the tokens the rounds committed over the tokens they promised scales every
    promise — so optimistic confidences (an n-gram match, a corpus share, a miscalibrated head)
    cannot keep the gate open where drafting loses, while the promises still follow each
    stretch of context.  Where drafting did not pay (the rounds' throughput below plain
    decoding's) the round runs plain, and after ``probe_every`` such rounds one drafts again to
    look — the wait doubling after every look that finds drafting still does not pay (up to
    16 × ``probe_every``), so a load where it never pays costs almost nothing in looks.  The
    gate reads only rounds already verified or scheduled — nothing of the round it decides
    exists yet — so it is causal (docs/design/verification.md#causality).
    """

    config: HardwareConfig
    profile: HardwareProfile | None
    # The gate weighs the last max(4, ⌈256 / R⌉) drafted rounds at R requests: one round of 64
    # requests says as much as 64 rounds of one, whose gain swings with its context — at one
    # request a shorter window follows one prompt's stretches and shuts the gate on a prompt that
    # has already finished (on the shipped drafter's recorded rounds, mean gain 1.00 at R = 1: 30 %
    # of 4-round windows fall below the bar, 6 % of 64-round ones, 2 % of 256-round ones).
    _GAIN_REQUEST_ROUNDS = 256
    # How the promises held is pooled over the last 1,024 request-rounds reported, every load
    # together.  Not the committed tokens alone in the window: a round's is all or nothing at one
    # request (no draft accepted: a gain of ≈ 0.7; three: ≈ 2), and a gate that judged those shut
    # on unlucky stretches of prompts that `composed` drafts at 1.2× (whole prompt sets plain).
    _HELD_REQUEST_ROUNDS = 1024
    # The gate closes where the chosen rounds' gain falls below 1 — where the model itself
    # expects drafting to lose.  No slack below 1: with the window above the mean is steady
    # enough, and the serving benchmark measured the slack's cost (at R = 2 the shipped drafter's
    # modelled gain sat at ≈ 0.96, the gate stayed open with a 0.95 bar, and the gated arms ran
    # at 0.92× plain decoding; docs/design/calibration-scheduling.md#what-drafting-costs-and-the-draft-gate).
    _CLOSE_BELOW = 1.0

    def _init_cost(self) -> None:
        cost = self.config.draft_cost
        self._auto_cost = cost == "auto" or (cost is None and self.config.profile == "auto")
        self.draft_cost: DraftCost | None = DraftCost(cost) if isinstance(cost, float) and cost > 0 else None
        # per load band (R.bit_length()): recent drafted rounds as (seconds plain decoding takes for
        # the tokens they promised, seconds they take), plain rounds since the last look, current wait
        self._rounds: dict[int, deque[tuple[float, float]]] = {}
        self._skipped: dict[int, int] = {}
        self._wait: dict[int, int] = {}
        # reported rounds as (R, tokens promised, tokens committed), their running sums, and the
        # round awaiting its report
        self._held: deque[tuple[int, float, int]] = deque()
        self._held_sums = [0, 0.0, 0]
        self._pending: tuple[int, float] | None = None

    def bind(self, target: Any) -> None:
        if self.profile is None:
            self.profile = machine_profile(target)
        elif isinstance(self.config.profile, Path):  # a file: measured for this target and dtype?
            self.profile.check_fits(str(target.name), target.precision_label, source=f"profile {self.config.profile}")

    def bind_draft_cost(self, measure: Callable[[], DraftCost]) -> None:
        """The engine offers this pipeline's drafting cost on this machine (measured once and
        cached); it is read only when ``draft_cost`` is ``auto``."""
        if self._auto_cost:
            self.draft_cost = measure()

    def _curve(self) -> HardwareProfile:
        if self.profile is None:
            raise RuntimeError("profile: auto needs the target's step curve: bind() the scheduler to a target first")
        return self.profile

    def _rho(self, num_requests: int) -> float:
        return 0.0 if self.draft_cost is None else self.draft_cost.ratio(num_requests)

    def draft_gate(self, num_requests: int) -> bool:
        """Whether this round drafts at all (see the class docstring)."""
        if not self._rho(num_requests):
            return True
        band = num_requests.bit_length()
        # A band without rounds of its own yet (a load reached as requests finish) goes by the
        # band above it: where drafting did not pay there, its first look waits `probe_every`
        # rounds instead of drafting at once in every band the falling load passes through.
        rounds = self._rounds.get(band) or self._rounds.get(band + 1)
        if not rounds or _gain(rounds) * self.promises_held() >= self._CLOSE_BELOW:
            self._wait.pop(band, None)
            return True
        wait = self._wait.setdefault(band, self.config.probe_every)
        skipped = self._skipped.get(band, 0) + 1
        if skipped <= wait:
            self._skipped[band] = skipped
            return False
        # Look again; if this look finds drafting still does not pay, wait twice as long.
        self._skipped[band] = 0
        self._wait[band] = min(2 * wait, 16 * self.config.probe_every)
        return True

    def promises_held(self) -> float:
        """Tokens the reported rounds committed over the tokens their confidences promised (1
        until the reports cover ``judge_after`` request-rounds)."""
        requests, promised, committed = self._held_sums
        return 1.0 if requests < self.config.judge_after else committed / promised

    def _admit(self, path: Any, n: int) -> Tensor:
        """Verify lengths of the first ``n`` candidates; note what the round promises over plain
        decoding (Θ_n ÷ R·SPS(R)) for the gate."""
        r = path.num_requests
        self._pending = None
        if r and self.draft_cost is not None:
            curve = self._curve()
            seconds = round_seconds(curve, r, n, self._rho(r))
            tokens = r + float(path.survival[:n].sum())  # τ_n: R plus the expected accepted drafts
            rounds = self._rounds.setdefault(r.bit_length(),
                                             deque(maxlen=max(4, -(-self._GAIN_REQUEST_ROUNDS // r))))
            rounds.append((tokens / (r * curve.sps(r)), seconds))
            self._pending = (r, tokens)
            if _gain([rounds[-1]]) * self.promises_held() > 1.0 and r.bit_length() in self._wait:
                self._wait[r.bit_length()] = self.config.probe_every  # a look that paid: look again soon
        return path.lengths(n)

    def observe(self, outcome: RoundOutcome) -> None:
        """How the scheduled round's promise held: the tokens it committed (R + accepted drafts)."""
        if self._pending is None:
            return
        (r, promised), self._pending = self._pending, None
        entry = (r, promised, r + int(outcome.accepted.sum()))
        self._held.append(entry)
        self._held_sums = [total + value for total, value in zip(self._held_sums, entry)]
        while self._held_sums[0] - self._held[0][0] >= self._HELD_REQUEST_ROUNDS:
            oldest = self._held.popleft()
            self._held_sums = [total - value for total, value in zip(self._held_sums, oldest)]

    def forget(self) -> None:
        """Forget the gate's history (between independent runs; :class:`specforge.protocols.Learns`)."""
        self._rounds.clear()
        self._skipped.clear()
        self._wait.clear()
        self._held.clear()
        self._held_sums = [0, 0.0, 0]
        self._pending = None


def _gain(rounds: Any) -> float:
    """Rounds' throughput over plain decoding's: the seconds plain decoding takes for the tokens
    they promise, over the seconds they take (a ratio of sums: a long round weighs as long as it runs)."""
    return sum(plain for plain, _ in rounds) / sum(seconds for _, seconds in rounds)


class HwPrefixScheduler(_HardwareAware):
    """Algorithm 1: admit candidates by decreasing survival while Θ = τ·SPS(B) strictly improves.

    The break at the first non-improvement is what keeps it lossless: whether (r, k) is admitted
    is decided by the path up to (r, k), and every candidate before it on the path has a survival
    that does not involve c_{r,k+1}, c_{r,k+2}, … — the only quantities x_{r,k} can influence.
    """

    def __init__(self, config: HardwareConfig) -> None:
        self.config = config
        self.profile = config.hardware_profile()
        self._init_cost()

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        path = admission_path(confidence, available)
        theta = path.throughput(self._curve(), self._rho(path.num_requests))
        return self._admit(path, causal_count(theta))


class AsyncTopKConfig(HardwareConfig):
    initial_capacity: int | None = Field(
        default=None,
        ge=0,
        description="draft tokens admitted per round before two rounds of history exist; "
        "null = every available token",
    )


class AsyncTopKScheduler(_HardwareAware):
    """The asynchronous scheduler of paper §5.2: a lagged capacity, filled by current rank.

    At call t the capacity K_t (draft tokens to verify, across the batch) is the arg-max of Θ over
    the *whole* admission path of call t−2 — an unconstrained global search, with no break, so it
    is not trapped by jagged SPS cliffs.  Call t then admits its own top-K_t candidates by
    *current* survival (ties by j, then r).  The first two calls, which have no t−2, use
    ``initial_capacity``.  K_t is computed when call t−2 runs, which is what lets a zero-overhead
    engine size the batch of step t before step t−1 finishes.

    Why this is causal although the search has no break: K_t depends only on confidences of an
    earlier round, which precede every draft token of round t.  Given K_t, position k of request r
    is admitted iff fewer than K_t candidates rank before (r, k); the candidates that rank before
    it are other requests' positions and r's own positions < k, because r's later positions have
    survival ≤ a_{r,k} and a larger j.  So nothing x_{r,k} influences (c_{r,k+1}, …) can change the
    decision, and ranking by a prefix product keeps the admitted set prefix-closed.

    The capacity counts draft tokens, not the flattened batch B = R + K, so it carries over
    unchanged when requests join or leave between rounds.  Call :meth:`forget` between
    independent runs.
    """

    def __init__(self, config: AsyncTopKConfig) -> None:
        self.config = config
        self.profile = config.hardware_profile()
        self._init_cost()
        self._ahead: deque[int] = deque()  # capacities computed by earlier calls, oldest first
        self.last_capacity: int | None = None  # the K used by the latest call (None = no cap)

    def forget(self) -> None:
        super().forget()
        self._ahead.clear()
        self.last_capacity = None

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        path = admission_path(confidence, available)
        capacity = self._ahead.popleft() if len(self._ahead) == 2 else self.config.initial_capacity
        theta = path.throughput(self._curve(), self._rho(path.num_requests))
        self._ahead.append(global_count(theta))
        self.last_capacity = capacity
        n = len(path) if capacity is None else min(capacity, len(path))
        return self._admit(path, n)

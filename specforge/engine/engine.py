"""The decoding engine: continuous batching of speculative rounds over one flattened target pass.

Invariant for every active request: the KV cache holds all committed tokens but the last one, the
anchor x_0.  A round feeds ``[x_0, x_1 … x_ℓ]`` of every request in one varlen pass; row j of a
request's logits is the target's distribution after x_j, exactly what the verifier needs.  After
verification the cache keeps x_0 and the accepted drafts (moving the length back is the rollback),
and the emitted correction/bonus token becomes the new anchor.  Plain decoding is the same round
with no drafter (ℓ = 0).

A drafter may propose a token *tree* instead of a chain (``DraftBlock.parents``): the round then
feeds ``[x_0, node_1 … node_ℓ]`` as one tree pass (each node sees its ancestors, at RoPE position
anchor + depth), the verifier returns the accepted path, and the rollback moves that path's K/V to
the consecutive positions after the anchor before the cache length is set.

A drafter that declares ``feature_layers`` (DSpark, DFlash, Eagle3) gets the target's hidden
states at those layers for exactly the positions each pass commits to the cache (the prefill's
prompt tokens, then the anchor and accepted drafts of each verify pass), through
``DraftContext.features``; the taps are requested only then, so other pipelines pay nothing.

A newly admitted prompt (all of it but the anchor) is prefilled in chunks of
``engine.prefill_chunk`` tokens (each waiting prompt its own) that ride along in the decoding
requests' pass, as extra runs after theirs that need no logits (chunked prefill): a long prompt
costs the batch a little more per round for a few rounds instead of one long stall.  When
nothing is decoding, the waiting prompts are prefilled whole in one pass and decode in the same
step; a tree round (whose runs are at most 64 tokens) prefills its chunks in a pass of their
own.  A request decodes from the round after its last chunk.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specforge.components import DraftBlock, DraftContext, RoundOutcome, TargetFeatures, Verifier
from specforge.config import EngineConfig, PipelineConfig, SamplingConfig
from specforge.engine.bind import bind_components, check_calibrator, drafter_needs, feature_taps
from specforge.engine.draft_cost import machine_draft_cost
from specforge.engine.request import (
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestStats,
    StreamEvent,
)
from specforge.engine.stops import apply_token_stops, find_stop_string, stop_prefix_length
from specforge.errors import ConfigError
from specforge.machine import GiB, memory_available
from specforge.protocols import DraftCostAware, DraftGate, ObservesRounds
from specforge.registry import ComponentKind
from specforge.sampling import NonFiniteError, SamplingParams, draw_uniforms, sampling_problem
from specforge.passes import VarlenBatch
from specforge.runtime import Needs, TargetModel, load_target

__all__ = ["Engine"]


@dataclass
class _Active:
    """Book-keeping of one admitted request."""

    request_id: int
    slot: int
    history: list[int]  # prompt + output; history[-1] is the anchor
    prompt_len: int
    prefilled: int  # positions of the prompt already in the cache (decoding once it is prompt_len - 1)
    max_new_tokens: int
    sampling: tuple[float, int, float]
    generator: torch.Generator
    stops: tuple[str, ...]
    eos_ids: frozenset[int]
    stats: RequestStats
    text: str = ""
    finish_reason: str | None = None
    pending_text: list[int] = field(default_factory=list)
    # Target taps of the committed positions not yet handed to the drafter: (positions, [n, m, d])
    # chunks, one per round since its last draft, concatenated once when it next drafts.
    features: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.history[self.prompt_len :]


class Engine:
    """Runs requests through draft → confidence → calibrate → schedule → verify → commit."""

    def __init__(
        self,
        target: TargetModel,
        verifier: Verifier,
        *,
        drafter=None,
        correction_head=None,
        confidence=None,
        calibrator=None,
        scheduler=None,
        sampling: SamplingConfig | None = None,
        engine: EngineConfig | None = None,
        trees: bool = False,
        bound: bool = False,
    ) -> None:
        """``trees``: the verifier verifies token trees too (its registration's ``trees``,
        :class:`specforge.registry.VerifierMeta`; :meth:`from_pipeline` reads it).  ``bound``: the
        components are already bound to ``target`` by another engine (lifecycle steps 1–2), as
        for the engine of its own a drafting-cost measurement runs (:mod:`.draft_cost`)."""
        self.target = target
        self.verifier = verifier
        self.drafter = drafter
        self.correction_head = correction_head
        self.confidence = confidence
        self.calibrator = calibrator
        self.scheduler = scheduler
        self.trees = trees
        self.defaults = sampling or SamplingConfig()
        self.config = engine or EngineConfig()
        self.context_limit = min(self.config.max_context, target.max_positions)
        self.taps: tuple[int, ...] = ()  # target layers tapped for the drafter on committing passes
        if drafter is not None:
            for name, part in (("confidence", confidence), ("calibrator", calibrator), ("scheduler", scheduler)):
                if part is None:
                    raise ValueError(f"a drafter needs a {name}")
            parts = {"drafter": drafter, "correction_head": correction_head, "confidence": confidence,
                     "calibrator": calibrator, "scheduler": scheduler, "verifier": verifier}
            self.taps = feature_taps(drafter, target) if bound else bind_components(target, parts)
        # After the taps are known, before a cache is allocated: a backend decided without them
        # (load_target(needs=…) not told) that cannot extract them says so here.
        target.require(Needs(self.taps))
        _check_cache_fits(target, self.config.max_batch, self.context_limit)
        self.cache = target.new_cache(self.config.max_batch, self.context_limit)
        self._queue: deque[tuple[int, GenerationRequest]] = deque()
        self._active: list[_Active] = []  # decoding
        self._prefilling: list[_Active] = []  # admitted, part of the prompt not yet in the cache
        self.prefill_chunk = _prefill_chunk(self.config.prefill_chunk, target)
        self._outputs: dict[int, RequestOutput] = {}
        # Whether each round's events carry their text delta.  ``generate`` turns it off: nobody
        # reads the deltas there, and decoding the whole output every round costs O(length²).
        self._text_deltas = True
        self._next_id = 0
        # Wall time per phase of the rounds run so far (seconds), for latency breakdowns: draft
        # (drafter, confidence, calibrator, scheduler), target (the flattened pass), verify, commit;
        # ``draft`` is further split into drafter, confidence (with the calibrator) and scheduler,
        # which are not counted again in the shares.
        self.phase_seconds: dict[str, float] = dict.fromkeys(("draft", "target", "verify", "commit"), 0.0)
        self.draft_seconds: dict[str, float] = dict.fromkeys(("drafter", "confidence", "scheduler"), 0.0)
        # Callables given each verified chain round's RoundOutcome, after the calibrator's
        # ``observe`` (e.g. ``specforge calibrate``'s recorder).
        self.round_observers: list[Any] = []
        self._raw_confidence: Tensor | None = None  # the current round's, for its outcome
        self.plain_rounds = 0  # rounds a drafting pipeline ran without drafting (the scheduler's draft gate)
        if drafter is not None and not bound and isinstance(scheduler, DraftCostAware):
            # Last, on the finished engine: the measurement runs on an engine of its own.
            scheduler.bind_draft_cost(functools.partial(machine_draft_cost, self))

    @classmethod
    def from_pipeline(cls, pipeline: PipelineConfig, target: TargetModel | None = None,
                      requests: int | None = None) -> Engine:
        """Build the target (unless given) and every component a validated pipeline names;
        ``requests``, the load the caller serves (1: one prompt at a time), decides ``auto``'s
        backend with the drafter's taps."""
        parts = {kind: (spec.create() if spec is not None else None) for kind, spec in pipeline.components.items()}
        drafter = parts[ComponentKind.DRAFTER]
        target = target or load_target(pipeline.target, needs=drafter_needs(drafter, requests))
        if drafter is not None:
            check_calibrator(parts[ComponentKind.CALIBRATOR], pipeline, drafter)
        return cls(
            target,
            parts[ComponentKind.VERIFIER],
            drafter=drafter,
            correction_head=parts[ComponentKind.CORRECTION_HEAD],
            confidence=parts[ComponentKind.CONFIDENCE] if drafter is not None else None,
            calibrator=parts[ComponentKind.CALIBRATOR] if drafter is not None else None,
            scheduler=parts[ComponentKind.SCHEDULER] if drafter is not None else None,
            sampling=pipeline.sampling,
            engine=pipeline.engine,
            trees=pipeline.component("verifier").registration.metadata.trees,
        )

    # -- submission ------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> int:
        rid = request.request_id if request.request_id is not None else self._next_id
        self._next_id = max(self._next_id, rid) + 1
        self._queue.append((rid, request))
        return rid

    @property
    def active(self) -> tuple[_Active, ...]:
        """The admitted, unfinished requests (id, cache slot, history, stats), read-only: for tools
        that inspect the engine between rounds, such as the conformance suite's rollback check."""
        return tuple(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._active or self._prefilling)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            ids = [int(i) for i in request.prompt_ids]
        elif request.prompt is not None:
            ids = self.target.encode(request.prompt, chat=request.chat)
        else:
            raise ValueError("a request needs a prompt or prompt_ids")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.context_limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context limit is {self.context_limit} "
                "(prompt plus at least one new token)"
            )
        return ids

    def _admit(self, rid: int, request: GenerationRequest) -> _Active:
        d = self.defaults
        ids = self._prompt_ids(request)
        sampling = (
            d.temperature if request.temperature is None else float(request.temperature),
            d.top_k if request.top_k is None else int(request.top_k),
            d.top_p if request.top_p is None else float(request.top_p),
        )
        problem = sampling_problem(*sampling)
        if problem:
            raise ValueError(f"request {rid}: {problem}")
        seed = d.seed + rid if request.seed is None else int(request.seed)
        max_new = d.max_new_tokens if request.max_new_tokens is None else int(request.max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new}")
        slot = self.cache.allocate()
        return _Active(
            request_id=rid, slot=slot, history=ids, prompt_len=len(ids), prefilled=0, max_new_tokens=max_new,
            sampling=sampling, generator=torch.Generator().manual_seed(seed),
            stops=tuple(request.stop), eos_ids=frozenset() if request.ignore_eos else self.target.eos_ids,
            stats=RequestStats(prompt_tokens=len(ids), started=time.perf_counter()),
        )

    def _admit_waiting(self) -> list[StreamEvent]:
        events = []
        while self._queue and self.cache.free_slots:
            rid, request = self._queue.popleft()
            try:
                state = self._admit(rid, request)
            except ValueError as exc:  # this request only: the others go on
                events.append(self._fail(rid, [], str(exc)))
                continue
            # A one-token prompt is its own anchor: nothing to prefill.
            (self._prefilling if len(state.history) > 1 else self._active).append(state)
        return events

    def _prefill_chunks(self, per_prompt: float) -> list[tuple[_Active, int, int]]:
        """The prompt spans ``(state, lo, hi)`` of the next prefill: up to ``per_prompt`` tokens of
        every waiting prompt.  Per prompt, not shared: a shared budget let a burst of prompts (slots
        freed together) trickle in over dozens of rounds with their slots idle — at 64 slots a
        gate-closed speculative engine, whose few drafted rounds had freed slots a round apart,
        ran 174 rounds for plain decoding's 128 (0.95× its tokens/s); one long prompt still adds at
        most one chunk to a round."""
        return [(s, s.prefilled, s.prefilled + int(min(s.prompt_len - 1 - s.prefilled, per_prompt)))
                for s in self._prefilling]

    def _prefill(self, chunks: list[tuple[_Active, int, int]]) -> None:
        """A pass of prompt chunks alone (no logits)."""
        batch = VarlenBatch.build([s.history[lo:hi] for s, lo, hi in chunks], [s.slot for s, _, _ in chunks],
                                  [lo for _, lo, _ in chunks])
        out = self.target.forward(batch, self.cache, taps=self.taps)
        self._prefilled(chunks, batch, out.taps, 0)

    def _prefilled(self, chunks: list[tuple[_Active, int, int]], batch: VarlenBatch, taps: dict[int, Tensor],
                   first: int) -> None:
        """Book the chunks a pass wrote (runs ``first``, ``first + 1``, … of ``batch``): their
        positions join the cache, their taps the drafter's pending features, and a request whose
        prompt is now cached but for its anchor starts decoding."""
        states = _stack_taps(taps, self.taps) if self.taps else None
        for i, (s, lo, hi) in enumerate(chunks):
            self.cache.advance(s.slot, hi)
            s.prefilled = hi
            if states is not None:  # every prompt row stays in the cache
                a, b = int(batch.cu_seqlens[first + i]), int(batch.cu_seqlens[first + i + 1])
                s.features.append((batch.positions[a:b], states[a:b]))
            if hi == s.prompt_len - 1:
                self._prefilling.remove(s)
                self._active.append(s)

    # -- one round -------------------------------------------------------------------------------

    def step(self) -> list[StreamEvent]:
        """Admit what fits, then run one round for every active request."""
        events = self._admit_waiting()
        if not self._active and self._prefilling:  # nothing decoding to stall: every waiting prompt whole
            self._prefill(self._prefill_chunks(math.inf))
        if not self._active:
            return events
        states = list(self._active)
        sampling = SamplingParams.stack([s.sampling for s in states])
        clock = time.perf_counter()
        block, lengths = self._draft(states, sampling)
        clock = self._lap("draft", clock)
        g = int(lengths.max()) if len(states) else 0
        # Python lists once per round, not a tensor slice and .tolist() per request (at R = 256
        # of a tiny model those were a tenth of a round).
        lens = lengths.tolist()
        if g:
            drafted = block.tokens[:, :g].tolist()
            runs = [[s.history[-1], *drafted[r][:lens[r]]] for r, s in enumerate(states)]
        else:
            drafted = [[] for _ in states]
            runs = [[s.history[-1]] for s in states]
        parents = block.parents
        if parents is not None:
            if not self.trees:
                raise ConfigError([f"the drafter proposes token trees; the verifier {type(self.verifier).__name__} "
                                   "verifies chains only (it is not registered with trees=True)"])
            parents = parents[:, :g].to(torch.long)
            run_parents = [[-1, *(parents[r, : int(lengths[r])] + 1).tolist()] for r in range(len(states))]
        chunks = self._prefill_chunks(self.prefill_chunk)
        # A tree pass's runs hold at most 64 tokens; `off` prefills whole prompts on their own.
        if chunks and (parents is not None or math.isinf(self.prefill_chunk)):
            self._prefill(chunks)
            chunks = []
        batch = VarlenBatch.build(runs + [s.history[lo:hi] for s, lo, hi in chunks],
                                  [s.slot for s in states] + [s.slot for s, _, _ in chunks],
                                  [len(s.history) - 1 for s in states] + [lo for _, lo, _ in chunks],
                                  parents=None if parents is None else run_parents)
        # Row j of request r lives at flat index cu[r] + j; pad rows past ℓ_r repeat its last row
        # (the prefill chunks' runs come after every request's and need no logits).
        # The logits come back in [R, γ+1] order, each distinct row projected once (the target
        # gathers the repeats), and plain decoding projects just R rows.
        offsets = torch.minimum(torch.arange(g + 1)[None, :], lengths[:, None])
        rows = (batch.cu_seqlens[:len(states), None] + offsets).reshape(-1)
        out = self.target.forward(batch, self.cache, logits_rows=rows, taps=self.taps)
        logits = out.logits.view(len(states), g + 1, -1)
        if chunks:
            self._prefilled(chunks, batch, out.taps, len(states))
        clock = self._lap("target", clock)
        uniforms = self._uniforms(states, lengths, g)
        tokens = block.tokens[:, :g]
        probs = None if block.probs is None else block.probs[:, :g]
        keep = list(range(len(states)))
        while True:
            # The [R, γ+1, V] tensors are indexed only once a request has been dropped:
            # logits[keep] would copy all of the round's logits just to select every row.
            whole = len(keep) == len(states)
            try:
                tree = {} if parents is None else {"parents": parents[keep]}
                result = self.verifier.verify(logits if whole else logits[keep], tokens[keep],
                                              None if probs is None else (probs if whole else probs[keep]),
                                              lengths[keep], sampling.rows(keep), uniforms[keep], **tree)
                break
            except NonFiniteError as exc:  # drop the offending request, verify the rest
                bad = keep[exc.request] if exc.request is not None else None
                if bad is None:
                    raise
                events.append(self._finish(states[bad], FinishReason.ERROR, str(exc)))
                keep.remove(bad)
                if not keep:
                    return events
        clock = self._lap("verify", clock)
        # The run rows each request keeps: its anchor, then the accepted drafts — the first n of
        # a chain, the path's nodes of a tree (whose K/V move to the positions after the anchor).
        accepted = result.num_accepted.tolist()
        kept_rows = [list(range(n + 1)) for n in accepted]
        drafts = [drafted[r][:accepted[i]] for i, r in enumerate(keep)]
        if parents is not None:
            paths = result.path.tolist()
            for i, r in enumerate(keep):
                path = paths[i][:accepted[i]]
                kept_rows[i] = [0, *(j + 1 for j in path)]
                drafts[i] = [drafted[r][j] for j in path]
                start = len(states[r].history) - 1
                self.cache.compact(states[r].slot, [start + j for j in kept_rows[i]], start)
        if self.taps:
            self._keep_features(states, keep, kept_rows, batch, out.taps)
        if parents is None and self._raw_confidence is not None:
            self._observe(states, keep, block, lengths, result.num_accepted, sampling)
        offered, bonus = block.lengths.tolist(), result.next_token.tolist()
        for i, r in enumerate(keep):
            events.append(self._commit(states[r], drafts[i], lens[r], offered[r], accepted[i], bonus[i]))
        self._lap("commit", clock)
        return events

    def reset_clocks(self) -> None:
        """Zero the phase clocks and the draft gate's plain-round counter (a benchmark measuring
        from here, or after a measurement of its own)."""
        for book in (self.phase_seconds, self.draft_seconds):
            book.update(dict.fromkeys(book, 0.0))
        self.plain_rounds = 0

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        book = self.phase_seconds if phase in self.phase_seconds else self.draft_seconds
        book[phase] += now - since
        return now

    def _draft(self, states: list[_Active], sampling: SamplingParams) -> tuple[DraftBlock, Tensor]:
        r = len(states)
        self._raw_confidence = None
        if self.drafter is None or (isinstance(self.scheduler, DraftGate) and not self.scheduler.draft_gate(r)):
            # No drafter, or a scheduler that knows before drafting that this round would not pay
            # for its drafts: a plain round (the committed features wait for the next draft).
            self.plain_rounds += self.drafter is not None
            empty = DraftBlock(tokens=torch.zeros(r, 0, dtype=torch.long), lengths=torch.zeros(r, dtype=torch.long))
            return empty, empty.lengths
        room = [min(self.drafter.gamma, s.max_new_tokens - len(s.output) - 1,
                    self.context_limit - len(s.history) - 1) for s in states]
        ctx = DraftContext(
            request_ids=[s.request_id for s in states],
            histories=[torch.tensor(s.history, dtype=torch.long) for s in states],
            max_tokens=torch.tensor([max(0, m) for m in room], dtype=torch.long),
            sampling=sampling,
            generators=[s.generator for s in states],
            features=self._pending_features(states) if self.taps else None,
            correction_head=self.correction_head,
        )
        clock = time.perf_counter()
        block = self.drafter.draft(ctx)
        clock = self._lap("drafter", clock)
        if block.parents is None:
            block_lengths = torch.minimum(block.lengths.to(torch.long), ctx.max_tokens)
        else:  # a tree: max_tokens bounds its depth (a deeper path is cut by the commit's token
            # limit); its node count only has to fit the cache behind the anchor
            cache_room = torch.tensor([self.context_limit - len(s.history) for s in states], dtype=torch.long)
            block_lengths = torch.minimum(block.lengths.to(torch.long), cache_room.clamp_min(0))
        if block.tokens.shape[1] == 0:
            return block, block_lengths
        raw = self._raw_confidence = self.confidence.estimate(block)
        confidence = self.calibrator.apply(raw)
        clock = self._lap("confidence", clock)
        lengths = self.scheduler.schedule(confidence, block_lengths)
        self._lap("scheduler", clock)
        return block, torch.minimum(lengths.to(torch.long), block_lengths)

    def _observe(self, states: list[_Active], keep: list[int], block: DraftBlock, lengths: Tensor, accepted: Tensor,
                 sampling: SamplingParams) -> None:
        """Tell the calibrator and the scheduler (``observe``) and the round observers what the
        verified round showed."""
        observers = [part.observe for part in (self.calibrator, self.scheduler) if isinstance(part, ObservesRounds)]
        observers += self.round_observers
        if not observers:
            return
        index = torch.tensor(keep, dtype=torch.long)
        available = block.lengths.to(torch.long).clamp(max=self._raw_confidence.shape[1])[index]
        outcome = RoundOutcome(request_ids=[states[r].request_id for r in keep],
                               confidence=self._raw_confidence[index].detach(), available=available,
                               verified=lengths[index].to(torch.long), accepted=accepted.to(torch.long),
                               temperature=sampling.temperature[index])
        for observer in observers:
            observer(outcome)

    def _pending_features(self, states: list[_Active]) -> TargetFeatures:
        """Hand over (and forget) what each request committed since its previous draft."""
        empty_pos = torch.zeros(0, dtype=torch.long)
        empty = torch.zeros(0, len(self.taps), self.target.args.dim, dtype=self.target.dtype)
        positions, rows = [], []
        for s in states:
            chunks = s.features or [(empty_pos, empty)]
            positions.append(torch.cat([p for p, _ in chunks]) if len(chunks) > 1 else chunks[0][0])
            rows.append(torch.cat([t for _, t in chunks]) if len(chunks) > 1 else chunks[0][1])
            s.features = []
        cu = torch.zeros(len(states) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor([len(p) for p in positions], dtype=torch.long), 0)
        return TargetFeatures(self.taps, torch.cat(rows), torch.cat(positions), cu)

    def _keep_features(self, states: list[_Active], keep: list[int], kept_rows: list[list[int]], batch: VarlenBatch,
                       taps: dict[int, Tensor]) -> None:
        """Store the taps of the rows the cache keeps: each request's anchor and accepted drafts
        (``kept_rows[i]``: run indices of request ``keep[i]``), at the positions they now hold."""
        counts = torch.tensor([len(k) for k in kept_rows], dtype=torch.long)
        offset = torch.tensor([j for k in kept_rows for j in k], dtype=torch.long)
        rows = torch.repeat_interleave(batch.cu_seqlens[keep], counts) + offset
        kept = _stack_taps({i: taps[i][rows] for i in self.taps}, self.taps)
        before = torch.cumsum(counts, 0) - counts
        positions = torch.repeat_interleave(batch.start_pos[keep], counts) + torch.arange(int(counts.sum())) \
            - torch.repeat_interleave(before, counts)
        lo = 0
        for r, n in zip(keep, counts.tolist()):
            # appended: a round that did not draft left its own chunk here for the next draft
            states[r].features.append((positions[lo:lo + n], kept[lo:lo + n]))
            lo += n

    @staticmethod
    def _uniforms(states: list[_Active], lengths: Tensor, g: int) -> Tensor:
        # Exactly ℓ_r + 1 pairs per request from its own generator, so a seeded request's stream
        # does not depend on how long its batch-mates' blocks are.
        out = torch.zeros(len(states), g + 1, 2, dtype=torch.float64)
        drawn = draw_uniforms([s.generator for s in states], (lengths.to(torch.long) + 1).tolist())
        out[:, :drawn.shape[1]] = drawn
        return out

    def _commit(self, s: _Active, drafts: list[int], verified: int, drafted: int, accepted: int,
                next_token: int) -> StreamEvent:
        start = len(s.history) - 1  # the anchor's position
        # Keep the anchor and the accepted drafts; everything the pass wrote past them is dropped.
        self.cache.advance(s.slot, start + 1 + accepted)
        s.stats.record_round(verified, accepted, drafted)
        proposed = [*drafts[:accepted], next_token]
        remaining = s.max_new_tokens - len(s.output)
        room = self.context_limit - len(s.history)
        kept, reason = apply_token_stops(proposed, s.eos_ids, remaining, room)
        before = len(s.output)
        s.history.extend(kept)
        s.stats.emitted = len(s.output)
        if s.stats.first_token is None and kept:
            s.stats.first_token = time.perf_counter()
        text_cut = None
        if s.stops:
            hit = find_stop_string(s.output, s.stops, self.target.decode, before)
            if hit is not None:
                n_keep, text_cut = hit
                del s.history[s.prompt_len + n_keep :]
                s.stats.emitted = len(s.output)
                reason = FinishReason.STOP
        new_ids = tuple(s.output[before:])
        if reason is None and not self._text_deltas:
            return StreamEvent(s.request_id, new_ids, "")  # the text is decoded once, at the end
        text = self.target.decode(s.output)
        if text_cut is not None:
            text = text[:text_cut]
        # Hold back a trailing partial character until the bytes that complete it arrive, and a
        # tail that may begin a stop string until the round that completes or breaks it.
        stable = text if reason is not None else text.rstrip("\ufffd")
        if reason is None and s.stops:
            stable = stable[: len(stable) - stop_prefix_length(stable, s.stops)]
        delta, s.text = stable[len(s.text):], stable
        if reason is not None:
            return self._finish(s, reason, None, new_ids, delta)
        return StreamEvent(s.request_id, new_ids, delta)

    def _finish(self, s: _Active, reason: str, error: str | None, new_ids: tuple[int, ...] = (),
                delta: str = "") -> StreamEvent:
        s.finish_reason = reason
        s.stats.finished = time.perf_counter()
        if error is not None and not self._text_deltas:  # the text streaming would have shown so far
            s.text = self.target.decode(s.output).rstrip("\ufffd")
        self._active.remove(s)
        self.cache.free(s.slot)
        if self.drafter is not None:
            self.drafter.release(s.request_id)
        self._outputs[s.request_id] = RequestOutput(
            s.request_id, s.history[: s.prompt_len], list(s.output), s.text, reason, s.stats, error
        )
        return StreamEvent(s.request_id, new_ids, delta, True, reason, error)

    def _fail(self, rid: int, prompt: list[int], error: str) -> StreamEvent:
        self._outputs[rid] = RequestOutput(rid, prompt, [], "", FinishReason.ERROR, RequestStats(), error)
        return StreamEvent(rid, (), "", True, FinishReason.ERROR, error)

    # -- driving ---------------------------------------------------------------------------------

    def stream(self, requests: Iterable[GenerationRequest]) -> Iterator[StreamEvent]:
        """Submit ``requests`` and yield events until every request has finished."""
        for request in requests:
            self.submit(request)
        while self.busy:
            yield from self.step()

    def generate(self, requests: Iterable[GenerationRequest]) -> list[RequestOutput]:
        """Run to completion; outputs in submission order."""
        ids = [self.submit(r) for r in requests]
        self._text_deltas = False
        try:
            for _ in self.stream(()):
                pass
        finally:
            self._text_deltas = True
        return [self._outputs.pop(i) for i in ids]

    def output(self, request_id: int) -> RequestOutput:
        return self._outputs[request_id]

    def take_output(self, request_id: int) -> RequestOutput:
        """Return a finished request's output and forget it (long-running drivers that stream
        many requests would otherwise keep every output in memory)."""
        return self._outputs.pop(request_id)


def _prefill_chunk(setting: int | str, target: TargetModel) -> float:
    """``engine.prefill_chunk`` in tokens (``off``: unbounded, each prompt whole)."""
    if setting == "off":
        return math.inf
    if setting == "auto":
        return target.precision.prefill_chunk
    return int(setting)


def _stack_taps(taps: dict[int, Tensor], layers: tuple[int, ...]) -> Tensor:
    """``{layer: [N, d]}`` → ``[N, m, d]`` in ``layers`` order."""
    return torch.stack([taps[i] for i in layers], dim=1)


def _check_cache_fits(target: TargetModel, slots: int, positions: int) -> None:
    """Refuse a cache that could outgrow the memory available, naming the keys that size it.

    The torch cache's pages are touched only as requests fill it, so a cache too big for the
    machine would not fail here but hours later, when the kernel's OOM killer ends the process
    with no message; llama.cpp allocates its cells up front and would fail with less to say."""
    need, free = target.cache_bytes(slots, positions), memory_available()
    if free is None or need <= free:
        return
    fits = bisect.bisect_left(range(1, slots + 1), True, key=lambda n: target.cache_bytes(n, positions) > free)
    raise ConfigError([f"engine.max_batch={slots} × {positions} positions (engine.max_context): the KV cache can "
                       f"grow to {need / GiB:.1f} GiB, and {free / GiB:.1f} GiB are available — lower "
                       f"engine.max_batch (≤ {fits} fits) or engine.max_context"])

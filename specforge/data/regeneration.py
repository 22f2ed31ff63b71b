"""Regenerate the assistant turns of conversations with the target itself (docs/data.md).

A drafter learns to predict what the *target* writes, so the replies in a dataset (ShareGPT's
come from ChatGPT) are replaced by the target's own answers: the user (and system) messages are
kept, and the target answers them turn by turn through the engine — the answer to user turn 1,
then that answer plus user turn 2 as the next prompt, and so on (or the first turn only).

Everything that makes a sample is pinned, so the output is a pure function of the inputs:

- each turn's seed is ``base_seed + H(conversation id) + turn`` (``H`` a stable hash), and the
  engine draws every request's randomness from its own generator, so an answer does not depend on
  its batch-mates, the batch size or the order requests finish in;
- output order is input order: shard ``k`` holds input conversations ``[k·S, (k+1)·S)`` minus
  the skipped ones, written only once all of them are done;
- shards and the manifest are written to a temporary file and renamed, so a killed run leaves
  complete shards or none, and a restart resumes at the first shard the manifest does not list.

A restarted run therefore writes byte for byte what an uninterrupted one would.  The manifest
(``progress.json``) records what the output was made from — source name, count and a hash of the
ids and kept messages; target name and dtype; decoder; sampling — and an output directory made
from anything else is refused before a byte is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge.errors import SpecforgeError
from specforge.conversations.chat import WRITTEN_IDS, Conversation, normalize_message
from specforge.files import remove_leftovers, write_atomic
from specforge.resume import UnreadableRecord, read_record, refuse_other_settings, write_record

__all__ = [
    "MANIFEST",
    "RegenerationError",
    "RegenerationReport",
    "conversation_seed",
    "iter_regenerated",
    "regenerate",
    "split_turns",
    "target_sampling",
    "turn_seed",
]

MANIFEST = "progress.json"
FORMAT = "specforge-regen/1"
_SEED_MOD = 2**63  # torch.Generator.manual_seed takes any non-negative int below 2**64


class RegenerationError(SpecforgeError, ValueError):
    """The output directory cannot be (re)used for these inputs; nothing was written."""


@dataclass
class RegenerationReport:
    """What a :func:`regenerate` call did.  Counts cover the whole output directory (resumed
    shards included); ``new_tokens`` and ``seconds`` only this call's work."""

    out_dir: str
    conversations: int = 0  # input conversations covered by completed shards
    written: int = 0  # output lines (conversations minus skipped)
    new_tokens: int = 0
    seconds: float = 0.0
    shards: int = 0  # completed shards
    resumed_shards: int = 0  # of which were already complete when the call started
    total_shards: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (id, reason): not in the output
    truncated: list[tuple[str, str]] = field(default_factory=list)  # (id, reason): later turns dropped

    @property
    def complete(self) -> bool:
        return self.shards == self.total_shards

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        out = [
            f"{self.out_dir}: {self.shards}/{self.total_shards} shards, {self.conversations:,} conversations "
            f"({self.written:,} written, {len(self.skipped):,} skipped, {len(self.truncated):,} cut short); "
            f"{self.new_tokens:,} new tokens in {self.seconds:.1f} s ({self.tokens_per_second:.1f} tok/s)"
        ]
        for label, items in (("skipped", self.skipped), ("cut short", self.truncated)):
            out += [f"  {label} {cid}: {reason}" for cid, reason in items[:10]]
            if len(items) > 10:
                out.append(f"  ... and {len(items) - 10} more {label}")
        return "\n".join(out)


# -- turns, seeds, sampling ---------------------------------------------------------------------


def split_turns(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, str]], list[int]]:
    """``(kept, cuts)``: the messages without the assistant's, and where the target answers.

    Cut ``i`` is an index into ``kept``: the target's answer ``i`` follows ``kept[:cuts[i]]``.  A
    run of user messages with no reply between them is one turn (answered once, after its last
    message); an assistant message that answers no user message (one opening the conversation,
    or a second in a row) is dropped with the rest.  A conversation that ends on a user message
    gets that message answered too.  A blank user message is no prompt (the loaders' rule,
    :attr:`~specforge.conversations.chat.Conversation.has_user_turn`): it is dropped, and so is a reply to it.
    """
    kept: list[dict[str, str]] = []
    cuts: list[int] = []
    for raw in messages:
        m = normalize_message(raw)
        if m["role"] == "user" and not m["content"].strip():
            continue
        if m["role"] == "assistant":
            if kept and kept[-1]["role"] == "user" and (not cuts or cuts[-1] < len(kept)):
                cuts.append(len(kept))
            continue
        kept.append(m)
    if kept and kept[-1]["role"] == "user" and (not cuts or cuts[-1] < len(kept)):
        cuts.append(len(kept))
    return kept, cuts


def conversation_seed(conversation_id: str, base_seed: int = 0) -> int:
    """``base_seed`` plus a stable hash of the id (Python's ``hash`` of a str changes per process)."""
    h = int.from_bytes(hashlib.sha256(conversation_id.encode("utf-8")).digest()[:8], "big")
    return (base_seed + h) % _SEED_MOD


def turn_seed(conversation_id: str, turn: int, base_seed: int = 0) -> int:
    """The engine seed of answer ``turn`` (0-based) of a conversation."""
    return (conversation_seed(conversation_id, base_seed) + turn) % _SEED_MOD


def target_sampling(target: Any) -> dict[str, float | int]:
    """The target's recommended sampling from its ``generation_config``, else its plain law.

    Only values the checkpoint sets count (``to_diff_dict``): transformers fills unset fields with
    library defaults (greedy, top-k 50) that recommend nothing.  With no recommendation the answer
    is sampled from the target's own distribution (T=1, no truncation), not greedily: greedy
    answers are a narrower distribution than the one the drafter will be asked to match.
    """
    gc = getattr(getattr(target, "hf_model", None), "generation_config", None)
    diff = gc.to_diff_dict() if gc is not None else {}
    temperature = diff.get("temperature")
    out = {
        "temperature": 1.0 if temperature is None else float(temperature),
        "top_k": int(diff.get("top_k") or 0),
        "top_p": float(diff.get("top_p") or 1.0),
    }
    if diff.get("do_sample") is False:  # the checkpoint asks for greedy decoding
        out["temperature"] = 0.0
    return out


# -- output files -------------------------------------------------------------------------------


def _shard_name(index: int) -> str:
    return f"regen-{index:05d}.jsonl"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=False, separators=(",", ":"))


def _fingerprint(conversations: Sequence[Conversation]) -> str:
    """Hash of every id and its messages but the answers, in order (answers do not matter).
    Taken before :func:`split_turns` drops anything, so a change to what it keeps (blank
    prompts) does not orphan directories written before it."""
    h = hashlib.sha256()
    for c in conversations:
        prompts = [m for m in map(normalize_message, c.messages) if m["role"] != "assistant"]
        h.update(_dumps([c.id, prompts]).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def _decoder_name(engine: Any) -> str:
    # Speculative decoding keeps the target's law but not the sample path: another verifier or
    # drafter gives other (equally valid) answers, so a resumed run must decode as the first did.
    # Component settings (γ, thresholds) are not visible here: resume with the same pipeline.
    def name(part: Any) -> str:
        return f"{type(part).__module__}.{type(part).__qualname__}"

    drafter = "plain" if engine.drafter is None else name(engine.drafter)
    return f"{drafter} + {name(engine.verifier)}"


def _check_existing(out_dir: Path, header: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest if ``out_dir`` holds a run of exactly ``header``; raises otherwise."""
    try:
        manifest = read_record(out_dir / MANIFEST)
    except UnreadableRecord as exc:
        raise RegenerationError(f"{exc}; remove the directory to start over") from None
    if manifest is None:
        strays = sorted(p.name for p in out_dir.glob("regen-*.jsonl")) if out_dir.is_dir() else []
        if strays:
            raise RegenerationError(f"{out_dir} holds {strays[0]} but no {MANIFEST}; not resuming an unknown run")
        return None
    refuse_other_settings(manifest, header, subject=str(out_dir), remedy="use another directory or remove it",
                          error=RegenerationError)
    for entry in manifest.setdefault("shards", []):
        path = out_dir / entry["file"]
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
            raise RegenerationError(
                f"{path} is missing or changed since it was written; remove the directory to start over"
            )
    return manifest


def iter_regenerated(out_dir: str | os.PathLike) -> Iterator[Conversation]:
    """The regenerated conversations of a complete output directory, in input order."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    if len(manifest["shards"]) != manifest["total_shards"]:
        raise RegenerationError(
            f"{out_dir}: {len(manifest['shards'])} of {manifest['total_shards']} shards done; finish the run first"
        )
    for entry in manifest["shards"]:
        with open(out_dir / entry["file"], encoding="utf-8") as fh:
            for line in fh:
                record = json.loads(line)
                yield Conversation(id=record["id"], messages=record["messages"])


# -- the run ------------------------------------------------------------------------------------


@dataclass
class _Work:
    """One conversation in flight: the messages so far and the turn being answered."""

    index: int
    conversation: Conversation
    kept: list[dict[str, str]]
    cuts: list[int]
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    answered_len: int = 0  # len(messages) before the current turn's user messages
    finish_reasons: list[str] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Done:
    """A finished conversation waiting for its shard: its output line, or why it was skipped."""

    line: dict[str, Any] | None
    skipped: str | None = None
    cut: str | None = None  # why its later turns were dropped


def _make_engine(target: Any, max_batch: int, max_context: int | None) -> Any:
    from specforge.config import EngineConfig
    from specforge.engine import Engine
    from specforge.plugins import get_host

    config = EngineConfig(max_batch=max_batch, **({} if max_context is None else {"max_context": max_context}))
    # Plain decoding: the rejection verifier with no drafts samples the target's law exactly.
    return Engine(target, get_host().create_verifier("rejection"), engine=config)


def _open_output(out_dir: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The manifest of ``out_dir``: the one there if it was made from ``header``, else a new one."""
    manifest = _check_existing(out_dir, header)  # every refusal happens before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    # Half-written files of a killed run: .regen-*.tmpPID, or regen-*.jsonl.tmp from older versions.
    remove_leftovers(out_dir, "*.tmp*")
    if manifest is None:
        manifest = {**header, "shards": []}
        write_record(out_dir / MANIFEST, manifest, indent=1)
    return manifest


class _Run:
    """One call of :func:`regenerate` over an opened output directory: conversations are asked
    turn by turn, and every shard is written once all of its conversations are done.

    What the run samples and how it shards is its manifest's (``sampling``, ``shard_size``):
    the settings the output was made with, checked against this call's.
    """

    def __init__(self, conversations: list[Conversation], engine: Any, out_dir: Path,
                 manifest: dict[str, Any], max_shards: int | None) -> None:
        self.conversations, self.engine, self.out_dir, self.manifest = conversations, engine, out_dir, manifest
        self.sampling = manifest["sampling"]
        self.shard_size = manifest["shard_size"]
        total = manifest["total_shards"]
        self.report = RegenerationReport(out_dir=str(out_dir), total_shards=total,
                                         resumed_shards=len(manifest["shards"]))
        for entry in manifest["shards"]:
            self._account(entry)
        self.next_shard = len(manifest["shards"])
        self.last_shard = total if max_shards is None else min(total, self.next_shard + max_shards)
        self.end = min(len(conversations), self.last_shard * self.shard_size)
        self.next_index = self.next_shard * self.shard_size  # the next conversation to submit
        self.done: dict[int, _Done] = {}  # finished conversations waiting for their shard
        self.in_flight: dict[int, _Work] = {}  # request id -> its conversation
        # Two requests per slot keep the engine full while finished ones are being replaced, without
        # running so far ahead that the shard being written waits on a long queue.
        self.window = 2 * engine.config.max_batch
        self.bar: Any = None

    def run(self, progress: bool) -> RegenerationReport:
        from tqdm.auto import tqdm

        n = len(self.conversations)
        self.bar = tqdm(total=n, initial=min(n, self.next_index), unit="conv", desc="regenerate",
                        disable=not progress, dynamic_ncols=True)
        started = time.perf_counter()
        streamed = 0
        try:
            while True:
                self._submit()
                self._flush_shards()
                if not self.in_flight:
                    if self.next_index >= self.end:
                        break
                    continue
                streamed += self._step()
                elapsed = time.perf_counter() - started
                if elapsed > 0:
                    self.bar.set_postfix_str(f"{streamed / elapsed:.1f} tok/s", refresh=False)
        finally:
            self.bar.close()
            self.report.seconds = time.perf_counter() - started
        return self.report

    # -- conversations ------------------------------------------------------------------------

    def _submit(self) -> None:
        """Start conversations until the window is full or none is left in this call's shards."""
        while len(self.in_flight) < self.window and self.next_index < self.end:
            c = self.conversations[self.next_index]
            kept, cuts = split_turns(c.messages)
            work = _Work(self.next_index, c, kept, cuts[:1] if self.sampling["turns"] == "first" else cuts)
            self.next_index += 1
            if not work.cuts:
                self._finish(work, skip="no user turn to answer")
            else:
                self._ask(work)

    def _ask(self, work: _Work) -> None:
        """Submit the prompt of ``work.turn``, or finish the conversation when it cannot be asked."""
        from specforge.engine import GenerationRequest

        work.answered_len = len(work.messages)
        lo = work.cuts[work.turn - 1] if work.turn else 0
        work.messages.extend(work.kept[lo : work.cuts[work.turn]])
        try:
            ids = self.engine.target.encode(work.messages, chat=True)
        except Exception as exc:  # a template that rejects this conversation: its problem only
            return self._cut_short(work, f"the chat template fails: {exc}")
        limit = self.engine.context_limit
        if len(ids) >= limit:
            return self._cut_short(work, f"prompt of {len(ids)} tokens does not fit the context limit of {limit}")
        s = self.sampling
        rid = self.engine.submit(GenerationRequest(
            prompt_ids=ids, max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], top_k=s["top_k"],
            top_p=s["top_p"], seed=turn_seed(work.conversation.id, work.turn, s["seed"])))
        self.in_flight[rid] = work

    def _step(self) -> int:
        """One engine round: record the answers it finished; returns the tokens it streamed."""
        streamed = 0
        for event in self.engine.step():
            streamed += len(event.token_ids)
            if event.finished:
                self._answered(self.in_flight.pop(event.request_id), event.request_id)
        return streamed

    def _answered(self, work: _Work, request_id: int) -> None:
        """Take the answer to ``work.turn``; ask the next turn, or finish the conversation."""
        from specforge.engine import FinishReason

        # take_output forgets it: a run over many thousand conversations must not keep every
        # output in the engine.
        out = self.engine.take_output(request_id)
        self.report.new_tokens += len(out.token_ids)
        if out.finish_reason == FinishReason.ERROR:
            return self._cut_short(work, out.error or "the engine failed this request")
        # The ids as written (without the end-of-sequence id the template's end of turn renders):
        # training splices them in, since tokenising the text again need not give them back.
        written = out.token_ids[:-1] if out.finish_reason == FinishReason.EOS else out.token_ids
        work.messages.append({"role": "assistant", "content": out.text, WRITTEN_IDS: list(written)})
        work.finish_reasons.append(out.finish_reason)
        work.new_tokens.append(len(out.token_ids))
        work.turn += 1
        if work.turn < len(work.cuts):
            self._ask(work)
        else:
            self._finish(work)

    def _cut_short(self, work: _Work, reason: str) -> None:
        if work.turn == 0:
            self._finish(work, skip=reason)
        else:  # keep the answered turns; the user messages of the unanswered one go
            del work.messages[work.answered_len:]
            self._finish(work, cut=f"turn {work.turn + 1}: {reason}")

    def _finish(self, work: _Work, skip: str | None = None, cut: str | None = None) -> None:
        self.bar.update(1)
        if skip is not None:
            self.done[work.index] = _Done(None, skipped=skip)
            return
        line = {"id": work.conversation.id, "messages": work.messages,
                "meta": {"finish_reasons": work.finish_reasons, "new_tokens": work.new_tokens}}
        self.done[work.index] = _Done(line, cut=cut)

    # -- shards -------------------------------------------------------------------------------

    def _flush_shards(self) -> None:
        """Write, in order, every shard whose conversations are all done."""
        while self.next_shard < self.last_shard:
            lo = self.next_shard * self.shard_size
            hi = min(len(self.conversations), lo + self.shard_size)
            if any(i not in self.done for i in range(lo, hi)):
                return
            entry, data = self._shard(self.next_shard, lo, hi)
            write_atomic(self.out_dir / entry["file"], data)
            # The manifest is updated after the shard lands: a kill in between only means the
            # shard is made again (identically) by the restart.
            self.manifest["shards"].append(entry)
            write_record(self.out_dir / MANIFEST, self.manifest, indent=1)
            self._account(entry)
            self.next_shard += 1

    def _shard(self, index: int, lo: int, hi: int) -> tuple[dict[str, Any], bytes]:
        """The manifest entry and the bytes of shard ``index`` (conversations ``[lo, hi)``)."""
        lines, entry = [], {"file": _shard_name(index), "first": lo, "count": hi - lo,
                            "written": 0, "new_tokens": 0, "skipped": [], "truncated": []}
        for i in range(lo, hi):
            done = self.done.pop(i)
            cid = self.conversations[i].id
            if done.line is None:
                entry["skipped"].append({"id": cid, "reason": done.skipped})
                continue
            lines.append(_dumps(done.line) + "\n")
            entry["written"] += 1
            entry["new_tokens"] += sum(done.line["meta"]["new_tokens"])
            if done.cut is not None:
                entry["truncated"].append({"id": cid, "reason": done.cut})
        data = "".join(lines).encode("utf-8")
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        return entry, data

    def _account(self, entry: dict[str, Any]) -> None:
        """Count a written shard in the report."""
        report = self.report
        report.shards += 1
        report.conversations += entry["count"]
        report.written += entry["written"]
        report.skipped += [(s["id"], s["reason"]) for s in entry["skipped"]]
        report.truncated += [(s["id"], s["reason"]) for s in entry["truncated"]]


def _run_sampling(target: Any, *, temperature: float | None, top_k: int | None, top_p: float | None,
                  seed: int, max_new_tokens: int, turns: str) -> dict[str, Any]:
    """The sampling of a run: what the call gives, else what the target recommends."""
    recommended = target_sampling(target)
    return {
        "temperature": recommended["temperature"] if temperature is None else float(temperature),
        "top_k": recommended["top_k"] if top_k is None else int(top_k),
        "top_p": recommended["top_p"] if top_p is None else float(top_p),
        "seed": int(seed),
        "max_new_tokens": int(max_new_tokens),
        "turns": turns,
    }


def _header(conversations: Sequence[Conversation], source: str, engine: Any, sampling: dict[str, Any],
            shard_size: int) -> dict[str, Any]:
    """What an output directory is made from; a run resumes only a directory of the same header."""
    target = engine.target
    return {
        "format": FORMAT,
        "source": {"name": source, "count": len(conversations), "sha256": _fingerprint(conversations)},
        "target": {"name": str(target.name), "dtype": target.precision_label},
        "decoder": _decoder_name(engine),
        "context_limit": int(engine.context_limit),
        "sampling": sampling,
        "shard_size": shard_size,
        "total_shards": -(-len(conversations) // shard_size),
    }


def regenerate(conversations: Iterable[Conversation], target_or_engine: Any, out_dir: str | os.PathLike, *,
               source: str = "conversations", turns: str = "all", max_new_tokens: int = 512,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               shard_size: int = 256, max_batch: int = 16, max_context: int | None = None,
               max_shards: int | None = None, progress: bool = True) -> RegenerationReport:
    """Answer every conversation's user turns with the target; write JSONL shards to ``out_dir``.

    ``target_or_engine`` is a :class:`~specforge.runtime.TargetModel` (decoded plainly by an engine
    of ``max_batch`` slots and ``max_context`` tokens) or a ready :class:`~specforge.engine.Engine`
    (its own batch size, context limit and drafter).  ``temperature``/``top_k``/``top_p`` left
    ``None`` take :func:`target_sampling`.  ``turns`` is ``"all"`` or ``"first"`` (answer only
    the first user turn, drop the later ones).  ``source`` names the inputs in the manifest.
    ``max_shards`` stops after that many shards are written by this call (a budget; a later
    call resumes).  A conversation whose first prompt does not fit the context limit is skipped;
    one whose later prompt does not fit keeps the turns answered so far; both are reported.
    """
    if turns not in ("all", "first"):
        raise ValueError(f"turns must be 'all' or 'first', got {turns!r}")
    if shard_size < 1 or max_new_tokens < 1:
        raise ValueError("shard_size and max_new_tokens must be at least 1")
    conversations = list(conversations)
    engine = target_or_engine if hasattr(target_or_engine, "step") else _make_engine(
        target_or_engine, max_batch, max_context)
    if engine.busy:
        raise ValueError("the engine has requests of its own in flight; regenerate needs it to itself")
    sampling = _run_sampling(engine.target, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             max_new_tokens=max_new_tokens, turns=turns)
    out_dir = Path(out_dir)
    manifest = _open_output(out_dir, _header(conversations, source, engine, sampling, shard_size))
    return _Run(conversations, engine, out_dir, manifest, max_shards).run(progress)
